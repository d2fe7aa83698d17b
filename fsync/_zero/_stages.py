"""The ZeRO step's stages over its buckets: reduce, update this rank's part, gather.

A ZeRO step is, per bucket of the plan, three stages (``ZeroLayout`` says who
updates what):

1. **reduce**: the bucket's gradients through the hook, with ``ctx.scatter``
   when buckets are sharded (each rank then receives its shard, by a
   reduce-scatter) or whole (an all-reduce);
2. **update**: the optimizer on this rank's piece of the bucket, if it has one;
3. **gather**: the updated pieces to every rank (an all-gather of the shards, or
   the owner's broadcast), issued at once and waited for only at the end.

``ZeroPipeline`` runs them bucket by bucket. ``push`` hands it the next packed
bucket, in plan order, and issues its reduce (``push_all`` every bucket at once,
through one call of the hook); ``advance(k)`` takes the buckets before ``k``
through update and gather, each as soon as its reduce is waited for; ``drain``
finishes the rest and returns every bucket whole, the new optimizer state and
the hook's. Who calls what decides the overlap: the ZeRO step (``_step``) pushes
every bucket at once and drains, so that every reduce is on the wire before the
first is waited for (in a compiled graph, where a wait blocks the thread that
computes and cannot move past a later collective, this keeps the waits out of
backward); its overlapped gradient call pushes each bucket as backward completes
it and advances past it where its reduce has arrived already (``arrived``: gloo's
reduce-scatter is waited for as it is issued), else to the bucket before it, so
that bucket ``k - 1`` is updated and gathered while bucket ``k`` is reduced and
backward goes on (``OverlappedStages``, the stages ``_backward.synced_backward``
calls). Either way every rank issues the same collectives in the same
order, decided by the code path and never by timing: reduces in plan order,
gathers in plan order, each gather right after its own reduce, after the reduce
of the bucket that follows it, or after every reduce.

Buckets go one at a time only where both halves allow it: a bucketwise hook
over a flat group (``_hierarchy.pipelined``; PowerSGD, or a 2-D mesh, reduces every
bucket at once, in ``drain``) and a leafwise optimizer
([fsync.optim.Optimizer][]'s ``leafwise``: the update of each bucket's piece on
its own gives the bits of one update of all pieces, see ``PieceUpdates``).

Owns: the order of a ZeRO step's stages. May import: layers 1 to 6
(``_reduce``'s stages, ``_layout``) and ``fsync.optim``'s types.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fsync import _comm, _tree
from fsync._agree import Agreement
from fsync._apply import alone, context, finish_bucket, start_bucket
from fsync._comm import _groups
from fsync._hierarchy import pipelined, reduce_started, reduce_started_shards, start_within
from fsync._hook import Hook, SyncContext
from fsync._plan import BucketPlan
from fsync._zero._layout import (
    Piece,
    ZeroLayout,
    check_pieces,
    own_part,
    read_range,
    start_gather,
)
from fsync.optim._base import Optimizer


class PieceUpdates:
    """An optimizer's update of this rank's pieces, one piece at a time or all at once.

    The optimizer state's per-parameter entries are lists with one tensor per
    piece (``ZeroLayout.is_pieces``); its other entries (the step count) are
    shared. Piece ``j`` is updated with the state cut down to entry ``j`` of
    each list and the shared entries as they are; ``state`` puts the lists back
    together and takes the shared entries from the last update (a leafwise
    optimizer computes the same ones for every piece). A rank without pieces
    still updates once, on no pieces, so that the shared entries advance.
    """

    def __init__(self, optimizer: Optimizer, layout: ZeroLayout, state: Any) -> None:
        self._optimizer, self._layout = optimizer, layout
        self._slots, self._rebuild = _tree.leaves_and_rebuild(state, is_leaf=layout.is_pieces)
        self._per_piece = [layout.is_pieces(slot) for slot in self._slots]
        self._new: dict[int, list[Any]] = {}  # piece -> its updated slots
        self._last: list[Any] | None = None  # the slots of the last update

    def one(self, j: int, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Piece ``j`` (of ``layout.pieces``) updated; its state kept for ``state``."""
        sub = self._cut(lambda slot: [slot[j]])
        (new,) = self._update((self._layout.pieces[j],), [param], [grad], sub)
        assert self._last is not None
        self._new[j] = self._last
        return new

    def all(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every piece updated at once."""
        return self._update(self._layout.pieces, params, grads, self._slots)

    def state(self) -> Any:
        """The new optimizer state of this rank's pieces."""
        if self._last is None:  # nothing updated: the shared entries still advance
            self._update((), [], [], self._cut(lambda slot: []))
        assert self._last is not None
        if not self._new:  # one update of every piece (or of none)
            return self._rebuild(self._last)
        assert sorted(self._new) == list(range(len(self._layout.pieces)))
        slots = [
            [self._new[j][s][0] for j in sorted(self._new)] if cut else last
            for s, (cut, last) in enumerate(zip(self._per_piece, self._last, strict=True))
        ]
        return self._rebuild(slots)

    def _cut(self, pick: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """The state's slots, each per-piece list replaced by ``pick(list)``."""
        return [
            pick(slot) if cut else slot
            for slot, cut in zip(self._slots, self._per_piece, strict=True)
        ]

    def _update(
        self,
        pieces: tuple[Piece, ...],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        slots: list[Any],
    ) -> list[torch.Tensor]:
        new, state = self._optimizer.update(params, grads, self._rebuild(slots))
        layout = self._layout._replace(pieces=pieces)
        check_pieces(layout, new)
        self._last, _ = _tree.leaves_and_rebuild(state, is_leaf=layout.is_pieces)
        return list(new)


class ZeroUpdate(NamedTuple):
    """What a ZeRO step's buckets update, and where: the inputs of its optimizer step."""

    layout: ZeroLayout
    """This rank's ``ZeroLayout``."""
    optimizer: Optimizer
    """The optimizer of the pieces."""
    params: Sequence[torch.Tensor | None]
    """The parameter tree's leaves (flatten order, fitted to the plan)."""
    opt_state: Any
    """This rank's optimizer state (``ZeroState.opt``)."""
    gather_over: _comm.Group
    """The ranks the update is split over and its pieces gathered from
    (``ZeroStep.shard_group``): the sync's group, a replica group's own, or this rank
    alone (nothing to gather)."""


class ZeroPipeline:
    """One ZeRO step's buckets through reduce, update and gather (see the module's docstring).

    Args:
        update: What the buckets update (``ZeroUpdate``).
        hook: The hook the gradient buckets go through.
        hook_state: Its state.
        ctx: The hook's context for every dense bucket, the ranks' agreement done
            (``_apply.context``, with ``scatter`` when buckets are sharded).
    """

    def __init__(self, update: ZeroUpdate, hook: Hook, hook_state: Any, ctx: SyncContext) -> None:
        self._layout, self._params, self._gather_over = (
            update.layout,
            update.params,
            update.gather_over,
        )
        self._hook, self._hook_state, self._ctx = hook, hook_state, ctx
        self._updates = PieceUpdates(update.optimizer, update.layout, update.opt_state)
        # Whether a bucket can be reduced on its own, and updated on its own.
        self._bucketwise = pipelined(hook, hook_state) and _comm.hierarchy(ctx.group) is None
        self._leafwise = bool(getattr(update.optimizer, "leafwise", False))
        self._piece_of = {p.bucket: j for j, p in enumerate(update.layout.pieces)}
        self._started: list[torch.Tensor] = []
        self._reduced: list[torch.Tensor] | None = None
        self._gathering: list[_groups.Issued] = []

    def push(self, buffer: torch.Tensor) -> None:
        """The next dense bucket, packed, in plan order: its reduce issued where it can be
        on its own (else in ``drain``; on a 2-D mesh its reduce-scatter in the node now)."""
        k = len(self._started)
        if self._bucketwise:
            started = start_bucket(buffer, self._hook, self._hook_state, alone(self._ctx, k))
        else:
            started = start_within(buffer, self._ctx.group)
        self._started.append(started)

    def push_all(self, buffers: Sequence[torch.Tensor]) -> None:
        """Every dense bucket at once, packed: the hook runs once over all of them, so that
        it issues every bucket's collectives before it waits for the first (a compiled
        graph cannot move a wait past a later collective)."""
        assert not self._started, "push_all takes every bucket, before any other"
        self._started = [start_within(b, self._ctx.group) for b in buffers]
        self._reduce_all()

    def arrived(self, k: int) -> bool:
        """Whether bucket ``k``'s reduce is over already: its hook waited for it as it issued
        it (gloo's reduce-scatter, a compressing hook's cast back), so that updating it now
        waits for nothing."""
        return self._bucketwise and not _comm.in_flight(self._started[k])

    def advance(self, upto: int) -> None:
        """Buckets before ``upto`` updated and their gathers issued, in order (where buckets
        go one at a time; else they wait for ``drain``)."""
        if self._bucketwise and self._leafwise:
            for k in range(self._done, upto):
                self._update(k)

    def drain(self) -> tuple[list[torch.Tensor], Any, Any]:
        """Every pushed bucket updated, gathered and waited for.

        Returns:
            ``(buffers, opt_state, hook_state)``: every bucket whole (the new
            parameters, packed), this rank's new optimizer state, the hook's.
        """
        n = len(self._started)
        if self._leafwise:
            for k in range(self._done, n):
                self._update(k)
        else:
            self._update_all()
        specs = self._layout.plan.specs
        buffers = [_comm.wait(g) for g in self._gathering]
        out = [b[: spec.numel] for b, spec in zip(buffers, specs, strict=True)]
        return out, self._updates.state(), self._hook_state

    @property
    def _done(self) -> int:
        """How many buckets are updated and gathered."""
        return len(self._gathering)

    def _reduce_all(self) -> None:
        # Split within a replica group of a hierarchical reduce (ZeroStep.shard_group): the
        # shard that crossed is this rank's part, HSDP's way, so it is not gathered first.
        mine = self._layout.shard_buckets and self._gather_over is not self._ctx.group
        reduced = reduce_started_shards if mine else reduce_started
        self._reduced, self._hook_state = reduced(
            self._started, self._hook, self._hook_state, self._ctx
        )

    def _grad(self, k: int) -> torch.Tensor:
        """This rank's piece of reduced bucket ``k``."""
        if self._reduced is not None:
            reduced = self._reduced[k]
        elif self._bucketwise:
            reduced = finish_bucket(self._started[k], alone(self._ctx, k))
        else:
            self._reduce_all()
            return self._grad(k)
        return own_part(self._layout, k, reduced)

    def _param(self, j: int) -> torch.Tensor:
        piece = self._layout.pieces[j]
        return read_range(self._params, self._layout.plan, piece, self._dtype(piece.bucket))

    def _dtype(self, k: int) -> torch.dtype:
        return self._layout.plan.specs[k].dtype

    def _update(self, k: int) -> None:
        """Bucket ``k``'s piece of this rank updated (where it has one) and its gather issued.
        Every rank waits for the bucket's reduce, its own piece or not: the same
        collectives, in the same order, on every rank."""
        grad = self._grad(k)
        j = self._piece_of.get(k)
        piece = None if j is None else self._updates.one(j, self._param(j), grad)
        self._gather(k, piece, grad)

    def _update_all(self) -> None:
        pieces = self._layout.pieces
        reduced = [self._grad(k) for k in range(len(self._started))]  # every one waited for
        grads = [reduced[p.bucket] for p in pieces]
        new = self._updates.all([self._param(j) for j in range(len(pieces))], grads)
        mine = {p.bucket: piece for p, piece in zip(pieces, new, strict=True)}
        for k in range(len(self._started)):
            self._gather(k, mine.get(k), reduced[k])

    def _gather(self, k: int, piece: torch.Tensor | None, reduced: torch.Tensor) -> None:
        """Bucket ``k``'s gather issued. A rank that does not own a whole bucket receives
        the owner's into the bucket's reduced gradients: the same size and dtype, and a
        collective that waits for the reduce on every rank alike, so that a compiler that
        reorders the ranks' (different) graphs still issues it at the same place on all."""
        if piece is None and not self._layout.shard_buckets:
            piece = reduced
        self._gathering.append(
            start_gather(self._layout, k, piece, self._dtype(k), self._gather_over)
        )


class OverlappedStages:
    """The stages of ``value_and_step`` for ``synced_backward``: as backward completes
    bucket ``k``, its reduce is issued and (``in_backward``) the buckets whose reduce is
    over are updated and gathered; the others are in ``finish``, after backward."""

    def __init__(
        self,
        update: ZeroUpdate,
        plan: BucketPlan,
        hook: Hook,
        hook_state: Any,
        group: _comm.Group,
        agreement: Agreement,
        *,
        in_backward: bool = False,
    ) -> None:
        self._make = functools.partial(ZeroPipeline, update, hook)
        self._in_backward = in_backward
        self._plan, self._hook_state, self._group = plan, hook_state, group
        self._agreement, self._scatter = agreement, update.layout.shard_buckets
        self._pipeline: ZeroPipeline | None = None

    def _started(self) -> ZeroPipeline:
        if self._pipeline is None:  # the first bucket waits for the ranks' agreement
            divisor = self._agreement.conclude().divisor
            ctx = context(self._plan, self._group, divisor, scatter=self._scatter)
            self._pipeline = self._make(self._hook_state, ctx)
        return self._pipeline

    def start(self, k: int, buffer: torch.Tensor) -> None:
        """Bucket ``k`` is complete: its reduce issued; in backward, bucket ``k`` itself
        updated and gathered where its reduce has arrived already (gloo's reduce-scatter),
        else ``k - 1`` (so that its reduce is not waited for before the next one is issued)."""
        pipeline = self._started()
        pipeline.push(buffer)
        if self._in_backward:
            pipeline.advance(k + 1 if pipeline.arrived(k) else k)

    def finish(self) -> tuple[list[torch.Tensor], Any, Any]:
        """The last bucket updated, every gather waited for (``ZeroPipeline.drain``)."""
        return self._started().drain()

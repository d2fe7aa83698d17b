"""Gradient accumulation: DDP's ``no_sync``, and its hierarchical form that defers the slow hop.

[fsync.accumulate][] sums micro-batches locally and leaves the sync to one call
at the end. On a 2-D mesh [fsync.DeferredSync][] does better: each
micro-batch's buckets are reduce-scattered within the node (the fast link) and
summed into this rank's ``1/local`` shard of them, and the cross-node reduce and
the all-gather within the node happen once per step, so the bytes that cross
nodes do not grow with the number of micro-batches, and the accumulated state
is ``1/local`` of the gradients.

Owns: [fsync.accumulate][], [fsync.DeferredSync][] and [fsync.DeferredState][]. May
import: every layer below (1 to 6).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from typing_extensions import Unpack

from fsync import _checks, _comm, _planner, _state, _tree
from fsync._agree import planned, refuse, verify_plan
from fsync._comm import _reports
from fsync._hierarchy import shard_plan
from fsync._options import OptionKeywords, SyncOptions
from fsync._plan import BucketPlan
from fsync._reduce import (
    Reduced,
    SyncCall,
    init_hook,
    local_size,
    reduce_add,
    reduce_finish,
    unpack_reduced,
)
from fsync._state import register_state


def accumulate(total: Any, grads: Any, /) -> Any:
    """Adds one micro-batch's gradients to a running total, without communicating.

    DDP's ``no_sync`` lets ``.grad`` accumulate locally and syncs on the last
    micro-batch; with fsync that is a plain sum followed by one sync::

        total = None
        for batch in micro_batches:
            total = fsync.accumulate(total, torch.func.grad(loss_fn)(params, batch))
        grads = fsync.sync_grads(total)

    The sum runs in micro-batch order, as autograd accumulates ``.grad``, so the
    result equals DDP's bit for bit where the all-reduce does. A ``None`` leaf
    counts as absent (an unused parameter); ``None`` as ``total`` starts a sum.
    Nothing passed in is modified.

    Args:
        total: The running total (a gradient tree) or ``None``.
        grads: A gradient tree with the same structure.

    Returns:
        A new tree: ``total + grads`` leaf by leaf.

    Raises:
        ValueError: The two trees differ in structure, shapes or dtypes.

    Example:
        >>> import torch, fsync
        >>> total = fsync.accumulate(None, {"w": torch.ones(2)})
        >>> fsync.accumulate(total, {"w": torch.ones(2)})
        {'w': tensor([2., 2.])}
    """
    if total is None:
        return grads
    totals, spec = _tree.flatten(total)
    leaves, other = _tree.flatten(grads)
    if spec != other:
        raise ValueError(
            f"accumulate got trees of different structure: the total is {spec} but the new "
            f"gradients are {other}. Accumulate gradients of the same parameters."
        )
    out = [b if a is None else a for a, b in zip(totals, leaves, strict=True)]
    both = [
        i
        for i, (a, b) in enumerate(zip(totals, leaves, strict=True))
        if a is not None and b is not None
    ]
    for i in both:
        a, b = totals[i], leaves[i]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"accumulate: leaf {_tree.path_str(spec.paths()[i])!r} is "
                f"{a.dtype}{list(a.shape)} in the total but {b.dtype}{list(b.shape)} in the new "
                "gradients."
            )
    # One call for every sum (the same additions, in C++), not one per leaf.
    sums = torch._foreach_add([totals[i] for i in both], [leaves[i] for i in both])
    for i, summed in zip(both, sums, strict=True):
        out[i] = summed
    return _tree.unflatten(spec, out)


_NOTHING_ADDED = (
    "DeferredSync.finish got a state with no micro-batch added since the last finish; call "
    "state = sync.add(grads, state) for each micro-batch first."
)

_UNSUPPORTED = (
    "DeferredSync averages over every rank and micro-batch: find_unused and "
    'divide_by="active" are not supported. Give unused parameters zero gradients, '
    "or use fsync.accumulate and a GradSync with these options."
)


@register_state
class DeferredState(NamedTuple):
    """What [fsync.DeferredSync][] threads through a step's micro-batches: tensors only.

    Attributes:
        fingerprint: 0-d int64 CPU tensor, the fingerprint of the plan this state
            belongs to.
        hook: The cross-node hook's state, made for the shards' plan on a 2-D mesh.
        like: The tree given to ``init`` as meta tensors (no memory): what the
            plan is rebuilt from.
        step: 0-d int64 CPU tensor, the number of ``add`` and ``finish`` calls
            done: the sequence number the ranks compare at each of them.
        shards: Per dense bucket, this rank's shard (``1/local`` of the bucket,
            zero-padded to ``local`` equal shards) of the sum of the node's
            micro-batches since the last ``finish``; on a 1-D group, where every
            rank is a node of its own, the whole bucket of its own sum.
        micro: 0-d int64 CPU tensor, the micro-batches added since the last
            ``finish``: the mean divides by it.
    """

    fingerprint: torch.Tensor
    hook: Any
    like: Any
    step: torch.Tensor
    shards: tuple[torch.Tensor, ...]
    micro: torch.Tensor


class DeferredSync:
    """Gradient accumulation that crosses nodes once per step: ``init``, ``add``, ``finish``.

    On a 2-D ``DeviceMesh`` (dim 0 across nodes, dim 1 within a node, HSDP's
    replicate and shard dims), ``add`` reduce-scatters a micro-batch's buckets
    within the node and sums this rank's ``1/local`` shard into the state;
    ``finish`` runs the hook on the summed shards across nodes (once per step,
    whatever the number of micro-batches), all-gathers them within the node and
    returns the mean over all ranks and micro-batches, the same bits on every
    rank. DDP's ``no_sync`` keeps all the gradients and sends all of them
    across; this keeps and sends ``1/local``. On a 1-D group (a node per rank)
    it is ``no_sync`` itself. Every ``add`` and ``finish`` starts with the
    ranks' agreement over the whole group: a rank that skipped a micro-batch is
    a ``ValueError`` on every rank. Eager and under ``torch.compile``.

    Args:
        group: A 2-D ``DeviceMesh`` (dims ``(nodes, local)``, with
            ``mesh_dim_names``), or any group [fsync.GradSync][] takes.
        **options: The sync options, fields of [fsync.SyncOptions][]: ``hook``
            runs across nodes on the accumulated shards (``ctx.plan`` is their
            plan, see [fsync.GradSync][]); the bucket options and
            ``reduce_dtype`` (the accumulation's dtype too) as for a sync.
            ``find_unused`` and ``divide_by="active"`` are not supported.

    Attributes:
        options: The [fsync.SyncOptions][] given, validated.
        group: The ``group`` given.

    Raises:
        ValueError: ``find_unused`` or ``divide_by="active"`` was given.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.zeros(3)}
        >>> sync = fsync.DeferredSync()  # group=mesh for a 2-D DeviceMesh
        >>> state = sync.init(params)
        >>> for g in (1.0, 3.0):  # two micro-batches
        ...     state = sync.add({"w": torch.full((3,), g)}, state)
        >>> grads, state = sync.finish(state)
        >>> grads["w"]  # the mean over ranks and micro-batches
        tensor([2., 2., 2.])
    """

    def __init__(self, *, group: _comm.Group = None, **options: Unpack[OptionKeywords]) -> None:
        self.options = SyncOptions.of(
            options, where="DeferredSync", mesh=_comm.hierarchy(group) is not None
        )
        if self.options.find_unused or self.options.divide_by != "world":
            raise ValueError(_UNSUPPORTED)
        self.group = group

    def plan(self, state: DeferredState, /) -> BucketPlan:
        """The bucket plan of ``state``."""
        return _fit(self, None, state).plan

    def init(self, tree: Any, /) -> DeferredState:
        """Plans the buckets for ``tree``, checks the plan across ranks, returns the state.

        Args:
            tree: A tree like the gradients to come (only metadata is read).

        Returns:
            The initial [fsync.DeferredState][]: zero shards, no micro-batch.

        Raises:
            TypeError: A leaf is sparse.
            ValueError: The ranks' trees differ (raised on every rank).
        """
        _comm.check_group(self.group)
        plan = planned(lambda: _dense_plan(self.options, tree), self.group)
        verify_plan(plan, self.group, what="trees passed to DeferredSync.init")
        shards = shard_plan(plan, local_size(self.group)).specs
        return DeferredState(
            fingerprint=torch.tensor(plan.fingerprint, dtype=torch.int64),
            hook=init_hook(self.options, plan, self.group),
            like=_state.like(tree),
            step=torch.zeros((), dtype=torch.int64),
            shards=tuple(torch.zeros(s.numel, dtype=s.dtype, device=s.device) for s in shards),
            micro=torch.zeros((), dtype=torch.int64),
        )

    def add(self, grads: Any, state: DeferredState, /) -> DeferredState:
        """Adds one micro-batch: reduce-scatters its buckets within the node into the state.

        Args:
            grads: This micro-batch's gradients, like the tree given to ``init``
                (``None`` leaves count as zeros).
            state: The [fsync.DeferredState][] from ``init``, ``add`` or ``finish``.

        Returns:
            The new state (nothing crossed nodes).

        Raises:
            TypeError: A leaf is not a floating point tensor.
            ValueError: ``grads`` does not fit the plan, or the ranks disagree.
        """
        try:
            leaves, plan, _ = _fit(self, _checks.given(grads), state)
        except (ValueError, TypeError) as error:
            return refuse(error, self.group, like=state)  # type: ignore[no-any-return]
        added = _reduce_add(self, leaves, plan, state)
        shards = tuple(
            torch.add(total, shard) for total, shard in zip(state.shards, added, strict=True)
        )
        return state._replace(shards=shards, micro=state.micro + 1, step=state.step + 1)

    def finish(self, state: DeferredState, /) -> tuple[Any, DeferredState]:
        """Reduces the accumulated shards across nodes and gathers them: the step's gradients.

        Args:
            state: The state after this step's ``add`` calls.

        Returns:
            ``(grads, state)``: the mean over all ranks and micro-batches, a tree like
            ``init``'s, and the next step's state (zero shards, no micro-batch).

        Raises:
            ValueError: No micro-batch was added, or the ranks disagree.
        """
        try:
            if not torch.compiler.is_compiling() and int(state.micro) == 0:
                raise ValueError(_NOTHING_ADDED)
            _, plan, rebuild = _fit(self, None, state)
        except (ValueError, TypeError) as error:
            like = (_state.zeros_of(state.like, _device(self, state)), state)
            return refuse(error, self.group, like)  # type: ignore[no-any-return]
        reduced = _reduce_finish(self, plan, state)
        new_state = state._replace(
            hook=reduced.hook_state,
            step=state.step + 1,
            shards=tuple(torch.zeros_like(s) for s in state.shards),
            micro=torch.zeros_like(state.micro),
        )
        return rebuild(unpack_reduced(reduced, plan)), new_state


def _reduce_add(
    sync: DeferredSync, leaves: list[Any], plan: BucketPlan, state: DeferredState
) -> list[torch.Tensor]:
    """``reduce_add`` at the state's step, a collective that fails in it named."""
    return _reports.naming(
        lambda: reduce_add(leaves, plan, SyncCall.at(sync, state)),
        sync.group,
        step=state.step,
    )


def _reduce_finish(sync: DeferredSync, plan: BucketPlan, state: DeferredState) -> Reduced:
    """``reduce_finish`` of the state's shards at its step, a failed collective named."""
    return _reports.naming(
        lambda: reduce_finish(state.shards, state.micro, plan, SyncCall.at(sync, state)),
        sync.group,
        step=state.step,
    )


def _dense_plan(options: SyncOptions, tree: Any) -> BucketPlan:
    """The plan of a tree DeferredSync can take: dense leaves only."""
    plan = _planner.plan_tree(tree, options.plan, what="tree").plan
    for spec in plan.specs:
        leaf = plan.leaves[spec.leaves[0]]
        if spec.sparse and leaf is not None:
            raise TypeError(
                f"tree leaf {leaf.path!r} is sparse; DeferredSync reduce-scatters dense "
                "buckets. Use fsync.accumulate and fsync.GradSync for sparse gradients."
            )
    return plan


def _fit(sync: DeferredSync, grads: Any, state: DeferredState) -> _planner.Planned:
    """``grads`` fitted to the plan of ``state`` (rebuilt from its ``like`` tree)."""
    if not isinstance(state, DeferredState):
        raise TypeError(
            f"state is a {type(state).__name__}; expected the DeferredState returned by "
            "DeferredSync.init, add or finish."
        )
    return _planner.fit_like(
        grads,
        state.like,
        sync.options.plan,
        what="grads",
        default_device=lambda: _device(sync, state),
    )


def _device(sync: DeferredSync, state: DeferredState) -> torch.device:
    """Where a state's gradients live: its shards' device, else the group's."""
    return state.shards[0].device if state.shards else _comm.default_device(sync.group)

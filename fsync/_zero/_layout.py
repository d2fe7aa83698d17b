"""Which elements of which buckets a rank of a ZeRO step updates, and its state.

A ZeRO step (``_step``) splits the optimizer's work over the ranks along the
bucket plan: with ``shard_buckets=True`` each bucket is cut into ``world_size``
equal shards (zero-padded) and every rank updates its shard of every bucket; with
``shard_buckets=False`` each bucket is owned whole by one rank, chosen by size so
that ranks hold similar amounts. ``ZeroLayout`` is that split as a pure value of
the plan, the world size, the rank and the mode, the world being ``shard_group``'s
(the step's group, or a fault-tolerant replica group's own ranks); ``ZeroState`` is
a rank's state, its optimizer state cut into the layout's pieces. This module also moves pieces:
packing a piece from leaves, gathering every rank's pieces into whole buckets,
and cutting a full optimizer state into this rank's pieces (``shard_full``).

Owns: the layout, the state and its checks. May import: layers 1 to 4 and
``fsync.optim``'s types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fsync import _checks, _comm, _pack, _trace, _tree
from fsync._comm import _groups
from fsync._plan import BucketPlan
from fsync._state import formerly, register_state
from fsync.optim._base import Optimizer

_META = torch.device("meta")

_ZERO_ACROSS_REPLICAS = (
    "fsync.ops.zero got group=the replica group of an fsync.ft.Replica of one rank; expected "
    "a process group, a mesh, or a replica group of several ranks (Replica(manager, "
    "within=...)). The ZeRO step splits its update over the ranks of a replica group and "
    "replicates each part across replicas; a replica group of one rank has nothing to split "
    "it over: use fsync.ops.replicated(optimizer, group=replica.group), which updates each "
    "bucket as its sum across replicas arrives, its state whole on every replica (healed "
    "whole), or the optimizer itself after GradSync."
)

GATHER_FIX = (
    "Gather it with fsync.ops.zero_state_dict(state, step) on the world that made it and shard "
    "the result for this world with ZeroStep.load(params, full_state)."
)


@formerly("fsync._zero_layout.ZeroState")  # the path in files saved before the package
@register_state
class ZeroState(NamedTuple):
    """This rank's state of a [fsync.ops.ZeroStep][].

    Attributes:
        layout: 1-D int64 CPU tensor ``[plan fingerprint, world size, rank,
            shard_buckets]``: what the state was sharded for, so that it is never
            used with another plan, world or rank.
        hook: The gradient hook's state (``()`` for stateless hooks).
        opt: The optimizer's state over this rank's pieces: a list with one
            flat tensor per bucket shard (``shard_buckets=True``) or per owned
            bucket (``shard_buckets=False``) wherever the optimizer keeps
            per-parameter state, and the optimizer's other entries (its step
            count) as they are.
        like: The parameter tree, each leaf a meta tensor of its shape, strides
            and dtype (no memory): what the plan is rebuilt from.
        step: 0-d int64 CPU tensor, the number of steps done: the sequence
            number the ranks compare at every step.
    """

    layout: torch.Tensor
    hook: Any
    opt: Any
    like: Any
    step: torch.Tensor


class Piece(NamedTuple):
    """The elements ``[lo, hi)`` of bucket ``bucket`` (``hi`` may pass its end: padding)."""

    bucket: int
    lo: int
    hi: int


class ZeroLayout(NamedTuple):
    """Which elements of which buckets this rank updates: a pure value.

    Attributes:
        plan: The bucket plan of the parameters.
        world_size: The number of ranks.
        rank: This rank.
        shard_buckets: Whether buckets are sharded (``True``) or owned whole.
        owners: The rank that owns each bucket with ``shard_buckets=False``
            (empty when sharded).
        pieces: This rank's pieces, in bucket order.
    """

    plan: BucketPlan
    world_size: int
    rank: int
    shard_buckets: bool
    owners: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def tensor(self) -> torch.Tensor:
        """``[plan fingerprint, world size, rank, shard_buckets]`` as a state keeps it."""
        values = [self.plan.fingerprint, self.world_size, self.rank, int(self.shard_buckets)]
        return torch.tensor(values, dtype=torch.int64)

    def is_pieces(self, x: Any) -> bool:
        """Whether ``x`` is a list of tensors shaped like this rank's pieces."""
        return (
            type(x) is list
            and len(x) == len(self.pieces)
            and all(
                isinstance(t, torch.Tensor) and tuple(t.shape) == (p.hi - p.lo,)
                for t, p in zip(x, self.pieces, strict=True)
            )
        )

    def meta_pieces(self) -> list[torch.Tensor]:
        """Memory-less tensors shaped like this rank's pieces (for optimizer templates)."""
        specs = self.plan.specs
        return [
            torch.empty(p.hi - p.lo, dtype=specs[p.bucket].dtype, device=_META) for p in self.pieces
        ]


def owners_by_size(nbytes: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The rank owning each bucket: largest bucket first, to the least loaded rank.

    Deterministic (ties go to the lower bucket index, then the lower rank), so
    every rank computes the same owners from the same plan.
    """
    load = [0] * world_size
    owners = [0] * len(nbytes)
    for b in sorted(range(len(nbytes)), key=lambda b: (-nbytes[b], b)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[b] = rank
        load[rank] += nbytes[b]
    return tuple(owners)


def zero_layout(plan: BucketPlan, world_size: int, rank: int, shard_buckets: bool) -> ZeroLayout:
    """The ``ZeroLayout`` of a plan for one rank of a world."""
    numels = tuple(spec.numel for spec in plan.specs)
    nbytes = tuple(spec.nbytes for spec in plan.specs)
    owners, pieces = _assign_pieces(numels, nbytes, world_size, rank, shard_buckets)
    return ZeroLayout(
        plan, world_size, rank, shard_buckets, owners, tuple(Piece(*p) for p in pieces)
    )


@_trace.python_at_trace_time
def _assign_pieces(
    numels: tuple[int, ...],
    nbytes: tuple[int, ...],
    world_size: int,
    rank: int,
    shard_buckets: bool,
) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
    """Bucket owners and this rank's ``(bucket, lo, hi)`` pieces, as Python at trace time."""
    if shard_buckets:
        shards = [_pack.shard_numel(n, world_size) for n in numels]
        return (), tuple((b, rank * n, (rank + 1) * n) for b, n in enumerate(shards))
    owners = owners_by_size(nbytes, world_size)
    return owners, tuple((b, 0, n) for b, n in enumerate(numels) if owners[b] == rank)


def pack_range(
    leaves: Sequence[Any], plan: BucketPlan, piece: Piece, dtype: torch.dtype
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a bucket packed from ``leaves`` in ``dtype``, zeros past its end.

    Only the leaves that overlap the range are read, so a rank never copies
    the whole bucket to get its shard; the result never shares memory with them.
    """
    parts = _parts(leaves, plan, piece, dtype)
    spec = plan.specs[piece.bucket]
    padding = piece.hi - max(piece.lo, spec.numel)
    if padding > 0 or not parts:
        parts.append(torch.zeros(max(padding, 0), dtype=dtype, device=spec.device))
    return torch.cat(parts).to(spec.device)


def read_range(
    leaves: Sequence[Any], plan: BucketPlan, piece: Piece, dtype: torch.dtype
) -> torch.Tensor:
    """``pack_range`` for reading only: eagerly, where the leaves of the range already lie
    one after the other in one buffer, in this layout and dtype (the parameters a ZeRO step
    returned, views of its gathered buckets), a view of that buffer instead of a copy."""
    parts = _parts(leaves, plan, piece, dtype)
    spec = plan.specs[piece.bucket]
    if piece.hi <= spec.numel and _consecutive(parts) and parts[0].device == spec.device:
        return parts[0].as_strided((piece.hi - piece.lo,), (1,))
    return pack_range(leaves, plan, piece, dtype)


def _parts(
    leaves: Sequence[Any], plan: BucketPlan, piece: Piece, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The leaves' flat slices that make up ``piece`` (views where the leaves allow)."""
    spec = plan.specs[piece.bucket]
    parts = []
    for i, offset, size in zip(spec.leaves, spec.offsets, spec.sizes, strict=True):
        start, stop = max(piece.lo, offset), min(piece.hi, offset + size)
        if start < stop:
            leaf_spec = plan.leaves[i]
            assert leaf_spec is not None
            parts.append(_pack.flat(leaves[i], leaf_spec, dtype)[start - offset : stop - offset])
    return parts


def _consecutive(parts: Sequence[torch.Tensor]) -> bool:
    """Whether 1-D ``parts`` lie one after the other in one storage (eagerly; traced, no)."""
    if not parts or torch.compiler.is_compiling():
        return False
    first = parts[0]
    end = first.storage_offset()
    for part in parts:
        if (
            part.stride() != (1,)
            or part.storage_offset() != end
            or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        ):
            return False
        end += part.numel()
    return True


def shard_group(group: _comm.Group) -> _comm.Group:
    """The ranks a ZeRO step splits its update and optimizer state over: ``group``'s, or a
    replica group's own ranks (``fsync.ft.ReplicaMesh``), each part replicated across
    replicas so that a dead replica's parts live on in its peers and a heal (rank ``r``
    from rank ``r`` of a peer) brings a rank its own part."""
    if not isinstance(group, _groups.ReplicaGroup):
        return group
    levels = _comm.hierarchy(group)
    if levels is None:
        raise ValueError(_ZERO_ACROSS_REPLICAS)
    return levels[1]


def own_part(layout: ZeroLayout, bucket: int, reduced: torch.Tensor) -> torch.Tensor:
    """This rank's part of bucket ``bucket`` once reduced: the bucket itself where buckets
    are owned whole, else this rank's shard of it; ``reduced`` is the whole bucket (a hook
    that returns it, PowerSGD; a hierarchical reduce's) or the shard already (a
    reduce-scatter's, or the shard that crossed replicas)."""
    if layout.shard_buckets and reduced.numel() == layout.plan.specs[bucket].numel:
        # Were it a one-element shard instead, the two readings agree.
        return _pack.shard_of(reduced, layout.rank, layout.world_size)
    return reduced


def start_gather(
    layout: ZeroLayout,
    bucket: int,
    piece: torch.Tensor | None,
    dtype: torch.dtype,
    group: _comm.Group,
) -> _groups.Issued:
    """Bucket ``bucket`` whole on every rank from its pieces: issued, not waited for.

    ``piece`` is this rank's piece of it (``None`` where, owned whole by another
    rank, this rank has none); ``dtype`` is the dtype of what is gathered. Padding
    past the bucket's end is not cut (``wait`` it, then cut).
    """
    spec = layout.plan.specs[bucket]
    if layout.shard_buckets:
        assert piece is not None
        return _comm.all_gather(piece, group)
    owner = layout.owners[bucket]
    if piece is None:
        piece = torch.empty(spec.numel, dtype=dtype, device=spec.device)
    return _comm.broadcast(piece, owner, group)


def gather(
    layout: ZeroLayout,
    pieces: Sequence[torch.Tensor],
    group: _comm.Group,
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """Every bucket whole on every rank, from each rank's pieces of it (eager or traced).

    Every collective is issued before the first is waited for. Traced, the
    owners' broadcasts are one op (see ``_comm.broadcasts``).
    """
    specs = layout.plan.specs
    mine = dict(zip((p.bucket for p in layout.pieces), pieces, strict=True))
    if not layout.shard_buckets and torch.compiler.is_compiling():
        sent = [
            mine[b] if b in mine else torch.empty(spec.numel, dtype=dtype, device=spec.device)
            for b, (spec, dtype) in enumerate(zip(specs, dtypes, strict=True))
        ]
        return _comm.broadcasts(sent, list(layout.owners), group)
    issued = [start_gather(layout, b, mine.get(b), dtype, group) for b, dtype in enumerate(dtypes)]
    return [_comm.wait(g)[: spec.numel] for g, spec in zip(issued, specs, strict=True)]


def check_pieces(layout: ZeroLayout, new_pieces: Any) -> None:
    if not isinstance(new_pieces, list | tuple) or len(new_pieces) != len(layout.pieces):
        raise ValueError(
            "optimizer.update must return the parameters with the structure it was given "
            f"(a list of {len(layout.pieces)} flat tensors); got {type(new_pieces).__name__}."
        )
    for piece, p in zip(new_pieces, layout.pieces, strict=True):
        spec = layout.plan.specs[p.bucket]
        if tuple(piece.shape) != (p.hi - p.lo,) or piece.dtype != spec.dtype:
            raise ValueError(
                f"optimizer.update returned a piece of bucket {p.bucket} with shape "
                f"{tuple(piece.shape)} and dtype {piece.dtype}; expected "
                f"({p.hi - p.lo},) and {spec.dtype}."
            )


def check_state(layout: ZeroLayout, state: Any) -> None:
    """Raises unless ``state`` was made for this layout's plan, world, mode and rank."""
    if torch.compiler.is_compiling():
        return
    fingerprint, world_size, rank, sharded = (int(v) for v in state.layout.tolist())
    if fingerprint != layout.plan.fingerprint:
        raise ValueError(
            "state belongs to another plan (its fingerprint differs): it was made for "
            "another parameter tree or other bucket sizes. Pass the state this ZeroStep's "
            "init or load returned."
        )
    if world_size != layout.world_size:
        raise ValueError(
            f"state was sharded for a world of {world_size} ranks, but this group has "
            f"{layout.world_size}. {GATHER_FIX}"
        )
    if bool(sharded) != layout.shard_buckets:
        raise ValueError(
            f"state was made with shard_buckets={bool(sharded)} but this step has "
            f"shard_buckets={layout.shard_buckets}. {GATHER_FIX}"
        )
    if rank != layout.rank:
        raise ValueError(
            f"state holds rank {rank}'s part, but this is rank {layout.rank}; every rank "
            "must pass its own state."
        )


def shard_full(layout: ZeroLayout, optimizer: Optimizer, full_state: Any) -> Any:
    """This rank's pieces of a full optimizer state (every per-parameter slot cut up)."""
    plan = layout.plan
    meta_params = _tree.unflatten(
        plan.treespec,
        [
            None if leaf is None else torch.empty(leaf.shape, dtype=leaf.dtype, device=_META)
            for leaf in plan.leaves
        ],
    )
    _checks.check_full_state(full_state, optimizer.init(meta_params))
    template_slots, slot_spec = _tree.flatten(
        optimizer.init(layout.meta_pieces()), is_leaf=layout.is_pieces
    )
    local: list[Any] = []
    for slot, template in zip(slot_spec.flatten_up_to(full_state), template_slots, strict=True):
        if not layout.is_pieces(template):
            local.append(slot)
            continue
        leaves, _ = _tree.flatten(slot)
        local.append(
            [
                pack_range(leaves, plan, p, t.dtype)
                for p, t in zip(layout.pieces, template, strict=True)
            ]
        )
    return _tree.unflatten(slot_spec, local)

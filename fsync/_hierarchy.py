"""The hierarchical reduce on a 2-D mesh: within the node, across nodes, within again.

A bucket's reduce on a 2-D ``DeviceMesh`` (dim 0 across nodes, dim 1 within a node)
is reduce-scattered (summed) within the node into ``1/local`` shards
(``reduce_within``, or ``start_within`` for one bucket), the hook runs on the shards
across nodes (``reduce_across``, with ``ctx.group`` the cross-node dim and ``ctx.plan``
the shards' plan), and the shards are all-gathered within the node
(``gather_within``); a bucketwise hook goes bucket by bucket, its stages overlapping
(``Pipeline``, ``GatheringPipeline``). ``reduce_started`` picks the flat or the
hierarchical form from the group.

The shards a hierarchical reduce sends across nodes, as a plan a hook can read.

On a 2-D ``DeviceMesh`` (dim 0 across nodes, dim 1 within a node, HSDP's
replicate and shard dims) each bucket is zero-padded to a multiple of the local
size and reduce-scattered within the node; what crosses the node boundary is
this rank's shard of every bucket, ``1/local`` of it. The hook given for the
cross-node hop sees those shards, so its state (PowerSGD's error feedback and
Q, say) must be sized for them: ``shard_plan`` describes them as a plan of its
own, one 1-D leaf (``"bucket3/shard"``) per bucket, which ``hook.init`` receives
and ``ctx.plan`` carries. The shards of all ranks of a node have the same
shapes, so every rank has the same shard plan.

Owns: the shard plan and the hierarchical stages. May import: ``_comm`` (with
``_comm._groups``), ``_tree``, ``_trace``, ``_plan``, ``_pack``, ``_hook``, ``_apply``
(layers 1 to 6, below the reduce).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fsync import _comm, _pack, _tree
from fsync._apply import alone, apply_hook, bucket_stage, finish_hook, start_hook
from fsync._comm import _groups
from fsync._hook import Hook, SyncContext
from fsync._pack import shard_numel
from fsync._plan import PLAN_CACHE_SIZE, BucketPlan, BucketSpec, LeafSpec
from fsync._trace import python_at_trace_time

_Bucket = tuple[int, torch.dtype, torch.device]


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _shard_plan(buckets: tuple[_Bucket, ...], local: int) -> BucketPlan:
    leaves = tuple(
        LeafSpec(f"bucket{b}/shard", (shard_numel(numel, local),), dtype, device, (0,))
        for b, (numel, dtype, device) in enumerate(buckets)
    )
    treespec = _tree.structure(list(range(len(leaves))))
    return BucketPlan(treespec, leaves, tuple((b,) for b in range(len(leaves))))


@python_at_trace_time
def _shard_plan_of(buckets: tuple[_Bucket, ...], local: int) -> BucketPlan:
    return _shard_plan(buckets, local)


def shard_plan(plan: BucketPlan, local: int) -> BucketPlan:
    """The plan of this rank's shards of ``plan``'s dense buckets, ``local`` shards each.

    One 1-D leaf per dense bucket, of ``ceil(numel / local)`` elements in the
    bucket's dtype, each its own bucket; built from metadata only (a constant
    under ``torch.compile``) and cached.
    """
    dense = tuple((s.numel, s.dtype, s.device) for s in plan.specs if not s.sparse)
    return _shard_plan_of(dense, local)


# The stages of a hierarchical reduce within the node, in the words of a failed wait.
_WITHIN = "a bucket's reduce-scatter within the node"
_GATHER = "the all-gather within the node"


def levels(group: _comm.Group) -> tuple[_comm.Group, _comm.Group | None]:
    """``(across, within)`` of a 2-D mesh; ``(group, None)`` where every rank is a node."""
    return _comm.hierarchy(group) or (group, None)


def reduce_dense(
    buffers: list[torch.Tensor], hook: Hook, state: Any, ctx: SyncContext
) -> tuple[list[torch.Tensor], Any]:
    """Every dense bucket reduced: the hook over ``ctx.group``, or hierarchically on a 2-D mesh.

    ``ctx.buckets`` describes ``buffers``. On a mesh the result is every
    bucket whole (a hierarchical reduce ignores ``ctx.scatter``).
    """
    return reduce_started([start_within(b, ctx.group) for b in buffers], hook, state, ctx)


def reduce_within(buffers: list[torch.Tensor], within: _comm.Group | None) -> list[torch.Tensor]:
    """Each bucket zero-padded to ``local`` shards and reduce-scattered (summed) in the node.

    With no ``within`` (a 1-D group: every rank is a node of its own) the buckets
    themselves.
    """
    if within is None:
        return buffers
    local = _comm.size(within)
    # Every reduce-scatter issued before the first is waited for.
    padded = (_pack.pad_to_shards(b, local) for b in buffers)
    pending = _comm.reduce_scatters(padded, "sum", within)
    return [_comm.wait(s, _WITHIN) for s in pending]


def reduce_across(
    shards: list[torch.Tensor],
    hook: Hook,
    state: Any,
    ctx: SyncContext,
    across: _comm.Group,
    within: _comm.Group | None,
) -> tuple[list[torch.Tensor], Any]:
    """The hook on this rank's shards of ``ctx.buckets``, over the cross-node group."""
    return apply_hook(shards, hook, state, cross_context(ctx, across, within), " across nodes")


def cross_context(ctx: SyncContext, across: _comm.Group, within: _comm.Group | None) -> SyncContext:
    """The hook's context across nodes: the shards' plan, and the shards of ``ctx.buckets``."""
    if within is None:
        size, rank = _comm.size(across), _comm.rank(across)
        return ctx._replace(group=across, rank=rank, world_size=size, scatter=False)
    splan = shard_plan(ctx.plan, _comm.size(within))
    dense = [spec for spec in ctx.plan.specs if not spec.sparse]
    position = {spec.leaves: k for k, spec in enumerate(dense)}
    return SyncContext(
        splan,
        tuple(splan.specs[position[spec.leaves]] for spec in ctx.buckets),
        across,
        _comm.rank(across),
        _comm.size(across),
        ctx.divisor,
        owned=ctx.owned,
    )


def gather_within(
    shards: list[torch.Tensor], buckets: Sequence[BucketSpec], within: _comm.Group | None
) -> list[torch.Tensor]:
    """Every bucket whole again from the node's shards (all-gathered, padding cut)."""
    if within is None:
        return shards
    gathered = [_comm.all_gather(s, within) for s in shards]
    return [_comm.wait(g, _GATHER)[: spec.numel] for g, spec in zip(gathered, buckets, strict=True)]


def start_within(buffer: torch.Tensor, group: _comm.Group) -> torch.Tensor:
    """A dense bucket's reduce-scatter within the node issued: this rank's shard, in flight.

    On a 1-D group, where every rank is a node of its own, the bucket itself.
    """
    within = levels(group)[1]
    if within is None:
        return buffer
    return _comm.reduce_scatter(_pack.pad_to_shards(buffer, _comm.size(within)), "sum", within)


class Pipeline:
    """A hierarchical reduce through a bucketwise hook, bucket by bucket, to each rank's shard.

    Each bucket is reduce-scattered within the node and its shard goes through the hook
    across nodes: pushing bucket ``k`` (its reduce-scatter in flight, or a shard already
    reduced within the node) starts bucket ``k - 1`` across nodes (its reduce-scatter
    waited for), so that while one bucket crosses the next is reduce-scattered. ``drain``
    returns this rank's shard of every bucket, reduced (HSDP's split of the update);
    ``GatheringPipeline`` gathers them whole. Every rank pushes the buckets in the plan's
    order, so every rank issues the same collectives in the same order on each group.
    """

    def __init__(self, hook: Hook, state: Any, ctx: SyncContext) -> None:
        across, within = levels(ctx.group)
        assert within is not None, "a pipeline is for a 2-D mesh"
        self._hook, self._state, self._ctx, self._within = hook, state, ctx, within
        self._cross = cross_context(ctx, across, within)
        self._started: list[torch.Tensor] = []
        self._crossing: list[torch.Tensor] = []

    def push(self, started: torch.Tensor) -> None:
        """The next bucket, in plan order: its shard, reduced within the node or on its way."""
        self._started.append(started)
        k = len(self._started) - 1
        if k >= 1:
            self._start_crossing(k - 1)

    def drain(self) -> list[torch.Tensor]:
        """This rank's shard of every pushed bucket, reduced across nodes."""
        self._cross_all()
        return [self._crossed(k) for k in range(len(self._crossing))]

    def _cross_all(self) -> None:
        for k in range(len(self._crossing), len(self._started)):
            self._start_crossing(k)

    def _start_crossing(self, k: int) -> None:
        shard = _comm.wait(self._started[k], functools.partial(bucket_stage, self._ctx, k, _WITHIN))
        out, _ = start_hook([shard], self._hook, self._state, alone(self._cross, k))
        self._crossing.append(out[0])

    def _crossed(self, k: int) -> torch.Tensor:
        return finish_hook([self._crossing[k]], alone(self._cross, k), " across nodes")[0]


class GatheringPipeline(Pipeline):
    """A ``Pipeline`` whose shards are all-gathered within the node, every bucket whole.

    Done in three rounds over all buckets, the cable would idle while the node works
    and the other way round. Here pushing bucket ``k`` also gathers bucket ``k - 2``
    (its crossing waited for): while one bucket crosses, the next is reduce-scattered
    and the one before gathered, the two kinds of link busy at once. ``drain``
    finishes the last two and returns every bucket whole.
    """

    def __init__(self, hook: Hook, state: Any, ctx: SyncContext) -> None:
        super().__init__(hook, state, ctx)
        self._gathering: list[_groups.Issued] = []

    def push(self, started: torch.Tensor) -> None:
        """The next bucket, in plan order (see ``Pipeline.push``); two before it gathered."""
        super().push(started)
        k = len(self._started) - 1
        if k >= 2:
            self._start_gathering(k - 2)

    def drain(self) -> list[torch.Tensor]:
        """Every pushed bucket, reduced and whole (its padding cut)."""
        self._cross_all()
        for k in range(len(self._gathering), len(self._started)):
            self._start_gathering(k)
        return [
            _comm.wait(g, functools.partial(bucket_stage, self._ctx, k, _GATHER))[: spec.numel]
            for k, (g, spec) in enumerate(zip(self._gathering, self._ctx.buckets, strict=True))
        ]

    def _start_gathering(self, k: int) -> None:
        self._gathering.append(_comm.all_gather(self._crossed(k), self._within))


def pipelined(hook: Hook, state: Any) -> bool:
    """Whether a hierarchical reduce through ``hook`` can go bucket by bucket (``Pipeline``)."""
    return hook.bucketwise and not optree.tree_leaves(state, namespace=_tree.NAMESPACE)


def reduce_started(
    started: list[torch.Tensor], hook: Hook, state: Any, ctx: SyncContext
) -> tuple[list[torch.Tensor], Any]:
    """``reduce_dense`` for buckets whose within-node part ``start_within`` already issued:
    every bucket reduced and whole. On a 2-D mesh a bucketwise hook goes through a
    ``GatheringPipeline``; another (PowerSGD) runs across nodes on every shard at once,
    between the within-node stages."""
    within = levels(ctx.group)[1]
    if within is not None and pipelined(hook, state):
        return drained(GatheringPipeline(hook, state, ctx), started), state
    out, state = reduce_started_shards(started, hook, state, ctx)
    return (out if within is None else gather_within(out, ctx.buckets, within)), state


def reduce_started_shards(
    started: list[torch.Tensor], hook: Hook, state: Any, ctx: SyncContext
) -> tuple[list[torch.Tensor], Any]:
    """``reduce_started`` up to this rank's shard of each bucket on a 2-D mesh
    (``ceil(numel / local)`` elements, zero-padded), not gathered; elsewhere, where every
    rank is a node, each bucket whole."""
    across, within = levels(ctx.group)
    if within is None:
        return apply_hook(started, hook, state, ctx)
    if pipelined(hook, state):
        return drained(Pipeline(hook, state, ctx), started), state
    shards = [_comm.wait(s, _WITHIN) for s in started]
    return reduce_across(shards, hook, state, ctx, across, within)


def drained(pipeline: Pipeline, started: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for pending in started:
        pipeline.push(pending)
    return pipeline.drain()

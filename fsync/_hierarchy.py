"""The shards a hierarchical reduce sends across nodes, as a plan a hook can read.

On a 2-D ``DeviceMesh`` (dim 0 across nodes, dim 1 within a node, HSDP's
replicate and shard dims) each bucket is zero-padded to a multiple of the local
size and reduce-scattered within the node; what crosses the node boundary is
this rank's shard of every bucket, ``1/local`` of it. The hook given for the
cross-node hop sees those shards, so its state (PowerSGD's error feedback and
Q, say) must be sized for them: ``shard_plan`` describes them as a plan of its
own, one 1-D leaf (``"bucket3/shard"``) per bucket, which ``hook.init`` receives
and ``ctx.plan`` carries. The shards of all ranks of a node have the same
shapes, so every rank has the same shard plan.

Owns: the shard plan. May import: ``_plan``, ``_pack``, ``_planner``, ``_tree``
(layers 1 to 4).
"""

from __future__ import annotations

import functools

import torch

from fsync import _tree
from fsync._pack import shard_numel
from fsync._plan import PLAN_CACHE_SIZE, BucketPlan, LeafSpec
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

"""The one reduce: checked leaves and their plan in, reduced buffers (or leaves) out.

Every entry point ([fsync.sync_grads][], [fsync.GradSync][], the ZeRO step and
[fsync.sync_stats][]) ends here, so they all issue the same collectives in the
same order: the control collective (if the options need one), then pack, the
hook, the wait, and unpack.

On a 2-D ``DeviceMesh`` (dim 0 across nodes, dim 1 within a node) the reduce is
hierarchical: each dense bucket is reduce-scattered (summed) within the node
into ``1/local`` shards, the hook runs on the shards across nodes (with
``ctx.group`` the cross-node dim and ``ctx.plan`` the shards' plan, see
``_hierarchy``), and the shards are all-gathered within the node. The ranks'
agreement still runs over the whole mesh, first. A deferred reduce
([fsync.DeferredSync][]) splits that in two stages: ``"add"`` stops after the
reduce-scatter, ``"finish"`` runs the hook and the all-gather on accumulated
shards.

Owns: the order of a sync's steps and the hook's calling convention. May
import: everything below it (layers 1 to 6), ``fsync.ops`` for the default hook.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch

from fsync import _checks, _comm, _pack, _sparse
from fsync._agree import agree_on
from fsync._hierarchy import shard_plan
from fsync._hook import Hook, SyncContext, hook_spec
from fsync._options import SyncOptions
from fsync._plan import BucketPlan
from fsync.ops._allreduce import allreduce

DEFAULT_HOOK = allreduce("mean")

Stage = Literal["sync", "add", "finish"]

_HOOK_RESULT = (
    "hook.apply returned {got}; expected a pair (buckets, state): a list with one tensor per "
    "bucket and the hook's new state. End a custom apply with `return buckets, state`."
)


class Reduced(NamedTuple):
    """What one reduce returns.

    Attributes:
        buffers: One reduced buffer per bucket of the plan (with ``scatter``,
            a dense bucket's buffer may be this rank's shard of it).
        used: Per leaf, whether any rank had a gradient for it (``None``
            unless ``find_unused``).
        hook_state: The hook's new state.
    """

    buffers: list[torch.Tensor]
    used: list[bool] | None
    hook_state: Any


def _apply_hook(
    buffers: list[torch.Tensor], plan: BucketPlan, hook: Hook, state: Any, ctx: Any
) -> tuple[list[torch.Tensor], Any]:
    dense = [b for b, spec in zip(buffers, plan.specs, strict=True) if not spec.sparse]
    result = hook.apply(dense, state, ctx)
    if not isinstance(result, tuple) or len(result) != 2:
        got = f"a {type(result).__name__}"
        if isinstance(result, tuple):
            got = f"a tuple of {len(result)}"
        raise TypeError(_HOOK_RESULT.format(got=got))
    out, state = result
    if not isinstance(out, list | tuple):
        raise TypeError(
            f"hook output: got a {type(out).__name__}; expected a list with one buffer per "
            "bucket, in the plan's order."
        )
    out = [_comm.wait(b) for b in out]
    _checks.check_buffers(
        out, ctx.buckets, plan, "hook output", shards=ctx.world_size if ctx.scatter else 0
    )
    return out, state


def reduce_buckets(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    options: SyncOptions,
    hook_state: Any,
    group: _comm.Group,
    *,
    active: bool = True,
    scatter: bool = False,
    step: torch.Tensor | None = None,
    state_fingerprint: torch.Tensor | None = None,
    stage: Stage = "sync",
    shards: Sequence[torch.Tensor] = (),
    micro: torch.Tensor | None = None,
) -> Reduced:
    """Agreement, pack, hook, wait: the reduced buffer of every bucket.

    ``leaves`` must already fit ``plan`` (see ``fit_tree``). The ranks first
    agree (``_agree.agree_on``) on the plan, the options, the stage, the sync's
    sequence number ``step`` (a state's step count) and that
    ``state_fingerprint`` (the fingerprint of the plan a state was made for) is
    the plan's. With ``scatter`` the hook may return this rank's shard of a
    bucket instead of all of it (the ZeRO step needs only that; a hierarchical
    reduce returns whole buckets). ``stage="add"`` returns, per dense bucket,
    this rank's within-node shard of the sum (the whole sum's bucket where
    every rank is a node of its own, a 1-D group); ``stage="finish"`` reduces
    such ``shards``, summed over ``micro`` micro-batches, across nodes and
    divides by ``micro`` times the world size.
    """
    sparse = [spec for spec in plan.specs if spec.sparse]
    if sparse and torch.compiler.is_compiling():
        leaf = plan.leaves[sparse[0].leaves[0]]
        assert leaf is not None
        raise TypeError(_checks.SPARSE_UNDER_COMPILE.format(path=leaf.path))
    if not active:
        leaves = [None] * len(leaves)
    hook = hook_of(options)
    levels = _comm.hierarchy(group)
    finish = stage == "finish"
    pack = functools.partial(_pack_after, leaves, plan)
    (divisor, used), buffers = agree_on(
        plan,
        leaves,
        group,
        hook=_agreed_hook(hook, levels, stage),
        find_unused=options.find_unused,
        divide_by=options.divide_by,
        active=active and not finish,
        step=step,
        state_fingerprint=state_fingerprint,
        pack=functools.partial(_after, shards) if finish else pack,
    )
    if sparse and hook_spec(hook) != DEFAULT_HOOK.spec:
        leaf = plan.leaves[sparse[0].leaves[0]]
        assert leaf is not None
        raise ValueError(_checks.SPARSE_NEEDS_DEFAULT_HOOK.format(path=leaf.path, hook=hook.spec))
    dense_specs = tuple(spec for spec in plan.specs if not spec.sparse)
    size = _comm.size(group)
    ctx = SyncContext(
        plan, dense_specs, group, _comm.rank(group), size, divisor, scatter=scatter, owned=True
    )
    if stage != "sync" or levels is not None:
        across, within = levels or (group, None)
        dense = [b for b, spec in zip(buffers, plan.specs, strict=True) if not spec.sparse]
        if not finish:
            dense = _reduce_within(dense, within)
        if stage == "add":
            return Reduced(dense, used, hook_state)
        if finish:
            assert micro is not None
            ctx = ctx._replace(divisor=micro.clamp(min=1) * divisor, owned=False)
        dense, hook_state = _across(dense, plan, hook, hook_state, ctx, across, within)
    else:
        dense, hook_state = _apply_hook(buffers, plan, hook, hook_state, ctx)
    reduced = iter(dense)
    out = [
        _sparse.sparse_mean(b, ctx) if spec.sparse else next(reduced)
        for b, spec in zip(buffers, plan.specs, strict=True)
    ]
    return Reduced(out, used, hook_state)


def _agreed_hook(hook: Hook, levels: tuple[_comm.Group, _comm.Group] | None, stage: Stage) -> str:
    """What the ranks compare for the hook: its spec, and where and at which stage it runs."""
    spec = hook_spec(hook)
    if levels is not None:
        spec = f"{spec} across the nodes of a {_comm.size(levels[0])}x{_comm.size(levels[1])} mesh"
    return spec if stage == "sync" else f"{spec}, deferred: {stage}"


def _after(shards: Sequence[torch.Tensor], token: torch.Tensor | None) -> list[torch.Tensor]:
    """Accumulated shards, made to wait for the agreement (``token``) as packed buckets do."""
    return [s if token is None else s * token for s in shards]


def local_size(group: _comm.Group) -> int:
    """The ranks of a node: dim 1 of a 2-D mesh; 1 for any other group (a rank per node)."""
    levels = _comm.hierarchy(group)
    return 1 if levels is None else _comm.size(levels[1])


def _reduce_within(dense: list[torch.Tensor], within: _comm.Group | None) -> list[torch.Tensor]:
    """Each bucket zero-padded to ``local`` shards and reduce-scattered (summed) in the node."""
    if within is None:
        return dense
    local = _comm.size(within)
    # Issue every reduce-scatter before waiting on the first.
    pending = [_comm.reduce_scatter(_pack.pad_to_shards(b, local), "sum", within) for b in dense]
    return [_comm.wait(s) for s in pending]


def _across(
    shards: list[torch.Tensor],
    plan: BucketPlan,
    hook: Hook,
    state: Any,
    ctx: SyncContext,
    across: _comm.Group,
    within: _comm.Group | None,
) -> tuple[list[torch.Tensor], Any]:
    """The hook on the shards across nodes, then every bucket whole again (all-gather)."""
    local = 1 if within is None else _comm.size(within)
    splan = shard_plan(plan, local) if within is not None else plan
    cross = SyncContext(
        splan,
        tuple(s for s in splan.specs if not s.sparse),
        across,
        _comm.rank(across),
        _comm.size(across),
        ctx.divisor,
        owned=ctx.owned,
    )
    out, state = _apply_hook(shards, splan, hook, state, cross)
    if within is None:
        return out, state
    gathered = [_comm.all_gather(s, within) for s in out]
    whole = [_comm.wait(g)[: spec.numel] for g, spec in zip(gathered, ctx.buckets, strict=True)]
    return whole, state


def _pack_after(
    leaves: Sequence[torch.Tensor | None], plan: BucketPlan, token: torch.Tensor | None
) -> list[torch.Tensor]:
    return _pack.pack_leaves(leaves, plan, after=token)


def unpack_reduced(reduced: Reduced, plan: BucketPlan) -> list[torch.Tensor | None]:
    """The leaves of reduced buffers; ``None`` where no rank had a gradient (``find_unused``)."""
    out = _pack.unpack_leaves(reduced.buffers, plan)
    if reduced.used is not None:
        out = [leaf if keep else None for leaf, keep in zip(out, reduced.used, strict=True)]
    return out


def hook_of(options: SyncOptions) -> Hook:
    """The options' hook, the default (all-reduce mean) filled in."""
    return DEFAULT_HOOK if options.hook is None else options.hook


def init_hook(options: SyncOptions, plan: BucketPlan, group: _comm.Group = None) -> Any:
    """The initial state of the options' hook for ``plan`` reduced over ``group``.

    On a 2-D mesh the hook runs on the shards across nodes: its state is made
    for their plan (``_hierarchy.shard_plan``).
    """
    levels = _comm.hierarchy(group)
    if levels is not None:
        plan = shard_plan(plan, _comm.size(levels[1]))
    return hook_of(options).init(plan)

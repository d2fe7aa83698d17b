"""The reduce, as stages that each entry point composes.

A sync is a sequence of stages over one plan:

1. **agree** (``agree_and_pack``): the ranks' control collective, with the
   buckets packed while it is on the wire (``_agree``);
2. **start** a bucket's hook (``start_hook``): the hook issues its collectives
   and returns buffers that may still be in flight;
3. **wait** (``finish_hook``): the hook's buffers, waited for and checked;
4. **unpack** (``unpack_reduced``): leaves again, ``None`` where no rank had one.

Stages 2 and 3 are the hook's calling convention (``_apply``). On a 2-D
``DeviceMesh`` (dim 0 across nodes, dim 1 within a node) a bucket's reduce is
hierarchical (``_hierarchy``: within the node, across nodes, within again);
``reduce_dense`` picks the flat or the hierarchical form from the group. The ranks'
agreement still runs over the whole mesh, first.

Who composes what: [fsync.sync_grads][] and [fsync.GradSync][] run the stages
back to back (``reduce``); the ZeRO step asks the hook for shards
(``SyncContext.scatter``); [fsync.DeferredSync][] stops ``add`` after
``reduce_within`` and runs ``finish`` from ``reduce_across`` on; and
[fsync.grad_and_value][] (``_backward``) agrees before backward, packs each
bucket as autograd completes it and starts it (``start_bucket``) in plan order.
Sparse buckets never reach a hook: fsync averages them itself (``with_sparse``: an
all-gather and a coalesce, as DDP does), after the dense ones.

Owns: the stages of a sync and their order. May import: everything below it (layers 1
to 6, ``_apply`` and ``_hierarchy`` among them; ``_allreduce``, the default hook).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from fsync import _checks, _comm, _pack, _tree
from fsync._agree import Agreed, Terms, agree_on, refuse
from fsync._allreduce import allreduce
from fsync._apply import context
from fsync._comm import _reports
from fsync._control import state_words
from fsync._hierarchy import (
    GatheringPipeline,
    drained,
    gather_within,
    levels,
    pipelined,
    reduce_across,
    reduce_dense,
    reduce_within,
    shard_plan,
)
from fsync._hook import Hook, SyncContext, hook_spec
from fsync._options import SyncOptions
from fsync._plan import BucketPlan
from fsync._planner import plan_tree

DEFAULT_HOOK = allreduce("mean")


class SyncCall(NamedTuple):
    """What one sync runs with besides its leaves and plan, built once by each entry point
    and passed down the stages: the options, the group, the hook's state and, where a state
    carries them, the sync's sequence number (its step count) and the fingerprint of the
    plan that state was made for (the ranks compare both, see ``terms``)."""

    options: SyncOptions
    group: _comm.Group
    hook_state: Any = ()
    step: torch.Tensor | None = None
    fingerprint: torch.Tensor | None = None

    @classmethod
    def at(cls, owner: Any, state: Any) -> SyncCall:
        """The sync of ``state``'s step: ``owner``'s options and group (a ``GradSync``'s, a
        ``DeferredSync``'s), the state's hook state, step count and plan fingerprint."""
        return cls(owner.options, owner.group, state.hook, state.step, state.fingerprint)


class Reduced(NamedTuple):
    """What one reduce returns.

    Attributes:
        buffers: One reduced buffer per bucket of the plan (with
            ``ctx.scatter``, a dense bucket's buffer may be this rank's shard of it).
        used: Per leaf, whether any rank had a gradient for it (``None``
            when every leaf comes back).
        hook_state: The hook's new state.
    """

    buffers: list[torch.Tensor]
    used: list[bool] | None
    hook_state: Any


# --- settings ------------------------------------------------------------------------------------


def hook_of(options: SyncOptions) -> Hook:
    """The options' hook, the default (all-reduce mean) filled in."""
    return DEFAULT_HOOK if options.hook is None else options.hook


def init_hook(options: SyncOptions, plan: BucketPlan, group: _comm.Group = None) -> Any:
    """The initial state of the options' hook for ``plan`` reduced over ``group``.

    On a 2-D mesh the hook runs on the shards across nodes: its state is made
    for their plan (``_hierarchy.shard_plan``).
    """
    return hook_of(options).init(hook_plan(plan, group))


def hook_plan(plan: BucketPlan, group: _comm.Group) -> BucketPlan:
    """The plan the hook sees: ``plan``, or its shards' plan on a 2-D mesh."""
    within = levels(group)[1]
    return plan if within is None else shard_plan(plan, _comm.size(within))


def local_size(group: _comm.Group) -> int:
    """The ranks of a node: dim 1 of a 2-D mesh; 1 for any other group (a rank per node)."""
    within = levels(group)[1]
    return 1 if within is None else _comm.size(within)


def agreed_spec(hook: Hook, group: _comm.Group, stage: str = "sync") -> str:
    """What the ranks compare for the hook: its spec, and where and at which stage it runs.

    ``stage`` names the part of a sync that runs ("sync" for a whole one;
    [fsync.DeferredSync][]'s ``"add"`` and ``"finish"``), so that ranks at
    different parts of a step disagree instead of pairing their collectives.
    """
    spec = hook_spec(hook)
    levels = _comm.hierarchy(group)
    if levels is not None:
        spec = f"{spec} across the nodes of a {_comm.size(levels[0])}x{_comm.size(levels[1])} mesh"
    return spec if stage == "sync" else f"{spec}, deferred: {stage}"


def gives_back(options: SyncOptions, plan: BucketPlan, group: _comm.Group) -> bool:
    """Whether a sync of ``plan`` over ``group`` returns every gradient as it is: one rank,
    the default mean (over itself: the identity), in the leaves' own dtypes, dense, every
    leaf coming back. Then there is nothing to pack, send or agree on."""
    return (
        _comm.size(group) == 1
        and _comm.hierarchy(group) is None
        and hook_spec(hook_of(options)) == DEFAULT_HOOK.spec
        and plan.reduce_dtype is None
        and not options.find_unused
        and not any(spec.sparse for spec in plan.specs)
    )


def copied_back(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    options: SyncOptions,
    group: _comm.Group,
    *,
    active: bool,
) -> list[torch.Tensor | None] | None:
    """An eager sync's leaves where it has nothing to send (``gives_back``, this rank active):
    each gradient copied into memory of its own, never the caller's tensor; else ``None``."""
    if active and not torch.compiler.is_compiling() and gives_back(options, plan, group):
        return _pack.copies(leaves, plan)
    return None


def _first_sparse(plan: BucketPlan) -> str | None:
    """The path of the plan's first sparse leaf, ``None`` if it has none."""
    spec = next((spec for spec in plan.specs if spec.sparse), None)
    if spec is None:
        return None
    leaf = plan.leaves[spec.leaves[0]]
    assert leaf is not None
    return leaf.path


def check_sparse_traced(plan: BucketPlan) -> None:
    """Refuses a sparse leaf inside ``torch.compile``: sparse buckets are averaged by fsync
    itself, eagerly. A check before the agreement (this rank's tree is enough)."""
    path = _first_sparse(plan)
    if path is not None and torch.compiler.is_compiling():
        raise TypeError(_checks.SPARSE_UNDER_COMPILE.format(path=path))


def check_sparse_hook(plan: BucketPlan, hook: Hook) -> None:
    """Refuses a hook other than the default where the plan has a sparse leaf: sparse buckets
    are averaged by fsync itself. A check after the agreement: only then is the plan known
    to be every rank's, so that every rank raises."""
    path = _first_sparse(plan)
    if path is not None and hook_spec(hook) != DEFAULT_HOOK.spec:
        raise ValueError(_checks.SPARSE_NEEDS_DEFAULT_HOOK.format(path=path, hook=hook.spec))


# --- stage 1: agree (and pack) -------------------------------------------------------------------


def agree_and_pack(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    call: SyncCall,
    *,
    active: bool = True,
    stage: str = "sync",
) -> tuple[Agreed, list[torch.Tensor]]:
    """The ranks' agreement on this sync, and every bucket packed (eagerly, meanwhile).

    ``leaves`` must already fit ``plan`` (see ``fit_tree``). The ranks agree
    (``_agree.agree_on``) on the plan and the ``terms`` of ``call`` at ``stage``. A
    rank with ``active=False`` packs zeros.
    """
    if not active:
        leaves = [None] * len(leaves)
    return agree_on(
        plan,
        leaves,
        call.group,
        terms(call, stage, active),
        pack=functools.partial(_pack_after, leaves, plan),
    )


def terms(call: SyncCall, stage: str = "sync", active: bool = True) -> Terms:
    """What the ranks compare at a sync (see ``_agree.Terms``): ``call``'s options, the
    ``stage``, its sequence number (a state's step count), that its fingerprint (of the
    plan a state was made for) is the plan's, and the metadata of its hook state."""
    return Terms(
        agreed_spec(hook_of(call.options), call.group, stage),
        call.options.find_unused,
        call.options.divide_by,
        active,
        call.step,
        call.fingerprint,
        state_words(call.hook_state),
    )


def _pack_after(
    leaves: Sequence[torch.Tensor | None], plan: BucketPlan, token: torch.Tensor | None
) -> list[torch.Tensor]:
    return _pack.pack_leaves(leaves, plan, after=token)


def dense(buffers: Sequence[torch.Tensor], plan: BucketPlan) -> list[torch.Tensor]:
    """The buffers of ``plan``'s dense buckets, in order (what hooks receive)."""
    return [b for b, spec in zip(buffers, plan.specs, strict=True) if not spec.sparse]


def with_sparse(
    reduced: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    plan: BucketPlan,
    ctx: SyncContext,
) -> list[torch.Tensor]:
    """Reduced dense buffers and the mean of each sparse one, in the plan's order."""
    out = iter(reduced)
    return [
        _sparse_mean(b, ctx) if spec.sparse else next(out)
        for b, spec in zip(buffers, plan.specs, strict=True)
    ]


def _sparse_mean(x: torch.Tensor, ctx: SyncContext) -> torch.Tensor:
    """The mean over ``ctx.group`` of a sparse COO tensor, as DDP computes it.

    As DDP does, each rank divides its values by the divisor, then the ranks'
    entries are summed: every rank's indices and values are all-gathered (padded
    to the largest count, one small all-gather of the counts first) and
    coalesced, which adds the values of repeated indices. The result is a
    coalesced sparse tensor.
    """
    x = x.coalesce()
    divisor = ctx.divisor
    values = x.values() / (divisor.to(x.dtype) if isinstance(divisor, torch.Tensor) else divisor)
    indices = x.indices()
    if ctx.world_size == 1:
        return torch.sparse_coo_tensor(indices, values, x.shape, check_invariants=True).coalesce()
    nnz = torch.tensor([values.shape[0]], dtype=torch.int64, device=x.device)
    counts = _comm.wait(_comm.all_gather(nnz, ctx.group)).tolist()
    most = max(counts)
    # Gathered along dim 0, so entries go first: indices as (nnz, sparse_dims).
    padded_indices = indices.new_zeros(most, indices.shape[0])
    padded_indices[: values.shape[0]] = indices.t()
    padded_values = values.new_zeros(most, *values.shape[1:])
    padded_values[: values.shape[0]] = values
    all_indices = _comm.wait(_comm.all_gather(padded_indices, ctx.group))
    all_values = _comm.wait(_comm.all_gather(padded_values, ctx.group))
    keep = torch.cat(
        [torch.arange(r * most, r * most + n, device=x.device) for r, n in enumerate(counts)]
    )
    # The indices come from other processes: have torch check them.
    return torch.sparse_coo_tensor(
        all_indices[keep].t(), all_values[keep], x.shape, check_invariants=True
    ).coalesce()


# --- the stages back to back ---------------------------------------------------------------------


def reduce(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    call: SyncCall,
    *,
    active: bool = True,
) -> Reduced:
    """One whole sync: agree and pack, every bucket reduced, sparse ones averaged.

    The callers have checked what they could before it (``check_sparse_traced`` among
    it), refusing what they found (``_agree.refuse``).
    """
    hook = hook_of(call.options)
    agreed, buffers = agree_and_pack(leaves, plan, call, active=active)
    check_sparse_hook(plan, hook)
    ctx = context(plan, call.group, agreed.divisor)
    out, hook_state = reduce_dense(dense(buffers, plan), hook, call.hook_state, ctx)
    return Reduced(with_sparse(out, buffers, plan, ctx), agreed.used, hook_state)


def reduce_add(
    leaves: Sequence[torch.Tensor | None], plan: BucketPlan, call: SyncCall
) -> list[torch.Tensor]:
    """A deferred reduce's first part: agree, pack, reduce-scatter within the node.

    Per dense bucket, this rank's within-node shard of the node's sum (the whole
    bucket where every rank is a node of its own, a 1-D group): what
    [fsync.DeferredSync][] accumulates over micro-batches. The hook's state is not
    compared here (it is not used before ``reduce_finish``).
    """
    _, buffers = agree_and_pack(leaves, plan, call._replace(hook_state=()), stage="add")
    return reduce_within(dense(buffers, plan), levels(call.group)[1])


def reduce_finish(
    shards: Sequence[torch.Tensor], micro: torch.Tensor, plan: BucketPlan, call: SyncCall
) -> Reduced:
    """A deferred reduce's last part: the hook across nodes on accumulated shards, then gather.

    ``shards`` (as ``reduce_add`` returned them, summed over ``micro``
    micro-batches) are divided by ``micro`` times the world size.
    """
    hook, hook_state, group = hook_of(call.options), call.hook_state, call.group
    agreed, held = agree_on(
        plan,
        [None] * len(plan.leaves),
        group,
        terms(call, "finish", False),
        pack=functools.partial(_after, shards),
    )
    ctx = context(plan, group, agreed.divisor)
    ctx = ctx._replace(divisor=micro.clamp(min=1) * agreed.divisor, owned=False)
    across, within = levels(group)
    if within is not None and pipelined(hook, hook_state):
        # The shards were reduced within the node already, by each add.
        return Reduced(
            drained(GatheringPipeline(hook, hook_state, ctx), held), agreed.used, hook_state
        )
    out, hook_state = reduce_across(held, hook, hook_state, ctx, across, within)
    return Reduced(gather_within(out, ctx.buckets, within), agreed.used, hook_state)


def _after(shards: Sequence[torch.Tensor], token: torch.Tensor | None) -> list[torch.Tensor]:
    """Accumulated shards, made to wait for the agreement (``token``) as packed buckets do."""
    return [s if token is None else s * token for s in shards]


def sync_tree(grads: Any, options: SyncOptions, group: _comm.Group, *, active: bool = True) -> Any:
    """A stateless sync of a gradient tree: plan it, reduce it, the synced tree back.

    What the checks before the agreement find on this rank is every rank's error
    (``_agree.refuse``).
    """
    try:
        leaves, plan, rebuild = plan_tree(grads, options.plan)
        state = init_hook(options, plan, group)
        if optree.tree_leaves(state, namespace=_tree.NAMESPACE):
            raise ValueError(_checks.STATEFUL_HOOK)
        check_sparse_traced(plan)
    except (ValueError, TypeError) as error:
        return refuse(error, group, like=grads)
    copies = copied_back(leaves, plan, options, group, active=active)
    if copies is not None:  # one rank: the mean is each gradient
        return rebuild(copies)
    reduced = _reports.naming(
        lambda: reduce(leaves, plan, SyncCall(options, group, state), active=active), group
    )
    return rebuild(unpack_reduced(reduced, plan))


def unpack_reduced(reduced: Reduced, plan: BucketPlan) -> list[torch.Tensor | None]:
    """The leaves of reduced buffers; ``None`` where no rank had a gradient (``find_unused``)."""
    out = _pack.unpack_leaves(reduced.buffers, plan)
    if reduced.used is not None:
        out = [leaf if keep else None for leaf, keep in zip(out, reduced.used, strict=True)]
    return out

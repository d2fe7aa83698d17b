"""The reduce, as stages that each entry point composes.

A sync is a sequence of stages over one plan:

1. **agree** (``agree_and_pack``): the ranks' control collective, with the
   buckets packed while it is on the wire (``_agree``);
2. **start** a bucket's hook (``start_hook``): the hook issues its collectives
   and returns buffers that may still be in flight;
3. **wait** (``finish_hook``): the hook's buffers, waited for and checked;
4. **unpack** (``unpack_reduced``): leaves again, ``None`` where no rank had one.

On a 2-D ``DeviceMesh`` (dim 0 across nodes, dim 1 within a node) a bucket's
reduce is hierarchical: it is reduce-scattered (summed) within the node into
``1/local`` shards (``reduce_within``), the hook runs on the shards across nodes
(``reduce_across``, with ``ctx.group`` the cross-node dim and ``ctx.plan`` the
shards' plan, see ``_hierarchy``), and the shards are all-gathered within the
node (``gather_within``); ``reduce_dense`` picks the flat or the hierarchical
form from the group. The ranks' agreement still runs over the whole mesh, first.

Who composes what: [fsync.sync_grads][] and [fsync.GradSync][] run the stages
back to back (``reduce``); the ZeRO step asks the hook for shards
(``SyncContext.scatter``); [fsync.DeferredSync][] stops ``add`` after
``reduce_within`` and runs ``finish`` from ``reduce_across`` on; and
[fsync.grad_and_value][] (``_backward``) agrees before backward, packs each
gradient as autograd produces it and starts each bucket (``start_bucket``) as
soon as it is complete. Sparse buckets never reach a hook: fsync averages them
itself (``with_sparse``), after the dense ones.

Owns: the stages of a sync, their order and the hook's calling convention. May
import: everything below it (layers 1 to 6), ``fsync.ops`` for the default hook.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from fsync import _checks, _comm, _pack, _sparse, _tree
from fsync._agree import Agreed, Terms, agree_on, refuse, state_words
from fsync._hierarchy import shard_plan
from fsync._hook import Hook, SyncContext, hook_spec
from fsync._options import SyncOptions
from fsync._plan import BucketPlan, BucketSpec
from fsync._planner import plan_tree
from fsync.ops._allreduce import allreduce

DEFAULT_HOOK = allreduce("mean")

# The stages of a hierarchical reduce within the node, in the words of a failed wait.
_WITHIN = "a bucket's reduce-scatter within the node"
_GATHER = "the all-gather within the node"

_HOOK_RESULT = (
    "hook.apply returned {got}; expected a pair (buckets, state): a list with one tensor per "
    "bucket and the hook's new state. End a custom apply with `return buckets, state`."
)


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
    within = _levels(group)[1]
    return plan if within is None else shard_plan(plan, _comm.size(within))


def local_size(group: _comm.Group) -> int:
    """The ranks of a node: dim 1 of a 2-D mesh; 1 for any other group (a rank per node)."""
    within = _levels(group)[1]
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


def context(
    plan: BucketPlan, group: _comm.Group, divisor: int | torch.Tensor, *, scatter: bool = False
) -> SyncContext:
    """The hook's [fsync.SyncContext][] for every dense bucket of ``plan``, buffers owned."""
    dense = tuple(spec for spec in plan.specs if not spec.sparse)
    return SyncContext(
        plan,
        dense,
        group,
        _comm.rank(group),
        _comm.size(group),
        divisor,
        scatter=scatter,
        owned=True,
    )


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


# --- stages 2 and 3: start the hook, wait for it -------------------------------------------------


def start_hook(
    buffers: list[torch.Tensor], hook: Hook, state: Any, ctx: SyncContext
) -> tuple[list[torch.Tensor], Any]:
    """``hook.apply`` on dense buffers: its collectives issued, its results maybe in flight.

    A check of the hook's that fails while tracing (a state that does not fit)
    is refused (``_agree.refuse``) rather than raised inside dynamo: at run time
    the ranks' agreement, earlier in the graph, has compared the hook states'
    metadata and raises first if they differ; where every rank's hook found the
    same, the refusal raises it on every rank.
    """
    try:
        result = hook.apply(buffers, state, ctx)
    except (ValueError, TypeError) as error:
        if not torch.compiler.is_compiling():
            raise
        refused: tuple[list[torch.Tensor], Any] = refuse(error, ctx.group, (buffers, state))
        return refused
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
    return list(out), state


def finish_hook(out: list[torch.Tensor], ctx: SyncContext, where: str = "") -> list[torch.Tensor]:
    """A started hook's buffers, waited for and checked against ``ctx.buckets``.

    ``where`` follows the bucket in the words of a failed wait (``" across nodes"``).
    """
    out = [
        _comm.wait(b, functools.partial(_stage, ctx, k, f"the hook's result{where}"))
        for k, b in enumerate(out)
    ]
    shards = ctx.world_size if ctx.scatter else 0
    _checks.check_buffers(out, ctx.buckets, ctx.plan, "hook output", shards=shards)
    return out


def apply_hook(
    buffers: list[torch.Tensor], hook: Hook, state: Any, ctx: SyncContext, where: str = ""
) -> tuple[list[torch.Tensor], Any]:
    """The hook on dense buffers over ``ctx.group``: started, then waited for."""
    out, state = start_hook(buffers, hook, state, ctx)
    return finish_hook(out, ctx, where), state


def _stage(ctx: SyncContext, k: int, what: str) -> str:
    """``"bucket 3 of 8 (what)"``: which of the plan's dense buckets ``ctx.buckets[k]`` is."""
    dense = [spec for spec in ctx.plan.specs if not spec.sparse]
    spec = ctx.buckets[k]
    number = next((i for i, s in enumerate(dense) if s is spec or s == spec), k)
    return f"bucket {number + 1} of {len(dense)} ({what})"


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


def alone(ctx: SyncContext, k: int) -> SyncContext:
    """``ctx`` for dense bucket ``k`` on its own."""
    return ctx._replace(buckets=(ctx.buckets[k],))


def start_bucket(buffer: torch.Tensor, hook: Hook, state: Any, ctx: SyncContext) -> torch.Tensor:
    """One complete dense bucket through a bucketwise hook over a flat group: issued, its
    result maybe in flight (``finish_bucket`` waits for it).

    ``ctx.buckets`` names the bucket alone (``alone(ctx, k)``); ``state`` is the
    hook's (which holds no tensors: it is the same for every bucket). On a 2-D
    mesh buckets go through a ``Pipeline`` instead. A collective that the hook
    waits for itself (a reduce-scatter on gloo, a compressing hook's cast back)
    and that fails is named as the bucket's.
    """
    if torch.compiler.is_compiling():
        return start_hook([buffer], hook, state, ctx)[0][0]
    try:
        out, _ = start_hook([buffer], hook, state, ctx)
    except _comm.CollectiveError as failure:
        if failure.stage:
            raise
        stage = _stage(ctx, 0, "the hook's collectives")
        raise _comm.CollectiveError(
            _comm.COLLECTIVE_FAILED, stage=stage, backend=failure.backend
        ) from failure
    return out[0]


def finish_bucket(pending: torch.Tensor, ctx: SyncContext) -> torch.Tensor:
    """The reduced buffer of a bucket that ``start_bucket`` started, waited for and checked."""
    return finish_hook([pending], ctx)[0]


def start_within(buffer: torch.Tensor, group: _comm.Group) -> torch.Tensor:
    """A dense bucket's reduce-scatter within the node issued: this rank's shard, in flight.

    On a 1-D group, where every rank is a node of its own, the bucket itself.
    """
    within = _levels(group)[1]
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
        across, within = _levels(ctx.group)
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
        shard = _comm.wait(self._started[k], functools.partial(_stage, self._ctx, k, _WITHIN))
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
        self._gathering: list[_comm.Issued] = []

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
            _comm.wait(g, functools.partial(_stage, self._ctx, k, _GATHER))[: spec.numel]
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
    within = _levels(ctx.group)[1]
    if within is not None and pipelined(hook, state):
        return _drained(GatheringPipeline(hook, state, ctx), started), state
    out, state = reduce_started_shards(started, hook, state, ctx)
    return (out if within is None else gather_within(out, ctx.buckets, within)), state


def reduce_started_shards(
    started: list[torch.Tensor], hook: Hook, state: Any, ctx: SyncContext
) -> tuple[list[torch.Tensor], Any]:
    """``reduce_started`` up to this rank's shard of each bucket on a 2-D mesh
    (``ceil(numel / local)`` elements, zero-padded), not gathered; elsewhere, where every
    rank is a node, each bucket whole."""
    across, within = _levels(ctx.group)
    if within is None:
        return apply_hook(started, hook, state, ctx)
    if pipelined(hook, state):
        return _drained(Pipeline(hook, state, ctx), started), state
    shards = [_comm.wait(s, _WITHIN) for s in started]
    return reduce_across(shards, hook, state, ctx, across, within)


def _drained(pipeline: Pipeline, started: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for pending in started:
        pipeline.push(pending)
    return pipeline.drain()


def with_sparse(
    reduced: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    plan: BucketPlan,
    ctx: SyncContext,
) -> list[torch.Tensor]:
    """Reduced dense buffers and the mean of each sparse one, in the plan's order."""
    out = iter(reduced)
    return [
        _sparse.sparse_mean(b, ctx) if spec.sparse else next(out)
        for b, spec in zip(buffers, plan.specs, strict=True)
    ]


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
    return reduce_within(dense(buffers, plan), _levels(call.group)[1])


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
    across, within = _levels(group)
    if within is not None and pipelined(hook, hook_state):
        # The shards were reduced within the node already, by each add.
        return Reduced(
            _drained(GatheringPipeline(hook, hook_state, ctx), held), agreed.used, hook_state
        )
    out, hook_state = reduce_across(held, hook, hook_state, ctx, across, within)
    return Reduced(gather_within(out, ctx.buckets, within), agreed.used, hook_state)


def _after(shards: Sequence[torch.Tensor], token: torch.Tensor | None) -> list[torch.Tensor]:
    """Accumulated shards, made to wait for the agreement (``token``) as packed buckets do."""
    return [s if token is None else s * token for s in shards]


def _levels(group: _comm.Group) -> tuple[_comm.Group, _comm.Group | None]:
    """``(across, within)`` of a 2-D mesh; ``(group, None)`` where every rank is a node."""
    return _comm.hierarchy(group) or (group, None)


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
    reduced = _comm.naming(
        lambda: reduce(leaves, plan, SyncCall(options, group, state), active=active), group
    )
    return rebuild(unpack_reduced(reduced, plan))


def unpack_reduced(reduced: Reduced, plan: BucketPlan) -> list[torch.Tensor | None]:
    """The leaves of reduced buffers; ``None`` where no rank had a gradient (``find_unused``)."""
    out = _pack.unpack_leaves(reduced.buffers, plan)
    if reduced.used is not None:
        out = [leaf if keep else None for leaf, keep in zip(out, reduced.used, strict=True)]
    return out

"""``sync_grads`` and ``GradSync``: flatten, pack, hook, unpack."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from fsync import _comm, _pack, _tree, _verify
from fsync._hook import Hook, SyncContext, check_hook
from fsync._plan import BucketPlan, check_bucket_options, leaf_spec, leaf_specs, plan_from_specs
from fsync._serialization import register_state
from fsync.ops._allreduce import allreduce

_DEFAULT_HOOK = allreduce("mean")
_PLAN_CACHE_SIZE = 64


@register_state
class SyncState(NamedTuple):
    """The state :class:`GradSync` threads from one step to the next.

    Attributes:
        fingerprint: 0-d int64 CPU tensor, the fingerprint of the plan this state
            belongs to, so a state is never silently used with another plan.
        hook: The hook's own state (``()`` for stateless hooks).
    """

    fingerprint: torch.Tensor
    hook: Any


def _check_grads(leaves: Sequence[Any], plan: BucketPlan) -> None:
    """Raises unless every non-``None`` leaf can be a gradient."""
    for leaf, spec in zip(leaves, plan.leaves, strict=True):
        if leaf is None or spec is None:
            continue
        if not leaf.dtype.is_floating_point:
            raise TypeError(
                f"grads leaf {spec.path!r} has dtype {leaf.dtype}; expected a floating point "
                "gradient. Integer, bool and complex tensors are not synced: keep buffers and "
                "counters out of the tree, or view complex gradients with torch.view_as_real."
            )
        if leaf.requires_grad:
            raise ValueError(
                f"grads leaf {spec.path!r} requires grad; expected a gradient. Did you pass the "
                "parameters instead of the gradients? Sync the output of torch.func.grad, or "
                "p.grad for each parameter after loss.backward()."
            )


def _check_grad_types(leaves: Sequence[Any], treespec: optree.PyTreeSpec) -> None:
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            path = _tree.path_str(treespec.paths()[i])
            raise TypeError(
                f"grads leaf {path!r} is a {type(leaf).__name__}; expected a torch.Tensor or "
                "None. Keep only gradients in the tree you sync."
            )


def _meta(leaf: torch.Tensor | None) -> Any:
    if leaf is None:
        return None
    if leaf.layout != torch.strided:
        return (leaf.shape, leaf.dtype, leaf.device, leaf.layout)
    return (leaf.shape, leaf.dtype, leaf.device, leaf.stride())


class _PlanCache:
    """Plans by tree metadata, so a steady-state eager step does no planning work."""

    def __init__(self, size: int) -> None:
        self._plans: collections.OrderedDict[Any, BucketPlan] = collections.OrderedDict()
        self._size = size
        self.hits = 0
        self.misses = 0

    def get(
        self, treespec: optree.PyTreeSpec, leaves: Sequence[Any], options: tuple[float, float]
    ) -> BucketPlan:
        key = (treespec, tuple(_meta(leaf) for leaf in leaves), options)
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        self.misses += 1
        plan = _plan_from_leaves(treespec, leaves, options)
        self._plans[key] = plan
        if len(self._plans) > self._size:
            self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = 0


_PLANS = _PlanCache(_PLAN_CACHE_SIZE)
# (plan fingerprint, group) pairs already checked across ranks by sync_grads.
_VERIFIED: set[tuple[int, Any]] = set()


def _plan_from_leaves(
    treespec: optree.PyTreeSpec, leaves: Sequence[Any], options: tuple[float, float]
) -> BucketPlan:
    _check_grad_types(leaves, treespec)
    paths = [_tree.path_str(p) for p in treespec.paths()]
    specs = [
        None if leaf is None else leaf_spec(path, leaf)
        for path, leaf in zip(paths, leaves, strict=True)
    ]
    bucket_cap_mb, first_bucket_mb = options
    return plan_from_specs(
        treespec, specs, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb
    )


def _context(plan: BucketPlan, group: _comm.Group) -> SyncContext:
    dense = tuple(spec for spec in plan.specs if not spec.sparse)
    world_size = _comm.size(group)
    return SyncContext(plan, dense, group, _comm.rank(group), world_size, world_size)


def _reduce(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    hook: Hook,
    hook_state: Any,
    ctx: SyncContext,
) -> tuple[list[torch.Tensor | None], Any]:
    """pack -> hook -> unpack over checked leaves; returns new leaves and hook state."""
    if any(spec.sparse for spec in plan.specs):
        raise TypeError(
            "sparse gradients are not supported by this version of fsync; use "
            "nn.Embedding(sparse=False)."
        )
    buffers = _pack.pack_leaves(leaves, plan)
    dense, hook_state = hook.apply(buffers, hook_state, ctx)
    dense = [_comm.wait(b) for b in dense]
    _pack.check_buffers(dense, ctx.buckets, plan, "hook output")
    return _pack.unpack_leaves(dense, plan), hook_state


def sync_grads(
    grads: Any,
    /,
    *,
    hook: Hook | None = None,
    group: _comm.Group = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> Any:
    """Synchronises a gradient tree across ranks: DDP's bucketed all-reduce as a function.

    The leaves are packed into DDP-sized buckets (see :func:`plan_buckets`),
    each bucket goes through ``hook`` (default: all-reduce mean) and the result
    is unpacked into a tree of the same structure, shapes, dtypes and memory
    layouts. The plan is cached by tree metadata, so repeated calls do no
    planning; the first call with a new plan checks with one small collective
    that every rank has the same plan. Works eagerly and inside
    ``torch.compile(fullgraph=True)``. Nothing passed in is modified.

    Args:
        grads: A pytree of floating point gradient tensors (``None`` leaves
            stay ``None``).
        hook: A stateless :class:`Hook`; stateful hooks (PowerSGD, ...) need
            :class:`GradSync`. Default: ``fsync.ops.allreduce("mean")``.
        group: ``None`` for the default process group, a ``ProcessGroup``, a
            1-D ``DeviceMesh`` or a ``(DeviceMesh, dim)`` pair.
        bucket_cap_mb: Bucket size limit in MiB.
        first_bucket_mb: Size limit of the first bucket in MiB.

    Returns:
        The synchronised gradients, as a tree like ``grads``.

    Raises:
        TypeError: A leaf is not a tensor or not a floating point tensor, or the
            hook is not a :class:`Hook`.
        ValueError: A gradient requires grad, the hook keeps state, or the
            ranks' trees differ (raised on every rank).

    Example:
        >>> import torch, fsync
        >>> grads = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> fsync.sync_grads(grads)["b"]  # one rank: the mean is the gradient itself
        tensor([1., 1.])
    """
    hook = check_hook(_DEFAULT_HOOK if hook is None else hook)
    options = (bucket_cap_mb, first_bucket_mb)
    check_bucket_options(*options)
    _comm.check_group(group)
    leaves, treespec = _tree.flatten(grads)
    if torch.compiler.is_compiling():
        # Traced once per compile: the plan becomes constants of the graph.
        plan = _plan_from_leaves(treespec, leaves, options)
    else:
        _check_grad_types(leaves, treespec)
        plan = _PLANS.get(treespec, leaves, options)
    _check_grads(leaves, plan)
    state = hook.init(plan)
    if optree.tree_leaves(state, namespace=_tree.NAMESPACE):
        raise ValueError(
            "this hook keeps state (its init returned tensors), which sync_grads would throw "
            "away after every call. Use fsync.GradSync(hook=...) and thread its state."
        )
    ctx = _context(plan, group)
    if not torch.compiler.is_compiling():
        key = (plan.fingerprint, group)
        if key not in _VERIFIED:
            _verify.verify_plan(plan, group)
            _VERIFIED.add(key)
    out, _ = _reduce(leaves, plan, hook, state, ctx)
    return _tree.unflatten(treespec, out)


class GradSync:
    """The stateful form of :func:`sync_grads`, for hooks that keep state.

    ``init(tree)`` fixes the bucket plan from a tree with the gradients'
    structure (usually the parameters), checks across ranks that everyone has
    the same plan, and returns the initial :class:`SyncState`; calling the
    object syncs a gradient tree and returns the new state. The plan is fixed
    from the first step: no warm-up iterations, no rebuild.

    Args:
        hook: The :class:`Hook` to apply to the buckets. Default:
            ``fsync.ops.allreduce("mean")``.
        group: ``None`` for the default process group, a ``ProcessGroup``, a
            1-D ``DeviceMesh`` or a ``(DeviceMesh, dim)`` pair.
        bucket_cap_mb: Bucket size limit in MiB.
        first_bucket_mb: Size limit of the first bucket in MiB.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> sync = fsync.GradSync()
        >>> state = sync.init(params)
        >>> grads, state = sync({"w": torch.ones(2, 2), "b": torch.ones(2)}, state)
        >>> sync.plan.buckets
        ((1, 0),)
    """

    def __init__(
        self,
        *,
        hook: Hook | None = None,
        group: _comm.Group = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
    ) -> None:
        self.hook = check_hook(_DEFAULT_HOOK if hook is None else hook)
        check_bucket_options(bucket_cap_mb, first_bucket_mb)
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self._plan: BucketPlan | None = None

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan fixed by :meth:`init`."""
        if self._plan is None:
            raise RuntimeError("GradSync has no plan yet; call .init(params) first.")
        return self._plan

    def init(self, tree: Any, /) -> SyncState:
        """Plans the buckets for ``tree``, checks the plan across ranks, returns the state.

        Args:
            tree: A tree shaped like the gradients to come, usually the
                parameters (only metadata is read), or a ready
                :class:`BucketPlan` (say, one with an explicit ``order``), which
                is used as it is.

        Returns:
            The initial :class:`SyncState`.

        Raises:
            ValueError: The ranks' trees differ (raised on every rank), or this
                object was already initialised for a different tree.
        """
        _comm.check_group(self.group)
        if isinstance(tree, BucketPlan):
            plan = tree
        else:
            treespec, _, specs = leaf_specs(tree)
            plan = plan_from_specs(
                treespec,
                specs,
                bucket_cap_mb=self.bucket_cap_mb,
                first_bucket_mb=self.first_bucket_mb,
            )
        if self._plan is not None and plan != self._plan:
            raise ValueError(
                "this GradSync was initialised for another tree; make one GradSync per tree."
            )
        _verify.verify_plan(plan, self.group, what="trees passed to GradSync.init")
        self._plan = plan
        return SyncState(
            fingerprint=torch.tensor(plan.fingerprint, dtype=torch.int64),
            hook=self.hook.init(plan),
        )

    def __call__(self, grads: Any, state: SyncState, /) -> tuple[Any, SyncState]:
        """Syncs ``grads`` with the plan fixed at :meth:`init`.

        Args:
            grads: Gradients shaped like the tree given to :meth:`init`; ``None``
                leaves are packed as zeros.
            state: The :class:`SyncState` from :meth:`init` or the previous call.

        Returns:
            ``(grads, state)``: the synchronised gradients and the new state.

        Raises:
            TypeError: A leaf is not a floating point tensor.
            ValueError: ``grads`` does not match the plan, a gradient requires
                grad, or ``state`` belongs to another plan.
        """
        plan = self.plan
        if not isinstance(state, SyncState):
            raise TypeError(
                f"state is a {type(state).__name__}; expected the SyncState returned by "
                "GradSync.init or by the previous call."
            )
        if not torch.compiler.is_compiling() and int(state.fingerprint) != plan.fingerprint:
            raise ValueError(
                "state belongs to another plan (its fingerprint differs); pass the state that "
                "this GradSync's init returned."
            )
        leaves, treespec = _tree.flatten(grads)
        _check_grad_types(leaves, treespec)
        _pack.check_leaves(leaves, treespec, plan, "grads")
        _check_grads(leaves, plan)
        out, hook_state = _reduce(leaves, plan, self.hook, state.hook, _context(plan, self.group))
        return _tree.unflatten(treespec, out), SyncState(state.fingerprint, hook_state)

"""``sync_grads`` and ``GradSync``: flatten, pack, hook, unpack."""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, cast

import optree
import torch

from fsync import _comm, _pack, _sparse, _tree, _verify
from fsync._hook import Hook, SyncContext, check_hook
from fsync._plan import (
    BucketPlan,
    Columns,
    LeafSpec,
    TensorMeta,
    assign,
    assignment_columns,
    check_bucket_options,
    check_reduce_dtype,
    count,
    in_leaf_indices,
    leaf_spec,
    leaf_specs,
    plan_from_specs,
    size_limits,
    tensor_meta,
)
from fsync._serialization import register_state
from fsync.ops._allreduce import allreduce

logger = logging.getLogger("fsync")

_DEFAULT_HOOK = allreduce("mean")
_PLAN_CACHE_SIZE = 64

DivideBy = Literal["world", "active"]

_NOT_FLOATING = (
    "grads leaf {path!r} has dtype {dtype}; expected a floating point gradient. Integer, bool "
    "and complex tensors are not synced: keep buffers and counters out of the tree, or view "
    "complex gradients with torch.view_as_real."
)
_REQUIRES_GRAD = (
    "grads leaf {path!r} requires grad; expected a gradient. Did you pass the parameters "
    "instead of the gradients? Sync the output of torch.func.grad, or p.grad for each "
    "parameter after loss.backward()."
)


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


def check_grads(leaves: Sequence[Any], plan: BucketPlan) -> None:
    """Raises unless every non-``None`` leaf can be a gradient."""
    for leaf, spec in zip(leaves, plan.leaves, strict=True):
        if leaf is None or spec is None:
            continue
        if not leaf.dtype.is_floating_point:
            raise TypeError(_NOT_FLOATING.format(path=spec.path, dtype=leaf.dtype))
        if leaf.requires_grad:
            raise ValueError(_REQUIRES_GRAD.format(path=spec.path))


def check_grad_types(leaves: Sequence[Any], treespec: optree.PyTreeSpec) -> None:
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            path = _tree.path_str(treespec.paths()[i])
            raise TypeError(
                f"grads leaf {path!r} is a {type(leaf).__name__}; expected a torch.Tensor or "
                "None. Keep only gradients in the tree you sync."
            )


def _check_one_device(plan: BucketPlan) -> None:
    devices: dict[torch.device, str] = {}
    for leaf in plan.leaves:
        if leaf is not None:
            devices.setdefault(leaf.device, leaf.path)
    if len(devices) > 1:
        where = ", ".join(f"{device} ({path!r})" for device, path in devices.items())
        raise ValueError(
            f"the tree's leaves are on several devices: {where}. fsync syncs the leaves of one "
            "device per call: move them with .to(device), or sync each device's tree separately."
        )


def check_sync_options(*, divide_by: str, active: bool = True, find_unused: bool = False) -> None:
    """Raises unless the options of ``sync_grads``, ``GradSync`` or ``sync_stats`` are valid."""
    for name, flag in (("active", active), ("find_unused", find_unused)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool; got {flag!r}.")
    if divide_by not in ("world", "active"):
        raise ValueError(f"divide_by must be 'world' or 'active'; got {divide_by!r}.")


def _log_plan(plan: BucketPlan, where: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s planned %s:\n%s", where, count(len(plan.buckets), "bucket"), plan)


class _PlanCache:
    """Plans by tree metadata, so a steady-state eager step does no planning work."""

    def __init__(self, size: int) -> None:
        self._plans: collections.OrderedDict[Any, BucketPlan] = collections.OrderedDict()
        self._size = size
        self.hits = 0
        self.misses = 0

    def get(
        self, treespec: optree.PyTreeSpec, leaves: Sequence[Any], options: tuple[Any, ...]
    ) -> BucketPlan:
        key = (treespec, tuple(None if x is None else tensor_meta(x) for x in leaves), options)
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        self.misses += 1
        plan = _plan_from_leaves(treespec, leaves, options)
        _log_plan(plan, "sync_grads")
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
    treespec: optree.PyTreeSpec, leaves: Sequence[Any], options: tuple[Any, ...]
) -> BucketPlan:
    check_grad_types(leaves, treespec)
    paths = [_tree.path_str(p) for p in treespec.paths()]
    specs = [
        None if leaf is None else leaf_spec(path, tensor_meta(leaf))
        for path, leaf in zip(paths, leaves, strict=True)
    ]
    bucket_cap_mb, first_bucket_mb, reduce_dtype = options
    plan = plan_from_specs(
        treespec,
        specs,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_mb=first_bucket_mb,
        reduce_dtype=reduce_dtype,
    )
    _check_one_device(plan)
    return plan


_F = TypeVar("_F", bound=Callable[..., Any])


def _python_at_trace_time(fn: _F) -> _F:
    """Marks ``fn`` for dynamo to call as Python, its result a constant of the graph.

    ``torch.compiler.assume_constant_result``, typed. The arguments must be
    constants (metadata, keys, options, objects from outside the trace).
    """
    mark = cast(Callable[[_F], _F], torch.compiler.assume_constant_result)
    return mark(fn)


def _check_grad_metas(specs: Sequence[LeafSpec | None], metas: Sequence[Any]) -> None:
    """:func:`check_grads` over metadata (the compiled path's version)."""
    for spec, meta in zip(specs, metas, strict=True):
        if meta is None or spec is None:
            continue
        if not meta.dtype.is_floating_point:
            raise TypeError(_NOT_FLOATING.format(path=spec.path, dtype=meta.dtype))
        if meta.requires_grad:
            raise ValueError(_REQUIRES_GRAD.format(path=spec.path))


class _FlatDictTable(NamedTuple):
    """A plain dict of gradients, read into what planning needs."""

    treespec: optree.PyTreeSpec
    leaves: tuple[LeafSpec | None, ...]
    sequence: list[int]
    columns: Columns


@functools.lru_cache(maxsize=16)
def _flat_dict_table(
    keys: tuple[Any, ...], traced: tuple[_TracedMeta | None, ...], reduce_dtype: torch.dtype | None
) -> _FlatDictTable:
    metas = tuple(_as_meta(meta) for meta in traced)
    leaves = tuple(
        None if meta is None else leaf_spec(_tree.path_str((key,)), meta)
        for key, meta in zip(keys, metas, strict=True)
    )
    _check_grad_metas(leaves, metas)
    sequence, columns = assignment_columns(leaves, "reverse", reduce_dtype)
    return _FlatDictTable(_tree.structure(dict.fromkeys(keys)), leaves, sequence, columns)


@_python_at_trace_time
def _flat_dict_columns(
    keys: tuple[Any, ...], metas: tuple[_TracedMeta | None, ...], reduce_dtype: torch.dtype | None
) -> Columns:
    return _flat_dict_table(keys, metas, reduce_dtype).columns


@_python_at_trace_time
def _flat_dict_plan(
    keys: tuple[Any, ...],
    metas: tuple[_TracedMeta | None, ...],
    reduce_dtype: torch.dtype | None,
    assigned: list[tuple[int, ...]],
) -> BucketPlan:
    table = _flat_dict_table(keys, metas, reduce_dtype)
    buckets = in_leaf_indices(assigned, table.sequence)
    plan = BucketPlan(table.treespec, table.leaves, buckets, reduce_dtype)
    _check_one_device(plan)
    return plan


def _plan_of_flat_dict(
    keys: tuple[Any, ...], leaves: Sequence[Any], options: tuple[Any, ...]
) -> BucketPlan:
    """The plan of a plain dict of gradients under ``torch.compile``, checks included.

    Python reads the leaves' metadata and builds the plan at trace time (dynamo
    calls these functions rather than tracing them leaf by leaf, so planning
    costs about what it costs eagerly). Only DDP's assignment loop is traced:
    the bucket sizes may reach it as symbolic floats (dynamo makes a float that
    changed between compilations dynamic), and its comparisons turn into guards.
    """
    bucket_cap_mb, first_bucket_mb, reduce_dtype = options
    metas = _flat_dict_metas(leaves)
    columns = _flat_dict_columns(keys, metas, reduce_dtype)
    assigned = assign(*columns, size_limits(bucket_cap_mb, first_bucket_mb))
    return _flat_dict_plan(keys, metas, reduce_dtype, assigned)


@_python_at_trace_time
def _check_flat_dict(
    plan: BucketPlan, keys: tuple[Any, ...], traced: tuple[_TracedMeta | None, ...]
) -> bool:
    """Raises unless a plain dict of gradients (keys, metadata) fits ``plan``."""
    if plan.dict_keys != keys:
        raise _pack.mismatch(
            "grads", f"its keys are {list(keys)} but the plan's are {list(plan.dict_keys or ())}"
        )
    metas = tuple(_as_meta(meta) for meta in traced)
    for spec, meta in zip(plan.leaves, metas, strict=True):
        if meta is None:
            continue
        if spec is None:
            raise _pack.mismatch("grads", "it holds a tensor where the plan's tree holds None")
        _pack.check_leaf_meta(spec, meta, "grads")
    _check_grad_metas(plan.leaves, metas)
    return True


# (shape, stride, dtype, device, requires_grad): what a traced leaf is read into.
# Plain tuples, which dynamo builds faster than NamedTuples; traced leaves are dense,
# since dynamo refuses sparse tensors.
_TracedMeta = tuple[Any, ...]


def _flat_dict_metas(leaves: Sequence[Any]) -> tuple[_TracedMeta | None, ...]:
    return tuple(
        None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
        for t in leaves
    )


def _as_meta(traced: _TracedMeta | None) -> TensorMeta | None:
    if traced is None:
        return None
    shape, stride, dtype, device, requires_grad = traced
    return TensorMeta(tuple(shape), tuple(stride), dtype, device, torch.strided, 0, requires_grad)


def control_flags(
    leaves: Sequence[Any], plan: BucketPlan, *, active: bool, find_unused: bool
) -> list[int]:
    """What a rank puts into the control all-reduce (see :func:`_control`).

    One flag per tensor leaf of the plan when ``find_unused`` (1 if this rank
    has a gradient for it), then one for ``active``. ``sync_stats`` counts the
    same list.
    """
    flags = []
    if find_unused:
        flags = [
            int(active and leaves[i] is not None)
            for i, spec in enumerate(plan.leaves)
            if spec is not None
        ]
    return [*flags, int(active)]


def _control(
    leaves: Sequence[Any],
    plan: BucketPlan,
    group: _comm.Group,
    *,
    active: bool,
    divide_by: DivideBy,
    find_unused: bool,
) -> tuple[list[bool] | None, int | torch.Tensor]:
    """The one small collective for unused leaves and contributing ranks, if needed.

    Returns which leaves some rank used (``None`` unless ``find_unused``) and the
    divisor of a mean: the world size, or the number of active ranks as a 0-d
    tensor (at least 1, so a step where nobody contributes yields zeros).
    """
    world_size = _comm.size(group)
    if not find_unused and divide_by == "world":
        return None, world_size
    if find_unused and torch.compiler.is_compiling():
        raise ValueError(
            "find_unused=True cannot run inside torch.compile: whether a leaf comes back None "
            "depends on the other ranks at run time. Sync eagerly, or use find_unused=False "
            "(unused leaves then count as zero gradients)."
        )
    tensor_leaves = [i for i, spec in enumerate(plan.leaves) if spec is not None]
    flags = control_flags(leaves, plan, active=active, find_unused=find_unused)
    device = plan.specs[0].device if plan.specs else _comm.default_device(group)
    counts = _comm.wait(
        _comm.all_reduce(torch.tensor(flags, dtype=torch.int32, device=device), "sum", group)
    )
    divisor: int | torch.Tensor = world_size
    if divide_by == "active":
        divisor = counts[-1].clamp(min=1)
    used = None
    if find_unused:
        used_leaves = set()
        for i, n in zip(tensor_leaves, counts[:-1].tolist(), strict=True):
            if n:
                used_leaves.add(i)
        used = [i in used_leaves for i in range(len(plan.leaves))]
    return used, divisor


def _reduce(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    hook: Hook,
    hook_state: Any,
    group: _comm.Group,
    *,
    active: bool = True,
    divide_by: DivideBy = "world",
    find_unused: bool = False,
) -> tuple[list[torch.Tensor | None], Any]:
    """pack -> hook -> unpack over checked leaves; returns new leaves and hook state."""
    sparse = [spec for spec in plan.specs if spec.sparse]
    if sparse and torch.compiler.is_compiling():
        leaf = plan.leaves[sparse[0].leaves[0]]
        assert leaf is not None
        raise TypeError(_sparse.SPARSE_UNDER_COMPILE.format(path=leaf.path))
    if not active:
        leaves = [None] * len(leaves)
    used, divisor = _control(
        leaves, plan, group, active=active, divide_by=divide_by, find_unused=find_unused
    )
    dense_specs = tuple(spec for spec in plan.specs if not spec.sparse)
    ctx = SyncContext(
        plan, dense_specs, group, _comm.rank(group), _comm.size(group), divisor, owned=True
    )
    buffers = _pack.pack_leaves(leaves, plan)
    dense, hook_state = hook.apply(
        [b for b, spec in zip(buffers, plan.specs, strict=True) if not spec.sparse],
        hook_state,
        ctx,
    )
    dense = [_comm.wait(b) for b in dense]
    _pack.check_buffers(dense, dense_specs, plan, "hook output")
    reduced = iter(dense)
    buffers = [
        _sparse.sparse_mean(b, ctx) if spec.sparse else next(reduced)
        for b, spec in zip(buffers, plan.specs, strict=True)
    ]
    out = _pack.unpack_leaves(buffers, plan)
    if used is not None:
        out = [leaf if keep else None for leaf, keep in zip(out, used, strict=True)]
    return out, hook_state


def sync_grads(
    grads: Any,
    /,
    *,
    hook: Hook | None = None,
    group: _comm.Group = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    reduce_dtype: torch.dtype | None = None,
    active: bool = True,
    divide_by: DivideBy = "world",
) -> Any:
    """Synchronises a gradient tree across ranks: DDP's bucketed all-reduce as a function.

    The leaves are packed into DDP-sized buckets (see :func:`plan_buckets`),
    each bucket goes through ``hook`` (default: all-reduce mean) and the result
    is unpacked into a tree of the same structure, shapes, dtypes and memory
    layouts. The plan is cached by tree metadata, so repeated calls do no
    planning; the first call with a new plan checks with one small collective
    that every rank has the same plan. Works eagerly and inside
    ``torch.compile(fullgraph=True)`` (sparse leaves eagerly only). Nothing
    passed in is modified.

    Args:
        grads: A pytree of floating point gradient tensors (``None`` leaves
            stay ``None``; sparse COO leaves are averaged by all-gather).
        hook: A stateless :class:`Hook`; stateful hooks (PowerSGD, ...) need
            :class:`GradSync`. Default: ``fsync.ops.allreduce("mean")``.
        group: ``None`` for the default process group, a ``ProcessGroup``, a
            1-D ``DeviceMesh`` or a ``(DeviceMesh, dim)`` pair.
        bucket_cap_mb: Bucket size limit in MiB.
        first_bucket_mb: Size limit of the first bucket in MiB.
        reduce_dtype: Reduce the floating point gradients in this dtype and
            return them in their own (``torch.float32`` for bf16 gradients;
            ``torch.bfloat16`` to halve the traffic of fp32 ones). ``None``
            reduces each in its own dtype.
        active: ``False`` on a rank that has no data this step (uneven inputs,
            DDP's ``join``): it contributes zeros and receives the result.
        divide_by: ``"world"`` divides the sum by the world size (DDP's
            ``divide_by_initial_world_size=True``); ``"active"`` by the number
            of ranks with ``active=True``, which costs one small collective.

    Returns:
        The synchronised gradients, as a tree like ``grads``.

    Raises:
        TypeError: A leaf is not a tensor or not a floating point tensor, or the
            hook is not a :class:`Hook`.
        ValueError: A gradient requires grad, the hook keeps state, the leaves
            are on several devices, or the ranks' trees differ (raised on every
            rank).

    Example:
        >>> import torch, fsync
        >>> grads = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> fsync.sync_grads(grads)["b"]  # one rank: the mean is the gradient itself
        tensor([1., 1.])
    """
    hook = check_hook(_DEFAULT_HOOK if hook is None else hook)
    check_bucket_options(bucket_cap_mb, first_bucket_mb)
    check_reduce_dtype(reduce_dtype)
    check_sync_options(divide_by=divide_by, active=active)
    _comm.check_group(group)
    options = (bucket_cap_mb, first_bucket_mb, reduce_dtype)
    flat = _tree.flat_dict(grads) if torch.compiler.is_compiling() else None
    if flat is not None:
        # Planned once per compile, by Python rather than by tracing: the plan and
        # the checks become constants of the graph.
        keys, leaves = flat
        plan = _plan_of_flat_dict(keys, leaves, options)
    else:
        leaves, treespec = _tree.flatten(grads)
        if torch.compiler.is_compiling():  # any other tree: traced
            plan = _plan_from_leaves(treespec, leaves, options)
        else:
            check_grad_types(leaves, treespec)
            plan = _PLANS.get(treespec, leaves, options)
        check_grads(leaves, plan)
    state = hook.init(plan)
    if optree.tree_leaves(state, namespace=_tree.NAMESPACE):
        raise ValueError(
            "this hook keeps state (its init returned tensors), which sync_grads would throw "
            "away after every call. Use fsync.GradSync(hook=...) and thread its state."
        )
    if not torch.compiler.is_compiling():
        key = (plan.fingerprint, group)
        if key not in _VERIFIED:
            _verify.verify_plan(plan, group)
            _VERIFIED.add(key)
    out, _ = _reduce(leaves, plan, hook, state, group, active=active, divide_by=divide_by)
    if flat is not None:
        return dict(zip(flat[0], out, strict=True))
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
        reduce_dtype: As for :func:`sync_grads`.
        find_unused: Gradients may be ``None`` for parameters some ranks did not
            use (DDP's ``find_unused_parameters=True``): one small collective per
            step finds which leaves any rank used; a leaf used nowhere comes back
            ``None``, one used somewhere is averaged over all ranks with zeros
            from the others. Eager only. With ``False`` (default) a ``None``
            gradient simply counts as zeros.
        divide_by: As for :func:`sync_grads`.

    Attributes:
        hook: The hook in use (the default filled in when none was given).
        group: The ``group`` given.
        bucket_cap_mb: The ``bucket_cap_mb`` given.
        first_bucket_mb: The ``first_bucket_mb`` given.
        reduce_dtype: The ``reduce_dtype`` given.
        find_unused: The ``find_unused`` given.
        divide_by: The ``divide_by`` given.

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
        reduce_dtype: torch.dtype | None = None,
        find_unused: bool = False,
        divide_by: DivideBy = "world",
    ) -> None:
        self.hook = check_hook(_DEFAULT_HOOK if hook is None else hook)
        check_bucket_options(bucket_cap_mb, first_bucket_mb)
        check_reduce_dtype(reduce_dtype)
        check_sync_options(divide_by=divide_by, find_unused=find_unused)
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self.reduce_dtype = reduce_dtype
        self.find_unused = find_unused
        self.divide_by: DivideBy = divide_by
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
            ValueError: The ranks' trees differ (raised on every rank), the
                leaves are on several devices, or this object was already
                initialised for a different tree.
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
                reduce_dtype=self.reduce_dtype,
            )
        _check_one_device(plan)
        if self._plan is not None and plan != self._plan:
            raise ValueError(
                "this GradSync was initialised for another tree; make one GradSync per tree."
            )
        _verify.verify_plan(plan, self.group, what="trees passed to GradSync.init")
        _log_plan(plan, "GradSync.init")
        self._plan = plan
        return SyncState(
            fingerprint=torch.tensor(plan.fingerprint, dtype=torch.int64),
            hook=self.hook.init(plan),
        )

    def __call__(
        self, grads: Any, state: SyncState, /, *, active: bool = True
    ) -> tuple[Any, SyncState]:
        """Syncs ``grads`` with the plan fixed at :meth:`init`.

        Args:
            grads: Gradients shaped like the tree given to :meth:`init` (``None``
                leaves allowed, see ``find_unused``); may be ``None`` as a whole
                when ``active=False``.
            state: The :class:`SyncState` from :meth:`init` or the previous call.
            active: ``False`` on a rank with no data this step (uneven inputs):
                it contributes zeros and receives the result.

        Returns:
            ``(grads, state)``: the synchronised gradients and the new state.

        Raises:
            TypeError: A leaf is not a floating point tensor.
            ValueError: ``grads`` does not match the plan, a gradient requires
                grad, or ``state`` belongs to another plan.
        """
        plan = self.plan
        check_sync_options(divide_by=self.divide_by, active=active)
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
        flat = _tree.flat_dict(grads) if torch.compiler.is_compiling() else None
        if grads is None and not active:
            leaves: list[Any] = [None] * len(plan.leaves)
        elif flat is not None and plan.dict_keys is not None:
            # Checked by Python rather than traced, as in sync_grads.
            leaves = flat[1]
            _check_flat_dict(plan, flat[0], _flat_dict_metas(leaves))
        else:
            leaves, treespec = _tree.flatten(grads)
            check_grad_types(leaves, treespec)
            _pack.check_leaves(leaves, treespec, plan, "grads")
            check_grads(leaves, plan)
        out, hook_state = _reduce(
            leaves,
            plan,
            self.hook,
            state.hook,
            self.group,
            active=active,
            divide_by=self.divide_by,
            find_unused=self.find_unused,
        )
        if plan.dict_keys is not None:
            tree = dict(zip(plan.dict_keys, out, strict=True))
        else:
            tree = _tree.unflatten(plan.structure(), out)
        return tree, SyncState(state.fingerprint, hook_state)

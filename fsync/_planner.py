"""The planner: a tree and plan options in, its leaves, its plan and a way back out.

One path, eager and compiled alike. A tree is flattened (a plain dict of
tensors directly, any other tree by optree), its leaves' metadata is read into
plain tuples, and the plan is a pure function of that metadata, the structure
and the options, cached with ``functools.lru_cache``. Under ``torch.compile``
the same function runs as Python at trace time
(``torch.compiler.assume_constant_result``): the plan becomes a constant of the
graph, its checks run once per compilation, and no planning is traced.

Owns: flattening for a plan, [fsync.plan_buckets][], DDP's assignment on
tensors ([fsync.compute_bucket_assignment_by_size][]) and the check that a tree
fits a plan. May import: ``_tree``, ``_trace``, ``_plan``, ``_state``, ``_checks`` (layers 1
to 3).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fsync import _checks, _metas, _trace, _tree
from fsync._metas import Meta as _Meta
from fsync._plan import (
    PLAN_CACHE_SIZE,
    BucketPlan,
    LeafSpec,
    Order,
    TensorMeta,
    assign,
    buffer_dtype,
    count,
    in_leaf_indices,
    leaf_spec,
    size_limits,
)
from fsync._state import SparseLike

logger = logging.getLogger("fsync")


class PlanOptions(NamedTuple):
    """The options a plan depends on (hashable: part of the plan cache's key).

    Attributes:
        bucket_cap_mb: Size limit of every bucket after the first, in MiB.
        first_bucket_mb: Size limit of the first bucket, in MiB.
        reduce_dtype: Reduce floating point leaves in this dtype; ``None`` keeps theirs.
        order: ``"reverse"``, ``"forward"`` or a tuple of tensor-leaf indices.
        buckets: An explicit layout (per bucket, its leaf indices in buffer
            order) used instead of DDP's assignment; ``None`` assigns by size.
    """

    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    reduce_dtype: torch.dtype | None = None
    order: str | tuple[int, ...] = "reverse"
    buckets: tuple[tuple[int, ...], ...] | None = None

    def check(self) -> PlanOptions:
        """Returns ``self`` if every option is valid, else raises with how to fix it."""
        _checks.check_bucket_options(self.bucket_cap_mb, self.first_bucket_mb)
        _checks.check_reduce_dtype(self.reduce_dtype)
        if not isinstance(self.order, str | tuple):
            raise ValueError(
                f"order must be 'reverse', 'forward' or a sequence of leaf indices; "
                f"got {self.order!r}."
            )
        return self


class Planned(NamedTuple):
    """A tree taken apart for a sync: its leaves, their plan, and the way back to a tree."""

    leaves: list[Any]
    plan: BucketPlan
    rebuild: Callable[[Sequence[Any]], Any]


# --- flattening ------------------------------------------------------------------------------

# What a tree's structure is passed to the planner as: ("dict", keys) for a plain dict of
# tensors, ("spec", treespec) eagerly, ("skeleton", tree of leaf indices) under compile,
# where dynamo's Python PyTreeSpec is no constant but a tree of ints is.
Structure = tuple[str, Any]


def _flatten(tree: Any, what: str) -> tuple[list[Any], Structure, Callable[[Sequence[Any]], Any]]:
    same = _tree.alike([tree])
    if same is not None and same.keys is not None:
        # dict(model.named_parameters()), the tree most code syncs: read directly, which
        # under torch.compile costs a fraction of tracing optree's generic flatten.
        return same.leaves[0], ("dict", same.keys), same.rebuild
    leaves, spec = _tree.flatten(tree)
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor | SparseLike):
            _checks.check_tensor_leaf(what, _tree.path_str(spec.paths()[i]), leaf)
    if torch.compiler.is_compiling():
        structure: Structure = ("skeleton", _tree.unflatten(spec, list(range(len(leaves)))))
    else:
        structure = ("spec", spec)
    return leaves, structure, functools.partial(_tree.unflatten, spec)


def _as_meta(meta: _Meta, device: torch.device | None) -> TensorMeta:
    shape, stride, dtype, here, layout, sparse_dim, requires_grad = meta
    where = here if device is None else device
    return TensorMeta(tuple(shape), tuple(stride), dtype, where, layout, sparse_dim, requires_grad)


def _treespec(structure: Structure) -> optree.PyTreeSpec:
    kind, value = structure
    if kind == "dict":
        return _tree.structure(dict.fromkeys(value))
    return value if kind == "spec" else _tree.structure(value)


# --- planning --------------------------------------------------------------------------------


def _sequence(leaves: Sequence[LeafSpec | None], order: Any) -> list[int]:
    tensor_leaves = [i for i, leaf in enumerate(leaves) if leaf is not None]
    _checks.check_order(order, tensor_leaves, len(leaves))
    if order == "reverse":
        return tensor_leaves[::-1]
    return tensor_leaves if order == "forward" else list(order)


def _columns(
    leaves: Sequence[LeafSpec | None], sequence: Sequence[int], reduce_dtype: torch.dtype | None
) -> tuple[tuple[Any, ...], tuple[int, ...], tuple[bool, ...]]:
    """DDP's assignment inputs, per leaf in ``sequence``: (dtype, device) key, bytes, sparse."""
    specs: list[LeafSpec] = [leaves[i] for i in sequence]  # type: ignore[misc]
    dtypes = [buffer_dtype(s, reduce_dtype) for s in specs]
    return (
        tuple((dtype, s.device) for dtype, s in zip(dtypes, specs, strict=True)),
        tuple(s.numel * dtype.itemsize for dtype, s in zip(dtypes, specs, strict=True)),
        tuple(s.sparse for s in specs),
    )


def plan_from_specs(
    treespec: optree.PyTreeSpec, leaves: Sequence[LeafSpec | None], options: PlanOptions
) -> BucketPlan:
    """The plan of leaves already described by [LeafSpec][fsync.LeafSpec] (DDP's assignment)."""
    if options.buckets is not None:
        return BucketPlan(treespec, tuple(leaves), options.buckets, options.reduce_dtype)
    sequence = _sequence(leaves, options.order)
    assigned = assign(
        *_columns(leaves, sequence, options.reduce_dtype),
        size_limits(options.bucket_cap_mb, options.first_bucket_mb),
    )
    buckets = in_leaf_indices(assigned, sequence)
    return BucketPlan(treespec, tuple(leaves), buckets, options.reduce_dtype)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _leaf_specs(
    structure: Structure,
    metas: tuple[_Meta | None, ...],
    what: str,
    device: torch.device | None,
) -> tuple[optree.PyTreeSpec, tuple[LeafSpec | None, ...]]:
    treespec = _treespec(structure)
    paths = [_tree.path_str(p) for p in treespec.paths()]
    specs: list[LeafSpec | None] = []
    for path, meta in zip(paths, metas, strict=True):
        if meta is None:
            specs.append(None)
            continue
        tensor = _as_meta(meta, device)
        specs.append(leaf_spec(path, tensor))
        if what == "grads":
            _checks.check_gradient(specs[-1], tensor)  # type: ignore[arg-type]
    return treespec, tuple(specs)


def _checked(plan: BucketPlan, what: str) -> BucketPlan:
    _checks.check_one_device(plan)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("fsync planned %s for %s:\n%s", count(len(plan.buckets), "bucket"), what, plan)
    return plan


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _cached_plan(
    structure: Structure,
    metas: tuple[_Meta | None, ...],
    options: PlanOptions,
    what: str,
    device: torch.device | None,
) -> BucketPlan:
    treespec, specs = _leaf_specs(structure, metas, what, device)
    return _checked(plan_from_specs(treespec, specs, options), what)


def _as_key(structure: Structure) -> Structure:
    if structure[0] == "skeleton":  # a tree of ints is no cache key; its spec is
        return ("spec", _tree.structure(structure[1]))
    return structure


def plan_tree(
    tree: Any,
    options: PlanOptions,
    /,
    *,
    what: str = "grads",
    device: torch.device | None = None,
) -> Planned:
    """Flattens ``tree`` and plans its buckets; eager and compiled alike.

    With ``what="grads"`` every tensor leaf is checked to be a gradient
    (floating point, not requiring grad). ``device`` replaces the leaves' own
    device in the plan (for a tree of meta tensors standing for real ones).
    """
    leaves, structure, rebuild = _flatten(tree, what)
    if torch.compiler.is_compiling():
        metas = _metas.read(leaves)
        plan = _plan_assigned(*_traced_assignment(structure, metas, options, what, device))
    else:
        plan = _cached_plan(structure, _metas.of(structure, leaves), options, what, device)
    return Planned(leaves, plan, rebuild)


# (structure, metas, options without the sizes, what, device): a tree to plan, as the
# constants that planning at trace time takes.
_Key = tuple[Structure, tuple[_Meta | None, ...], tuple[Any, ...], str, torch.device | None]


def _traced_assignment(
    structure: Structure,
    metas: tuple[_Meta | None, ...],
    options: PlanOptions,
    what: str,
    device: torch.device | None,
) -> tuple[_Key, list[tuple[int, ...]] | None]:
    """Under torch.compile, Python plans at trace time all but DDP's loop over the sizes:
    a size that changed between compilations reaches dynamo symbolic (automatic dynamic),
    and a symbolic value cannot enter a constant function. The loop is traced, its
    comparisons becoming guards; what it assigns (and the key without the sizes) is
    constant again, for ``_plan_assigned``."""
    key = (structure, metas, (None, None, *options[2:]), what, device)
    if options.buckets is not None:
        return key, None
    limits = size_limits(options.bucket_cap_mb, options.first_bucket_mb)
    return key, assign(*_columns_of(key), limits)


@_trace.python_at_trace_time
def _columns_of(key: _Key) -> tuple[tuple[Any, ...], tuple[int, ...], tuple[bool, ...]]:
    structure, metas, options, what, device = key
    _, specs = _leaf_specs(_as_key(structure), metas, what, device)
    return _columns(specs, _sequence(specs, options[3]), options[2])


@_trace.python_at_trace_time
def _plan_assigned(
    key: _Key,
    assigned: list[tuple[int, ...]] | None,
    fit: tuple[Structure, tuple[_Meta | None, ...], str] | None = None,
) -> BucketPlan:
    """The plan of ``key`` with the buckets ``assigned``; with ``fit`` (a tree's structure,
    its leaves' metadata and what it is), checked to fit that tree."""
    structure, metas, options, what, device = key
    treespec, specs = _leaf_specs(_as_key(structure), metas, what, device)
    buckets = options[4]
    if assigned is not None:
        buckets = in_leaf_indices(assigned, _sequence(specs, options[3]))
    plan = _checked(BucketPlan(treespec, specs, buckets, options[2]), what)
    if fit is not None:
        _fits(plan, _treespec(_as_key(fit[0])), fit[1], fit[2])
    return plan


def _fits(plan: BucketPlan, treespec: Any, metas: tuple[_Meta | None, ...], what: str) -> None:
    """Raises unless a tree of ``treespec`` with leaves of ``metas`` fits ``plan``."""
    expected = plan.treespec if isinstance(treespec, optree.PyTreeSpec) else plan.structure()
    if treespec != expected:
        raise _checks.mismatch(what, f"its structure is {treespec} but the plan's is {expected}")
    for spec, meta in zip(plan.leaves, metas, strict=True):
        if meta is None:
            continue
        tensor = _as_meta(meta, None)
        _checks.check_leaf_fits(spec, tensor, what)
        if what == "grads":
            _checks.check_gradient(spec, tensor)  # type: ignore[arg-type]


def fit_tree(tree: Any, plan: BucketPlan, /, *, what: str = "grads") -> Planned:
    """Flattens ``tree`` and checks that it fits ``plan`` (``None`` fits any leaf)."""
    leaves, structure, rebuild = _flatten(tree, what)
    if torch.compiler.is_compiling():  # Python at trace time: no cache for dynamo to trace
        kind, value = structure
        treespec = _tree.structure(value) if kind == "skeleton" else _treespec(structure)
        _fits(plan, treespec, _metas.read(leaves), what)
    else:
        _fitted(plan, structure, _metas.of(structure, leaves), what)
    return Planned(leaves, plan, rebuild)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _fitted(
    plan: BucketPlan, structure: Structure, metas: tuple[_Meta | None, ...], what: str
) -> None:
    """``_fits`` eagerly, once per tree (a tree that does not fit raises every call)."""
    _fits(plan, _treespec(structure), metas, what)


# --- the public planning functions ----------------------------------------------------------


def compute_bucket_assignment_by_size(
    tensors: Sequence[torch.Tensor], size_limits: Sequence[int], /
) -> list[list[int]]:
    """Assigns tensors to buckets exactly as DDP's Reducer does.

    Tensors are taken in the given order and accumulate per (dtype, device); a
    bucket closes once its bytes reach the current size limit, after which that
    (dtype, device) moves on to the next limit (staying on the last one). Sparse
    tensors get a bucket of their own. Buckets come back sorted by the smallest
    index they hold. For dense tensors the result equals
    ``torch.distributed._compute_bucket_assignment_by_size(tensors, size_limits)[0]``.

    Args:
        tensors: The tensors to assign; only their metadata is read.
        size_limits: Bucket size limits in bytes, used in turn per (dtype, device).

    Returns:
        A list of buckets, each a list of indices into ``tensors``. An empty
        input gives an empty list.

    Raises:
        TypeError: An element of ``tensors`` is not a tensor.
        ValueError: ``size_limits`` is empty or holds a negative or non-integer value.

    Example:
        >>> import torch, fsync
        >>> f32, f64 = torch.float32, torch.float64
        >>> sizes = [(50, f32), (100, f64), (300, f32), (10, f32)]
        >>> tensors = [torch.zeros(n, dtype=dtype) for n, dtype in sizes]
        >>> fsync.compute_bucket_assignment_by_size(tensors, [400, 2000])
        [[0, 2], [1], [3]]
    """
    limits = _checks.check_size_limits(size_limits)
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{i}] is a {type(tensor).__name__}; expected a torch.Tensor.")
    buckets = assign(
        [(t.dtype, t.device) for t in tensors],
        [t.numel() * t.element_size() for t in tensors],
        [t.layout == torch.sparse_coo for t in tensors],
        limits,
    )
    return [list(bucket) for bucket in buckets]


def plan_buckets(
    tree: Any,
    /,
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    order: Order = "reverse",
    reduce_dtype: torch.dtype | None = None,
) -> BucketPlan:
    """Plans the buckets for a tree of tensors, as DDP's Reducer would.

    Leaves are taken in ``order`` and assigned with
    [fsync.compute_bucket_assignment_by_size][] under the limits
    ``[first_bucket_mb, bucket_cap_mb]`` MiB. The default ``"reverse"`` order
    gives the buckets DDP builds after its first iteration when gradients arrive
    in reverse definition order: a small first bucket holding the last layers,
    then buckets of ``bucket_cap_mb``. Only leaf metadata is read.

    Args:
        tree: A pytree of tensors (parameters or gradients); ``None`` leaves
            are kept in the structure and belong to no bucket. Dict keys keep
            their insertion order, as ``named_parameters()`` yields them.
        bucket_cap_mb: Size limit of every bucket after the first, in MiB.
        first_bucket_mb: Size limit of the first bucket, in MiB. DDP uses 1 MiB
            with the default cap and the cap itself when ``bucket_cap_mb`` is set.
        order: ``"reverse"`` (default), ``"forward"`` or an explicit sequence
            of the tensor leaves' indices in flatten order.
        reduce_dtype: Reduce floating point leaves in this dtype (buckets are
            then grouped and sized by it); ``None`` keeps each leaf's dtype.

    Returns:
        The frozen [fsync.BucketPlan][].

    Raises:
        TypeError: A leaf is neither a tensor nor ``None``, or ``reduce_dtype``
            is not a floating point dtype.
        ValueError: A size is not a finite positive number, or ``order`` is not a
            permutation of the tensor leaves.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.zeros(256, 256), "b": torch.zeros(256)}
        >>> plan = fsync.plan_buckets(params, bucket_cap_mb=0.25, first_bucket_mb=0.25)
        >>> plan.buckets, plan.nbytes
        (((1, 0),), (263168,))
    """
    sequence = order if isinstance(order, str) else tuple(order)
    options = PlanOptions(bucket_cap_mb, first_bucket_mb, reduce_dtype, sequence).check()
    return plan_tree(tree, options, what="tree").plan


# DDP broadcasts module state in 250 MiB buckets.
VALUE_BUCKET_MB = 250.0
VALUE_OPTIONS = PlanOptions(VALUE_BUCKET_MB, VALUE_BUCKET_MB, None, "forward")


def value_plan(tree: Any, what: str) -> Planned:
    """A forward-order plan of large buckets, for moving or comparing values."""
    planned = plan_tree(tree, VALUE_OPTIONS, what=what)
    for spec in planned.plan.leaves:
        if spec is not None and spec.sparse:
            raise TypeError(
                f"{what} leaf {spec.path!r} is sparse; only dense tensors are supported here. "
                "Call .to_dense() on it first."
            )
    return planned


def fit_like(
    tree: Any,
    held: Any,
    options: PlanOptions,
    /,
    *,
    what: str,
    default_device: Callable[[], torch.device],
) -> Planned:
    """The plan of ``held`` (a ``like`` tree) and ``tree``'s leaves fitted to it.

    The plan's device is that of ``tree``'s first tensor leaf (``default_device()``
    if it has none); ``tree`` may be ``None`` as a whole (no leaves at all). The
    returned ``rebuild`` makes a tree of the held structure.
    """
    held_leaves, held_structure, rebuild = _flatten(held, "state")
    metas: tuple[_Meta | None, ...]
    if tree is None:
        leaves: list[Any] = [None] * len(held_leaves)
        structure, metas = held_structure, (None,) * len(held_leaves)
    else:
        leaves, structure, _ = _flatten(tree, what)
        metas = _metas.of(structure, leaves)
    device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
    device = device or default_device()
    if torch.compiler.is_compiling():
        held_metas = _metas.read(held_leaves)
        assignment = _traced_assignment(held_structure, held_metas, options, "tree", device)
        plan = _plan_assigned(*assignment, (structure, metas, what))
    else:
        held_metas = _metas.of(held_structure, held_leaves)
        plan = _cached_plan(held_structure, held_metas, options, "tree", device)
        _fitted(plan, structure, metas, what)
    return Planned(leaves, plan, rebuild)

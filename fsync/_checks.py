"""Every check fsync makes of what it is given, and every message it raises for it.

A message says what was expected, what was received and how to fix it; each is
a constant used in one place. Checks read options and metadata (leaf specs,
tensor metadata, buffers' shapes), never values, so they cost the same eagerly
and under ``torch.compile`` (where most run once, at trace time).

Owns: the validation of options, trees, gradients, plans and hook outputs.
May import: ``_tree`` and ``_plan`` (layers 1 and 2), never a process group.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from fsync import _tree
from fsync._plan import PLAN_CACHE_SIZE, BucketPlan, BucketSpec, LeafSpec, TensorMeta, count

NOT_A_TENSOR = (
    "{what} leaf {path!r} is a {kind}; expected a torch.Tensor or None. Keep only tensors in "
    "the tree (move settings and Python numbers out of it)."
)
NOT_FLOATING = (
    "grads leaf {path!r} has dtype {dtype}; expected a floating point gradient. Integer, bool "
    "and complex tensors are not synced: keep buffers and counters out of the tree, or view "
    "complex gradients with torch.view_as_real."
)
REQUIRES_GRAD = (
    "grads leaf {path!r} requires grad; expected a gradient. Did you pass the parameters "
    "instead of the gradients? Sync the output of torch.func.grad, or p.grad for each "
    "parameter after loss.backward()."
)
NOT_DIFFERENTIABLE = (
    "argument leaf {path!r} {kind}; fsync.grad_and_value differentiates dense floating point "
    "tensors (as torch.func does). Pass integer tensors, buffers and settings in an argument "
    "that argnums leaves out."
)
SEVERAL_DEVICES = (
    "the tree's leaves are on several devices: {where}. fsync syncs the leaves of one device "
    "per call: move them with .to(device), or sync each device's tree separately."
)
DIFFERENT_TREE = (
    "{what} does not match the plan: {detail}. Pass the tree the plan was built for (same "
    "structure, shapes and dtypes), or build a new plan with fsync.plan_buckets."
)
SPARSE_UNDER_COMPILE = (
    "sparse gradient {path!r} cannot be synced inside torch.compile: the all-gather of its "
    "indices has a size known only at run time. Sync sparse gradients eagerly (call "
    "sync_grads outside the compiled function), or use nn.Embedding(sparse=False)."
)
HOOK_NOT_FLOATING = (
    "{name} got bucket {index} of dtype {dtype} (first leaf {path!r}); it works on floating "
    "point buckets only. Keep integer and complex tensors out of the tree you sync."
)
STATEFUL_HOOK = (
    "this hook keeps state (its init returned tensors), which sync_grads would throw away "
    "after every call. Use fsync.GradSync(hook=...) and thread its state."
)
NO_GRADS = (
    "grads is None on an active rank; expected a gradient tree. A rank without data this "
    "step passes active=False (it then contributes zeros and receives the others' mean)."
)
SPARSE_NEEDS_DEFAULT_HOOK = (
    "sparse gradient {path!r} is averaged by fsync itself (an all-gather of its entries), "
    "not by the hook, so the hook {hook} would not apply to it. Sync sparse gradients with "
    "the default hook (in a separate sync_grads call), or make them dense "
    "(nn.Embedding(sparse=False))."
)
FIND_UNUSED_NEEDS_STATE = (
    "find_unused is an option of fsync.GradSync, not of sync_grads: a leaf unused on some "
    "ranks is None there, so sync_grads, which plans from the tree it is given, would see "
    "another tree on each rank. Use fsync.GradSync(find_unused=True) and init it with the "
    "parameters."
)
FIND_UNUSED_UNDER_COMPILE = (
    "find_unused=True cannot run inside torch.compile: whether a leaf comes back None depends "
    "on the other ranks at run time. Sync eagerly, or use find_unused=False (unused leaves then "
    "count as zero gradients)."
)


def mismatch(what: str, detail: str) -> ValueError:
    """The ``ValueError`` for a tree that does not fit its plan."""
    return ValueError(DIFFERENT_TREE.format(what=what, detail=detail))


# --- options ---------------------------------------------------------------------------------


def check_flag(name: str, value: Any) -> None:
    """Raises ``TypeError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}.")


def check_bucket_options(bucket_cap_mb: float, first_bucket_mb: float) -> None:
    """Raises unless ``bucket_cap_mb > 0`` and ``first_bucket_mb >= 0``, both finite numbers."""
    for name, value, allow_zero in (
        ("bucket_cap_mb", bucket_cap_mb, False),
        ("first_bucket_mb", first_bucket_mb, True),
    ):
        bound = "non-negative" if allow_zero else "positive"
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            # Comparisons rather than math.isfinite: under torch.compile a float that
            # changed between calls arrives symbolic, and comparisons on it trace.
            or value != value  # NaN
            or value in (math.inf, -math.inf)
            or value < 0
            or (value == 0 and not allow_zero)
        ):
            raise ValueError(f"{name} must be a finite {bound} number of MiB; got {value!r}.")


def check_reduce_dtype(reduce_dtype: Any) -> None:
    """Raises ``TypeError`` unless ``reduce_dtype`` is ``None`` or a floating point dtype."""
    if reduce_dtype is not None and not (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        raise TypeError(
            f"reduce_dtype must be None or a floating point torch.dtype such as torch.float32 "
            f"or torch.bfloat16; got {reduce_dtype!r}."
        )


def check_divide_by(divide_by: Any) -> None:
    """Raises ``ValueError`` unless ``divide_by`` is ``"world"`` or ``"active"``."""
    if divide_by not in ("world", "active"):
        raise ValueError(f"divide_by must be 'world' or 'active'; got {divide_by!r}.")


def check_order(order: Any, tensor_leaves: Sequence[int], n: int) -> None:
    """Raises unless ``order`` is ``"reverse"``, ``"forward"`` or a permutation of the leaves."""
    if isinstance(order, str):
        if order not in ("reverse", "forward"):
            raise ValueError(
                f"order must be 'reverse', 'forward' or a sequence of leaf indices; got {order!r}."
            )
        return
    indices = list(order)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in indices) or sorted(
        indices
    ) != sorted(tensor_leaves):
        raise ValueError(
            f"order must list each of the tree's {len(tensor_leaves)} tensor leaves exactly once "
            f"(indices into the {n} flattened leaves, None leaves left out); got {indices!r}."
        )


def check_size_limits(size_limits: Sequence[Any]) -> tuple[int, ...]:
    """``size_limits`` as a tuple, if it holds at least one non-negative int."""
    limits = tuple(size_limits)
    if not limits:
        raise ValueError("size_limits is empty; expected at least one bucket size in bytes.")
    for limit in limits:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(
                f"size_limits must hold non-negative integers (bytes); got {limit!r} "
                f"in {list(limits)!r}."
            )
    return limits


def check_rank(name: str, value: Any, world_size: int) -> None:
    """Raises ``ValueError`` unless ``value`` is a rank of a group of ``world_size``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world_size:
        raise ValueError(
            f"{name} must be a rank of the group, 0 to {world_size - 1}; got {value!r}."
        )


def check_optimizer(optimizer: Any) -> None:
    """Raises ``TypeError`` unless ``optimizer`` looks like a pure ``fsync.optim.Optimizer``
    (the ZeRO step keeps the state it updates, so an in-place one is refused too)."""
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}; expected an fsync.optim.Optimizer "
            "(init, update), such as fsync.optim.adamw(1e-3)."
        )
    refuse_in_place(optimizer, "optimizer", "the ZeRO step")


def refuse_in_place(optimizer: Any, name: str, owner: str) -> None:
    """Raises ``TypeError`` where ``optimizer`` updates in place: ``owner`` keeps the state
    it updates and takes pure updates only."""
    if getattr(optimizer, "in_place", False):
        raise TypeError(
            f"{name} updates in place (in_place=True); {owner} owns the state it updates and "
            "takes a pure optimizer: make it without in_place, e.g. fsync.optim.adamw(1e-3)."
        )


# --- trees and gradients ---------------------------------------------------------------------


def check_tensor_leaf(what: str, path: str, leaf: Any) -> None:
    """Raises ``TypeError`` unless ``leaf`` is a tensor or ``None``."""
    if leaf is not None and not isinstance(leaf, torch.Tensor):
        raise TypeError(NOT_A_TENSOR.format(what=what, path=path, kind=type(leaf).__name__))


def check_gradient(spec: LeafSpec, meta: TensorMeta) -> None:
    """Raises unless a tensor with metadata ``meta`` at ``spec.path`` can be a gradient."""
    if not meta.dtype.is_floating_point:
        raise TypeError(NOT_FLOATING.format(path=spec.path, dtype=meta.dtype))
    if meta.requires_grad:
        raise ValueError(REQUIRES_GRAD.format(path=spec.path))


def given(grads: Any) -> Any:
    """``grads``, unless it is ``None`` (a rank without data passes ``active=False``)."""
    if grads is None:
        raise ValueError(NO_GRADS)
    return grads


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)  # a plan that passes, once
def check_differentiable(plan: BucketPlan) -> None:
    """Raises unless every tensor leaf of ``plan`` can be differentiated (dense, floating)."""
    for spec in plan.leaves:
        if spec is not None and (spec.sparse or not spec.dtype.is_floating_point):
            kind = "is sparse" if spec.sparse else f"has dtype {spec.dtype}"
            raise TypeError(NOT_DIFFERENTIABLE.format(path=spec.path, kind=kind))


def check_one_device(plan: BucketPlan) -> None:
    """Raises ``ValueError`` unless every leaf of ``plan`` is on one device."""
    devices: dict[torch.device, str] = {}
    for leaf in plan.leaves:
        if leaf is not None:
            devices.setdefault(leaf.device, leaf.path)
    if len(devices) > 1:
        where = ", ".join(f"{device} ({path!r})" for device, path in devices.items())
        raise ValueError(SEVERAL_DEVICES.format(where=where))


def check_leaf_fits(spec: LeafSpec | None, meta: TensorMeta, what: str) -> None:
    """Raises ``ValueError`` unless a tensor with metadata ``meta`` fits the plan's ``spec``."""
    if spec is None:
        raise mismatch(what, "it holds a tensor where the plan's tree holds None")
    if meta.shape != spec.shape or meta.dtype != spec.dtype:
        raise mismatch(
            what,
            f"leaf {spec.path!r} has shape {meta.shape} and dtype {meta.dtype}, "
            f"expected shape {spec.shape} and dtype {spec.dtype}",
        )
    if meta.device != spec.device:
        raise mismatch(what, f"leaf {spec.path!r} is on {meta.device}, expected {spec.device}")
    if meta.sparse_dim != spec.sparse_dim:
        kind = f"sparse with {spec.sparse_dim} sparse dims" if spec.sparse else "dense"
        raise mismatch(what, f"leaf {spec.path!r} should be {kind}")


def leaf_difference(got: Any, want: Any) -> tuple[str, str] | None:
    """``(got, want)`` in words (``"torch.float32[2, 3]"``, ``"None"``) where two leaves (tensors
    or ``None``) differ in presence, shape or dtype; ``None`` where they are alike."""
    if got is None or want is None:
        if got is None and want is None:
            return None
    elif got.shape == want.shape and got.dtype == want.dtype:
        return None

    def words(x: Any) -> str:
        return "None" if x is None else f"{x.dtype}{list(x.shape)}"

    return words(got), words(want)


def check_floating(name: str, plan: BucketPlan, specs: Sequence[BucketSpec]) -> None:
    """Raises ``TypeError`` naming the first bucket of ``specs`` that is not floating point."""
    for b, spec in enumerate(specs):
        if not spec.dtype.is_floating_point:
            leaf = plan.leaves[spec.leaves[0]]
            path = leaf.path if leaf is not None else "?"
            raise TypeError(
                HOOK_NOT_FLOATING.format(name=name, index=b, dtype=spec.dtype, path=path)
            )


def check_full_state(full_state: Any, template: Any) -> None:
    """Raises unless ``full_state`` has the structure, shapes and dtypes of ``template``."""
    expected, spec = _tree.flatten(template)
    try:
        got = spec.flatten_up_to(full_state)
    except ValueError as error:
        raise ValueError(
            f"full_state has structure {_tree.structure(full_state)}, but this optimizer's "
            f"state for these parameters has {spec}. Pass what fsync.ops.zero_state_dict "
            "returned for the same optimizer and parameter tree."
        ) from error
    for accessor, want, have in zip(spec.accessors(), expected, got, strict=True):
        where = accessor.codify("full_state")
        if (want is None) != (have is None) or (
            want is not None and have.__class__ is not want.__class__
        ):
            kind = "None" if have is None else f"a {type(have).__name__}"
            raise ValueError(
                f"{where} is {kind}; expected {'None' if want is None else 'a tensor'}."
            )
        if want is not None and (have.shape != want.shape or have.dtype != want.dtype):
            raise ValueError(
                f"{where} has shape {tuple(have.shape)} and dtype {have.dtype}; expected "
                f"shape {tuple(want.shape)} and dtype {want.dtype}. Was it saved for another "
                "model or optimizer?"
            )


# --- buffers ---------------------------------------------------------------------------------


def check_buffers(
    buffers: Sequence[Any],
    specs: Sequence[BucketSpec],
    plan: BucketPlan,
    what: str,
    *,
    shards: int = 0,
) -> None:
    """Raises unless ``buffers`` fit ``specs`` (a plan's buckets or its dense ones).

    With ``shards=n`` a dense buffer may also be this rank's shard of its
    bucket: ``ceil(numel / n)`` elements (what a reduce-scatter returns).
    """
    if not isinstance(buffers, list | tuple):
        raise TypeError(
            f"{what}: got a {type(buffers).__name__}; expected a list with one buffer per "
            "bucket, in the plan's order."
        )
    if len(buffers) != len(specs):
        raise ValueError(
            f"{what}: got {count(len(buffers), 'buffer')} for {count(len(specs), 'bucket')}; "
            "expected exactly one buffer per bucket, in the plan's order."
        )
    for b, (buffer, spec) in enumerate(zip(buffers, specs, strict=True)):
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{what}: buffer {b} is a {type(buffer).__name__}; expected a tensor.")
        if spec.sparse:
            leaf = plan.leaves[spec.leaves[0]]
            assert leaf is not None
            ok = buffer.layout == torch.sparse_coo and tuple(buffer.shape) == leaf.shape
            expected = f"a sparse tensor of shape {leaf.shape}"
        else:
            sizes = {spec.numel} | ({-(-spec.numel // shards)} if shards else set())
            ok = buffer.layout == torch.strided and buffer.dim() == 1 and buffer.numel() in sizes
            expected = f"a dense 1-D tensor of {spec.numel} elements"
            if shards:
                expected += f", or this rank's shard of it ({-(-spec.numel // shards)} elements)"
        if not ok:
            raise ValueError(
                f"{what}: buffer {b} has shape {tuple(buffer.shape)} and layout "
                f"{buffer.layout}; expected {expected}."
            )
        if buffer.dtype != spec.dtype or buffer.device != spec.device:
            raise ValueError(
                f"{what}: buffer {b} is {buffer.dtype} on {buffer.device}; expected "
                f"{spec.dtype} on {spec.device}."
            )

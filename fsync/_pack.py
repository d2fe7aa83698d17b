"""Flat bucket buffers from a tree's leaves and back, following a :class:`BucketPlan`.

Like ``optree``'s ``tree_ravel``: a flat tensor per bucket plus the plan to go
back, and a loud check both ways. Under ``torch.compile`` the concatenation of
a bucket (with any cast or scale around it) becomes one fused kernel and the
unpacked leaves are views of the buffer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from fsync import _tree
from fsync._plan import BucketPlan, BucketSpec, LeafSpec, TensorMeta, count, tensor_meta

_DIFFERENT_TREE = (
    "{what} does not match the plan: {detail}. Pass the tree the plan was built for "
    "(same structure, shapes and dtypes), or build a new plan with fsync.plan_buckets."
)


def mismatch(what: str, detail: str) -> ValueError:
    return ValueError(_DIFFERENT_TREE.format(what=what, detail=detail))


def check_leaves(leaves: Sequence[Any], treespec: Any, plan: BucketPlan, what: str) -> None:
    """Raises ``ValueError``/``TypeError`` unless ``leaves`` fit ``plan``.

    A ``None`` leaf is accepted where the plan has a tensor (an unused
    parameter); a tensor where the plan has ``None`` is not.
    """
    if treespec != plan.structure():
        raise mismatch(
            what,
            f"its structure is {treespec} but the plan's is {plan.treespec}",
        )
    for leaf, spec in zip(leaves, plan.leaves, strict=True):
        if leaf is None:
            continue
        if spec is None:
            raise mismatch(what, "it holds a tensor where the plan's tree holds None")
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what} leaf {spec.path!r} is a {type(leaf).__name__}; expected a torch.Tensor "
                "or None."
            )
        check_leaf_meta(spec, tensor_meta(leaf), what)


def check_leaf_meta(spec: LeafSpec, meta: TensorMeta, what: str) -> None:
    """Raises ``ValueError`` unless a tensor with metadata ``meta`` fits ``spec``."""
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


def flat(leaf: torch.Tensor | None, spec: LeafSpec, dtype: torch.dtype) -> torch.Tensor:
    """``leaf`` as a 1-D ``dtype`` tensor in the plan's memory order (zeros for ``None``)."""
    if leaf is None:
        return torch.zeros(spec.numel, dtype=dtype, device=spec.device)
    # Only the operations a leaf needs: under torch.compile each one costs trace time.
    if spec.perm != tuple(range(len(spec.perm))):
        leaf = leaf.permute(spec.perm)
    if leaf.dim() != 1:
        leaf = leaf.reshape(-1)
    return leaf if leaf.dtype == dtype else leaf.to(dtype)


def pack_leaves(leaves: Sequence[torch.Tensor | None], plan: BucketPlan) -> list[torch.Tensor]:
    """The buffers of already flattened, already checked leaves."""
    return [_pack_bucket(leaves, plan, spec) for spec in plan.specs]


def _pack_bucket(
    leaves: Sequence[torch.Tensor | None], plan: BucketPlan, spec: BucketSpec
) -> torch.Tensor:
    if spec.sparse:
        (i,) = spec.leaves
        leaf, leaf_spec_ = leaves[i], plan.leaves[i]
        assert leaf_spec_ is not None
        if leaf is None:
            dense_shape = leaf_spec_.shape[leaf_spec_.sparse_dim :]
            return torch.sparse_coo_tensor(
                torch.zeros(leaf_spec_.sparse_dim, 0, dtype=torch.int64, device=spec.device),
                torch.zeros(0, *dense_shape, dtype=spec.dtype, device=spec.device),
                leaf_spec_.shape,
                check_invariants=True,
            ).coalesce()
        return leaf.coalesce()
    parts = []
    for i, layout in zip(spec.leaves, spec.layouts, strict=True):
        leaf = leaves[i]
        if leaf is None:
            leaf_spec_ = plan.leaves[i]
            assert leaf_spec_ is not None
            leaf = torch.zeros(leaf_spec_.numel, dtype=spec.dtype, device=spec.device)
        elif layout.perm is not None:
            leaf = leaf.permute(layout.perm)
        parts.append(leaf)
    if torch.compiler.is_compiling() and len(parts) <= FUSED_CAT_LEAVES:
        # A plain cat, which inductor fuses with the hook's scaling or cast: one pass.
        flattened = [part if part.dim() == 1 else part.reshape(-1) for part in parts]
        return torch.cat([p if p.dtype == spec.dtype else p.to(spec.dtype) for p in flattened])
    # Many leaves: one opaque concatenation (C++ eagerly, a custom op under compile)
    # whose cost does not grow with the number of leaves in Python or in the compiler.
    buffer = _concat(parts)
    return buffer if buffer.dtype == spec.dtype else buffer.to(spec.dtype)


# Buckets of up to this many leaves are packed by torch.cat under torch.compile, which
# inductor turns into one kernel fused with what follows; beyond it the generated
# kernel, and its compile time, grow with every leaf.
FUSED_CAT_LEAVES = 32


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts, each flattened in row-major order, in one new 1-D tensor."""
    if torch.compiler.is_compiling():
        concatenated: torch.Tensor = torch.ops.fsync.concat(parts)
        return concatenated
    return _concat_impl(parts)


@torch.library.custom_op("fsync::concat", mutates_args=())
def _concat_op(parts: list[torch.Tensor]) -> torch.Tensor:
    return _concat_impl(parts)


@_concat_op.register_fake
def _(parts: list[torch.Tensor]) -> torch.Tensor:
    dtype = parts[0].dtype
    for part in parts[1:]:
        dtype = torch.promote_types(dtype, part.dtype)
    return parts[0].new_empty(sum(part.numel() for part in parts), dtype=dtype)


def _concat_impl(parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:  # flatten_dense_tensors would return a view of the input
        return parts[0].reshape(-1).clone()
    flattened: torch.Tensor = torch._C._nn.flatten_dense_tensors(parts)
    return flattened


def pack(tree: Any, plan: BucketPlan, /) -> list[torch.Tensor]:
    """Packs the leaves of ``tree`` into one flat 1-D buffer per bucket of ``plan``.

    Each leaf is laid out in its own memory order (a channels_last leaf as
    NHWC), so :func:`unpack` can give it back with the same strides, and cast
    to the bucket's dtype (the plan's ``reduce_dtype``, if any). A ``None``
    leaf where the plan expects a tensor (an unused parameter) packs as zeros.
    A sparse bucket's "buffer" is the coalesced sparse tensor itself.

    Args:
        tree: A tree with the plan's structure, leaf shapes and dtypes.
        plan: The :class:`BucketPlan` built for such a tree.

    Returns:
        One new tensor per bucket, in the plan's communication order. The
        buffers never share memory with ``tree``.

    Raises:
        ValueError: The tree does not match the plan.
        TypeError: A leaf is neither a tensor nor ``None``.

    Example:
        >>> import torch, fsync
        >>> tree = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
        >>> plan = fsync.plan_buckets(tree)
        >>> fsync.pack(tree, plan)
        [tensor([0., 0., 1., 1., 1., 1.])]
    """
    leaves, treespec = _tree.flatten(tree)
    check_leaves(leaves, treespec, plan, "tree")
    return pack_leaves(leaves, plan)


def check_buffers(
    buffers: Sequence[torch.Tensor], specs: Sequence[BucketSpec], plan: BucketPlan, what: str
) -> None:
    """Raises unless ``buffers`` fit ``specs`` (a plan's buckets or its dense ones)."""
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
            ok = buffer.layout == torch.strided and tuple(buffer.shape) == (spec.numel,)
            expected = f"a dense 1-D tensor of {spec.numel} elements"
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


def unpack_leaves(buffers: Sequence[torch.Tensor], plan: BucketPlan) -> list[torch.Tensor | None]:
    """Leaves (flatten order) of already checked buffers; views where layouts allow."""
    leaves: list[torch.Tensor | None] = [None] * len(plan.leaves)
    for buffer, spec in zip(buffers, plan.specs, strict=True):
        if spec.sparse:
            leaves[spec.leaves[0]] = buffer
            continue
        # One narrow per leaf rather than one split: a split's N outputs come back as
        # getitems on one N-long list, which inductor lowers in time quadratic in N.
        starts = itertools.accumulate(spec.sizes[:-1], initial=0)
        pieces = [buffer.narrow(0, a, n) for a, n in zip(starts, spec.sizes, strict=True)]
        for i, piece, layout in zip(spec.leaves, pieces, spec.layouts, strict=True):
            if layout.view is not None:
                piece = piece.view(layout.view)
            if layout.inverse is not None:
                piece = piece.permute(layout.inverse)
            leaves[i] = piece if layout.dtype is None else piece.to(layout.dtype)
    return leaves


def unpack(buffers: Sequence[torch.Tensor], plan: BucketPlan, /) -> Any:
    """Inverse of :func:`pack`: a tree with the plan's structure from its buffers.

    Every leaf comes back with its shape, dtype and memory layout (a
    channels_last leaf is channels_last again), as a view of its buffer unless
    the plan reduces in another dtype; the plan's ``None`` leaves stay ``None``.

    Args:
        buffers: One tensor per bucket, as :func:`pack` (or a hook) returned them.
        plan: The plan the buffers were packed with.

    Returns:
        The tree.

    Raises:
        ValueError: The buffers do not fit the plan (count, sizes, dtypes).

    Example:
        >>> import torch, fsync
        >>> tree = {"w": torch.ones(2, 2), "b": None}
        >>> plan = fsync.plan_buckets(tree)
        >>> fsync.unpack(fsync.pack(tree, plan), plan)
        {'w': tensor([[1., 1.],
                [1., 1.]]), 'b': None}
    """
    check_buffers(buffers, plan.specs, plan, "unpack")
    return _tree.unflatten(plan.structure(), unpack_leaves(buffers, plan))


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per rank when ``numel`` elements are cut into ``world_size`` equal shards."""
    return -(-numel // world_size)


def pad_to_shards(buffer: torch.Tensor, world_size: int) -> torch.Tensor:
    """``buffer`` (1-D) zero-padded to ``world_size`` equal shards."""
    extra = world_size * shard_numel(buffer.numel(), world_size) - buffer.numel()
    return torch.nn.functional.pad(buffer, (0, extra)) if extra else buffer


def shard_of(buffer: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of a 1-D buffer padded as by :func:`pad_to_shards` (a view)."""
    n = shard_numel(buffer.numel(), world_size)
    return pad_to_shards(buffer, world_size)[rank * n : (rank + 1) * n]

"""Flat bucket buffers from a tree's leaves and back, following a [BucketPlan][fsync.BucketPlan].

Like ``optree``'s ``tree_ravel``: a flat tensor per bucket plus the plan to go
back, and a loud check both ways. Under ``torch.compile`` a bucket is one
``fsync::pack`` op (with the mean's scale, once [fsync.compile][] folds it in) and
the unpacked leaves are views of the buffer.

Owns: moving leaves into flat buffers and back, and cutting buffers into shards.
May import: ``_tree``, ``_plan``, ``_checks``, ``_planner``, ``_buffers`` (layers 1 to 4).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any, cast

import torch

from fsync import _buffers, _tree
from fsync._checks import check_buffers
from fsync._plan import PLAN_CACHE_SIZE, BucketPlan, BucketSpec, LeafLayout, LeafSpec
from fsync._planner import fit_tree
from fsync._state import empty_sparse, like_of_spec


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


def pack_leaves(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    *,
    after: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The buffers of already flattened, already checked leaves.

    ``after``, a 0-d tensor that is always true (the ranks' agreement computes
    it), multiplies every dense leaf on its way into its bucket: the same bits
    (``x * 1`` is ``x``), in the same fused kernel, but under ``torch.compile``
    every bucket then depends on the agreement, so no bucket collective can be
    scheduled before it and the agreement is never dropped as unused.
    """
    return [_pack_bucket(leaves, plan, k, after) for k in range(len(plan.specs))]


def _pack_bucket(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    k: int,
    after: torch.Tensor | None,
) -> torch.Tensor:
    spec = plan.specs[k]
    if spec.sparse:
        (i,) = spec.leaves
        leaf, leaf_spec_ = leaves[i], plan.leaves[i]
        assert leaf_spec_ is not None
        if leaf is None:
            return empty_sparse(leaf_spec_.shape, leaf_spec_.sparse_dim, spec.dtype, spec.device)
        return leaf.coalesce()
    if not torch.compiler.is_compiling():
        into = _buffers.kept(plan).buffer(k, spec)
        return pack_grads([leaves[i] for i in spec.leaves], spec, into=into)
    parts: list[torch.Tensor] = []
    for i, layout in zip(spec.leaves, spec.layouts, strict=True):
        leaf = leaves[i]
        if leaf is None:
            leaf = torch.zeros(spec.sizes[len(parts)], dtype=spec.dtype, device=spec.device)
        elif layout.perm is not None:
            leaf = leaf.permute(layout.perm)
        parts.append(leaf)
    # One op per bucket, whatever the backend, so that the compiler keeps the bucket whole;
    # fsync.compile folds the mean's scale into it and lowers it for the device (_compile).
    buffer: torch.Tensor = torch.ops.fsync.pack(parts, after, spec.dtype, 1.0)
    return buffer


def pack_grads(
    grads: Sequence[torch.Tensor | None], spec: BucketSpec, *, into: torch.Tensor | None = None
) -> torch.Tensor:
    """A dense bucket's buffer from its leaves' tensors (in buffer order), eagerly: ``into``
    (1-D, the bucket's numel and dtype) or a new one.

    One batched copy, each leaf in its memory order, cast where the bucket's dtype is
    another: a call per bucket, not per leaf. A ``None`` leaf is zeros, a sparse one is
    made dense. The tensors are only read, and the buffer shares memory with none of them.
    """
    parts = cast(Sequence[torch.Tensor], grads)
    strided = torch.strided
    if _permuted(spec) or any(g is None or g.layout is not strided for g in grads):
        parts = [_dense(g, spec, j) for j, g in enumerate(grads)]
    if into is not None:
        return _copy_into(into, parts)
    return pack_parts(parts, spec.dtype, 1.0)


def _copy_into(into: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``into`` holding the dense ``parts`` one after another, each in its memory order and
    cast to ``into``'s dtype: the bits of ``pack_parts`` (a copy casts as ``to`` does)."""
    if len(parts) == 1:
        return into.copy_(parts[0].reshape(-1))
    torch._foreach_copy_(torch._C._nn.unflatten_dense_tensors(into, list(parts)), list(parts))
    return into


def _permuted(spec: BucketSpec) -> bool:
    return any(layout.perm is not None for layout in spec.layouts)


def _dense(g: torch.Tensor | None, spec: BucketSpec, j: int) -> torch.Tensor:
    """Leaf ``j`` of bucket ``spec`` as a dense tensor in memory order."""
    if g is None:
        return torch.zeros(spec.sizes[j], dtype=spec.dtype, device=spec.device)
    if g.layout != torch.strided:
        g = g.to_dense()
    perm = spec.layouts[j].perm
    return g if perm is None else g.permute(perm)


def own_grads(grads: Sequence[torch.Tensor], plan: BucketPlan) -> list[torch.Tensor | None]:
    """Autograd's gradients of the plan's tensor leaves (in flatten order) as results: in
    the plan's flatten order (``None`` leaves kept), each dense, laid out as its leaf and
    in memory of its own.

    ``torch.autograd.grad`` may hand out one tensor for two leaves (``a + b``), a view of
    part of another tensor (a ``cat``'s pieces), a broadcast one, or another memory order;
    such a gradient is copied into a new tensor of its leaf's layout. The others (a
    linear layer's gradients are whole views, of a transposed product or a kept dim) are
    the results as they are: no copy.
    """
    out: list[torch.Tensor | None] = [None] * len(plan.leaves)
    roots: set[int] = set()
    strides = _unpacked_strides(plan)
    for (i, perm), g in zip(_orders(plan), grads, strict=True):
        if g.layout != torch.strided:
            g = g.to_dense()
        root = g._base
        if root is None:
            root = g
        elif root.numel() != g.numel():  # a part of it
            root = None
        laid_out = g.is_contiguous() if perm is None else g.permute(perm).is_contiguous()
        if root is None or not laid_out or id(root) in roots:
            g = root = _copy_laid_out(g, strides[i])  # type: ignore[arg-type]
        roots.add(id(root))
        out[i] = g
    return out


def copies(leaves: Sequence[torch.Tensor | None], plan: BucketPlan) -> list[torch.Tensor | None]:
    """Each dense tensor leaf of ``plan`` (flatten order) copied into memory of its own, laid
    out as unpacking lays it out (its leaf's memory order, dense): what a sync whose mean
    is the gradient itself returns (one rank), without a bucket.

    A leaf already dense in that layout is cloned (which keeps its strides); another is
    copied into a new tensor of that layout.
    """
    out: list[torch.Tensor | None] = []
    for leaf, strides in zip(leaves, _unpacked_strides(plan), strict=True):
        if leaf is None or strides is None:
            out.append(None)
        elif leaf.stride() == strides:
            out.append(leaf.clone())
        else:
            out.append(_copy_laid_out(leaf, strides))
    return out


def _copy_laid_out(x: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``x`` copied into a new tensor of its shape, dtype and device, with ``strides``."""
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _unpacked_strides(plan: BucketPlan) -> tuple[tuple[int, ...] | None, ...]:
    """Per leaf (flatten order), the strides unpacking gives it; ``None`` for a ``None`` leaf."""
    return tuple(
        None if spec is None else like_of_spec(spec).stride()  # type: ignore[union-attr]
        for spec in plan.leaves
    )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _orders(plan: BucketPlan) -> tuple[tuple[int, tuple[int, ...] | None], ...]:
    """Per tensor leaf (flatten order): its index, and its memory order unless row-major."""
    return tuple(
        (i, None if spec.perm == tuple(range(len(spec.perm))) else spec.perm)
        for i, spec in enumerate(plan.leaves)
        if spec is not None
    )


@torch.library.custom_op("fsync::pack", mutates_args=())
def pack_op(
    parts: list[torch.Tensor], after: torch.Tensor | None, dtype: torch.dtype, factor: float
) -> torch.Tensor:
    """A bucket from its leaves (each in its memory order), as one op of the compiled graph.

    Each element is ``x.to(dtype) * factor``, the bits of the eager pack followed by the
    mean's ``x * (1 / world_size)`` (``factor`` is 1.0 until [fsync.compile][] folds the
    mean into it). ``after``, the agreement's always-true token, is an input only so that
    the pack runs after the agreement: its value is not read. Under ``torch.compile`` a
    ``cat`` of many leaves becomes a kernel per leaf on CUDA; this op stays one, and on
    the CPU, whose backend fuses any ``cat`` into one loop, fsync.compile lowers it back
    into one (``_compile.lower_pack``).
    """
    return pack_parts(parts, dtype, factor)


def pack_parts(parts: Sequence[torch.Tensor], dtype: torch.dtype, factor: float) -> torch.Tensor:
    """A new buffer of dense parts, each in its memory order: one batched copy
    (``flatten_dense_tensors``, C++), the cast, the scale in place. The eager pack's, and
    ``fsync::pack``'s kernel on any device."""
    if len(parts) == 1:  # flatten_dense_tensors would return a view of it
        buffer = parts[0].reshape(-1).clone()
    else:
        buffer = torch._C._nn.flatten_dense_tensors(list(parts))
    if buffer.dtype != dtype:
        buffer = buffer.to(dtype)
    return buffer.mul_(factor) if factor != 1.0 else buffer


@pack_op.register_fake
def _(
    parts: list[torch.Tensor], after: torch.Tensor | None, dtype: torch.dtype, factor: float
) -> torch.Tensor:
    return parts[0].new_empty(sum(part.numel() for part in parts), dtype=dtype)


def _pack_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """The pack's derivative: each leaf's slice of ``grad`` times ``factor``, in its shape."""
    pieces = grad.split_with_sizes([numel for numel, _, _ in ctx.parts])
    grads = [
        (piece * ctx.factor).to(dtype).view(shape)
        for piece, (_, shape, dtype) in zip(pieces, ctx.parts, strict=True)
    ]
    return grads, None, None, None


def _save_parts(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    parts, _, _, factor = inputs
    ctx.parts = [(part.numel(), part.shape, part.dtype) for part in parts]
    ctx.factor = factor


pack_op.register_autograd(_pack_backward, setup_context=_save_parts)


def pack(tree: Any, plan: BucketPlan, /) -> list[torch.Tensor]:
    """Packs the leaves of ``tree`` into one flat 1-D buffer per bucket of ``plan``.

    Each leaf is laid out in its own memory order (a channels_last leaf as
    NHWC), so [unpack][fsync.unpack] can give it back with the same strides, and cast
    to the bucket's dtype (the plan's ``reduce_dtype``, if any). A ``None``
    leaf where the plan expects a tensor (an unused parameter) packs as zeros.
    A sparse bucket's "buffer" is the coalesced sparse tensor itself.

    Args:
        tree: A tree with the plan's structure, leaf shapes and dtypes.
        plan: The [BucketPlan][fsync.BucketPlan] built for such a tree.

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
    return pack_leaves(fit_tree(tree, plan, what="tree").leaves, plan)


def unpack_leaves(buffers: Sequence[torch.Tensor], plan: BucketPlan) -> list[torch.Tensor | None]:
    """Leaves (flatten order) of already checked buffers; views where layouts allow."""
    leaves: list[torch.Tensor | None] = [None] * len(plan.leaves)
    if torch.compiler.is_compiling():
        for buffer, spec in zip(buffers, plan.specs, strict=True):
            if spec.sparse:
                leaves[spec.leaves[0]] = buffer
                continue
            # One narrow per leaf rather than one split: a split's N outputs come back as
            # getitems on one N-long list, which inductor lowers in time quadratic in N.
            starts = itertools.accumulate(spec.sizes[:-1], initial=0)
            for i, a, n, layout in zip(spec.leaves, starts, spec.sizes, spec.layouts, strict=True):
                leaves[i] = _leaf_of(buffer.narrow(0, a, n), layout)
        return leaves
    for buffer, spec, odd in zip(buffers, plan.specs, _unpacking(plan), strict=True):
        if spec.sparse:
            leaves[spec.leaves[0]] = buffer
            continue
        # Every leaf's slice in one call (C++); then the leaves that need more (a shape).
        pieces = list(buffer.split_with_sizes(spec.sizes))
        for j in odd:
            pieces[j] = _leaf_of(pieces[j], spec.layouts[j])
        for i, piece in zip(spec.leaves, pieces, strict=True):
            leaves[i] = piece
    return leaves


def _leaf_of(piece: torch.Tensor, layout: LeafLayout) -> torch.Tensor:
    """A leaf from its slice of a bucket (or its view in memory order): shape, strides, dtype."""
    if layout.view is not None:
        piece = piece.view(layout.view)
    if layout.inverse is not None:
        piece = piece.permute(layout.inverse)
    return piece if layout.dtype is None else piece.to(layout.dtype)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _unpacking(plan: BucketPlan) -> tuple[tuple[int, ...], ...]:
    """Per bucket, the positions of the leaves that are more than a 1-D slice of it (a
    shape, a permutation back, a cast)."""
    return tuple(
        tuple(
            j
            for j, layout in enumerate(spec.layouts)
            if layout.view is not None or layout.inverse is not None or layout.dtype is not None
        )
        for spec in plan.specs
    )


def unpack(buffers: Sequence[torch.Tensor], plan: BucketPlan, /) -> Any:
    """Inverse of [pack][fsync.pack]: a tree with the plan's structure from its buffers.

    Every leaf comes back with its shape, dtype and memory layout (a
    channels_last leaf is channels_last again), as a view of its buffer unless
    the plan reduces in another dtype; the plan's ``None`` leaves stay ``None``.

    Args:
        buffers: One tensor per bucket, as [pack][fsync.pack] (or a hook) returned them.
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
    """This rank's shard of a 1-D buffer padded as by ``pad_to_shards`` (a view)."""
    n = shard_numel(buffer.numel(), world_size)
    return pad_to_shards(buffer, world_size)[rank * n : (rank + 1) * n]

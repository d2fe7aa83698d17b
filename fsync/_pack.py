"""Flat bucket buffers from a tree's leaves and back, following a [BucketPlan][fsync.BucketPlan].

Like ``optree``'s ``tree_ravel``: a flat tensor per bucket plus the plan to go
back, and a loud check both ways. Under ``torch.compile`` the concatenation of
a bucket (with any cast or scale around it) becomes one fused kernel and the
unpacked leaves are views of the buffer.

Owns: moving leaves into flat buffers and back, and cutting buffers into shards.
May import: ``_tree``, ``_plan``, ``_checks``, ``_planner`` (layers 1 to 4).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from fsync import _tree
from fsync._checks import check_buffers
from fsync._plan import BucketPlan, BucketSpec, LeafSpec
from fsync._planner import empty_sparse, fit_tree


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
    return [_pack_bucket(leaves, plan, spec, after) for spec in plan.specs]


def _pack_bucket(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    spec: BucketSpec,
    after: torch.Tensor | None,
) -> torch.Tensor:
    if spec.sparse:
        (i,) = spec.leaves
        leaf, leaf_spec_ = leaves[i], plan.leaves[i]
        assert leaf_spec_ is not None
        if leaf is None:
            return empty_sparse(leaf_spec_.shape, leaf_spec_.sparse_dim, spec.dtype, spec.device)
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
        if after is not None:
            flattened = [part * after for part in flattened]
        return torch.cat([p if p.dtype == spec.dtype else p.to(spec.dtype) for p in flattened])
    # Many leaves: one opaque concatenation (C++ eagerly, a custom op under compile)
    # whose cost does not grow with the number of leaves in Python or in the compiler.
    buffer = _concat(parts)
    if after is not None:
        buffer = buffer * after
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

"""Flat bucket buffers from a tree's leaves and back, following a :class:`BucketPlan`.

Like ``optree``'s ``tree_ravel``: a flat tensor per bucket plus the plan to go
back, and a loud check both ways. Under ``torch.compile`` the concatenation of
a bucket (with any cast or scale around it) becomes one fused kernel and the
unpacked leaves are views of the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fsync import _tree
from fsync._plan import BucketPlan, BucketSpec, LeafSpec

_DIFFERENT_TREE = (
    "{what} does not match the plan: {detail}. Pass the tree the plan was built for "
    "(same structure, shapes and dtypes), or build a new plan with fsync.plan_buckets."
)


def _mismatch(what: str, detail: str) -> ValueError:
    return ValueError(_DIFFERENT_TREE.format(what=what, detail=detail))


def check_leaves(leaves: Sequence[Any], treespec: Any, plan: BucketPlan, what: str) -> None:
    """Raises ``ValueError``/``TypeError`` unless ``leaves`` fit ``plan``.

    A ``None`` leaf is accepted where the plan has a tensor (an unused
    parameter); a tensor where the plan has ``None`` is not.
    """
    if treespec != plan.structure():
        raise _mismatch(
            what,
            f"its structure is {treespec} but the plan's is {plan.treespec}",
        )
    for leaf, spec in zip(leaves, plan.leaves, strict=True):
        if leaf is None:
            continue
        if spec is None:
            raise _mismatch(what, "it holds a tensor where the plan's tree holds None")
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what} leaf {spec.path!r} is a {type(leaf).__name__}; expected a torch.Tensor "
                "or None."
            )
        if tuple(leaf.shape) != spec.shape or leaf.dtype != spec.dtype:
            raise _mismatch(
                what,
                f"leaf {spec.path!r} has shape {tuple(leaf.shape)} and dtype {leaf.dtype}, "
                f"expected shape {spec.shape} and dtype {spec.dtype}",
            )
        if leaf.device != spec.device:
            raise _mismatch(what, f"leaf {spec.path!r} is on {leaf.device}, expected {spec.device}")
        sparse_dim = leaf.sparse_dim() if leaf.layout == torch.sparse_coo else 0
        if sparse_dim != spec.sparse_dim:
            kind = f"sparse with {spec.sparse_dim} sparse dims" if spec.sparse else "dense"
            raise _mismatch(what, f"leaf {spec.path!r} should be {kind}")


def flat(leaf: torch.Tensor | None, spec: LeafSpec, dtype: torch.dtype) -> torch.Tensor:
    """``leaf`` as a 1-D ``dtype`` tensor in the plan's memory order (zeros for ``None``)."""
    if leaf is None:
        return torch.zeros(spec.numel, dtype=dtype, device=spec.device)
    if spec.perm != tuple(range(len(spec.perm))):
        leaf = leaf.permute(spec.perm)
    return leaf.reshape(-1).to(dtype)


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
    for i in spec.leaves:
        leaf_spec_ = plan.leaves[i]
        assert leaf_spec_ is not None
        parts.append(flat(leaves[i], leaf_spec_, spec.dtype))
    # torch.cat always returns new memory, so a hook may own the buffer it gets.
    return torch.cat(parts)


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
            f"{what}: got {len(buffers)} buffers for {len(specs)} buckets; expected exactly "
            "one buffer per bucket, in the plan's order."
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
    leaves: list[torch.Tensor | None] = [None] * plan.num_leaves
    for buffer, spec in zip(buffers, plan.specs, strict=True):
        if spec.sparse:
            leaves[spec.leaves[0]] = buffer
            continue
        for i, piece in zip(spec.leaves, torch.split(buffer, list(spec.sizes)), strict=True):
            leaf = plan.leaves[i]
            assert leaf is not None
            leaves[i] = _shape(piece, leaf).to(leaf.dtype)
    return leaves


def _shape(piece: torch.Tensor, leaf: LeafSpec) -> torch.Tensor:
    if leaf.perm == tuple(range(len(leaf.perm))):
        return piece.view(leaf.shape)
    inverse = [0] * len(leaf.perm)
    for position, dim in enumerate(leaf.perm):
        inverse[dim] = position
    return piece.view([leaf.shape[d] for d in leaf.perm]).permute(inverse)


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

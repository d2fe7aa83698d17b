"""What fsync's states are made of besides tensors: trees held as metadata, and the state
classes ``torch.load`` may rebuild.

A state keeps the tree it was made for as ``like(tree)``, meta tensors of the leaves'
shapes, strides and dtypes (``SparseLike`` for a sparse leaf), so that a sync can rebuild
its plan from ``(state, options)`` alone; ``register_state`` lets ``torch.load`` rebuild
a state class with ``weights_only=True`` (its default).

Owns: metadata trees and the state classes' registration. May import: ``_tree``,
``_plan`` (layers 1 and 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import optree
import torch

from fsync import _tree
from fsync._plan import LeafSpec

T = TypeVar("T", bound=type)


def register_state(cls: T) -> T:
    """Class decorator: lets ``torch.load`` rebuild this state NamedTuple of tensors.

    fsync's states hold only tensors and nested tuples, so allowing their
    classes in the weights-only unpickler is safe; without it every user would
    have to pass ``weights_only=False`` to load a checkpoint.
    """
    torch.serialization.add_safe_globals([cls])
    return cls


def formerly(path: str) -> Callable[[T], T]:
    """Class decorator: ``torch.load`` (weights only) also rebuilds this state from files
    that saved it under ``path``, the module and name it had in an earlier release."""

    def register(cls: T) -> T:
        torch.serialization.add_safe_globals([(cls, path)])
        return cls

    return register


def like(tree: Any, /) -> Any:
    """``tree`` with every tensor leaf replaced by a tensor that holds its metadata only.

    A dense leaf becomes a meta tensor of its shape, strides and dtype (no
    memory); a sparse leaf an empty sparse tensor of its shape on its device.
    States keep such a tree, so that a sync can rebuild its plan from
    ``(state, options)`` alone.
    """
    return optree.tree_map(
        _like_leaf, tree, is_leaf=lambda x: x is None, none_is_leaf=True, namespace=_tree.NAMESPACE
    )


def like_of_spec(leaf: LeafSpec | None) -> torch.Tensor | SparseLike | None:
    """The leaf ``like`` makes of a tensor, from its plan's spec of it (metadata only)."""
    if leaf is None:
        return None
    if leaf.sparse:
        return SparseLike(leaf.shape, leaf.sparse_dim, leaf.dtype, leaf.device)
    strides = [0] * len(leaf.shape)
    step = 1
    for d in reversed(leaf.perm):
        strides[d] = step
        step *= max(leaf.shape[d], 1)
    return torch.empty_strided(leaf.shape, strides, dtype=leaf.dtype, device="meta")


def zeros_of(held: Any, device: torch.device, /) -> Any:
    """Zeros with the shapes, strides and dtypes of a tree that ``like`` made, on ``device``."""
    return optree.tree_map(
        lambda x: torch.zeros_like(x, device=device) if isinstance(x, torch.Tensor) else x,
        held,
        is_leaf=lambda x: x is None,
        none_is_leaf=True,
        namespace=_tree.NAMESPACE,
    )


@register_state
@dataclasses.dataclass(frozen=True)
class SparseLike:
    """What a state keeps of a sparse COO leaf: its metadata (``torch.compile`` takes no sparse
    tensor in, not even an empty one, and a state must pass through it).

    Attributes:
        shape: The leaf's shape.
        sparse_dim: Its number of sparse dimensions.
        dtype: Its dtype.
        device: Its device.
    """

    shape: tuple[int, ...]
    sparse_dim: int
    dtype: torch.dtype
    device: torch.device


def _like_leaf(leaf: Any) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if leaf.layout == torch.sparse_coo:
        return SparseLike(tuple(leaf.shape), leaf.sparse_dim(), leaf.dtype, leaf.device)
    return torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device="meta")


def empty_sparse(
    shape: tuple[int, ...], sparse_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A coalesced sparse COO tensor of ``shape`` without entries."""
    return torch.sparse_coo_tensor(
        torch.zeros(sparse_dim, 0, dtype=torch.int64, device=device),
        torch.zeros(0, *shape[sparse_dim:], dtype=dtype, device=device),
        shape,
        check_invariants=True,
    ).coalesce()

"""A leaf's metadata as the planner reads it, and the memo that spares reading it again.

The planner keys its plans on plain tuples of each leaf's metadata, ``(shape, stride,
dtype, device, layout, sparse_dim, requires_grad)`` (``read``). Reading them is a handful
of calls into torch per leaf, each making a Python object (about 50 µs for 150 leaves on
the 2-core machines), and a training loop passes leaves of the same metadata every step.
So, eagerly, the metadata of a structure's last few sets of leaves is kept beside dynamo's
C++ check of it (``torch._C._dynamo.guards.TensorGuards``: dispatch keys, which tell the
device type and the layout, dtype, device index, ``requires_grad``, sizes and strides;
7 µs for the same 150 leaves), and leaves that pass the check get those tuples back
without being read (``of``). A check that fails only costs the read; leaves that are not
all plain strided tensors (``None``, sparse, a subclass) are read every call, as is every
leaf under ``torch.compile``, where the reads are traced once.

Owns: leaf metadata tuples. May import: ``_plan``, ``_state`` (layer 2).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch._C._dynamo.guards import TensorGuards

from fsync._plan import PLAN_CACHE_SIZE
from fsync._state import SparseLike

# (shape, stride, dtype, device, layout, sparse_dim, requires_grad): a leaf's metadata as
# plain tuples, which dynamo builds faster than NamedTuples.
Meta = tuple[Any, ...]
Metas = tuple[Meta | None, ...]

# Sets of leaves remembered per structure (a training loop passes one or two: the
# gradients, the parameters, their meta-tensor state), and the leaf types checked.
KEPT_PER_STRUCTURE = 4
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def read(leaves: Sequence[Any]) -> Metas:
    """Each leaf's metadata (``None`` for a ``None`` leaf), read from the leaves."""
    if torch.compiler.is_compiling():
        return tuple(None if t is None else _meta(t) for t in leaves)
    # Eagerly, once per leaf where the memo cannot be used: one expression.
    strided = torch.strided
    return tuple(
        None
        if t is None
        else (t.shape, t.stride(), t.dtype, t.device, strided, 0, t.requires_grad)
        if type(t) is torch.Tensor and t.layout is strided
        else _meta(t)
        for t in leaves
    )


def of(structure: Any, leaves: Sequence[Any]) -> Metas:
    """``read(leaves)``, taken eagerly from the memo of ``structure`` (hashable; its trees
    have ``len(leaves)`` leaves) where the leaves pass the check of a set seen before."""
    if torch.compiler.is_compiling():
        return read(leaves)
    return _seen(structure).metas(leaves)


class _Seen:
    """The metadata of one structure's last sets of plain leaves, each with its check
    (thread-safe: calls of several threads may share a structure)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[tuple[TensorGuards, Metas]] = []  # most recent first

    def metas(self, leaves: Sequence[Any]) -> Metas:
        for check, metas in self._kept:
            if check.check(*leaves):
                return metas
        metas = read(leaves)
        if all(type(t) in _PLAIN and t.layout is torch.strided for t in leaves):
            check = _check_of(leaves, metas)
            with self._lock:
                self._kept = [(check, metas), *self._kept[: KEPT_PER_STRUCTURE - 1]]
        return metas


def _check_of(leaves: Sequence[torch.Tensor], metas: Metas) -> TensorGuards:
    """The C++ check that tensors have the metadata ``metas`` of ``leaves``: every size and
    stride given (none dynamic), as dynamo's own guards gave them; without them the
    constructor reads a missing list. (Its stub lists neither the tensors nor these types.)"""
    sizes: list[Any] = [list(m[0]) for m in metas if m is not None]
    strides: list[Any] = [list(m[1]) for m in metas if m is not None]
    return TensorGuards(*leaves, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _seen(structure: Any) -> _Seen:
    return _Seen()


def _meta(t: torch.Tensor | SparseLike) -> Meta:
    if isinstance(t, SparseLike):
        return (t.shape, (), t.dtype, t.device, torch.sparse_coo, t.sparse_dim, False)
    if t.layout == torch.strided:
        shape, stride = _static(t.shape), _static(t.stride())
        return (shape, stride, t.dtype, t.device, torch.strided, 0, t.requires_grad)
    sparse_dim = t.sparse_dim() if t.layout == torch.sparse_coo else 0
    return (_static(t.shape), (), t.dtype, t.device, t.layout, sparse_dim, t.requires_grad)


def _static(sizes: Sequence[int]) -> tuple[int, ...]:
    """Sizes as Python ints: a plan needs static shapes (every rank must send the same bytes).

    Under ``torch.compile`` a size that changed between calls reaches dynamo
    symbolic (automatic dynamic shapes); ``operator.index`` specializes it, with a
    guard, so that each shape compiles with a plan of its own (as ``dynamic=False``
    compiles), which the ranks then compare. Eagerly the sizes are ints already.
    """
    if not torch.compiler.is_compiling():
        return tuple(sizes)
    return tuple(operator.index(d) for d in sizes)

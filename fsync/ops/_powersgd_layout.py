"""Which elements of a bucket PowerSGD compresses, and as which matrices.

A layout is a static function of the plan and the settings (the rank and the
minimum compression rate): [fsync.ops.powersgd][] reads each leaf as a matrix and
compresses those that are worth it, [fsync.ops.batched_powersgd][] reads the whole
bucket, zero-padded, as one square matrix. Either way a ``Layout`` says where each
of the bucket's segments goes (among the compressed elements or the rest) and how
the compressed elements split into batches of equal matrices.

Owns: the layout and its two constructions. May import: ``_plan`` (layer 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from fsync._plan import BucketPlan, BucketSpec


class Segment(NamedTuple):
    """One leaf's elements in the bucket, and where they go: the compressed or the rest."""

    offset: int
    numel: int
    compressed: bool
    position: int
    """Offset among the compressed elements (see ``Layout``) or among the rest."""


class Group(NamedTuple):
    """``batch`` matrices of ``rows`` x ``cols``, compressed at ``rank``, one after another."""

    batch: int
    rows: int
    cols: int
    rank: int


class Layout(NamedTuple):
    """How one bucket is compressed: a static function of the plan and the settings.

    The compressed elements are the compressed segments gathered by matrix
    shape (as DDP batches them), then ``padding`` zeros: each group is one
    contiguous block, read as a batch of matrices and multiplied in one call.
    P, Q and the error feedback follow the same order. The other segments are
    averaged as they are.
    """

    segments: tuple[Segment, ...]
    groups: tuple[Group, ...]
    padding: int = 0

    @property
    def compressed_numel(self) -> int:
        return sum(g.batch * g.rows * g.cols for g in self.groups)

    @property
    def p_numel(self) -> int:
        return sum(g.batch * g.rows * g.rank for g in self.groups)

    @property
    def q_numel(self) -> int:
        return sum(g.batch * g.cols * g.rank for g in self.groups)

    def split(self, bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's compressed elements (in compression order) and the rest."""
        compressed = sorted((s for s in self.segments if s.compressed), key=lambda s: s.position)
        rest = [bucket[s.offset : s.offset + s.numel] for s in self.segments if not s.compressed]
        x = torch.cat(
            [bucket[s.offset : s.offset + s.numel] for s in compressed]
            + [bucket.new_zeros(self.padding)]
        )
        return x, torch.cat(rest) if rest else bucket.new_zeros(0)

    def join(self, compressed: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """Inverse of ``split``: the bucket from its two parts."""
        return torch.cat(
            [
                (compressed if s.compressed else rest)[s.position : s.position + s.numel]
                for s in self.segments
            ]
        )


LayoutFn = Callable[[BucketPlan, BucketSpec, int, float], Layout]
"""A layout's construction: ``(plan, bucket, rank, min_compression_rate) -> Layout``."""


def _worth_compressing(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """DDP's test: (rows + cols) * rank * min_compression_rate < rows * cols."""
    return rows * cols > 0 and (rows + cols) * rank * min_compression_rate < rows * cols


def per_leaf_layout(
    plan: BucketPlan, spec: BucketSpec, rank: int, min_compression_rate: float
) -> Layout:
    """Each leaf of the bucket as a matrix, compressed where that saves enough."""
    shapes: dict[tuple[int, int, int], list[int]] = {}  # first-seen order, as DDP's
    compressed: list[bool] = []
    for k, (i, numel) in enumerate(zip(spec.leaves, spec.sizes, strict=True)):
        leaf = plan.leaves[i]
        assert leaf is not None
        # A leaf's elements sit in its memory order, so its matrix is its outermost
        # dimension in memory by the rest: DDP's view(shape[0], -1) for a contiguous
        # leaf, out-channels by the rest for a channels_last convolution too.
        rows = leaf.shape[leaf.perm[0]] if leaf.shape else 1
        cols = numel // rows if rows else 0
        r = min(rows, cols, rank)
        compressed.append(_worth_compressing(rows, cols, r, min_compression_rate))
        if compressed[-1]:
            shapes.setdefault((rows, cols, r), []).append(k)
    position = {}
    start = 0
    for (rows, cols, _), members in shapes.items():
        for k in members:
            position[k] = start
            start += rows * cols
    segments, rest = [], 0
    for k, (offset, numel) in enumerate(zip(spec.offsets, spec.sizes, strict=True)):
        if compressed[k]:
            segments.append(Segment(offset, numel, True, position[k]))
        else:
            segments.append(Segment(offset, numel, False, rest))
            rest += numel
    groups = tuple(Group(len(members), *shape) for shape, members in shapes.items())
    return Layout(tuple(segments), groups)


def batched_layout(
    plan: BucketPlan, spec: BucketSpec, rank: int, min_compression_rate: float
) -> Layout:
    """The whole bucket, zero-padded to a square, as one matrix, if that saves enough."""
    side = math.isqrt(spec.numel - 1) + 1 if spec.numel else 0  # ceil(sqrt(numel))
    r = min(side, rank)
    if spec.numel == 0 or not 2 * side * r * min_compression_rate < spec.numel:
        return Layout((Segment(0, spec.numel, False, 0),), ())
    return Layout(
        (Segment(0, spec.numel, True, 0),), (Group(1, side, side, r),), side * side - spec.numel
    )

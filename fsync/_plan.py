"""The bucket plan: which leaves travel together, in which order, at which offsets.

A plan is a pure value computed from leaf metadata (shape, dtype, device,
memory layout, sparsity) and two size limits. It never looks at tensor values
and never talks to a process group, so every rank that holds the same tree
computes the same plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import optree
import torch

from fsync import _tree

MiB = 1024 * 1024

# Plans, and what is derived from one, kept per process: a training loop syncs one or a
# few trees.
PLAN_CACHE_SIZE = 64

Order = Literal["reverse", "forward"] | Sequence[int]


class LeafSpec(NamedTuple):
    """Metadata of one leaf: everything the plan needs, nothing about values.

    Buckets store each leaf in its memory order (``perm``), so a leaf comes back
    from [fsync.unpack][] with the layout it went in with, as DDP's bucket
    views keep the parameter's strides.

    Attributes:
        path: The leaf's path in the tree, as error messages and ``print(plan)``
            show it (``"layer.0.weight"``).
        shape: The leaf's shape.
        dtype: The leaf's dtype.
        device: The leaf's device.
        perm: The leaf's memory layout as a dimension order, outermost first:
            ``tensor.permute(perm)`` is contiguous. ``(0, 1, 2, 3)`` is a
            contiguous NCHW tensor, ``(0, 2, 3, 1)`` a channels_last one; empty
            for a sparse leaf.
        sparse_dim: 0 for a dense leaf, the number of sparse dimensions of a
            sparse COO leaf.
    """

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    perm: tuple[int, ...]
    sparse_dim: int = 0

    @property
    def sparse(self) -> bool:
        """Whether the leaf is a sparse COO tensor (it then has a bucket of its own)."""
        return self.sparse_dim > 0

    @property
    def numel(self) -> int:
        """Number of elements of the leaf's shape (dense size, for a sparse leaf too)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the leaf in its own dtype: ``numel`` times the dtype's item size."""
        return self.numel * self.dtype.itemsize

    @property
    def layout(self) -> str:
        """The memory layout in words: ``contiguous``, ``channels_last`` ..."""
        if self.sparse:
            return f"sparse ({self.sparse_dim} sparse dims)"
        order = tuple(d for d in self.perm if self.shape[d] != 1)
        if order == tuple(sorted(order)):
            return "contiguous"
        if len(self.shape) == 4 and order == tuple(d for d in (0, 2, 3, 1) if self.shape[d] != 1):
            return "channels_last"
        if len(self.shape) == 5 and order == tuple(
            d for d in (0, 2, 3, 4, 1) if self.shape[d] != 1
        ):
            return "channels_last_3d"
        return f"dim order {self.perm}"

    def describe(self) -> str:
        """``shape (4, 3), dtype torch.float32, contiguous`` (device index left out)."""
        return (
            f"shape {tuple(self.shape)}, dtype {self.dtype}, device {self.device.type}, "
            f"{self.layout}"
        )


class LeafLayout(NamedTuple):
    """How one leaf goes into its bucket and back: the few operations it needs.

    Precomputed with the plan, so that packing and unpacking (and tracing them
    under ``torch.compile``) do no per-leaf decisions.
    """

    perm: tuple[int, ...] | None
    """Dimension order to permute to before flattening; ``None`` if already in order."""
    view: tuple[int, ...] | None
    """Shape to view the leaf's slice as (in memory order); ``None`` for a 1-D leaf."""
    inverse: tuple[int, ...] | None
    """Permutation back to the leaf's dimension order after the view; ``None`` if none."""
    dtype: torch.dtype | None
    """The leaf's dtype where it differs from the bucket's, else ``None``."""


class BucketSpec(NamedTuple):
    """Metadata of one bucket, in the order its leaves sit in the flat buffer."""

    leaves: tuple[int, ...]
    """Leaf indices (positions in the flattened tree), in buffer order."""
    offsets: tuple[int, ...]
    """Element offset of each leaf in the buffer."""
    sizes: tuple[int, ...]
    """Number of elements of each leaf."""
    numel: int
    """Number of elements of the buffer: the sum of ``sizes``."""
    dtype: torch.dtype
    """The buffer's dtype: the leaves' own, or the plan's ``reduce_dtype`` if floating."""
    device: torch.device
    """The device of the buffer and of all its leaves."""
    sparse: bool
    """Whether the bucket holds one sparse COO leaf (such a bucket never reaches a hook)."""
    layouts: tuple[LeafLayout, ...] = ()
    """How each leaf goes in and out of the buffer (empty for a sparse bucket)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer: ``numel`` times the item size of ``dtype``."""
        return self.numel * self.dtype.itemsize


class TensorMeta(NamedTuple):
    """What fsync reads of a tensor: hashable, and constant under ``torch.compile``."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    layout: torch.layout
    sparse_dim: int
    requires_grad: bool


def leaf_spec(path: str, meta: TensorMeta, /) -> LeafSpec:
    """The [LeafSpec][fsync.LeafSpec] of a tensor with metadata ``meta`` found at ``path``."""
    if meta.layout == torch.sparse_coo:
        if meta.sparse_dim == 0:
            raise TypeError(
                f"leaf {path!r} is a sparse tensor without sparse dimensions; use .to_dense()."
            )
        return LeafSpec(path, meta.shape, meta.dtype, meta.device, (), meta.sparse_dim)
    if meta.layout != torch.strided:
        raise TypeError(
            f"leaf {path!r} has layout {meta.layout}; fsync handles dense (strided) and "
            "sparse COO tensors. Convert it with .to_dense() or .to_sparse()."
        )
    strides = meta.stride
    # Outermost dimension first; ties (size-1 or broadcast dimensions) keep their
    # order, which leaves the element order unchanged.
    perm = tuple(sorted(range(len(meta.shape)), key=lambda d: (-strides[d], d)))
    return LeafSpec(path, meta.shape, meta.dtype, meta.device, perm)


def assign(
    keys: Sequence[Any], nbytes: Sequence[int], sparse: Sequence[bool], limits: Sequence[int]
) -> list[tuple[int, ...]]:
    """DDP's greedy assignment over items given as (key, bytes, sparse) columns.

    Items accumulate per key (dtype, device); a bucket closes as soon as its
    bytes reach the key's current limit, and each key then moves on to the next
    limit, staying on the last one. Sparse items get a bucket each. Buckets are
    returned sorted by their smallest index.
    """
    closed: list[tuple[int, ...]] = []
    open_buckets: dict[Any, list[int]] = {}
    open_bytes: dict[Any, int] = {}
    limit_index: dict[Any, int] = {}
    for i, key in enumerate(keys):
        if sparse[i]:
            closed.append((i,))
            continue
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + nbytes[i]
        position = limit_index.setdefault(key, 0)
        if open_bytes[key] >= limits[position]:
            closed.append(tuple(open_buckets.pop(key)))
            open_bytes[key] = 0
            limit_index[key] = min(position + 1, len(limits) - 1)
    closed.extend(tuple(indices) for indices in open_buckets.values())
    # Indices within a bucket increase, so its first one is its smallest.
    return sorted(closed, key=lambda bucket: bucket[0])


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 bucket"``, ``"3 buckets"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Which leaves of a tree go into which flat bucket, in communication order.

    Build one with [plan_buckets][fsync.plan_buckets]. A plan is a frozen value: hashable,
    comparable, and the same on every rank that holds the same tree (the device
    index aside, which ``fingerprint`` ignores). ``print(plan)`` shows a table.

    Attributes:
        treespec: The structure of the tree, ``None`` leaves included.
        leaves: One [LeafSpec][fsync.LeafSpec] per leaf in flatten order, ``None`` for a
            ``None`` leaf (which belongs to no bucket).
        buckets: Per bucket, in communication order, the indices of its leaves
            in the order they sit in the buffer.
        reduce_dtype: If set, the dtype of every floating point bucket (the
            leaves are cast to it in [fsync.pack][] and back in
            [fsync.unpack][]); ``None`` keeps each leaf's own dtype.
    """

    treespec: optree.PyTreeSpec
    leaves: tuple[LeafSpec | None, ...]
    buckets: tuple[tuple[int, ...], ...]
    reduce_dtype: torch.dtype | None = None
    specs: tuple[BucketSpec, ...] = dataclasses.field(init=False, repr=False, compare=False)
    """One [fsync.BucketSpec][] per bucket, in communication order (derived, not compared)."""
    fingerprint: int = dataclasses.field(init=False, repr=False, compare=False)
    """A 63-bit digest of the plan, equal on ranks whose plans can talk to each other.

    It covers the tree structure, every leaf's path, shape, dtype, device type
    and layout, the bucket assignment and the reduce dtype; it leaves out the
    device index, so ``cuda:0`` on one rank and ``cuda:1`` on another agree."""
    description: str = dataclasses.field(init=False, repr=False, compare=False)
    """The plan in words (JSON: structure, each leaf's path and metadata, buckets), which
    ranks exchange to name what differs when their fingerprints do not agree."""
    skeleton: Any = dataclasses.field(init=False, repr=False, compare=False)
    """The tree with each leaf replaced by its index; see ``structure``."""

    def __post_init__(self) -> None:
        if self.treespec.num_leaves != len(self.leaves):
            raise ValueError(
                f"the tree has {self.treespec.num_leaves} leaves but {len(self.leaves)} leaf specs "
                "were given."
            )
        seen: set[int] = set()
        specs = []
        for b, indices in enumerate(self.buckets):
            if not indices:
                raise ValueError(f"bucket {b} is empty.")
            for i in indices:
                if not 0 <= i < len(self.leaves) or self.leaves[i] is None:
                    raise ValueError(f"bucket {b} names leaf {i}, which is not a tensor leaf.")
                if i in seen:
                    raise ValueError(f"leaf {i} is in more than one bucket.")
                seen.add(i)
            specs.append(self._bucket_spec(b, indices))
        missing = [i for i, leaf in enumerate(self.leaves) if leaf is not None and i not in seen]
        if missing:
            raise ValueError(f"leaves {missing} are in no bucket.")
        object.__setattr__(self, "specs", tuple(specs))
        object.__setattr__(self, "fingerprint", _fingerprint(self))
        object.__setattr__(self, "description", _description(self))
        object.__setattr__(
            self, "skeleton", _tree.unflatten(self.treespec, range(len(self.leaves)))
        )

    def __hash__(self) -> int:
        # The digest of what equality compares (the device index aside): hashing the
        # leaves again at every cache lookup would cost microseconds per leaf and call.
        return self.fingerprint

    def structure(self) -> optree.PyTreeSpec:
        """The tree structure, in a form the running code can use.

        Inside ``torch.compile``, dynamo replaces optree's C++ ``PyTreeSpec``
        with a Python one and cannot use a C++ spec made outside the trace; the
        structure is then rebuilt from ``skeleton``, a constant it can flatten.
        """
        if torch.compiler.is_compiling():
            return _tree.structure(self.skeleton)
        return self.treespec

    def _bucket_spec(self, b: int, indices: tuple[int, ...]) -> BucketSpec:
        leaves = [self.leaves[i] for i in indices]
        first = leaves[0]
        assert first is not None
        dtype = buffer_dtype(first, self.reduce_dtype)
        for leaf in leaves:
            assert leaf is not None
            if (buffer_dtype(leaf, self.reduce_dtype), leaf.device) != (dtype, first.device):
                raise ValueError(
                    f"bucket {b} mixes {first.dtype} on {first.device} ({first.path!r}) with "
                    f"{leaf.dtype} on {leaf.device} ({leaf.path!r}); a bucket holds one dtype "
                    "on one device."
                )
        if first.sparse and len(indices) > 1:
            raise ValueError(f"bucket {b} holds a sparse leaf with others; sparse leaves go alone.")
        sizes = tuple(leaf.numel for leaf in leaves)  # type: ignore[union-attr]
        offsets = tuple(itertools.accumulate(sizes, initial=0))[:-1]
        layouts = () if first.sparse else tuple(_layout(leaf, dtype) for leaf in leaves)  # type: ignore[arg-type]
        return BucketSpec(
            indices, offsets, sizes, sum(sizes), dtype, first.device, first.sparse, layouts
        )

    @property
    def nbytes(self) -> tuple[int, ...]:
        """Bytes per bucket, in communication order."""
        return tuple(spec.nbytes for spec in self.specs)

    @property
    def num_leaves(self) -> int:
        """Number of leaves of the tree, ``None`` leaves included."""
        return len(self.leaves)

    def __repr__(self) -> str:
        leaves, buckets = (
            count(len(self.leaves), "leaf", "leaves"),
            count(len(self.buckets), "bucket"),
        )
        return (
            f"BucketPlan({leaves}, {buckets}, {sum(self.nbytes) / MiB:.2f} MiB, "
            f"fingerprint={self.fingerprint:#018x})"
        )

    def __str__(self) -> str:
        return plan_table(self)


def _fingerprint(plan: BucketPlan) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr(plan.treespec).encode())
    for leaf in plan.leaves:
        digest.update(b"\0" + (b"-" if leaf is None else leaf_key(leaf).encode()))
    digest.update(repr(plan.buckets).encode())
    digest.update(str(plan.reduce_dtype).encode())
    return int.from_bytes(digest.digest(), "big") >> 1


def _description(plan: BucketPlan) -> str:
    paths = [_tree.path_str(p) for p in plan.treespec.paths()]
    leaves = [
        [path, "None" if leaf is None else leaf.describe()]
        for path, leaf in zip(paths, plan.leaves, strict=True)
    ]
    return json.dumps(
        {
            "structure": repr(plan.treespec),
            "leaves": leaves,
            "buckets": [list(b) for b in plan.buckets],
            "reduce_dtype": str(plan.reduce_dtype),
        }
    )


def _layout(leaf: LeafSpec, dtype: torch.dtype) -> LeafLayout:
    identity = leaf.perm == tuple(range(len(leaf.perm)))
    inverse = [0] * len(leaf.perm)
    for position, dim in enumerate(leaf.perm):
        inverse[dim] = position
    return LeafLayout(
        perm=None if identity else leaf.perm,
        view=None if len(leaf.shape) == 1 else tuple(leaf.shape[d] for d in leaf.perm),
        inverse=None if identity else tuple(inverse),
        dtype=None if leaf.dtype == dtype else leaf.dtype,
    )


def buffer_dtype(leaf: LeafSpec, reduce_dtype: torch.dtype | None, /) -> torch.dtype:
    """The dtype ``leaf`` travels in: ``reduce_dtype`` for dense floating leaves if set."""
    if reduce_dtype is not None and leaf.dtype.is_floating_point and not leaf.sparse:
        return reduce_dtype
    return leaf.dtype


def leaf_key(leaf: LeafSpec, /) -> str:
    """What must agree about a leaf across ranks for their buckets to line up."""
    order = tuple(d for d in leaf.perm if leaf.shape[d] != 1)
    return f"{leaf.path}|{leaf.shape}|{leaf.dtype}|{leaf.device.type}|{order}|{leaf.sparse_dim}"


def size_limits(bucket_cap_mb: float, first_bucket_mb: float) -> list[int]:
    """DDP's limits in bytes: the first bucket's, then every other's."""
    return [int(first_bucket_mb * MiB), int(bucket_cap_mb * MiB)]


def in_leaf_indices(
    assigned: Sequence[Sequence[int]], sequence: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """Buckets of positions in the assignment order, as buckets of leaf indices."""
    return tuple(tuple(sequence[k] for k in bucket) for bucket in assigned)


def plan_table(plan: BucketPlan, /) -> str:
    """The table ``print(plan)`` shows: one row per bucket."""
    rows = [("bucket", "leaves", "dtype", "device", "MiB", "first leaf .. last leaf")]
    for b, spec in enumerate(plan.specs):
        first, last = plan.leaves[spec.leaves[0]], plan.leaves[spec.leaves[-1]]
        assert first is not None and last is not None
        span = first.path if first is last else f"{first.path} .. {last.path}"
        kind = " (sparse)" if spec.sparse else ""
        rows.append(
            (
                str(b),
                str(len(spec.leaves)),
                str(spec.dtype).removeprefix("torch.") + kind,
                str(spec.device),
                f"{spec.nbytes / MiB:.3f}",
                span,
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    right = {0, 1, 4}
    reduced = "" if plan.reduce_dtype is None else f", reduced in {plan.reduce_dtype}"
    leaves = count(sum(len(b) for b in plan.buckets), "tensor leaf", "tensor leaves")
    lines = [
        f"BucketPlan: {leaves} in {count(len(plan.buckets), 'bucket')}, "
        f"{sum(plan.nbytes) / MiB:.3f} MiB{reduced}"
    ]
    for row in rows:
        cells = [
            cell.rjust(widths[c]) if c in right else cell.ljust(widths[c])
            for c, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)

"""The sync options as one frozen, validated value.

Every option a sync takes is a field of [fsync.SyncOptions][]: checked once, in
``__post_init__``, where it is given, and hashable, so that the plan cache and
the fingerprint the ranks compare can be keyed on it.

Owns: the options and their validation. May import: ``_checks``, ``_planner``
and ``_hook`` (layers 3 to 5); never ``fsync.ops`` (the default hook is
resolved by the reduce).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, TypedDict

import torch

from fsync import _checks
from fsync._hook import Hook, check_hook
from fsync._plan import Order
from fsync._planner import PlanOptions

DivideBy = Literal["world", "active"]

# The bucket size limit when none is given: DDP's, and a smaller one on a 2-D mesh, where a
# bucket crosses nodes while the next is reduce-scattered inside the node (the sizes measured
# against each other: docs/hierarchical.md).
DDP_BUCKET_CAP_MB = 25.0
MESH_BUCKET_CAP_MB = 4.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """Everything a sync is told besides the tree, its state and the group.

    Build one from keywords; every field is validated on construction, with an
    error that says how to fix it.

    Attributes:
        hook: The [fsync.Hook][] the buckets go through; ``None`` for
            ``fsync.ops.allreduce("mean")``.
        bucket_cap_mb: Size limit of every bucket after the first, in MiB:
            DDP's 25 by default; an entry point given a 2-D mesh and no size
            uses 4, so that the hierarchical stages of consecutive buckets
            overlap (see the hierarchical mean's page).
        first_bucket_mb: Size limit of the first bucket, in MiB.
        reduce_dtype: Reduce floating point gradients in this dtype and return
            them in their own; ``None`` reduces each in its own dtype.
        order: The order leaves are assigned to buckets in: ``"reverse"``
            (DDP's, after its first iteration), ``"forward"`` or a sequence of
            tensor-leaf indices.
        buckets: An explicit bucket layout, per bucket the indices of its
            leaves in buffer order (as [fsync.BucketPlan][]'s ``buckets``),
            used instead of DDP's assignment by size; ``None`` (default)
            assigns by size. DDP's ``bucket_cap_mb_list``, and more.
        find_unused: A leaf some ranks have no gradient for is averaged with
            zeros from them; one no rank has comes back ``None`` (DDP's
            ``find_unused_parameters=True``). Costs one small collective a step.
        divide_by: ``"world"`` divides the sum by the world size; ``"active"``
            by the number of ranks that contribute this step.

    Example:
        >>> import fsync
        >>> options = fsync.SyncOptions(bucket_cap_mb=4.0, divide_by="active")
        >>> options.plan.bucket_cap_mb, options.find_unused
        (4.0, False)
    """

    hook: Hook | None = None
    bucket_cap_mb: float = DDP_BUCKET_CAP_MB
    first_bucket_mb: float = 1.0
    reduce_dtype: torch.dtype | None = None
    order: Order = "reverse"
    buckets: Sequence[Sequence[int]] | None = None
    find_unused: bool = False
    divide_by: DivideBy = "world"

    def __post_init__(self) -> None:
        if self.hook is not None:
            check_hook(self.hook)
        if not isinstance(self.order, str):
            object.__setattr__(self, "order", tuple(self.order))
        if self.buckets is not None:
            object.__setattr__(self, "buckets", tuple(tuple(b) for b in self.buckets))
        self.plan.check()
        _checks.check_flag("find_unused", self.find_unused)
        _checks.check_divide_by(self.divide_by)

    @classmethod
    def of(cls, options: OptionKeywords, /, *, where: str, mesh: bool = False) -> SyncOptions:
        """The options given as keywords to ``where``, validated (a clear error for a typo);
        on a 2-D ``mesh`` with no ``bucket_cap_mb`` given, ``MESH_BUCKET_CAP_MB``."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"{where} got unknown options {unknown}; the options are the fields of "
                f"fsync.SyncOptions: {list(OPTION_NAMES)}."
            )
        if mesh and "bucket_cap_mb" not in options:
            options = {**options, "bucket_cap_mb": MESH_BUCKET_CAP_MB}
        return cls(**options)

    @property
    def plan(self) -> PlanOptions:
        """The options the bucket plan depends on."""
        order = self.order if isinstance(self.order, str) else tuple(self.order)
        buckets = None if self.buckets is None else tuple(tuple(b) for b in self.buckets)
        return PlanOptions(
            self.bucket_cap_mb, self.first_bucket_mb, self.reduce_dtype, order, buckets
        )


class OptionKeywords(TypedDict, total=False):
    """The fields of [fsync.SyncOptions][], as keywords the entry points take (``**options``)."""

    hook: Hook | None
    bucket_cap_mb: float
    first_bucket_mb: float
    reduce_dtype: torch.dtype | None
    order: Order
    buckets: Sequence[Sequence[int]] | None
    find_unused: bool
    divide_by: DivideBy


# The option names, in field order (a tuple: read, never changed, under torch.compile too).
OPTION_NAMES = tuple(field.name for field in dataclasses.fields(SyncOptions))

"""Checks the hooks share."""

from __future__ import annotations

from collections.abc import Sequence

from fsync._plan import BucketPlan, BucketSpec

NOT_FLOATING = (
    "{name} got bucket {index} of dtype {dtype} (first leaf {path!r}); it works on floating "
    "point buckets only. Keep integer and complex tensors out of the tree you sync."
)


def check_floating(name: str, plan: BucketPlan, specs: Sequence[BucketSpec]) -> None:
    """Raises ``TypeError`` naming the first bucket of ``specs`` that is not floating point."""
    for b, spec in enumerate(specs):
        if not spec.dtype.is_floating_point:
            leaf = plan.leaves[spec.leaves[0]]
            path = leaf.path if leaf is not None else "?"
            raise TypeError(NOT_FLOATING.format(name=name, index=b, dtype=spec.dtype, path=path))

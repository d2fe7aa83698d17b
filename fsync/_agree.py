"""Agreement between ranks: the small collectives a sync issues before any bucket collective.

``verify_plan`` compares a 64-bit fingerprint of the
plan across ranks and, only when they differ, gathers descriptions to name the
first difference; ``control`` is the per-step control
all-reduce of ``find_unused`` and ``divide_by="active"``.

Owns: what ranks compare and the words for how they differ. May import:
``_comm``, ``_tree``, ``_plan``, ``_checks`` (layers 1 to 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fsync import _checks, _comm, _tree
from fsync._plan import BucketPlan

_FIX = (
    "Every rank must pass the same tree (same structure, shapes, dtypes and layouts) with the "
    "same bucket options. Build the plan from the parameter tree (GradSync.init(params)) so "
    "that gradients unused on some ranks are still covered."
)


def describe(plan: BucketPlan) -> dict[str, Any]:
    """A picklable, device-index-free description of ``plan`` for error messages."""
    paths = [_tree.path_str(p) for p in plan.treespec.paths()]
    leaves = [
        (path, "None" if leaf is None else leaf.describe())
        for path, leaf in zip(paths, plan.leaves, strict=True)
    ]
    return {"structure": repr(plan.treespec), "leaves": leaves, "buckets": plan.buckets}


def first_difference(descriptions: list[dict[str, Any]], what: str) -> str:
    """Words for the first way in which a rank's description differs from rank 0's."""
    ref = descriptions[0]
    for rank, other in enumerate(descriptions[1:], start=1):
        for (path0, desc0), (path1, desc1) in zip(ref["leaves"], other["leaves"], strict=False):
            if path0 != path1:
                return (
                    f"{what} differ across ranks: the leaf at this position is {path0!r} on "
                    f"rank 0 but {path1!r} on rank {rank}."
                )
            if desc0 != desc1:
                return (
                    f"{what} differ across ranks: leaf {path0!r} has {desc0} on rank 0 but "
                    f"{desc1} on rank {rank}."
                )
        n0, n1 = len(ref["leaves"]), len(other["leaves"])
        if n0 != n1:
            longer, extra = (0, ref) if n0 > n1 else (rank, other)
            return (
                f"{what} differ across ranks: rank 0 has {n0} leaves and rank {rank} has {n1}; "
                f"the first extra one is {extra['leaves'][min(n0, n1)][0]!r} on rank {longer}."
            )
        if ref["structure"] != other["structure"]:
            return (
                f"{what} differ across ranks: the tree structure is {ref['structure']} on rank 0 "
                f"but {other['structure']} on rank {rank}."
            )
        if ref["buckets"] != other["buckets"]:
            return (
                f"{what} differ across ranks: the bucket plans differ (bucket_cap_mb, "
                f"first_bucket_mb or order) between rank 0 and rank {rank}."
            )
    return f"{what} differ across ranks in a way the descriptions do not show."


def verify_plan(plan: BucketPlan, group: _comm.Group, what: str = "grads") -> None:
    """Raises the same ``ValueError`` on every rank unless all ranks hold the same plan.

    One all-gather of a 64-bit fingerprint; only on a mismatch do the ranks
    exchange descriptions to say what differs.
    """
    if _comm.size(group) == 1:
        return
    device = _comm.default_device(group)
    mine = torch.tensor([plan.fingerprint], dtype=torch.int64, device=device)
    fingerprints = _comm.wait(_comm.all_gather(mine, group)).tolist()
    if len(set(fingerprints)) == 1:
        return
    descriptions = _comm.all_gather_object(describe(plan), group, device)
    raise ValueError(f"{first_difference(descriptions, what)} {_FIX}")


def control_flags(
    leaves: Sequence[Any], plan: BucketPlan, *, active: bool, find_unused: bool
) -> list[int]:
    """What a rank puts into the control all-reduce (see ``control``).

    One flag per tensor leaf of the plan when ``find_unused`` (1 if this rank
    has a gradient for it), then one for ``active``. ``sync_stats`` counts the
    same list.
    """
    flags = []
    if find_unused:
        flags = [
            int(active and leaves[i] is not None)
            for i, spec in enumerate(plan.leaves)
            if spec is not None
        ]
    return [*flags, int(active)]


def control(
    leaves: Sequence[Any],
    plan: BucketPlan,
    group: _comm.Group,
    *,
    active: bool,
    divide_by: str,
    find_unused: bool,
) -> tuple[list[bool] | None, int | torch.Tensor]:
    """The one small collective for unused leaves and contributing ranks, if needed.

    Returns which leaves some rank used (``None`` unless ``find_unused``) and the
    divisor of a mean: the world size, or the number of active ranks as a 0-d
    tensor (at least 1, so a step where nobody contributes yields zeros).
    """
    world_size = _comm.size(group)
    if not find_unused and divide_by == "world":
        return None, world_size
    if find_unused and torch.compiler.is_compiling():
        raise ValueError(_checks.FIND_UNUSED_UNDER_COMPILE)
    tensor_leaves = [i for i, spec in enumerate(plan.leaves) if spec is not None]
    flags = control_flags(leaves, plan, active=active, find_unused=find_unused)
    device = plan.specs[0].device if plan.specs else _comm.default_device(group)
    counts = _comm.wait(
        _comm.all_reduce(torch.tensor(flags, dtype=torch.int32, device=device), "sum", group)
    )
    divisor: int | torch.Tensor = world_size
    if divide_by == "active":
        divisor = counts[-1].clamp(min=1)
    used = None
    if find_unused:
        used_leaves = set()
        for i, n in zip(tensor_leaves, counts[:-1].tolist(), strict=True):
            if n:
                used_leaves.add(i)
        used = [i in used_leaves for i in range(len(plan.leaves))]
    return used, divisor

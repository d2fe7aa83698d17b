"""Cross-rank agreement checks: one small collective before any bucket collective."""

from __future__ import annotations

from typing import Any

import torch

from fsync import _comm, _tree
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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as integers of its size, so that equality is bitwise (NaN == NaN)."""
    if x.dtype.is_complex:
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        return x.to(torch.uint8)
    return x.view(_INT_OF_SIZE[x.dtype.itemsize])


def verify(tree: Any, /, *, group: _comm.Group = None, values: bool = False) -> None:
    """Checks that every rank holds the same tree; raises the same ``ValueError`` on all.

    The structure, every leaf's shape, dtype and memory layout are compared
    with one small collective (what DDP's ``verify_params_across_processes``
    checks); with ``values=True`` rank 0's values are broadcast and compared
    bit for bit as well (NaN equals NaN). The error names the first leaf that
    differs, the ranks and both ranks' values.

    Args:
        tree: A pytree of tensors, such as the parameters.
        group: ``None`` for the default group, a ``ProcessGroup``, a 1-D
            ``DeviceMesh`` or ``(DeviceMesh, dim)``.
        values: Also compare the values (one broadcast of the whole tree).

    Raises:
        ValueError: The trees differ across ranks.
        TypeError: A leaf is not a tensor.

    Example:
        >>> import torch, fsync
        >>> fsync.verify({"w": torch.ones(2)}, values=True)
    """
    from fsync._broadcast import broadcast_leaves
    from fsync._plan import value_plan

    _comm.check_group(group)
    leaves, plan = value_plan(tree, "verify")
    verify_plan(plan, group, what="trees passed to fsync.verify")
    if not values or _comm.size(group) == 1:
        return
    reference = broadcast_leaves(leaves, plan, 0, group)
    differs = [
        leaf is not None and not torch.equal(_bits(leaf.detach()), _bits(ref))
        for leaf, ref in zip(leaves, reference, strict=True)
    ]
    device = _comm.default_device(group)
    flags = _comm.wait(_comm.all_gather(torch.tensor(differs, device=device), group))
    flags = flags.view(_comm.size(group), -1).cpu()
    if not bool(flags.any()):
        return
    leaf_index = int(flags.any(0).nonzero()[0])
    first_rank = int(flags[:, leaf_index].nonzero()[0])
    detail = None
    if _comm.rank(group) == first_rank:
        mine, ref = leaves[leaf_index].detach(), reference[leaf_index]
        where = (_bits(mine) != _bits(ref)).nonzero()[0].tolist()
        detail = (tuple(where), ref[tuple(where)].item(), mine[tuple(where)].item())
    details = _comm.all_gather_object(detail, group, device)
    where, ref_value, value = details[first_rank]
    path = _tree.path_str(plan.treespec.paths()[leaf_index])
    raise ValueError(
        f"values differ across ranks: leaf {path!r} at index {where} is {ref_value!r} on rank 0 "
        f"but {value!r} on rank {first_rank}. Start every rank from the same values with "
        "fsync.broadcast(params) (DDP's constructor does this for you)."
    )

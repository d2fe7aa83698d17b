"""[fsync.verify][]: every rank holds the same tree, and with ``values=True`` the same values.

Owns: the public check of a tree's metadata and values across ranks. May
import: every layer below (1 to 6) and ``_broadcast`` (for rank 0's values).
"""

from __future__ import annotations

from typing import Any

import torch

from fsync import _comm, _tree
from fsync._agree import planned, verify_plan
from fsync._broadcast import broadcast_leaves
from fsync._planner import value_plan

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
    _comm.check_group(group)
    leaves, plan, _ = planned(lambda: value_plan(tree, "verify"), group)
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

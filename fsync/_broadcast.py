"""Sending rank ``src``'s tensors to everyone: start-up state and buffers.

Owns: [fsync.broadcast][] and [fsync.sync_buffers][]. May import: every layer
below (1 to 6) and [fsync.sync_grads][] (for the mean of float buffers).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from fsync import _checks, _comm, _pack, _tree
from fsync._agree import planned, verify_plan
from fsync._plan import BucketPlan
from fsync._planner import VALUE_BUCKET_MB, value_plan
from fsync._sync import sync_grads


def _check_src(src: int, group: _comm.Group) -> None:
    _checks.check_rank("src", src, _comm.size(group))


def broadcast_leaves(
    leaves: list[Any], plan: BucketPlan, src: int, group: _comm.Group
) -> list[Any]:
    """Rank ``src``'s values of already planned and checked leaves."""
    with torch.no_grad():
        buffers = [
            _comm.wait(_comm.broadcast(b, src, group)) for b in _pack.pack_leaves(leaves, plan)
        ]
    return _pack.unpack_leaves(buffers, plan)


def broadcast(tree: Any, /, *, src: int = 0, group: _comm.Group = None) -> Any:
    """Returns rank ``src``'s values of ``tree`` on every rank.

    What DDP's constructor does to parameters and buffers at start-up, as a
    function: the leaves are packed into large buckets, one broadcast per
    bucket, and unpacked with their own shapes, dtypes and layouts. The ranks'
    trees are first checked to agree in structure, shapes and dtypes. Any
    dtype is fine (integer buffers too); the result never requires grad and
    the input is not modified.

    Args:
        tree: A pytree of dense tensors (``None`` leaves stay ``None``).
        src: The rank, within ``group``, whose values everyone gets.
        group: ``None`` for the default group, a ``ProcessGroup``, a 1-D
            ``DeviceMesh`` or ``(DeviceMesh, dim)``.

    Returns:
        A new tree like ``tree`` holding rank ``src``'s values.

    Raises:
        TypeError: A leaf is not a tensor, or is sparse.
        ValueError: ``src`` is not a rank of the group, or the ranks' trees differ
            (raised on every rank).

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.ones(2)}
        >>> fsync.broadcast(params, src=0)
        {'w': tensor([1., 1.])}
    """
    _comm.check_group(group)
    _check_src(src, group)
    leaves, plan, rebuild = planned(lambda: value_plan(tree, "broadcast"), group)
    if not torch.compiler.is_compiling():
        verify_plan(plan, group, what="trees passed to fsync.broadcast")
    return rebuild(broadcast_leaves(leaves, plan, src, group))


def sync_buffers(
    buffers: Any,
    /,
    *,
    mode: Literal["broadcast", "mean"] = "broadcast",
    src: int = 0,
    group: _comm.Group = None,
) -> Any:
    """Makes module buffers agree across ranks, as DDP's ``broadcast_buffers`` does.

    ``"broadcast"`` gives every rank rank ``src``'s buffers (DDP's behaviour
    before each forward). ``"mean"`` averages the floating point buffers over
    the group, as one would BatchNorm running statistics before evaluation,
    and broadcasts the others (such as ``num_batches_tracked``) from ``src``.

    Args:
        buffers: A pytree of tensors, such as ``dict(model.named_buffers())``.
        mode: ``"broadcast"`` (default) or ``"mean"``.
        src: The rank within ``group`` whose values are broadcast.
        group: As for [broadcast][fsync.broadcast].

    Returns:
        A new tree like ``buffers``.

    Raises:
        ValueError: ``mode`` is unknown, ``src`` is out of range, or the ranks'
            trees differ.

    Example:
        >>> import torch, fsync
        >>> bn = torch.nn.BatchNorm1d(3)
        >>> stats = fsync.sync_buffers(dict(bn.named_buffers()), mode="mean")
        >>> sorted(stats)
        ['num_batches_tracked', 'running_mean', 'running_var']
    """
    if mode not in ("broadcast", "mean"):
        raise ValueError(f"mode must be 'broadcast' or 'mean'; got {mode!r}.")
    if mode == "broadcast":
        return broadcast(buffers, src=src, group=group)
    _comm.check_group(group)
    _check_src(src, group)
    leaves, plan, rebuild = planned(lambda: value_plan(buffers, "sync_buffers"), group)
    if not torch.compiler.is_compiling():
        verify_plan(plan, group, what="trees passed to fsync.sync_buffers")
    floating = [leaf is not None and leaf.dtype.is_floating_point for leaf in leaves]
    with torch.no_grad():
        means = sync_grads(
            rebuild([x if f else None for f, x in zip(floating, leaves, strict=True)]),
            group=group,
            bucket_cap_mb=VALUE_BUCKET_MB,
        )
    rest = broadcast(
        rebuild([None if f else x for f, x in zip(floating, leaves, strict=True)]),
        src=src,
        group=group,
    )
    merged = [
        m if f else r
        for f, m, r in zip(floating, _tree.flatten(means)[0], _tree.flatten(rest)[0], strict=True)
    ]
    return rebuild(merged)

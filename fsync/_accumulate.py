"""Gradient accumulation: the local half of DDP's ``no_sync``."""

from __future__ import annotations

from typing import Any

import torch

from fsync import _tree


def accumulate(total: Any, grads: Any, /) -> Any:
    """Adds one micro-batch's gradients to a running total, without communicating.

    DDP's ``no_sync`` lets ``.grad`` accumulate locally and syncs on the last
    micro-batch; with fsync that is a plain sum followed by one sync::

        total = None
        for batch in micro_batches:
            total = fsync.accumulate(total, torch.func.grad(loss_fn)(params, batch))
        grads = fsync.sync_grads(total)

    The sum runs in micro-batch order, as autograd accumulates ``.grad``, so the
    result equals DDP's bit for bit where the all-reduce does. A ``None`` leaf
    counts as absent (an unused parameter); ``None`` as ``total`` starts a sum.
    Nothing passed in is modified.

    Args:
        total: The running total (a gradient tree) or ``None``.
        grads: A gradient tree with the same structure.

    Returns:
        A new tree: ``total + grads`` leaf by leaf.

    Raises:
        ValueError: The two trees differ in structure, shapes or dtypes.

    Example:
        >>> import torch, fsync
        >>> total = fsync.accumulate(None, {"w": torch.ones(2)})
        >>> fsync.accumulate(total, {"w": torch.ones(2)})
        {'w': tensor([2., 2.])}
    """
    if total is None:
        return grads
    totals, spec = _tree.flatten(total)
    leaves, other = _tree.flatten(grads)
    if spec != other:
        raise ValueError(
            f"accumulate got trees of different structure: the total is {spec} but the new "
            f"gradients are {other}. Accumulate gradients of the same parameters."
        )
    out = []
    for path, a, b in zip(spec.paths(), totals, leaves, strict=True):
        if a is None or b is None:
            out.append(b if a is None else a)
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"accumulate: leaf {_tree.path_str(path)!r} is {a.dtype}{list(a.shape)} in the "
                f"total but {b.dtype}{list(b.shape)} in the new gradients."
            )
        out.append(torch.add(a, b))
    return _tree.unflatten(spec, out)

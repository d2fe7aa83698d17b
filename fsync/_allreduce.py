"""The plain all-reduce hook: DDP's default, and every sync's when none is given.

It sits below the reduce, which falls back to it (``_reduce.DEFAULT_HOOK``), so that no
arrow runs up into ``fsync.ops`` (which re-exports it as ``fsync.ops.allreduce`` beside the
other hooks, and the ZeRO step, whose modules import the reduce).

Owns: ``allreduce``. May import: ``_comm``, ``_hook``, ``_pack`` (layers 1 to 5).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from fsync import _comm
from fsync._hook import Buckets, Hook, SyncContext, spec_of
from fsync._pack import pad_to_shards


def allreduce(op: Literal["mean", "sum"] = "mean") -> Hook:
    """All-reduces every bucket: DDP's default communication.

    ``"mean"`` is computed as DDP computes it: each bucket is multiplied by
    ``1 / world_size``, then summed across ranks, so results agree with DDP's
    bit for bit where the summation order does. With one rank nothing is
    communicated. Bytes on the wire: those of the buckets (the reference for
    every other hook). Where the caller needs only shards (``ctx.scatter``,
    the ZeRO step), each bucket is reduce-scattered instead.

    Args:
        op: ``"mean"`` (default) or ``"sum"``.

    Returns:
        A stateless [fsync.Hook][].

    Raises:
        ValueError: ``op`` is neither ``"mean"`` nor ``"sum"``.

    Example:
        >>> import fsync
        >>> hook = fsync.ops.allreduce("sum")
        >>> hook.init(None)
        ()
    """
    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum'; got {op!r}.")

    def init(plan: Any) -> tuple[()]:
        return ()

    def apply(buckets: Buckets, state: Any, ctx: SyncContext) -> tuple[Buckets, Any]:
        # The buckets are this hook's to overwrite if the caller says so (ctx.owned),
        # or once divided into new tensors: then the all-reduce works in place,
        # eagerly sparing the copy a functional all-reduce makes.
        divides = isinstance(ctx.divisor, torch.Tensor) or ctx.divisor != 1
        fresh = ctx.owned or (op == "mean" and divides)
        # One bucket at a time, so that eagerly bucket k is on the wire while k + 1
        # is divided.
        divided = (ctx.divide(b, inplace=ctx.owned) if op == "mean" else b for b in buckets)
        if ctx.scatter:
            padded = (pad_to_shards(b, ctx.world_size) for b in divided)
            return _comm.reduce_scatters(padded, "sum", ctx.group), state
        return [_comm.all_reduce(b, "sum", ctx.group, inplace=fresh) for b in divided], state

    return Hook(init, apply, spec_of("allreduce", op=op), bucketwise=True)

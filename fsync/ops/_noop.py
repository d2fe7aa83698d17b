"""The hook that does nothing, to measure everything but the communication."""

from __future__ import annotations

from typing import Any

from fsync._hook import Buckets, Hook, SyncContext


def noop() -> Hook:
    """Leaves every bucket as it is: no communication, each rank keeps its own gradients.

    For benchmarking: a step with ``noop()`` costs what a synced step costs
    minus the communication (flatten, pack, unpack remain), so the difference
    between the two is what the collectives take. Training with it is not data
    parallel (ranks drift apart). Bytes on the wire: none.

    Returns:
        A stateless [fsync.Hook][].

    Example:
        >>> import torch, fsync
        >>> grads = {"w": torch.ones(2)}
        >>> fsync.sync_grads(grads, hook=fsync.ops.noop())["w"]
        tensor([1., 1.])
    """

    def init(plan: Any) -> tuple[()]:
        return ()

    def apply(buckets: Buckets, state: Any, ctx: SyncContext) -> tuple[Buckets, Any]:
        return buckets, state

    return Hook(init, apply, "noop()", bucketwise=True)

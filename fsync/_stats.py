"""What a sync puts on the wire, measured by running its hook with recorded collectives."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsync import _comm
from fsync._comm import Collective
from fsync._hook import Hook, SyncContext, check_hook
from fsync._plan import BucketPlan, MiB, plan_buckets
from fsync._sync import DivideBy, check_sync_options, control_flags


class SyncStats(NamedTuple):
    """One sync step's communication, per rank.

    Attributes:
        buckets: Number of dense buckets.
        bytes_reduced: Bytes of the buckets, what a plain all-reduce sends.
        bytes_on_wire: Bytes this rank hands to collectives in one step (the
            payload of each all-reduce, all-gather, reduce-scatter or broadcast,
            the small control all-reduce of ``find_unused`` or
            ``divide_by="active"`` included).
        collectives: Every collective of the step, in order.
        world_size: The world size the step was run for.
    """

    buckets: int
    bytes_reduced: int
    bytes_on_wire: int
    collectives: tuple[Collective, ...]
    world_size: int

    @property
    def num_collectives(self) -> int:
        """The number of collectives one step issues (``len(collectives)``)."""
        return len(self.collectives)

    @property
    def compression(self) -> float:
        """``bytes_reduced / bytes_on_wire``: 1.0 for all-reduce, about 2 for fp16."""
        return self.bytes_reduced / self.bytes_on_wire if self.bytes_on_wire else float("inf")

    def __str__(self) -> str:
        by_op: dict[str, list[int]] = {}
        for c in self.collectives:
            by_op.setdefault(f"{c.op} {str(c.dtype).removeprefix('torch.')}", []).append(c.nbytes)
        ops = ", ".join(f"{len(v)} x {k} ({sum(v) / MiB:.3f} MiB)" for k, v in by_op.items())
        return (
            f"SyncStats: {self.buckets} buckets of {self.bytes_reduced / MiB:.3f} MiB on "
            f"{self.world_size} ranks; {self.num_collectives} collectives put "
            f"{self.bytes_on_wire / MiB:.3f} MiB on the wire per rank "
            f"(compression {self.compression:.2f}x)" + (f": {ops}" if ops else "")
        )


def sync_stats(
    tree: Any,
    /,
    *,
    hook: Hook | None = None,
    state: Any = None,
    world_size: int = 2,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    reduce_dtype: torch.dtype | None = None,
    find_unused: bool = False,
    divide_by: DivideBy = "world",
) -> SyncStats:
    """Measures one sync step's communication without communicating.

    The hook runs once on zero buckets of the plan's sizes while fsync's
    collectives are recorded instead of issued (as if on ``world_size`` ranks),
    so the numbers are those of the real code path, for any hook, your own
    included. Needs no process group. Sparse buckets, reduced by fsync itself
    with data-dependent sizes, are left out. The options are those of
    :class:`GradSync` that change what goes on the wire.

    Args:
        tree: A tree like the gradients (only metadata is read), or a
            :class:`BucketPlan`.
        hook: The hook to measure; default ``fsync.ops.allreduce()``.
        state: The hook state to measure from (e.g. a PowerSGD state after its
            warm-up); default ``hook.init(plan)``.
        world_size: The number of ranks to measure for.
        bucket_cap_mb: As for :func:`fsync.plan_buckets`, when ``tree`` is a tree.
        first_bucket_mb: As for :func:`fsync.plan_buckets`, when ``tree`` is a tree.
        reduce_dtype: As for :func:`fsync.plan_buckets`, when ``tree`` is a tree
            (a plan carries its own).
        find_unused: As for :class:`GradSync`: counts its control all-reduce,
            one int32 per tensor leaf and one more, issued before the buckets.
        divide_by: As for :class:`GradSync`: ``"active"`` counts a control
            all-reduce of one int32 (unless ``find_unused`` already issues one).

    Returns:
        The :class:`SyncStats`.

    Raises:
        ValueError: ``world_size`` is not a positive int or ``divide_by`` is
            neither ``"world"`` nor ``"active"``.
        TypeError: ``find_unused`` is not a bool, ``reduce_dtype`` is not a
            floating point dtype, or ``hook`` is not a :class:`Hook`.

    Example:
        >>> import torch, fsync
        >>> stats = fsync.sync_stats({"w": torch.zeros(1024, 256)}, world_size=4)
        >>> stats.bytes_on_wire, stats.num_collectives
        (1048576, 1)
        >>> fsync.sync_stats({"w": torch.zeros(1024, 256)}, find_unused=True).collectives[0]
        Collective(op='all_reduce', dtype=torch.int32, numel=2)
    """
    from fsync.ops._allreduce import allreduce

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}.")
    check_sync_options(divide_by=divide_by, find_unused=find_unused)
    hook = check_hook(allreduce() if hook is None else hook)
    plan = (
        tree
        if isinstance(tree, BucketPlan)
        else plan_buckets(
            tree,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb,
            reduce_dtype=reduce_dtype,
        )
    )
    dense = tuple(spec for spec in plan.specs if not spec.sparse)
    buckets = [torch.zeros(s.numel, dtype=s.dtype, device=s.device) for s in dense]
    state = hook.init(plan) if state is None else state
    # As GradSync's step: the divisor is a tensor when it counts the active ranks.
    divisor = torch.tensor(world_size, dtype=torch.int32) if divide_by == "active" else world_size
    ctx = SyncContext(plan, dense, None, 0, world_size, divisor)
    with torch.no_grad(), _comm.recording(world_size) as calls:
        if find_unused or divide_by == "active":  # GradSync's control all-reduce
            flags = control_flags(plan.leaves, plan, active=True, find_unused=find_unused)
            _comm.all_reduce(torch.tensor(flags, dtype=torch.int32), "sum", None)
        hook.apply(buckets, state, ctx)
    return SyncStats(
        buckets=len(dense),
        bytes_reduced=sum(s.nbytes for s in dense),
        bytes_on_wire=sum(c.nbytes for c in calls),
        collectives=tuple(calls),
        world_size=world_size,
    )

"""What a sync puts on the wire, measured by running it with recorded collectives.

[fsync.sync_stats][] calls the one reduce that every sync calls, over a
``Recorder`` group instead of a process group, so it counts
what the real path issues, control collective included.

Owns: [fsync.SyncStats][]. May import: every layer below (1 to 6).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from typing_extensions import Unpack

from fsync import _comm
from fsync._comm import Collective
from fsync._options import OptionKeywords, SyncOptions
from fsync._plan import BucketPlan, MiB, count
from fsync._planner import plan_tree
from fsync._reduce import init_hook, reduce_buckets


class SyncStats(NamedTuple):
    """One sync step's communication, per rank.

    Attributes:
        buckets: Number of dense buckets.
        bytes_reduced: Bytes of the buckets, what a plain all-reduce sends.
        bytes_on_wire: Bytes this rank hands to the buckets' collectives in one
            step (the payload of each all-reduce, all-gather, reduce-scatter or
            broadcast the hook issues).
        collectives: The buckets' collectives, in order.
        world_size: The world size the step was run for.
        control: fsync's own collectives of the step, issued before the
            buckets': the ranks' agreement (one int64 all-reduce of a few
            elements at every step, whatever the world size), and the per-leaf
            count of ranks with a gradient where ``find_unused`` is set or a
            gradient is ``None``.
    """

    buckets: int
    bytes_reduced: int
    bytes_on_wire: int
    collectives: tuple[Collective, ...]
    world_size: int
    control: tuple[Collective, ...] = ()

    @property
    def num_collectives(self) -> int:
        """The number of collectives one step issues (``len(collectives)``)."""
        return len(self.collectives)

    @property
    def control_bytes(self) -> int:
        """Bytes of the control collectives of one step."""
        return sum(c.nbytes for c in self.control)

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
            f"(compression {self.compression:.2f}x)"
            + (f": {ops}" if ops else "")
            + f"; the ranks' agreement adds {count(len(self.control), 'all-reduce')} of "
            f"{self.control_bytes} B"
        )


def sync_stats(
    tree: Any,
    /,
    *,
    state: Any = None,
    world_size: int = 2,
    **options: Unpack[OptionKeywords],
) -> SyncStats:
    """Measures one sync step's communication without communicating.

    The hook runs once on zero buckets of the plan's sizes while fsync's
    collectives are recorded instead of issued (as if on ``world_size`` ranks),
    so the numbers are those of the real code path, for any hook, your own
    included. Needs no process group. Sparse buckets, reduced by fsync itself
    with data-dependent sizes, are left out. The options are those of
    [GradSync][fsync.GradSync] that change what goes on the wire.

    Args:
        tree: A tree like the gradients (only metadata is read), or a
            [BucketPlan][fsync.BucketPlan].
        state: The hook state to measure from (e.g. a PowerSGD state after its
            warm-up); default ``hook.init(plan)``.
        world_size: The number of ranks to measure for.
        **options: The options of the sync to measure, fields of
            [fsync.SyncOptions][]: ``hook`` (default ``fsync.ops.allreduce()``);
            the bucket options when ``tree`` is a tree (a plan carries its own);
            ``find_unused`` and ``divide_by="active"`` count the control
            all-reduce [fsync.GradSync][] issues before the buckets (one int32
            per tensor leaf and one more, or one int32).

    Returns:
        The [SyncStats][fsync.SyncStats].

    Raises:
        ValueError: ``world_size`` is not a positive int or an option is invalid.
        TypeError: An option is unknown or of the wrong type.

    Example:
        >>> import torch, fsync
        >>> stats = fsync.sync_stats({"w": torch.zeros(1024, 256)}, world_size=4)
        >>> stats.bytes_on_wire, stats.num_collectives
        (1048576, 1)
        >>> stats.control  # the ranks' agreement, before the buckets, at every step
        (Collective(op='all_reduce', dtype=torch.int64, numel=13, control=True),)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}.")
    sync_options = SyncOptions.of(options, where="sync_stats")
    plan = (
        tree
        if isinstance(tree, BucketPlan)
        else plan_tree(tree, sync_options.plan, what="tree").plan
    )
    dense = [spec for spec in plan.specs if not spec.sparse]
    if len(dense) < len(plan.specs):  # sparse buckets send data-dependent sizes: left out
        plan = BucketPlan(
            plan.treespec,
            tuple(None if leaf is None or leaf.sparse else leaf for leaf in plan.leaves),
            tuple(spec.leaves for spec in dense),
            plan.reduce_dtype,
        )
    leaves = [
        None if spec is None else torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
        for spec in plan.leaves
    ]
    recorder = _comm.Recorder(world_size)
    with torch.no_grad():
        reduce_buckets(
            leaves,
            plan,
            sync_options,
            init_hook(sync_options, plan) if state is None else state,
            recorder,
        )
    buckets = tuple(c for c in recorder.calls if not c.control)
    return SyncStats(
        buckets=len(dense),
        bytes_reduced=sum(s.nbytes for s in dense),
        bytes_on_wire=sum(c.nbytes for c in buckets),
        collectives=buckets,
        world_size=world_size,
        control=tuple(c for c in recorder.calls if c.control),
    )

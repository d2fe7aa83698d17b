"""What a sync puts on the wire, measured by running it with recorded collectives.

[fsync.sync_stats][] calls the one reduce that every sync calls, over a
``Recorder`` group instead of a process group, so it counts
what the real path issues, control collective included. A 2-D recorder stands
for a 2-D mesh (the hierarchical reduce) and records which mesh dim each
collective ran over.

Owns: [fsync.SyncStats][]. May import: every layer below (1 to 6).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from typing_extensions import Unpack

from fsync._comm import _recorder
from fsync._comm._recorder import Collective
from fsync._hierarchy import shard_plan
from fsync._options import OptionKeywords, SyncOptions
from fsync._plan import BucketPlan, MiB, count
from fsync._planner import plan_tree
from fsync._reduce import SyncCall, init_hook, local_size, reduce, reduce_add, reduce_finish


class SyncStats(NamedTuple):
    """One sync step's communication, per rank.

    Attributes:
        buckets: Number of dense buckets.
        bytes_reduced: Bytes of the buckets, what a plain all-reduce sends.
        bytes_on_wire: Bytes this rank hands to the buckets' collectives in one
            step (the payload of each all-reduce, all-gather, reduce-scatter or
            broadcast the hook issues).
        collectives: The buckets' collectives, in order.
        world_size: The world size the step was run for (all ranks of a mesh).
        control: fsync's own collectives of the step, issued before the
            buckets': the ranks' agreement (one int64 all-reduce of a few
            elements at every step, whatever the world size), and the per-leaf
            count of ranks with a gradient where ``find_unused`` is set or a
            gradient is ``None``.
        mesh_shape: ``(nodes, local)`` for a step on a 2-D mesh, else ``()``;
            each of its bucket collectives then names its mesh dim
            (``Collective.dim``: 0 across nodes, 1 within a node).
        micro_batches: The micro-batches of a [fsync.DeferredSync][] step measured
            (``add`` each, then ``finish``); 0 for one sync.
    """

    buckets: int
    bytes_reduced: int
    bytes_on_wire: int
    collectives: tuple[Collective, ...]
    world_size: int
    control: tuple[Collective, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    micro_batches: int = 0

    def bytes_on(self, dim: int, /) -> int:
        """Bytes this rank hands to the buckets' collectives over mesh dim ``dim`` in one step.

        ``stats.bytes_on(0)`` is what crosses nodes on a 2-D mesh, ``bytes_on(1)``
        what stays within a node; 0 for a step on a 1-D group.
        """
        return sum(c.nbytes for c in self.collectives if c.dim == dim)

    def collectives_on(self, dim: int, /) -> tuple[Collective, ...]:
        """The buckets' collectives over mesh dim ``dim``, in order."""
        return tuple(c for c in self.collectives if c.dim == dim)

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
        where = f"{self.world_size} ranks"
        if self.mesh_shape:
            nodes, local = self.mesh_shape
            where = (
                f"a {nodes}x{local} mesh ({self.bytes_on(0) / MiB:.3f} MiB across nodes, "
                f"{self.bytes_on(1) / MiB:.3f} MiB within)"
            )
        if self.micro_batches:
            where += f", {count(self.micro_batches, 'micro-batch', 'micro-batches')} deferred"
        return (
            f"SyncStats: {self.buckets} buckets of {self.bytes_reduced / MiB:.3f} MiB on "
            f"{where}; {self.num_collectives} collectives put "
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
    world_size: int | tuple[int, int] = 2,
    micro_batches: int = 0,
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
        world_size: The number of ranks to measure for, or ``(nodes, local)``
            for a 2-D mesh: the hierarchical reduce, the hook across nodes on
            ``1/local`` shards (see [fsync.SyncStats.bytes_on][]).
        micro_batches: ``k > 0`` measures one step of [fsync.DeferredSync][]:
            ``k`` calls of ``add`` and one of ``finish``; 0 (default) one sync.
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
        (Collective(op='all_reduce', dtype=torch.int64, numel=13, control=True, dim=None),)
        >>> mesh = fsync.sync_stats({"w": torch.zeros(1024, 256)}, world_size=(2, 4))
        >>> mesh.bytes_on(0)  # across nodes: the all-reduce of a quarter of the bucket
        262144
        >>> [(c.op, c.numel) for c in mesh.collectives_on(1)]  # within: scatter, then gather
        [('reduce_scatter', 262144), ('all_gather', 65536)]
    """
    shape = world_size if isinstance(world_size, tuple) else (world_size,)
    if len(shape) not in (1, 2) or not all(_positive(n) for n in shape):
        raise ValueError(
            f"world_size must be a positive int or a pair (nodes, local) of them; got "
            f"{world_size!r}."
        )
    if not _positive(micro_batches) and micro_batches != 0:
        raise ValueError(f"micro_batches must be an int >= 0; got {micro_batches!r}.")
    sync_options = SyncOptions.of(options, where="sync_stats", mesh=len(shape) == 2)
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
    size = shape[0] * shape[-1] if len(shape) == 2 else shape[0]
    recorder = _recorder.Recorder(size, shape=shape if len(shape) == 2 else ())
    hook_state = init_hook(sync_options, plan, recorder) if state is None else state
    call = SyncCall(sync_options, recorder, hook_state)
    with torch.no_grad():
        if not micro_batches:
            reduce(leaves, plan, call)
        else:
            _deferred_step(leaves, plan, call, micro_batches)
    buckets = tuple(c for c in recorder.calls if not c.control)
    return SyncStats(
        buckets=len(dense),
        bytes_reduced=sum(s.nbytes for s in dense),
        bytes_on_wire=sum(c.nbytes for c in buckets),
        collectives=buckets,
        world_size=size,
        control=tuple(c for c in recorder.calls if c.control),
        mesh_shape=recorder.shape,
        micro_batches=micro_batches,
    )


def _positive(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _deferred_step(
    leaves: list[torch.Tensor | None], plan: BucketPlan, call: SyncCall, micro_batches: int
) -> None:
    """One [fsync.DeferredSync][] step's reduces: ``add`` per micro-batch, then ``finish``."""
    for _ in range(micro_batches):
        reduce_add(leaves, plan, call)
    shards = [
        torch.zeros(s.numel, dtype=s.dtype, device=s.device)
        for s in shard_plan(plan, local_size(call.group)).specs
    ]
    reduce_finish(shards, torch.tensor(micro_batches), plan, call)

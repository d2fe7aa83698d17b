"""The ZeRO step's factories: [fsync.ops.zero][] (the update split over the ranks) and
[fsync.ops.replicated][] (nothing split), each a ``ZeroStep`` of settings.

Owns: the factories and the sync options they build. May import: ``_step`` and what
it may (layers 1 to 7 below the entry points), ``fsync.optim``'s types.
"""

from __future__ import annotations

from fsync import _comm
from fsync._comm import _groups
from fsync._hook import Hook
from fsync._options import OptionKeywords, SyncOptions
from fsync._zero._layout import shard_group
from fsync._zero._step import ZeroStep
from fsync.optim._base import Optimizer


def zero(
    optimizer: Optimizer,
    *,
    hook: Hook | None = None,
    shard_buckets: bool = True,
    group: _comm.Group = None,
    bucket_cap_mb: float | None = None,
    first_bucket_mb: float = 1.0,
    update_in_backward: bool | None = None,
) -> ZeroStep:
    """A ZeRO step: synced gradients feed an optimizer update sharded across ranks.

    Every rank keeps the full parameters and only its part of the optimizer
    state. Per bucket of the plan ([fsync.plan_buckets][] with these
    sizes), with ``shard_buckets=True`` the gradients are reduce-scattered
    (through ``hook`` with ``ctx.scatter`` set), each rank updates its shard
    with ``optimizer`` and the shards are all-gathered; with
    ``shard_buckets=False`` each bucket is all-reduced and updated by one
    owning rank, which broadcasts it (the owners balance bucket bytes,
    largest first). Works with any world size, backend and parameter dtypes,
    eagerly and under ``torch.compile(fullgraph=True)``.

    Args:
        optimizer: An [fsync.optim.Optimizer][]; it is applied to a list
            of flat tensors (this rank's pieces).
        hook: The [fsync.Hook][] for the gradient buckets; default
            ``fsync.ops.allreduce("mean")``. It may return per bucket the
            whole reduced bucket or this rank's shard of it.
        shard_buckets: Shard every bucket across ranks (``True``) or give each
            bucket whole to one rank (``False``).
        group: ``None`` for the default group, a ``ProcessGroup``, a 1-D
            ``DeviceMesh``, ``(DeviceMesh, dim)``, or a 2-D ``DeviceMesh``
            ``(nodes, local)``: gradients are then reduced hierarchically (as
            [fsync.sync_grads][] does) and the ranks of the whole mesh share
            the update. Or ``replica.group`` of an [fsync.ft.Replica][] of
            several ranks: reduced hierarchically, within the replica group and
            across replicas, the update split over the replica group's ranks
            and each part replicated across replicas (the guide "Fault
            tolerance").
        bucket_cap_mb: Bucket size limit in MiB; ``None``: 25, or 4 on a 2-D mesh
            (see [fsync.SyncOptions][]).
        first_bucket_mb: Size limit of the first bucket in MiB.
        update_in_backward: Where ``value_and_step`` updates and gathers a bucket:
            during backward, as its reduce is over (``True``), or after backward,
            bucket after bucket (``False``; the reduces still leave during backward).
            ``None``: during backward on an accelerator, after it on the CPU, where
            the update would take the cores backward computes on (measured slower
            there: the guide "ZeRO"). The bits are the same either way; under
            ``torch.compile`` the compiler schedules.

    Returns:
        A [fsync.ops.ZeroStep][]: ``state = step.init(params)``, then
        ``params, state = step(params, grads, state)``.

    Raises:
        TypeError: ``optimizer`` or ``hook`` has the wrong type, ``optimizer``
            updates in place, or ``update_in_backward`` is not a bool or ``None``.
        ValueError: A bucket size is not a finite positive number, or ``group`` is
            the replica group of an [fsync.ft.Replica][] of one rank.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
        >>> step = fsync.ops.zero(fsync.optim.sgd(0.5))
        >>> state = step.init(params)
        >>> params, state = step(params, {"w": torch.ones(2, 2), "b": torch.ones(2)}, state)
        >>> params["b"]
        tensor([-0.5000, -0.5000])
    """
    options = _options("fsync.ops.zero", hook, group, bucket_cap_mb, first_bucket_mb)
    return ZeroStep(
        optimizer,
        options=options,
        shard_buckets=shard_buckets,
        group=group,
        shard_group=shard_group(group),
        update_in_backward=update_in_backward,
    )


def replicated(
    optimizer: Optimizer,
    *,
    hook: Hook | None = None,
    group: _comm.Group = None,
    bucket_cap_mb: float | None = None,
    first_bucket_mb: float = 1.0,
    update_in_backward: bool | None = None,
) -> ZeroStep:
    """The ZeRO step's pipeline with nothing split: every rank updates every bucket.

    Data parallelism as DDP does it, the optimizer state whole on every rank, with
    the ZeRO step's schedule: per bucket of the plan the gradients are
    all-reduced through ``hook`` and the bucket's parameters updated by
    ``optimizer`` as soon as its all-reduce is over, while the buckets after it
    are still on the wire; nothing is gathered. ``value_and_step`` does it in one
    backward pass (after backward on the CPU, as the reduces arrive, by
    default): where the link is slower than backward, the update hides behind
    the last buckets' transfer instead of following it. The result is
    ``optimizer.update(params, synced_grads, opt_state)`` after
    [fsync.sync_grads][] with the same options, bit for bit (a leafwise
    optimizer's operations are elementwise); the optimizer state, as
    [fsync.ops.zero_state_dict][] gathers it, is that update's state.

    Args:
        optimizer: An [fsync.optim.Optimizer][], applied to each bucket flat.
        hook: The [fsync.Hook][] for the gradient buckets; default
            ``fsync.ops.allreduce("mean")``.
        group: As for [fsync.ops.zero][]; also the replica group of an
            [fsync.ft.Replica][] of one rank (the state is then healed whole).
        bucket_cap_mb: Bucket size limit in MiB; ``None``: 25, or 4 on a 2-D mesh.
        first_bucket_mb: Size limit of the first bucket in MiB.
        update_in_backward: As for [fsync.ops.zero][].

    Returns:
        A [fsync.ops.ZeroStep][] whose ``shard_group`` is this rank alone:
        ``state = step.init(params)``, then ``params, state = step(params, grads,
        state)`` or ``(params, loss), state = step.value_and_step(loss_fn)(state,
        params, batch)``.

    Raises:
        TypeError: ``optimizer`` or ``hook`` has the wrong type, ``optimizer``
            updates in place, or ``update_in_backward`` is not a bool or ``None``.
        ValueError: A bucket size is not a finite positive number.

    Example:
        >>> import torch, fsync
        >>> step = fsync.ops.replicated(fsync.optim.sgd(0.5))
        >>> state = step.init({"w": torch.ones(2)})
        >>> step.shard_group, step.layout(state).world_size  # nothing split
        (ALONE (this rank by itself), 1)
        >>> params, state = step({"w": torch.ones(2)}, {"w": torch.ones(2)}, state)
        >>> params["w"]
        tensor([0.5000, 0.5000])
    """
    options = _options("fsync.ops.replicated", hook, group, bucket_cap_mb, first_bucket_mb)
    # Every rank owns every bucket whole: a world of one, this rank, that gathers nothing.
    return ZeroStep(
        optimizer,
        options=options,
        shard_buckets=False,
        group=group,
        shard_group=_groups.ALONE,
        update_in_backward=update_in_backward,
    )


def _options(
    where: str,
    hook: Hook | None,
    group: _comm.Group,
    bucket_cap_mb: float | None,
    first_bucket_mb: float,
) -> SyncOptions:
    """The sync options of a step built by ``where`` (checked there)."""
    given = OptionKeywords(hook=hook, first_bucket_mb=first_bucket_mb)
    if bucket_cap_mb is not None:  # else the default for the group (SyncOptions.of)
        given["bucket_cap_mb"] = bucket_cap_mb
    mesh = _comm.hierarchy(group) is not None
    return SyncOptions.of(given, where=where, mesh=mesh)

"""Communication: the only package of fsync that talks to ``torch.distributed``.

Collectives go through ``torch.distributed._functional_collectives``, which run
eagerly (returning tensors that wait on first use) and trace under
``torch.compile`` into c10d functional ops the compiler can schedule. A group
is a ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``(DeviceMesh, dim)`` pair, a
2-D ``DeviceMesh`` (dim 0 across nodes, dim 1 within a node: its collectives run
over all of its ranks, and ``hierarchy`` names its two dims for a hierarchical
reduce), ``None`` for the default group, or one of the kinds no c10d group stands
behind: a ``Recorder`` (a sync measured rather than run), a ``ReplicaGroup`` (the live
replicas of ``fsync.ft``, whose two levels ``hierarchy`` takes as a 2-D mesh's) and
``ALONE``. With one rank no collective is issued.

The package, a module per concept: this boundary (every call into c10d); ``_groups``, the
kinds no c10d group stands behind and their one interface (``Standalone``); ``_recorder``,
the group that records instead of issuing; ``_failures``, what a failed collective raises;
``_reports``, naming a failure from the ranks' reports in the store. Only this module
imports ``torch.distributed``; its children import torch and each other, and only
``_reports`` imports this module back.

Owns: every call into ``torch.distributed`` (DCP's too, for ``fsync.checkpoint``:
``checkpointing``) and the differences between torch releases. May import: torch,
``_trace`` and this package's ``_recorder``, ``_groups`` and ``_failures`` (layer 1).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import (  # type: ignore[attr-defined]
    _get_process_group_store,
    _resolve_process_group,
)

from fsync import _trace
from fsync._comm._failures import COLLECTIVE_FAILED, CollectiveError
from fsync._comm._groups import (
    REPLICAS_UNDER_COMPILE,
    Failed,
    Issued,
    Pending,
    ReplicaGroup,
    Standalone,
)
from fsync._comm._recorder import Recorder

# torch >= 2.13 deprecates all_gather_tensor/reduce_scatter_tensor in favour of the
# *_single names; older releases only have the former.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _replicas(group: Group) -> ReplicaGroup | None:
    """``group`` as a ``ReplicaGroup`` (eager only), else ``None``."""
    if not isinstance(group, ReplicaGroup):
        return None
    if torch.compiler.is_compiling():
        raise RuntimeError(REPLICAS_UNDER_COMPILE)
    return group


Group = dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, int] | Recorder | Standalone | None

_NOT_INITIALISED = (
    "torch.distributed is not initialised. Call torch.distributed.init_process_group() "
    "first (torchrun sets the environment it reads), or pass group= explicitly."
)


def check_group(group: Group) -> None:
    """Raises ``TypeError``/``RuntimeError`` unless ``group`` names a usable group."""
    if isinstance(group, tuple):
        if (
            len(group) != 2
            or not isinstance(group[0], DeviceMesh)
            or isinstance(group[1], bool)
            or not isinstance(group[1], int)
        ):
            raise TypeError(f"group tuple must be (DeviceMesh, mesh_dim); got {group!r}.")
        if not 0 <= group[1] < group[0].ndim:
            raise ValueError(
                f"mesh dim {group[1]} is out of range for a {group[0].ndim}-D DeviceMesh."
            )
        return
    if isinstance(group, DeviceMesh):
        if group.ndim > 2:
            raise ValueError(
                f"a {group.ndim}-D DeviceMesh needs a dim: pass group=(mesh, dim) with the "
                "data-parallel dimension, or a 2-D mesh of it (nodes, local) for a "
                "hierarchical reduce."
            )
        if group.ndim == 2 and not group.mesh_dim_names:
            raise ValueError(
                "a 2-D DeviceMesh needs mesh_dim_names, which fsync's collectives over the whole "
                "mesh rely on: build it with init_device_mesh(device_type, (nodes, local), "
                'mesh_dim_names=("node", "local")).'
            )
        return
    if isinstance(group, Recorder | Standalone):
        return
    placeholder: Any = group  # new_group's value on ranks it leaves out: an int
    if isinstance(placeholder, int) and placeholder == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group it was "
            "given: torch.distributed.new_group(ranks) returns a placeholder on the ranks it "
            "leaves out. Sync over a group only on its member ranks."
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group is a {type(group).__name__}; expected a torch.distributed.ProcessGroup, a "
            "DeviceMesh, a (DeviceMesh, dim) pair, an fsync.ft replica group or None for the "
            "default group."
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(_NOT_INITIALISED)


def _mesh_dim(group: Group) -> tuple[DeviceMesh, int] | None:
    """``(mesh, dim)`` for a mesh group (a 1-D mesh is its dim 0, a 2-D mesh its
    flattened form), else ``None``."""
    if isinstance(group, DeviceMesh):
        if group.ndim == 2:
            return _flattened(group), 0
        return group, 0
    return group if isinstance(group, tuple) else None


def _flattened(mesh: DeviceMesh) -> DeviceMesh:
    """A 2-D mesh as one dim over all of its ranks, in row-major order.

    ``DeviceMesh._flatten`` creates its process group once (every rank of the mesh
    calls it at the same sync, the first that needs the whole mesh) and keeps it on
    the mesh: later calls return it. Under ``torch.compile`` the agreement reaches it
    through ``group_name``, which runs as Python at trace time.
    """
    return mesh._flatten()


def hierarchy(group: Group) -> tuple[Group, Group] | None:
    """``(across, within)``: a 2-D mesh's (or 2-D ``Recorder``'s) dims 0 and 1, a two-level
    ``ReplicaGroup``'s levels; else ``None``."""
    if isinstance(group, Standalone):
        return group.levels()
    if isinstance(group, Recorder):
        return (group.along(0), group.along(1)) if len(group.shape) == 2 else None
    if isinstance(group, DeviceMesh) and group.ndim == 2:
        return (group, 0), (group, 1)
    return None


def _funcol_group(group: Group) -> Any:
    return _mesh_dim(group) or (dist.group.WORLD if group is None else group)


def size(group: Group) -> int:
    """Number of ranks in ``group``."""
    if isinstance(group, Standalone):
        return group.size()
    if isinstance(group, Recorder):
        return group.world_size
    if isinstance(group, DeviceMesh) and group.ndim == 2:
        return group.size(0) * group.size(1)
    mesh_dim = _mesh_dim(group)
    return mesh_dim[0].size(mesh_dim[1]) if mesh_dim else dist.get_world_size(process_group(group))


def rank(group: Group) -> int:
    """This process's rank within ``group``."""
    if isinstance(group, Standalone):
        return group.rank()
    if isinstance(group, Recorder):
        return group.rank
    if isinstance(group, DeviceMesh) and group.ndim == 2:  # row-major, as flattened
        return group.get_local_rank(0) * group.size(1) + group.get_local_rank(1)
    mesh_dim = _mesh_dim(group)
    if mesh_dim:
        return mesh_dim[0].get_local_rank(mesh_dim[1])
    return dist.get_rank(process_group(group))


def process_group(group: Group) -> dist.ProcessGroup:
    """The ``ProcessGroup`` behind ``group``."""
    if isinstance(group, ReplicaGroup):
        raise TypeError("a ReplicaGroup (fsync.ft) has no c10d ProcessGroup of fixed members.")
    if isinstance(group, Standalone):
        raise TypeError(f"{group!r}: no c10d ProcessGroup stands behind it.")
    mesh_dim = _mesh_dim(group)
    if mesh_dim:
        return mesh_dim[0].get_group(mesh_dim[1])
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]


def _group_name(group: Group) -> str:
    if isinstance(group, ReplicaGroup):
        raise RuntimeError(REPLICAS_UNDER_COMPILE)
    name: str = funcol._resolve_group_name(_funcol_group(group))
    return name


# The name c10d knows a group by: what a custom op can carry into a compiled graph. Read
# as Python at trace time (the group is a constant there; its name type is not traceable).
group_name = _trace.constant_result(_group_name)


def _on_gloo(group: Group) -> bool:
    if isinstance(group, ReplicaGroup):
        return False
    return "gloo" in str(dist.get_backend(process_group(group)))


# gloo's all-gather and reduce-scatter (c10d's *_coalesced forms, which functional
# collectives call) are slower than its broadcast and all-to-all over the same bytes (2
# ranks, 33.6 MB: all-gather 60-73 ms, a broadcast per rank 16-62; reduce-scatter 73-98 ms,
# an all-to-all and a local sum 45-64). So on gloo a reduce-scatter is always composed from
# the faster collective, and an all-gather eagerly (compiled, c10d's is as fast: see
# all_gather). Read at trace time, like the group's name.
on_gloo = _trace.constant_result(_on_gloo)


def group_named(name: str) -> dist.ProcessGroup:
    """The group a name from ``group_name`` stands for."""
    return _resolve_process_group(name)  # type: ignore[arg-type]


def all_reduce(
    x: torch.Tensor, op: str, group: Group, *, inplace: bool = False, control: bool = False
) -> torch.Tensor:
    """Reduces ``x`` over ``group`` with ``op`` (``"sum"``, ``"avg"``, ``"max"``, ``"min"``,
    ``"product"``).

    ``inplace=True`` lets an eager call reduce into ``x`` itself (for a tensor the
    caller owns) instead of a copy. Either way the result waits for the collective
    on first use, as functional collectives do. Under ``torch.compile`` the
    functional form is traced and inductor decides where the result lives.
    ``control`` marks fsync's own agreement for a ``Recorder``.
    """
    local = _local("all_reduce", x, group, op, control=control)
    if local is not None:
        return local
    replicas = _replicas(group)
    if replicas is not None:
        pending = replicas.all_reduce(x if inplace else x.clone(), op)
        in_flight = _waits_on_first_use(pending)
        if pending.works:  # none where the group waited as it issued it
            replicas.unsettled.append(in_flight)
        return in_flight
    if inplace and not torch.compiler.is_compiling():
        name = funcol._resolve_group_name(_funcol_group(group))
        return _on_first_use(torch.ops._c10d_functional.all_reduce_(x, op, name))
    reduced: torch.Tensor = funcol.all_reduce(x, op, _funcol_group(group))
    return reduced


def _local(
    op: str, x: torch.Tensor, group: Group, reduce_op: str = "sum", *, control: bool = False
) -> torch.Tensor | None:
    """What ``op`` on ``x`` gives without a process group: ``x`` itself with one rank, a
    ``Recorder``'s answer; ``None`` when the collective must be issued."""
    if size(group) == 1:
        return x
    if not isinstance(group, Recorder):
        return None
    return group.answer(op, x, reduce_op, control=control)


def all_gather(x: torch.Tensor, group: Group) -> Issued:
    """Every rank's ``x`` concatenated along dim 0, in rank order (``wait`` for it).

    Eagerly on gloo this is one broadcast per rank rather than gloo's all-gather
    (see ``on_gloo``), all of them issued before this returns and none waited for:
    the result is a ``Pending`` holding the same tensor. Compiled on gloo it is an
    all-to-all of ``x`` repeated once per rank (each rank sends and receives what an
    all-gather would, plus one local copy): gloo's all-gather, with inductor's
    communication passes keeping several in flight beside all-to-alls, corrupts the
    heap (see the CHANGELOG). Elsewhere it is the functional all-gather;
    one collective keeps the ranks' graphs free of rank-dependent inputs.
    """
    local = _local("all_gather", x, group)
    if local is not None:
        return local
    replicas = _replicas(group)
    if replicas is not None:
        return replicas.all_gather(x.reshape(-1) if x.dim() == 0 else x)
    if not on_gloo(group):
        gathered: torch.Tensor = _all_gather(x, 0, _funcol_group(group))
        return gathered
    n = size(group)
    x = x.reshape(-1) if x.dim() == 0 else x  # a scalar gathers into a vector, as c10d's does
    if torch.compiler.is_compiling():
        repeated = torch.cat([x] * n)
        exchanged: torch.Tensor = funcol.all_to_all_single(
            repeated, None, None, _funcol_group(group)
        )
        return exchanged
    me = rank(group)
    # Eagerly: every rank's part arrives in place in one buffer, this rank's copied in.
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    chunks = out.chunk(n)
    chunks[me].copy_(x)
    return Pending(out, _issue_broadcasts(chunks, range(n), process_group(group)))


def reduce_scatter(x: torch.Tensor, op: str, group: Group) -> torch.Tensor:
    """Reduces ``x`` over ``group`` and returns this rank's chunk of dim 0.

    On gloo a sum is an all-to-all of the chunks and a local sum in rank order
    (see ``on_gloo``): each rank's chunk is summed on that rank alone, and every
    rank sends what gloo's reduce-scatter would. That sum waits for the
    all-to-all: reduce-scatter several tensors with ``reduce_scatters``.
    """
    (shard,) = reduce_scatters([x], op, group)
    return shard


def reduce_scatters(xs: Iterable[torch.Tensor], op: str, group: Group) -> list[torch.Tensor]:
    """``reduce_scatter`` of each of ``xs``, every one issued before the first is waited for.

    Eagerly each is issued as ``xs`` yields it. Where a reduce-scatter is an
    all-to-all and a local sum (gloo), the sums follow every issue: in a
    compiled graph a wait cannot move past a later collective (inductor's
    ``sink_waits_iterative``), so a sum right after its own all-to-all would
    hold every later bucket's collective, and the compute before it, until that
    one had arrived.
    """
    out: list[torch.Tensor] = []
    pending: list[tuple[int, torch.Tensor]] = []
    for x in xs:
        local = _local("reduce_scatter", x, group, op)
        if local is not None:
            out.append(local)
        elif isinstance(group, ReplicaGroup):  # rare across replicas: the reduce, then a chunk
            out.append(all_reduce(x, op, group).chunk(size(group))[rank(group)])
        elif op != "sum" or not on_gloo(group):
            shard: torch.Tensor = _reduce_scatter(x, op, 0, _funcol_group(group))
            out.append(shard)
        else:
            pending.append(
                (len(out), funcol.all_to_all_single(x, None, None, _funcol_group(group)))
            )
            out.append(x)  # replaced below
    n = size(group)
    for k, received in pending:
        # Chunk r is rank r's part of this rank's shard: added up in rank order, on this rank
        # only, by elementwise adds (a sum over a strided dim takes twice as long eagerly).
        out[k] = functools.reduce(torch.add, wait(received).chunk(n))
    return out


def broadcast(x: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """Rank ``src``'s ``x`` (``src`` counted within ``group``)."""
    received: torch.Tensor | None = _local("broadcast", x, group)
    replicas = _replicas(group)
    if received is None and replicas is not None:
        return _waited(replicas.broadcast(x.clone(), src), replicas)
    return funcol.broadcast(x, src, _funcol_group(group)) if received is None else received


def broadcasts(tensors: list[torch.Tensor], sources: list[int], group: Group) -> list[torch.Tensor]:
    """Tensor ``k`` of rank ``sources[k]`` on every rank, one broadcast each, in this order.

    A receiving rank's tensor gives only the shape and dtype. Under
    ``torch.compile`` all of them are one opaque op (``fsync::broadcasts``): the
    ranks' graphs differ (a source computes its tensor, the others do not), and
    inductor's communication passes would otherwise move a broadcast whose input
    needs nothing ahead of other collectives on the receiving ranks alone, so
    that ranks issue collectives in different orders and wait on each other forever.
    """
    if not torch.compiler.is_compiling() or size(group) == 1 or isinstance(group, Recorder):
        _replicas(group)
        return [wait(broadcast(t, src, group)) for t, src in zip(tensors, sources, strict=True)]
    received: list[torch.Tensor] = _broadcasts_op(tensors, sources, group_name(group))
    return received


@torch.library.custom_op("fsync::broadcasts", mutates_args=())
def _broadcasts_op(
    tensors: list[torch.Tensor], sources: list[int], group: str
) -> list[torch.Tensor]:
    pg = group_named(group)
    me = dist.get_rank(pg)
    out = [
        t.clone() if src == me else torch.empty_like(t)
        for t, src in zip(tensors, sources, strict=True)
    ]
    _broadcast_in_place(out, sources, pg)
    return out


@_broadcasts_op.register_fake
def _(tensors: list[torch.Tensor], sources: list[int], group: str) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


def in_flight(x: Issued) -> bool:
    """Whether ``x`` is a collective's result that ``wait`` may still wait for (a plain
    tensor has arrived: it was waited for already, or never left this rank)."""
    return isinstance(x, Pending | funcol.AsyncCollectiveTensor)


def wait(x: Issued, stage: str | Callable[[], str] = "") -> torch.Tensor:
    """Waits for a collective's result and returns it as a plain tensor.

    A collective that fails (a peer died, timed out, or called something else)
    raises ``CollectiveError`` saying what to check, with ``stage`` (which part of
    the sync waited; a function is called only then), for ``named`` to complete.
    """
    if isinstance(x, Pending):
        for work in x.works:
            _wait_work(work, stage)
        return x.tensor
    if not isinstance(x, funcol.AsyncCollectiveTensor):
        return x
    waited: torch.Tensor = _wait_work(x if torch.compiler.is_compiling() else _Arrival(x), stage)
    return waited


class _Arrival:
    """A functional collective's result as a work to wait for, eagerly: its ``wait_tensor``
    called below autograd. torch 2.13 registers the op's derivative (the identity) in
    Python, which costs 40 us a wait (2 gloo ranks, 13 or 160,000 floats); the result is
    the collective's own tensor, with whatever graph it has, either way."""

    def __init__(self, x: funcol.AsyncCollectiveTensor) -> None:
        self._x = x

    def wait(self) -> torch.Tensor:
        x = self._x
        if x.completed:
            return x.elem
        with torch._C._AutoDispatchBelowAutograd():
            out: torch.Tensor = torch.ops._c10d_functional.wait_tensor(x.elem)
        x.completed = True
        return out


class _Works(dist.Work):
    """A ``Pending``'s works as one c10d ``Work``, waited for in order (a failure raises)."""

    def __init__(self, works: tuple[Any, ...]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        return True


def _on_first_use(issued: torch.Tensor) -> torch.Tensor:
    """An eager functional collective's result as ``funcol`` gives it, waiting on first use.

    Made directly: torch 2.13's own wrapper (``funcol._maybe_wrap_tensor``) is a Python
    custom op, for autograd through the result, which costs 0.1 ms a collective (2 gloo
    ranks, 13 or 160,000 floats: 166-186 us issued against 46-56 us for the op alone);
    what ``all_reduce`` issues in place is a buffer no gradient flows through.
    """
    if funcol._are_we_tracing():  # make_fx or fake tensors: funcol's own path
        waited: torch.Tensor = torch.ops._c10d_functional.wait_tensor(issued)
        return waited
    in_flight: torch.Tensor = funcol.AsyncCollectiveTensor(issued)
    return in_flight


def _waits_on_first_use(x: Pending) -> torch.Tensor:
    """``x``'s tensor as a functional collective's result: it waits for ``x``'s works on
    first use, or in ``wait`` (where a failure is a ``CollectiveError``), so that a
    ``ReplicaGroup``'s collectives stay in flight as c10d's do, several at once."""
    if not x.works:  # nothing of it left on the wire
        return x.tensor
    torch._C._distributed_c10d._register_work(x.tensor, _Works(x.works))
    # Made directly, eager only (a ReplicaGroup refuses tracing): funcol's wrapper asks
    # whether it traces, which imports torch._dynamo on first call, a second that a
    # restarted replica would add to its first step, with the survivors waiting on it.
    in_flight: torch.Tensor = funcol.AsyncCollectiveTensor(x.tensor)
    return in_flight


def _waited(x: Pending, group: ReplicaGroup) -> torch.Tensor:
    """``x`` waited for as it is issued (a broadcast over replicas); a failure is kept for
    the caller's ``wait``, which names the stage it broke, as one in flight would be."""
    try:
        for work in x.works:
            work.wait()
    except RuntimeError as error:
        failed = _waits_on_first_use(Pending(x.tensor, (Failed(error),)))
        group.unsettled.append(failed)
        return failed
    return x.tensor


def _issue_broadcasts(
    tensors: Sequence[torch.Tensor], sources: Iterable[int], pg: dist.ProcessGroup
) -> tuple[Any, ...]:
    """Has tensor ``k`` overwritten with rank ``sources[k]``'s (ranks within ``pg``), in order.

    Returns the c10d ``Work`` of each, none waited for: torch releases differ in
    whether a functional collective's wait keeps every work registered on one
    storage, so buffers sharing one storage wait through their ``Work``s (a
    ``Pending``).
    """
    return tuple(
        dist.broadcast(t, dist.get_global_rank(pg, src), group=pg, async_op=True)
        for t, src in zip(tensors, sources, strict=True)
    )


def _broadcast_in_place(
    tensors: Sequence[torch.Tensor], sources: Iterable[int], pg: dist.ProcessGroup
) -> None:
    """``_issue_broadcasts``, every one waited for."""
    wait(Pending(torch.empty(0), _issue_broadcasts(tensors, sources, pg)))


def _wait_work(work: Any, stage: str | Callable[[], str] = "") -> Any:
    """``work.wait()`` (a c10d ``Work`` or a functional collective's result), in fsync's words."""
    try:
        return work.wait()
    except RuntimeError as error:
        if isinstance(error, CollectiveError):
            raise
        where = stage() if callable(stage) else stage
        raise CollectiveError(COLLECTIVE_FAILED, stage=where, backend=str(error)) from error


def sequence_number(group: Group) -> int:
    """How many collectives this rank has issued on ``group`` (c10d's count); -1 if unknown."""
    if isinstance(group, Recorder | Standalone) or size(group) == 1:
        return -1
    try:
        pg: Any = process_group(group)
        return int(pg._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return -1


def store(group: Group) -> Any:
    """The c10d store of ``group``'s process group."""
    return _get_process_group_store(process_group(group))


def all_gather_object(obj: Any, group: Group, device: torch.device) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (eager only; for checks, not data).

    Two fixed-size collectives (lengths, then padded bytes), so ranks that
    disagree on the object's size still meet in the same collectives.
    """
    n = size(group)
    if n == 1:
        return [obj]
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = wait(all_gather(length, group)).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = wait(all_gather(padded, group)).view(n, -1).cpu()
    return [pickle.loads(gathered[r, : lengths[r]].numpy().tobytes()) for r in range(n)]


def default_device(group: Group) -> torch.device:
    """Where small control tensors for ``group`` live (CPU for gloo, the GPU for NCCL)."""
    if isinstance(group, Recorder):
        return torch.device("cpu")
    if isinstance(group, Standalone):
        return group.device
    backend = str(dist.get_backend(process_group(group)))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@functools.cache
def checkpointing() -> Any:
    """``torch.distributed.checkpoint`` (DCP), for ``fsync.checkpoint``: imported on first
    use, not with fsync (DCP and the DTensor modules it pulls in take about 0.5 s to import).
    Its ``metadata`` and ``planner`` submodules are loaded with it."""
    import torch.distributed.checkpoint as dcp

    return dcp


def initialized() -> bool:
    """Whether a default process group exists (a checkpoint is also written by one process
    without one)."""
    return dist.is_available() and dist.is_initialized()

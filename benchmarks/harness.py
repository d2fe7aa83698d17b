"""Settings timed in turns, each in processes of its own.

A *setting* is one way to do a step: DDP, an fsync step, a collective alone. :func:`turns`
starts one gloo world per setting, each in processes of its own, builds and warms up
(compiles) the worlds, two at a time, and then lets them take turns: world A runs
``steps`` steps while the others wait, then world B, ..., round after round. Settings that
shared one process moved each other by 5-10 % (the allocator, caches, threads); turns
make a drift of the machine (another tenant, the clock) weigh on every setting alike.

A setting's figure in a round is its turn's wall time per step on rank 0, after a barrier
that starts the world's ranks together. A ratio between two settings is taken round by
round and reported as its spread over the rounds (:class:`benchmarks.table.Spread`:
lowest, median, highest), never as one figure.

The processes are forked from a server that has imported torch, fsync and the settings'
modules once (``multiprocessing``'s forkserver), so a world costs a fork and a gloo
rendezvous, not an interpreter. They meet through one ``TCPStore`` held by the calling
process (on two nodes, by node 0's), which also carries the turns: a world waits, blocked,
for the key that gives it its turn, so the waiting worlds use no CPU. Every process gets
``env`` (share one ``TORCHINDUCTOR_CACHE_DIR`` across them, and a recompile is a cache
hit), one intra-op thread, and compiles in its own thread.

Each world also reports its rank 0's resident memory: once built, after the warm-up, and
its peak over the timed turns (``VmHWM``, reset after the warm-up).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import gc
import json
import multiprocessing
import os
import pathlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypedDict

import torch
import torch._inductor.config
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

_FAILED = "failed"  # the store's key of the first failure: "setting ..., rank ...: ..."
_POLL_S = 0.05  # how long the coordinator sleeps at most between looks for a key
_WAIT = datetime.timedelta(hours=12)  # a rank waits this long for its turn
_MMAP_THRESHOLD = -3  # glibc's M_MMAP_THRESHOLD for mallopt
# Worlds built (and compiled) at once, before any turn: a world's two ranks leave a core
# idle while one waits for the other's compile of the same kernel (inductor locks it).
_BUILDING = 2
# Imported once by the server the processes fork from: torch, its compiler and fsync, with
# what inductor asks each process once worked out (the test suite's gloo ranks fork from a
# server preloaded the same way).
PRELOAD = ("tests._preload",)


class UnavailableError(Exception):
    """Raised by a setting's builder, on every rank, where the setting cannot run here (a
    backend it refuses, an API this fsync lacks); the page then says why."""


class Built(NamedTuple):
    """A built setting: ``step()`` is timed; ``info()``, called on every rank after the
    last turn, returns what else the page reports (JSON values)."""

    step: Callable[[], object]
    info: Callable[[], dict[str, Any]] | None = None


class Setting(NamedTuple):
    """A setting: its name on the page and how its processes build it.

    ``build`` runs in each of the setting's processes, after the world's group is made,
    and returns a :class:`Built` or a bare step; it must be picklable: a function of an
    importable module (a page run as a script imports itself by name to run, so that its
    functions are not ``__main__``'s), or a ``functools.partial`` of one with plain
    arguments. It raises :class:`UnavailableError` on every rank or on none. ``repeat``
    runs the step that many times per step of a turn (a 1 ms collective is timed over more
    calls than a turn of steps holds).
    """

    name: str
    build: Callable[[], Built | Callable[[], object]]
    repeat: int = 1


@dataclasses.dataclass(frozen=True)
class Node:
    """Where this process's ranks sit: node ``rank`` of ``count``, ``local`` ranks each,
    meeting at ``host:port`` (node 0 holds the store there; port 0: any free one)."""

    count: int = 1
    rank: int = 0
    local: int = 2
    host: str = "127.0.0.1"
    port: int = 0


class Row(TypedDict):
    """What :func:`turns` returns (JSON): per setting, ms per step in each round, rank 0's
    memory in MiB and every rank's ``info``; why each unavailable setting did not run; and
    every turn in the order taken (setting, round, pid of rank 0, start and end times)."""

    rounds: dict[str, list[float]]
    memory: dict[str, dict[str, float]]
    info: dict[str, list[dict[str, Any]]]
    unavailable: dict[str, str]
    turns: list[dict[str, Any]]


def turns(
    settings: Sequence[Setting],
    *,
    rounds: int,
    steps: int,
    warmup: int,
    node: Node | None = None,
    env: Mapping[str, str] | None = None,
    follow_rss: bool = False,
    backend: str = "gloo",
) -> Row | None:
    """Times ``settings`` in turns, each in a world of processes of its own.

    Args:
        settings: What to time, in the order of each round's turns.
        rounds: How many turns each setting takes.
        steps: Steps per turn.
        warmup: Untimed steps of each world before the first turn (compiling is in them).
        node: This node's place (two nodes: each node calls ``turns`` with the same
            settings and its own ``rank``); default one node of 2 ranks.
        env: Set in every process before it builds its setting.
        follow_rss: glibc gives back every freed block of 64 KiB or more at once, so that
            resident memory follows the tensors alive (the memory pages; it slows steps).
        backend: ``"gloo"``, or ``"nccl"`` with one rank per GPU.

    Returns:
        The :class:`Row` on node 0; ``None`` on the other nodes.

    Raises:
        RuntimeError: A process of a setting failed (its traceback is on stderr).
    """
    node = node or Node()
    coordinator = node.rank == 0
    store = TCPStore(
        node.host, node.port, is_master=coordinator, wait_for_workers=False, timeout=_WAIT
    )
    jobs = [
        _Job(k, s, node.rank * node.local + i, node.count * node.local, node.host, store.port)
        for k, s in enumerate(settings)
        for i in range(node.local)
    ]
    options = _Options(rounds, steps, warmup, dict(env or {}), follow_rss, backend)
    context = _context(settings)
    processes = [context.Process(target=_rank, args=(job, options)) for job in jobs]
    for process in processes:
        process.start()
    names = [s.name for s in settings]

    def watch() -> None:
        # The first failure, as its rank wrote it before exiting (a rank whose collective then
        # failed for want of it exits too, maybe before this looks); else an exit with none.
        if store.check([_FAILED]):
            raise RuntimeError(str(store.get(_FAILED).decode()))
        for job, process in zip(jobs, processes, strict=True):
            if process.exitcode not in (None, 0):
                message = f"setting {names[job.world]!r}, rank {job.rank}: exit {process.exitcode}"
                store.set(_FAILED, message)
                raise RuntimeError(message)

    try:
        if coordinator:
            return _coordinate(store, names, rounds, node.count * node.local, watch)
        while any(p.exitcode is None for p in processes):
            watch()
            time.sleep(_POLL_S)
        return None
    except BaseException:  # the others may wait for the failed one for hours: stop them
        for process in processes:
            process.kill()
        raise
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.exitcode is None:
                process.kill()


def in_turns(
    calls: Mapping[str, Callable[[int], object]],
    *,
    rounds: int,
    steps: int,
    warmup: int,
    before: Callable[[], object] = lambda: None,
    after: Callable[[], object] = lambda: None,
) -> dict[str, dict[str, list[float]]]:
    """Times ``calls`` in turns in this process, where one process must hold them all (a
    GPU's one rank, a host cost that processes of their own would blur): each call
    ``warmup`` times, then round after round ``steps`` calls of each in a turn, ``before()``
    ahead of its clock (a barrier) and ``after()`` inside it (the GPU's queue). A call gets
    its step's index. Returns per call its ms per call in each round: ``"wall"``, and
    ``"cpu"`` (this process's, every thread's)."""
    for fn in calls.values():
        for k in range(warmup):
            fn(k)
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name, fn in calls.items():
            before()
            started, clock = time.process_time(), time.perf_counter()
            for k in range(steps):
                fn(r * steps + k)
            after()
            cpu[name].append(1000 * (time.process_time() - started) / steps)
            wall[name].append(1000 * (time.perf_counter() - clock) / steps)
    return {"wall": wall, "cpu": cpu}


# --- the coordinator ------------------------------------------------------------------------


def _await(store: TCPStore, key: str, watch: Callable[[], None]) -> str:
    """``key``'s value once it is set, looking every 1 ms at first, then less often."""
    delay = 0.001
    while not store.check([key]):
        watch()
        time.sleep(delay)
        delay = min(2 * delay, _POLL_S)
    return str(store.get(key).decode())


def _coordinate(
    store: TCPStore, names: list[str], rounds: int, size: int, watch: Callable[[], None]
) -> Row:
    """Builds the worlds, two at a time, then gives the turns, round after round."""
    row: Row = {"rounds": {}, "memory": {}, "info": {}, "unavailable": {}, "turns": []}
    live, started = [], time.perf_counter()
    for k in range(min(_BUILDING, len(names))):
        store.set(f"build/{k}", "go")
    for k, name in enumerate(names):
        reasons = [_await(store, f"ready/{k}/{rank}", watch) for rank in range(size)]
        if k + _BUILDING < len(names):
            store.set(f"build/{k + _BUILDING}", "go")
        seconds, started = time.perf_counter() - started, time.perf_counter()
        print(
            f"  {name}: {'unavailable' if any(reasons) else 'warm'} ({seconds:.0f} s)", flush=True
        )
        if any(reasons):
            row["unavailable"][name] = next(r for r in reasons if r)
            store.set(f"go/{k}/0", "stop")
        else:
            live.append(k)
            row["rounds"][name] = []
    for r in range(rounds):
        for k in live:
            store.set(f"go/{k}/{r}", "run")
            turn = json.loads(_await(store, f"done/{k}/{r}/0", watch))
            for rank in range(1, size):  # every rank done before the next world starts
                _await(store, f"done/{k}/{r}/{rank}", watch)
            row["rounds"][names[k]].append(turn.pop("ms"))
            row["turns"].append({"setting": names[k], "round": r, **turn})
    for k in live:
        store.set(f"go/{k}/{rounds}", "stop")
        infos = [json.loads(_await(store, f"info/{k}/{rank}", watch)) for rank in range(size)]
        memory = [info.pop("memory") for info in infos]
        row["memory"][names[k]] = memory[0]  # rank 0's
        row["info"][names[k]] = infos
    return row


# --- a rank ---------------------------------------------------------------------------------


class _Job(NamedTuple):
    world: int
    setting: Setting
    rank: int
    size: int
    host: str
    port: int


class _Options(NamedTuple):
    rounds: int
    steps: int
    warmup: int
    env: dict[str, str]
    follow_rss: bool
    backend: str


def _context(settings: Sequence[Setting]) -> Any:
    """Where the processes start: a forkserver that imports torch, fsync, the benchmarks and
    the builders' modules once, as it starts; on a machine with a GPU, fresh interpreters
    (spawn) instead, since a process forked from one that has touched the CUDA driver cannot
    use CUDA, and the preloaded imports do.

    A child runs the main module again as ``__mp_main__`` (spawn's rule) unless its server
    imported it: a script's (``python benchmarks/link.py``) is preloaded; a module run with
    ``-m`` is left out, since running it again finds itself imported and warns.
    """
    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    main = getattr(sys.modules["__main__"].__spec__, "name", None)
    modules = {*PRELOAD, "__main__" if main is None else main}
    # The preload is read once, as the server starts: every page module the caller has, so
    # that the later rounds' builders (another page's) are not imported child by child.
    modules |= {name for name in sys.modules if name.split(".")[0] == __package__}
    for setting in settings:
        modules.add(getattr(setting.build, "func", setting.build).__module__)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(sorted(modules - {main}))  # once: before the server starts
    return context


def _rank(job: _Job, options: _Options) -> None:
    # What the server imported stays alive: out of the collector's way, so that a
    # collection (leave_group's, the automatic ones) walks the setting's objects only, not
    # torch's and inductor's millions (1-2 s a collection here).
    gc.freeze()
    os.environ.update(options.env)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # Inductor compiles in this process: a pool of compile workers, fresh interpreters,
    # would be started by every world that compiles (the server read its size already).
    torch._inductor.config.compile_threads = 1
    if options.follow_rss:
        ctypes.CDLL("libc.so.6").mallopt(_MMAP_THRESHOLD, 65536)
    store = TCPStore(job.host, job.port, is_master=False, timeout=_WAIT)
    try:
        _turns(job, options, store)
    except Exception as error:
        # Said before this process exits, so that the failure the page reports is this one
        # and not a peer's collective that failed because this rank was gone.
        name = job.setting.name
        store.compare_set(_FAILED, "", f"setting {name!r}, rank {job.rank}: {error!r}")
        raise


def _turns(job: _Job, options: _Options, store: TCPStore) -> None:
    """A rank's world built, warmed up and through its turns (as the store says)."""
    k, rank = job.world, job.rank
    store.wait([f"build/{k}"])
    if options.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    group = PrefixStore(f"group/{k}", store)
    dist.init_process_group(options.backend, store=group, rank=rank, world_size=job.size)
    try:
        built = job.setting.build()
    except UnavailableError as why:
        store.set(f"ready/{k}/{rank}", str(why) or type(why).__name__)
        store.wait([f"go/{k}/0"])
        leave_group()
        return
    step = built if isinstance(built, Built) else Built(built)
    memory = {"built": rss_mib("VmRSS")}
    for _ in range(options.warmup * job.setting.repeat):
        step.step()
    dist.barrier()
    memory["warm"] = rss_mib("VmRSS")
    memory["since start"] = float(not reset_peak())
    store.set(f"ready/{k}/{rank}", "")
    for r in range(options.rounds + 1):
        store.wait([f"go/{k}/{r}"])
        if store.get(f"go/{k}/{r}") == b"stop":
            break
        dist.barrier()
        start, clock = time.time(), time.perf_counter()
        for _ in range(options.steps * job.setting.repeat):
            step.step()
        seconds = time.perf_counter() - clock
        per_step = 1000 * seconds / (options.steps * job.setting.repeat)
        turn = {"ms": per_step, "pid": os.getpid(), "start": start, "end": time.time()}
        store.set(f"done/{k}/{r}/{rank}", json.dumps(turn))
    memory["peak"] = rss_mib("VmHWM")
    info = step.info() if step.info is not None else {}
    store.set(f"info/{k}/{rank}", json.dumps({**info, "memory": memory}))
    del built, step  # a DDP among them: freed before its group (leave_group)
    leave_group()


def leave_group() -> None:
    """Waits for every rank, then destroys the default group, with no DDP left to outlive it.

    A ``DistributedDataParallel`` sits in a reference cycle, so it lives on until the
    garbage collector runs. Collected after ``destroy_process_group``, its Reducer holds the
    group's last reference and frees it with the GIL held; the gloo group's destructor then
    joins a worker thread that may be waiting for the GIL to free the work it just finished,
    and the rank hangs (pytorch/pytorch#56297): one of 20 of the memory page's DDP worlds
    did here. Collecting first frees every unreachable DDP while the group is still
    registered (a caller drops those it still holds first): none of 24 hung.
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def rss_mib(field: str) -> float:
    """``field`` of ``/proc/self/status`` (``VmRSS``: resident now, ``VmHWM``: its peak) in MiB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def reset_peak() -> bool:
    """Sets this process's peak RSS (``VmHWM``) to its RSS now; ``False`` where Linux refuses."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True

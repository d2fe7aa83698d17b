"""Replica processes of a fault-tolerant job (``fsync.ft`` over torchft) for the tests.

``Job`` starts an in-process lighthouse and replica processes, kills one with
SIGKILL where a test says (inside backward, with buckets in flight, or between
steps), restarts it, and reads what each replica left: a log of its steps (JSON
lines) and its final state. Every rank of a replica is forked from the server the
test suite's gloo ranks come from, which imported torch and fsync once (an
interpreter of its own spent ~2 s of CPU on that, twenty times a suite), so a
killed replica group starts again milliseconds after it died, sooner than torchrun
restarts one (``tests/test_examples.py`` runs torchrun's own restart).

A replica trains a small MLP (several buckets) with a transaction per step
until the job has committed ``steps`` steps. Its batch is a function of the
committed step and its replica index, so that a run without failures is the
same computation as plain fsync over that many ranks (``plain``).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import socket
import time
from typing import Any, NamedTuple

import torch

from tests._world import forked

WIDTH, DEPTH, BATCH = 16, 3, 8
# A replica's environment: one OpenMP thread, torchft's Rust side quiet but for errors.
ENV = {"OMP_NUM_THREADS": "1", "RUST_LOG": "error"}


class TrainState(NamedTuple):
    params: Any
    opt: Any
    sync: Any
    count: torch.Tensor  # the updates applied to params: must equal the committed steps


def model(width: int = WIDTH) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    params = {}
    for k in range(DEPTH):
        params[f"{k}.w"] = torch.randn(width, width) / width**0.5
        params[f"{k}.b"] = torch.zeros(width)
    return params


def batch(step: int, replica: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, kill: Any = None):
    h = x
    for k in range(DEPTH):
        h = h @ params[f"{k}.w"] + params[f"{k}.b"]
        if k == 0 and kill is not None:
            h.register_hook(kill)  # the first layer's gradient: the last buckets of backward
        if k < DEPTH - 1:
            h = torch.tanh(h)
    return ((h - y) ** 2).mean()


def setup(config: dict[str, Any], group: Any):
    """The sync, the optimizer and the initial state a replica (or a plain rank) starts with."""
    import fsync

    hook = fsync.ops.powersgd(rank=1, start_step=2) if config["hook"] == "powersgd" else None
    # ~1 KiB buckets: one per layer or two, so a kill in backward leaves some started.
    sync = fsync.GradSync(group=group, hook=hook, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    opt = fsync.optim.sgd(0.05, momentum=0.9)
    params = model(config.get("width", WIDTH))
    if config["mode"] in ("zero", "replicated"):  # the update split over a replica group's
        # ranks, or (replicated) whole on each, each bucket updated as its sum arrives
        build = fsync.ops.zero if config["mode"] == "zero" else fsync.ops.replicated
        zero = build(opt, group=group, bucket_cap_mb=0.001, first_bucket_mb=0.001)
        return zero, None, TrainState(params, (), zero.init(params), torch.tensor(0))
    if config["mode"] == "diloco":
        h = config.get("inner_steps", 2)
        outer = fsync.diloco(h, group=group, bucket_cap_mb=0.001, first_bucket_mb=0.001)
        state = TrainState(params, opt.init(params), outer.init(params), torch.tensor(0))
        return outer, opt, state
    state = TrainState(params, opt.init(params), sync.init(params), torch.tensor(0))
    return sync, opt, state


def train_step(sync: Any, opt: Any, config: dict[str, Any], rank: int, kill: Any):
    """``fn(state) -> (state, loss)``: one step at the state's count, data of ``rank``."""

    def step(state: TrainState) -> tuple[TrainState, float]:
        x, y = batch(int(state.count), rank, config.get("width", WIDTH))
        if config["mode"] == "diloco":
            loss, grads = torch.func.grad_and_value(loss_fn)(state.params, x, y)[::-1]
            params, opt_state = opt.update(state.params, grads, state.opt)
            params, outer_state = sync.update(params, state.sync)
            return TrainState(params, opt_state, outer_state, state.count + 1), float(loss)
        if config["mode"] in ("zero", "replicated"):
            call = sync.value_and_step(loss_fn)
            (params, loss), zero_state = call(state.sync, state.params, x, y, kill)
            return TrainState(params, (), zero_state, state.count + 1), float(loss)
        (grads, loss), sync_state = sync.grad_and_value(loss_fn)(
            state.sync, state.params, x, y, kill
        )
        params, opt_state = opt.update(state.params, grads, state.opt)
        return TrainState(params, opt_state, sync_state, state.count + 1), float(loss)

    return step


def name(index: int, rank: int, ranks: int) -> str:
    """A process's name in the files it leaves: its replica, and its rank in a replica group
    of several ranks."""
    return f"{index}" if ranks == 1 else f"{index}.{rank}"


def main(config: dict[str, Any]) -> None:
    """One rank of a replica: steps until the job has committed ``config["steps"]``.

    A replica group of several ranks (``config["ranks"]``) has a gloo group of its own
    (its TCPStore at ``config["store_port"]``, as torchrun's MASTER_PORT): its sync is
    hierarchical, within the group, then each rank's shard across replicas with rank
    ``r`` of the others (``fsync.ft.ReplicaMesh``).
    """
    import datetime

    import torch.distributed as dist

    import fsync.ft

    torch.set_num_threads(1)
    out = pathlib.Path(config["dir"])
    index, rank, ranks = config["replica"], config.get("rank", 0), config.get("ranks", 1)
    me = name(index, rank, ranks)
    log = open(out / f"log-{me}.jsonl", "a", buffering=1)  # noqa: SIM115
    store, local = None, None
    if ranks > 1:
        store = ("localhost", config["store_port"])
        tcp = dist.TCPStore(*store, is_master=False, wait_for_workers=False)
        # The group's process group under a prefix of this life's (as torchrun's does per
        # attempt); torchft's keys in the store itself, where a restart finds the last life's.
        prefixed = dist.PrefixStore(f"within/{config['life']}", tcp)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=ranks)
        local = dist.group.WORLD
    outage = {}
    if "outage_s" in config:  # how long the lighthouse may be away (else fsync.ft's default)
        outage["lighthouse_outage"] = datetime.timedelta(seconds=config["outage_s"])
    try:
        replica = fsync.ft.Replica.connect(
            config["lighthouse"],
            replica_id=f"replica_{index}",
            timeout=datetime.timedelta(seconds=config["timeout_s"]),
            quorum_timeout=datetime.timedelta(seconds=config.get("quorum_timeout_s", 30)),
            **outage,
            rank=rank,
            world_size=ranks,
            store=store,
            within=local,
        )
    except fsync.ft.QuorumError as error:  # the lighthouse away as this replica started
        lost = {"event": "no quorum", "t": time.time(), "error": str(error)}
        log.write(json.dumps(lost) + "\n")
        os._exit(4)
    sync, opt, state = setup(config, replica.group)
    (out / f"ready-{me}-{os.getpid()}").touch()
    every = config["replicas"] * ranks
    while len(list(out.glob("ready-*"))) < every and not config.get("restarted"):
        time.sleep(0.05)  # every replica's Manager up before the first quorum
    kill_at = config.get("kill")
    dies = kill_at is not None and kill_at.get("rank", 0) == rank and not config.get("restarted")
    kill_step = kill_at["step"] if dies else None  # (another rank of its group may die)

    def die(grad: torch.Tensor) -> torch.Tensor:
        if kill_at["when"] == "backward" and current["count"] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    current = {"count": -1}
    fn = train_step(sync, opt, config, index * ranks + rank, die if kill_step is not None else None)

    def step(state: TrainState) -> tuple[TrainState, float]:
        current["count"] = int(state.count)
        return fn(state)

    transaction = replica.step(step)
    log.write(json.dumps({"event": "start", "pid": os.getpid()}) + "\n")
    outcome = None
    until = config.get("until")  # a file the test writes when the others may stop

    def going_on() -> bool:
        if outcome is None or outcome.step < config["steps"]:
            return True
        if until is None or pathlib.Path(until).exists():
            return False
        time.sleep(0.05)  # stepping on, slowly, until the test has seen what it waits for
        return True

    while going_on():
        try:
            state, outcome = transaction(state)
        except ValueError as error:
            log.write(json.dumps({"event": "refused", "error": str(error)}) + "\n")
            replica.close()
            os._exit(3)
        except fsync.ft.QuorumError as error:
            lost = {"event": "no quorum", "t": time.time(), "error": str(error)}
            log.write(json.dumps(lost) + "\n")
            os._exit(4)
        log.write(
            json.dumps(
                {
                    "event": "step",
                    "t": time.time(),
                    "committed": outcome.committed,
                    "step": outcome.step,
                    "count": int(state.count),
                    "participants": outcome.participants,
                    "healed": outcome.healed,
                    "error": outcome.error,
                }
            )
            + "\n"
        )
        if kill_step is not None and kill_at["when"] == "between" and outcome.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save(state, out / f"final-{me}.pt")
    if config["mode"] in ("zero", "replicated"):  # the optimizer state whole (gathered within)
        full = fsync.ops.zero_state_dict(state.sync, sync)
        if rank == 0:
            torch.save(full, out / f"full-{me}.pt")
    log.write(json.dumps({"event": "done"}) + "\n")
    time.sleep(config.get("close_after_s", {}).get(str(rank), 0.0))  # a rank slow to close
    started = time.perf_counter()
    replica.close()
    log.write(json.dumps({"event": "closed", "s": time.perf_counter() - started}) + "\n")
    os._exit(0)  # torchft's threads need not be joined


def plain(config: dict[str, Any]) -> TrainState:
    """The same training with plain fsync over the default group (rank = replica index; with
    ``config["ranks"]``, over a 2-D mesh of (replicas, ranks): replica ``rank // ranks``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ranks, world, me = config.get("ranks", 1), dist.get_world_size(), dist.get_rank()
    group = None
    if ranks > 1:
        group = init_device_mesh("cpu", (world // ranks, ranks), mesh_dim_names=("node", "local"))
    sync, opt, state = setup(config, group)
    fn = train_step(sync, opt, config, me, None)
    for _ in range(config["steps"]):
        state, _ = fn(state)
    return state


def _free_port() -> int:
    """A TCP port nothing listens on now: the lighthouse's, kept across its restarts."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


class Job:
    """A lighthouse in this process and replica processes, each rank forked
    (``_world.forked``).

    A replica group of several ranks (``config["ranks"]``) is its ranks' processes and a
    TCPStore this process serves for them, kept across the group's restarts as torchrun
    keeps its own (so a restarted group finds what its last life wrote there); as torchrun
    does, a rank that fails ends its whole replica group (``wait``).
    """

    def __init__(self, tmp: pathlib.Path, config: dict[str, Any]) -> None:
        import fsync.ft

        self.dir = tmp
        # A quorum forms with ``min_replicas`` (a job that waits for a restarted replica has
        # all of them), and waits up to join_timeout_ms for the other live ones.
        minimum = config.get("min_replicas", 1)
        self._lighthouse = functools.partial(
            fsync.ft.lighthouse, min_replicas=minimum, join_timeout_ms=1000
        )
        self.lighthouse = self._lighthouse(port=_free_port())
        self.config = {**config, "dir": str(tmp), "lighthouse": self.lighthouse.address()}
        self.ranks: int = config.get("ranks", 1)
        self.procs: dict[int, list[Any]] = {}
        self._stores: dict[int, Any] = {}
        self._lives: dict[int, int] = {}  # how many times each replica has started, less one

    def start(self, index: int, **overrides: Any) -> None:
        life = self._lives[index] = self._lives.get(index, -1) + 1
        config = {**self.config, "replica": index, "life": life, **overrides}
        if self.ranks > 1:
            import torch.distributed as dist

            if index not in self._stores:
                self._stores[index] = dist.TCPStore(
                    "localhost", 0, is_master=True, wait_for_workers=False
                )
            config["store_port"] = self._stores[index].port
        self.procs[index] = []
        for rank in range(self.ranks):
            me = name(index, rank, self.ranks)
            output = self.dir / f"stderr-{me}.txt"  # appended to by each life
            self.procs[index].append(forked(_replica, {**config, "rank": rank}, str(output)))

    def wait(self, index: int, timeout: float) -> int:
        """Replica ``index``'s exit code: its first rank's that failed (the others are then
        killed), else 0."""
        procs, deadline = self.procs[index], time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [proc.exitcode for proc in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
        self.close()
        raise AssertionError(f"replica {index} ran over {timeout} s:\n{self.stderr(index)}")

    def stderr(self, index: int) -> str:
        return "".join(
            (self.dir / f"stderr-{name(index, r, self.ranks)}.txt").read_text()[-3000:]
            for r in range(self.ranks)
        )

    def log(self, index: int, rank: int = 0) -> list[dict[str, Any]]:
        lines = (self.dir / f"log-{name(index, rank, self.ranks)}.jsonl").read_text()
        return [json.loads(line) for line in lines.splitlines()]

    def final(self, index: int, rank: int = 0) -> TrainState:
        path = self.dir / f"final-{name(index, rank, self.ranks)}.pt"
        state: TrainState = torch.load(path, weights_only=False)
        return state

    def full_optimizer_state(self, index: int) -> Any:
        """A ZeRO replica group's optimizer state whole, as its rank 0 gathered it."""
        return torch.load(self.dir / f"full-{name(index, 0, self.ranks)}.pt", weights_only=False)

    def stop_lighthouse(self) -> None:
        """The lighthouse gone, as a crash or a restart takes it."""
        self.lighthouse.shutdown()
        self.lighthouse = None

    def start_lighthouse(self) -> None:
        """A lighthouse again, at the address of the last (empty: a restarted one)."""
        port = int(self.config["lighthouse"].rsplit(":", 1)[1])
        self.lighthouse = self._lighthouse(port=port)

    def kill(self, index: int) -> None:
        """Replica ``index``'s processes killed (SIGKILL), as a crash takes them."""
        _stop(self.procs[index])

    def close(self) -> None:
        for procs in self.procs.values():
            _stop(procs)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def _stop(procs: list[Any]) -> None:
    """Kills those of ``procs`` still running, and reaps them."""
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def _replica(config: dict[str, Any], output: str) -> None:
    """A replica's rank in a process forked for it: its output to ``output``, its
    environment :data:`ENV`, then :func:`main`."""
    fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(ENV)
    main(config)

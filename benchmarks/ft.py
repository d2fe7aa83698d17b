"""Fault-tolerant training on torchft: ``python -m benchmarks.ft`` writes ``docs/benchmarks-ft.md``.

Two replica groups of one process each, on gloo, meet through an in-process torchft
lighthouse (``fsync.ft.lighthouse``); each has a torchft ``Manager`` (hostname
``localhost``, port 0, synchronous quorum: the one ``fsync.ft.Replica.connect`` makes).
The page answers three questions:

1. What does a step cost on torchft when nothing fails? ``fsync.ft``'s transaction
   (``Replica.step`` around ``GradSync.grad_and_value`` over ``replica.group`` and an
   AdamW update) against plain fsync (``fsync.grad_and_value`` over an ordinary 2-rank
   gloo group), on the same model, batch and optimizer.
2. Against torchft's own module path: ``torchft.ddp.DistributedDataParallel`` with
   ``torchft.optim.OptimizerWrapper`` around ``torch.optim.AdamW``, eager, on the same
   Manager settings (and plain DDP beside it, for torchft's own cost).
3. How long does a failure cost? One replica is SIGKILLed at a known step and restarted;
   the timeline shows when the survivor commits again and when the restarted replica
   commits its first (healed) step, beside torchft's timeouts.

Questions 1 and 2 are timed as every page times settings (:mod:`benchmarks.harness`):
each setting in a world of processes of its own, the settings taking turns round by
round; a torchft setting's world gets a lighthouse of its own, made here and named to
its builder. The unshaped rate runs in the page's own process, 8 Gbit/s in a child of it
(``--child RATE``) under ``../shared/tools/slownet`` (which needs root); the recovery runs
unshaped, its replicas started as fresh interpreters (``--replica CONFIG``) so that a
restart costs what a real one does. By hand, one rate::

    ../shared/tools/slownet --rate 8gbit -- python -m benchmarks.ft --child 8gbit \\
        --json 8gbit.json

This module imports the harness and the steps where they are used, not at the top: a
replica process imports it too, and its start-up (timed by question 3) should be what a
training process pays, without ``torch._inductor`` (2 s here).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if not __package__:  # run as a script: the repository first, not benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

import fsync
import fsync.ft
from benchmarks import page, table
from benchmarks.constants import CAP_MB, LR, ROOT, caps
from benchmarks.models import Load, Workload
from benchmarks.page import label, row_key

if TYPE_CHECKING:
    from benchmarks.harness import Built, Row, Setting
    from benchmarks.table import Spread, Table, Target

RATES = ("unshaped", "8gbit")
PLAIN = "fsync, plain gloo group"
FT = "fsync.ft, Replica.step"
FT_REPLICATED = "fsync.ft, Replica.step, replicated value_and_step"
TORCHFT_DDP = "torchft DDP + OptimizerWrapper"
DDP = "DDP, plain gloo group"
SETTINGS = (PLAIN, FT, FT_REPLICATED, TORCHFT_DDP, DDP)
# Each world of these gets a lighthouse of its own.
TORCHFT_SETTINGS = (FT, FT_REPLICATED, TORCHFT_DDP)
OVERHEAD = 1.05  # fsync.ft's step <= 1.05x plain fsync's
AGAINST_DDP, AGAINST_DDP_RATE = 0.90, "8gbit"  # fsync.ft's step <= 0.90x torchft DDP's there
# Bucket caps per rate (MiB; None: each library's default, 25 MiB for DDP and fsync alike).
# Where the link waits, the rows run again with the slow-link page's 4 MiB: the last bucket
# backward completes is the one nothing can hide, and at 25 MiB the MLP's is 24 of its 32 MB.
CAPS: dict[str, tuple[float | None, ...]] = {"unshaped": (None,), "8gbit": (None, CAP_MB)}

# torchft's timeouts, as every Manager and lighthouse of this page has them.
TIMEOUT_S = 10.0  # the Manager's: a collective, a commit, a heal (a hung peer costs this)
QUORUM_TIMEOUT_S = 60.0  # the Manager's: how long a quorum may take to form
JOIN_TIMEOUT_MS = 1000  # the lighthouse's: how long a quorum waits for a replica it hears from
# torchft 0.2.0's defaults, which fsync.ft leaves as they are (`torchft_lighthouse --help`,
# torchft.Manager's signature): how long the lighthouse hears a dead replica's last
# heartbeat, and how often a Manager sends one.
HEARTBEAT_TIMEOUT_MS = 5000
HEARTBEAT_INTERVAL_MS = 100
SLACK_S = 2.0  # a recovery's target: within torchft's longest wait on its path + this


def loads(smoke: bool) -> list[Load]:
    """The benchmark MLP at batch 64 and the GPT at 256 tokens (4 sequences of 64)."""
    return [Load("MLP", 64, smoke=smoke), Load("GPT", 256, smoke=smoke)]


def local(address: str) -> str:
    """A lighthouse's address (``http://HOSTNAME:PORT``) through ``localhost``: it binds
    every interface, and inside slownet's namespace only the loopback is up."""
    return "http://localhost:" + address.rsplit(":", 1)[1]


# --- the steps, built in the settings' processes (and in the recovery's replicas) -------------


class State(NamedTuple):
    """What fsync.ft's transaction commits, and a replica that heals receives."""

    params: dict[str, torch.Tensor]
    opt: fsync.optim.AdamState
    sync: fsync.SyncState


Step = Callable[[State, tuple[torch.Tensor, ...]], tuple[State, fsync.ft.Outcome]]


def ft_training(
    replica: fsync.ft.Replica,
    work: Workload,
    loss: Callable[..., torch.Tensor],
    cap: float | None = None,
) -> tuple[Step, State]:
    """The transaction of one step (gradients synced over ``replica.group`` as backward
    produces them, in buckets of ``cap`` MiB, then ``fsync.optim.adamw``) and the state it
    starts from."""
    opt = fsync.optim.adamw(LR)
    sync = fsync.GradSync(group=replica.group, **caps(cap))
    grad_fn = sync.grad_and_value(loss)

    def train(state: State, batch: tuple[torch.Tensor, ...]) -> tuple[State, torch.Tensor]:
        (grads, value), sync_state = grad_fn(state.sync, state.params, batch)
        params, opt_state = opt.update(state.params, grads, state.opt)
        return State(params, opt_state, sync_state), value

    params = work.params()
    return replica.step(train), State(params, opt.init(params), sync.init(params))


def timeouts() -> dict[str, Any]:
    """Every Manager's timeouts on this page, as ``Replica.connect`` and torchft take them."""
    seconds = {"timeout": TIMEOUT_S, "quorum_timeout": QUORUM_TIMEOUT_S}
    return {name: datetime.timedelta(seconds=s) for name, s in seconds.items()}


def connect(lighthouse: str, replica_id: str) -> fsync.ft.Replica:
    """This page's replica: ``Replica.connect`` with its timeouts."""
    return fsync.ft.Replica.connect(lighthouse, replica_id=replica_id, **timeouts())


def ft_fsync(load: Load, cap: float | None, lighthouse: str) -> Built:
    """``fsync.ft``'s transaction, one replica group per rank of the world."""
    work = load.build()
    rank = dist.get_rank()
    replica = connect(lighthouse, f"replica_{rank}")
    step, state = ft_training(replica, work, work.functional_loss, cap)
    return _transacting(replica, step, state, work.batch(rank))


def ft_replicated(load: Load, cap: float | None, lighthouse: str) -> Built:
    """``fsync.ft``'s transaction around ``fsync.ops.replicated``'s ``value_and_step``:
    AdamW on each bucket as its sum across replicas arrives, the state whole."""
    work = load.build()
    rank = dist.get_rank()
    replica = connect(lighthouse, f"replica_{rank}")
    step = fsync.ops.replicated(fsync.optim.adamw(LR), group=replica.group, **caps(cap))
    call = step.value_and_step(work.functional_loss)

    def train(state: tuple[Any, Any], batch: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        (params, value), zero_state = call(state[1], state[0], batch)
        return (params, zero_state), value

    params = work.params()
    return _transacting(replica, replica.step(train), (params, step.init(params)), work.batch(rank))


def _transacting(
    replica: fsync.ft.Replica, step: Callable[..., Any], state: Any, batch: Any
) -> Built:
    """A setting's call: ``step`` (a transaction) from ``state`` on ``batch``, state kept."""
    from benchmarks.harness import Built

    box = [state]
    calls = [0]

    def call() -> None:
        box[0], _ = step(box[0], batch)
        calls[0] += 1

    return Built(call, lambda: _commits(replica.manager, calls[0]))


def torchft_ddp(load: Load, cap: float | None, lighthouse: str) -> Built:
    """torchft's module path: its DDP and ``OptimizerWrapper(torch.optim.AdamW)`` on a
    Manager made as ``Replica.connect`` makes fsync.ft's (``zero_grad`` starts the quorum,
    ``step`` asks ``should_commit``); the state it heals is the module's and AdamW's."""
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from benchmarks.harness import Built
    from benchmarks.steps import autograd_step
    from fsync.ft import _connect

    work = load.build()
    rank = dist.get_rank()
    manager = _connect.manager(lighthouse, f"replica_{rank}", **timeouts())
    model = DistributedDataParallel(manager, work.model, **caps(cap))
    optimizer = OptimizerWrapper(manager, torch.optim.AdamW(model.parameters(), lr=LR))

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def restore(sent: dict[str, Any]) -> None:
        model.load_state_dict(sent["model"])
        optimizer.load_state_dict(sent["optim"])

    manager.register_state_dict_fn("ddp", restore, save)
    train, calls = autograd_step(work, model, work.batch(rank), optimizer), [0]

    def step() -> None:
        train()
        calls[0] += 1

    return Built(step, lambda: _commits(manager, calls[0]))


def _commits(manager: Any, calls: int) -> dict[str, Any]:
    """Steps run and steps torchft committed (its step count) in a setting's world."""
    return {"steps": calls, "committed": int(manager.current_step())}


def row_settings(load: Load, cap: float | None, lighthouses: Mapping[str, str]) -> list[Setting]:
    """The steps of a row (:data:`SETTINGS`), in buckets of ``cap`` MiB, with AdamW;
    ``lighthouses``: each torchft setting's address."""
    from benchmarks import steps
    from benchmarks.steps import setting

    row: dict[str, Any] = {"load": load, "cap": cap}
    adamw = {**row, "optimizer": "adamw"}
    return [
        # fsync.grad_and_value over the world's own gloo group, then fsync.optim.adamw
        setting(PLAIN, steps.functional, sync="grad_and_value", **adamw),
        setting(FT, ft_fsync, lighthouse=lighthouses[FT], **row),
        setting(FT_REPLICATED, ft_replicated, lighthouse=lighthouses[FT_REPLICATED], **row),
        setting(TORCHFT_DDP, torchft_ddp, lighthouse=lighthouses[TORCHFT_DDP], **row),
        # torch.nn.parallel.DistributedDataParallel over it, torch.optim.AdamW
        setting(DDP, steps.module, ddp=True, **adamw),
    ]


# --- 3. recovery: replica processes, one killed and restarted ---------------------------------


def replica(config: dict[str, Any]) -> None:
    """One replica group of one process: fsync.ft's step until the job commits the step in
    the file ``stop``; at ``kill_at`` committed steps it SIGKILLs itself as its backward
    starts. Every event goes to ``log-{replica}-{life}.jsonl`` with its wall time."""
    torch.set_num_threads(1)
    out, index = pathlib.Path(config["dir"]), config["replica"]
    log = open(out / f"log-{index}-{config['life']}.jsonl", "a", buffering=1)  # noqa: SIM115

    def write(event: str, **more: Any) -> None:
        log.write(json.dumps({"event": event, "t": time.time(), **more}) + "\n")

    write("imported")
    me = connect(config["lighthouse"], f"replica_{index}")
    work = Load(*config["load"]).build()
    batch = work.batch(index)
    armed = [False]

    def die(grad: torch.Tensor) -> torch.Tensor:
        write("kill")
        os.kill(os.getpid(), signal.SIGKILL)
        return grad

    def loss(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        value = work.functional_loss(params, batch)
        if armed[0]:
            value.register_hook(die)  # type: ignore[no-untyped-call]  # backward's first
        return value

    step, state = ft_training(me, work, loss)
    write("ready")
    (out / f"ready-{index}-{config['life']}").touch()
    while config["life"] == 0 and len(list(out.glob("ready-*-0"))) < 2:
        time.sleep(0.02)  # both first lives' Managers up before the first quorum
    stop, outcome = out / "stop", None
    while True:
        committed = 0 if outcome is None else outcome.step
        armed[0] = config["kill_at"] is not None and committed == config["kill_at"]
        state, outcome = step(state, batch)
        write(
            "step",
            committed=outcome.committed,
            step=outcome.step,
            participants=outcome.participants,
            healed=outcome.healed,
            error=outcome.error,
        )
        if stop.exists() and outcome.step >= int(stop.read_text()):
            break
    write("done")
    me.close()
    os._exit(0)  # torchft's threads need not be joined


def recovery(load: Load, *, kill_at: int, after: int, deadline_s: float) -> dict[str, Any]:
    """Replicas 0 and 1 train ``load``; replica 1 kills itself at ``kill_at`` committed
    steps and is restarted at once; once it has committed ``after`` steps, both stop a few
    steps later. Returns :func:`timeline` of their logs."""
    lighthouse = fsync.ft.lighthouse(min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS)
    env = page.children_env({"OMP_NUM_THREADS": "1", "RUST_LOG": "error"})
    with tempfile.TemporaryDirectory(prefix="fsync-ft-") as tmp:
        out = pathlib.Path(tmp)
        base = {"lighthouse": local(lighthouse.address()), "dir": tmp, "load": list(load)}
        procs: dict[int, subprocess.Popen[bytes]] = {}

        def start(index: int, life: int, kill: int | None) -> None:
            config = {**base, "replica": index, "life": life, "kill_at": kill}
            command = [sys.executable, "-m", "benchmarks.ft", "--replica", json.dumps(config)]
            with open(out / f"stderr-{index}-{life}.txt", "wb") as err:
                procs[index] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=err, stderr=err)

        def failed(why: str) -> RuntimeError:
            logs = "".join(
                f"\n--- {path.name}:\n{path.read_text()[-2000:]}"
                for path in sorted(out.glob("stderr-*"))
            )
            return RuntimeError(f"recovery of {load}: {why}{logs}")

        started = time.time()
        start(0, 0, None)
        start(1, 0, kill_at)
        restarted_at: float | None = None
        try:
            while any(p.poll() is None for p in procs.values()):
                if time.time() - started > deadline_s:
                    raise failed(f"ran over {deadline_s:.0f} s")
                if restarted_at is None and (code := procs[1].poll()) is not None:
                    if code != -signal.SIGKILL:
                        raise failed(f"replica 1 exited with {code} before it was killed")
                    restarted_at = time.time()
                    start(1, 1, None)
                if restarted_at is not None and not (out / "stop").exists():
                    steps = [e for e in _log(out, 1, 1) if e["event"] == "step"]
                    if sum(e["committed"] for e in steps) >= after:
                        # A few steps on: both replicas are at most one step past their logs.
                        (out / "stop.tmp").write_text(str(steps[-1]["step"] + 3))
                        (out / "stop.tmp").rename(out / "stop")
                if any(p.poll() not in (None, 0, -signal.SIGKILL) for p in procs.values()):
                    raise failed("a replica failed")
                time.sleep(0.02)
            if restarted_at is None:
                raise failed("replica 1 finished without being killed")
            logs = {name: _log(out, i, life) for name, (i, life) in LIVES.items()}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            lighthouse.shutdown()
    return timeline(logs, restarted_at, kill_at)


LIVES = {"survivor": (0, 0), "victim": (1, 0), "restarted": (1, 1)}


def _log(out: pathlib.Path, index: int, life: int) -> list[dict[str, Any]]:
    path = out / f"log-{index}-{life}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def timeline(
    logs: Mapping[str, list[dict[str, Any]]], restarted_at: float, kill_at: int
) -> dict[str, Any]:
    """The recovery read off the replicas' logs (``survivor``, ``victim``: replica 1's first
    life, ``restarted``: its second), in seconds since the kill.

    Returns ``events`` (what happened, in order, with its time since the kill), the two
    figures the targets judge (``survivor_s``: the kill to the survivor's next committed
    step; ``restart_s``: the restarted process's start to its first committed step), whether
    that step healed, and the survivor's median step before the kill (``step_s``).

    Raises:
        ValueError: A log lacks an event the timeline needs (the run went wrong).
    """

    def first(name: str, what: str, test: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        found = next((e for e in logs[name] if test(e)), None)
        if found is None:
            raise ValueError(f"the {name}'s log has no {what}: {logs[name][-5:]}")
        return found

    kill = first("victim", "kill", lambda e: e["event"] == "kill")["t"]
    steps = {name: [e for e in logs[name] if e["event"] == "step"] for name in logs}
    before = [e["t"] for e in steps["survivor"] if e["t"] < kill]
    failed = first(
        "survivor", "step after the kill", lambda e: e["event"] == "step" and e["t"] > kill
    )
    alone = first(
        "survivor",
        "committed step after the kill",
        lambda e: e["event"] == "step" and e["t"] > kill and e["committed"],
    )
    rejoined = first(
        "survivor",
        "step committed by 2 replicas after the restart",
        lambda e: (
            e["event"] == "step"
            and e["t"] > restarted_at
            and e["committed"]
            and e["participants"] == 2
        ),
    )
    imported = first("restarted", "start", lambda e: e["event"] == "imported")["t"]
    ready = first("restarted", "ready", lambda e: e["event"] == "ready")["t"]
    healed = first("restarted", "committed step", lambda e: e["event"] == "step" and e["committed"])
    discarded = "committed" if failed["committed"] else "discarded"
    events = [
        (f"replica 1 SIGKILLed as backward starts, {kill_at} steps committed", kill),
        (f"replica 0: the step in flight {discarded}", failed["t"]),
        (f"replica 0: next step committed, {alone['participants']} replica(s)", alone["t"]),
        ("replica 1 restarted (a new process)", restarted_at),
        ("replica 1: torch, fsync, torchft imported", imported),
        ("replica 1: Manager up, model built", ready),
        (
            f"replica 1: first step committed ({'healed' if healed['healed'] else 'not healed'}"
            f" at step {healed['step'] - 1})",
            healed["t"],
        ),
        ("replica 0: first step committed by 2 replicas again", rejoined["t"]),
    ]
    gaps = [b - a for a, b in itertools.pairwise(before)]
    return {
        "events": sorted(([what, t - kill] for what, t in events), key=lambda e: e[1]),
        "survivor_s": alone["t"] - kill,
        "restart_s": healed["t"] - restarted_at,
        "healed": bool(healed["healed"]),
        "rejoined_s": rejoined["t"] - kill,
        "step_s": statistics.median(gaps) if gaps else float("nan"),
        "kill_at": kill_at,
    }


# --- one rate, in its namespace -------------------------------------------------------------


def measure(args: argparse.Namespace, rate: str, env: Mapping[str, str]) -> dict[str, Any]:
    """Every row at ``rate`` (the loopback already shaped), ``env`` set in every setting's
    processes; the recovery where unshaped."""
    from benchmarks import harness

    os.environ.setdefault("RUST_LOG", "error")  # the lighthouses' log: errors only
    out: dict[str, Any] = {"steps": {}, "recovery": {}}
    for load, cap in itertools.product(loads(args.smoke), CAPS[rate]):
        started = time.perf_counter()
        made = {
            n: fsync.ft.lighthouse(min_replicas=2, join_timeout_ms=JOIN_TIMEOUT_MS)
            for n in TORCHFT_SETTINGS
        }
        try:
            addresses = {name: local(lighthouse.address()) for name, lighthouse in made.items()}
            out["steps"][row_key(load, cap, None)] = harness.turns(
                row_settings(load, cap, addresses),
                **page.timing(args),
                env={**env, "RUST_LOG": "error"},
            )
        finally:
            for lighthouse in made.values():
                lighthouse.shutdown()
        took = time.perf_counter() - started
        print(f"ft {rate}: {row_key(load, cap, None)} ({took:.0f} s)", flush=True)
    if rate == "unshaped":
        kill_at, after = (2, 1) if args.smoke else (5, 3)
        for load in loads(args.smoke):
            started = time.perf_counter()
            found = recovery(
                load, kill_at=kill_at, after=after, deadline_s=120 if args.smoke else 300
            )
            out["recovery"][str(load)] = found
            print(f"ft recovery: {load} ({time.perf_counter() - started:.0f} s)", flush=True)
    return out


# --- the page --------------------------------------------------------------------------------


def bound_s() -> float:
    """A recovery's target: torchft's longest wait on its path plus :data:`SLACK_S`.

    That wait is the lighthouse's heartbeat timeout: a quorum must hold more than half of
    the replicas heard from within it (torchft's guard against a split brain), so the
    survivor of two gets none until the dead replica's last heartbeat is that old or the
    restarted one joins; the join timeout, shorter, only waits for replicas still heard.
    """
    return max(HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS) / 1000 + SLACK_S


def targets(results: Mapping[str, Any]) -> list[Target]:
    """(target, measured, met), judged on the median over the rounds; ``not run`` where a
    rate or a row was not run."""

    def ratio(rate: str, key: str, name: str, base: str) -> Spread | None:
        return table.ran(results.get(rate, {}).get("steps", {}).get(key), name, base)

    out: list[Target] = []
    keys = [str(load) for load in loads(False)]
    for rate in RATES:
        for key in keys:
            text = f"{key}: fsync.ft <= {OVERHEAD:.2f}x plain fsync, {label(rate)}"
            out.append(table.check(text, ratio(rate, key, FT, PLAIN), OVERHEAD))
    against = f"{AGAINST_DDP:.2f}x torchft DDP, {label(AGAINST_DDP_RATE)}"
    for load, cap in itertools.product(loads(False), CAPS[AGAINST_DDP_RATE]):
        key = row_key(load, cap, None)
        for name, what in ((FT, "fsync.ft"), (FT_REPLICATED, "fsync.ft replicated")):
            text = f"{key}: {what} <= {against}"
            out.append(
                table.check(text, ratio(AGAINST_DDP_RATE, key, name, TORCHFT_DDP), AGAINST_DDP)
            )
    bound = bound_s()
    recovered = results.get("unshaped", {}).get("recovery", {})
    for key in keys:
        found = recovered.get(key)
        for what, field in (
            ("survivor: the kill to its next committed step", "survivor_s"),
            ("restarted replica: its start to its first committed step (healed)", "restart_s"),
        ):
            text = f"{key}: {what} <= {bound:g} s"
            if found is None:
                out.append((text, "not run", None))
                continue
            healed = field == "survivor_s" or found["healed"]
            seconds = found[field]
            note = "" if healed else ", not healed"
            out.append((text, f"{seconds:.2f} s{note}", seconds <= bound and healed))
    return out


def tables(results: Mapping[str, Any]) -> list[tuple[Table, str]]:
    """Every table of the page, with the note printed above it."""
    out: list[tuple[Table, str]] = []
    for rate, found in results.items():
        cells = []
        for key, row in found.get("steps", {}).items():

            def committed(name: str, row: Row = row) -> list[str]:
                info = row["info"][name][0]
                return [f"{info['committed']}/{info['steps']}" if "steps" in info else "-"]

            cells += table.timings(row, PLAIN, TORCHFT_DDP, extra=committed, prefix=f"{key}: ")
        header = ["", "ms", "vs plain fsync", "vs torchft DDP", "steps committed"]
        title = f"Step time without failures, {label(rate)}"
        out.append(((title, header, cells), STEPS_NOTE if rate == "unshaped" else ""))
    recovered = results.get("unshaped", {}).get("recovery", {})
    if recovered:
        bound = bound_s()
        header = [
            "",
            "step before (s)",
            "survivor: kill -> next commit (s)",
            "restarted: start -> first commit (s)",
            "healed",
            "survivor: kill -> 2 replicas again (s)",
            "target (s)",
        ]
        cells = [
            [
                key,
                f"{r['step_s']:.2f}",
                f"{r['survivor_s']:.2f}",
                f"{r['restart_s']:.2f}",
                "yes" if r["healed"] else "**no**",
                f"{r['rejoined_s']:.2f}",
                f"{bound:g}",
            ]
            for key, r in recovered.items()
        ]
        out.append((("Recovery from a killed replica, unshaped", header, cells), RECOVERY_NOTE))
        for key, r in recovered.items():
            lines = [[what, f"{t:+.2f}"] for what, t in r["events"]]
            out.append(((f"Recovery timeline: {key}", ["event", "s since the kill"], lines), ""))
        timeouts = [
            ["lighthouse: join timeout", f"{JOIN_TIMEOUT_MS / 1000:g}", JOIN_NOTE],
            ["lighthouse: heartbeat timeout", f"{HEARTBEAT_TIMEOUT_MS / 1000:g}", HEARTBEAT_NOTE],
            [
                "Manager: heartbeat interval",
                f"{HEARTBEAT_INTERVAL_MS / 1000:g}",
                "torchft's default",
            ],
            ["Manager: timeout", f"{TIMEOUT_S:g}", TIMEOUT_NOTE],
            ["Manager: quorum timeout", f"{QUORUM_TIMEOUT_S:g}", "how long a quorum may take"],
        ]
        out.append(
            (("torchft's timeouts in these runs", ["", "s", "what it bounds"], timeouts), "")
        )
    return out


READING = (
    "Written by `python -m benchmarks.ft` (or `python benchmarks/run.py --only ft`; the "
    "8 Gbit/s rows need root, for `../shared/tools/slownet`). Two replica groups of one "
    "process each, on gloo, with torchft 0.2.0: an in-process lighthouse "
    "(`fsync.ft.lighthouse`) and a `Manager` per replica (hostname `localhost`, port 0, "
    "synchronous quorum), made as `fsync.ft.Replica.connect` makes it. Each setting of a "
    "row ran in a world of processes of its own (a torchft setting's world with a "
    "lighthouse of its own), and the settings took turns, world after world, round after "
    "round (`benchmarks/harness.py`): a figure in ms is the median over the rounds of a "
    "turn's time per step on rank 0; a ratio is taken round by round and given as "
    "`median [lowest, highest]`; a target is judged on the median. Every setting trains "
    "with AdamW (lr 1e-3, weight decay 1e-2) on the same model and batch; the MLP is the "
    "benchmark MLP (8.4M parameters) at batch 64, the GPT 6 layers, d_model 512 (21M "
    "parameters) at 256 tokens per rank (4 sequences of 64)."
)
STEPS_NOTE = (
    "*fsync, plain gloo group*: `fsync.grad_and_value` over the world's 2-rank gloo group, "
    "then `fsync.optim.adamw`. *fsync.ft, Replica.step*: the transaction of "
    "docs/fault-tolerance.md, `Replica.step` around `GradSync(group=replica.group)"
    ".grad_and_value` and `fsync.optim.adamw` (a quorum and a `should_commit` per step, "
    "every bucket on the Manager's process group). *fsync.ft, Replica.step, replicated "
    "value_and_step*: the same transaction around `fsync.ops.replicated(fsync.optim.adamw, "
    "group=replica.group).value_and_step`, which updates each bucket as its sum across "
    "replicas arrives, while the buckets after it are still on the link (the state whole on "
    "each replica, healed whole). *torchft DDP + OptimizerWrapper*: "
    "`torchft.ddp.DistributedDataParallel(manager, model)` and "
    "`torchft.optim.OptimizerWrapper(manager, torch.optim.AdamW(...))` on the same Manager "
    "settings (synchronous quorum; torchft's default starts the quorum asynchronously, "
    "which fsync.ft's transaction cannot). *DDP, plain gloo group*: "
    "`torch.nn.parallel.DistributedDataParallel` and `torch.optim.AdamW`. Every setting "
    "uses its library's default buckets (25 MiB, the first 1 MiB) unless its row says "
    "otherwise: at 8 Gbit/s each row runs again with 4 MiB buckets for every setting "
    "(`bucket_cap_mb=4`, as on the slow-link page), since the last bucket backward "
    "completes waits on the link after backward whatever the library does, and at 25 MiB "
    "the MLP's last bucket holds 24 of its 32 MiB. *steps committed*: torchft's step count "
    "over the steps run (warm-up included); every step should commit."
)
RECOVERY_NOTE = (
    "A lighthouse with `min_replicas=1` and two replicas training fsync.ft's step; replica 1 "
    "SIGKILLs itself as the backward of a known step starts (a hook on the loss's "
    "gradient), and this page restarts it at once as a new process (a fresh interpreter, "
    "as a job scheduler would). Times are wall clock: from the kill (replica 1's last log "
    "line) to the survivor's next committed step; from the restart (the new process's "
    "creation) to the restarted replica's first committed step, whose state it received "
    "from the survivor (*healed*); and from the kill to the survivor's first step with both "
    "replicas again. *step before*: the survivor's median step before the kill. With two "
    "replicas the survivor cannot go on alone at once: torchft's lighthouse forms a quorum "
    "only of more than half of the replicas it has heard from within its heartbeat timeout "
    "(a guard against a split brain), so the survivor waits until the dead replica's last "
    "heartbeat is that old or the restarted replica joins, whichever comes first. The "
    f"target for both: that timeout ({HEARTBEAT_TIMEOUT_MS / 1000:g} s) plus {SLACK_S:g} s."
)
JOIN_NOTE = (
    "how long a quorum waits for a replica that the lighthouse hears from but that has not "
    "asked to join; not what a lone survivor of two waits for (the heartbeat timeout is)"
)
HEARTBEAT_NOTE = (
    "torchft's default: a replica silent this long is dead to the lighthouse; until then a "
    "quorum needs more than half of the replicas heard from, so a lone survivor of two waits"
)
TIMEOUT_NOTE = (
    "a collective, a commit, a heal: a hung peer costs the survivors this much once; a "
    "killed one shows at once (its sockets close)"
)


def environment(args: argparse.Namespace, results: Mapping[str, Any]) -> dict[str, str]:
    """What the page adds to the table of what it was measured on."""
    return {
        "torchft": importlib.metadata.version("torchft"),
        "backend": "gloo on CPU, 2 replica groups of 1 rank, 1 intra-op thread each",
        "rates": ", ".join(label(r) for r in results) or "none",
        "rounds": f"{args.rounds}, of {args.steps} steps each (after {args.warmup} untimed)",
    }


def _replica_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", metavar="CONFIG", help=argparse.SUPPRESS)


PAGE = page.Page(
    file="benchmarks-ft.md",
    title="Benchmarks: fault tolerance on torchft",
    module="benchmarks.ft",
    measure=measure,
    targets=targets,
    tables=tables,
    intro=(READING,),
    # 10 steps a turn: a turn of 3 (0.4 s of the MLP) was shorter than the swings of these
    # shared 2 cores, which moved a round's ratio by up to a third.
    timing=page.Timing(rounds=10, steps=10, warmup=3),
    rates=RATES,
    environment=environment,
    flags=_replica_flag,
)


def main(argv: list[str] | None = None) -> int:
    args = page.parse(PAGE, argv)
    if args.replica:
        replica(json.loads(args.replica))
        return 0
    return page.run(PAGE, args)


if __name__ == "__main__":
    from benchmarks import ft  # this module by name, so that its builders pickle

    sys.exit(ft.main())

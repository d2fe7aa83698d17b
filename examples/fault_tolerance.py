"""The main job surviving a dead replica: fsync.ft on torchft, each step a transaction.

Run three replicas on one machine, kill replica 1 with SIGKILL in the middle of
its backward pass at step 20 (its first buckets already on the wire) and restart it:

    python examples/fault_tolerance.py --replicas 3 --steps 60 --kill 1:20

This process starts a torchft lighthouse and one process per replica group
(``--replica K``, which is also how a cluster starts them, each with the
lighthouse's address); it restarts a replica that died of a signal, once. Each
replica trains ``train.py``'s MLP on its own shard of the same synthetic task,
eagerly: ``fsync.ft.Replica.step`` wraps the functional step (gradients synced
across the live replicas during backward, ``fsync.optim.adam``), so a step whose
collectives fail is discarded and the survivors go on; the restarted replica
heals from a peer (parameters, Adam state, sync state, step count). At the end
every replica has committed the same steps, and this process checks that their
parameters and optimizer states are identical, bit for bit.

Replica groups of several ranks, each group started by torchrun (whose
``--max-restarts`` restarts a group one of whose ranks died), the last rank of
replica 1 killed in backward at step 20:

    python examples/fault_tolerance.py --replicas 2 --ranks-per-replica 2 --steps 60 --kill 1:20

Within a group the sync is hierarchical (``fsync.ft.ReplicaMesh``): each bucket
reduce-scattered within the group, each rank's shard reduced across replicas
through its own torchft Manager, gathered within. Each rank trains on a shard of
its own; at the end every rank of every group holds the same state.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
from torch import nn
from train import make_model

import fsync
import fsync.ft


class State(NamedTuple):
    """Everything a step commits, and a peer that heals receives."""

    params: dict[str, torch.Tensor]
    opt: Any
    sync: fsync.SyncState


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3, help="replica groups to start")
    parser.add_argument(
        "--ranks-per-replica",
        type=int,
        default=1,
        help="ranks of each replica group (more than one: each group is a torchrun of its own)",
    )
    parser.add_argument("--steps", type=int, default=60, help="steps the job commits")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--kill",
        default=None,
        metavar="REPLICA:STEP",
        help="SIGKILL a replica (its last rank) in backward",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="torchft's timeout (s)")
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="replicas a step needs (default: all, so that the survivors wait, at the quorum, "
        "for a killed replica's restart; with fewer they go on without it, and a run that "
        "ends before it is back leaves it nothing to heal from)",
    )
    parser.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--die-at", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def replica(args: argparse.Namespace) -> None:
    """One rank of a replica group: train until the job has committed ``--steps``.

    Under torchrun (``WORLD_SIZE`` > 1) the group's ranks form a gloo group of
    their own and ``replica.group`` is two-level; a group restarted by torchrun
    (``TORCHELASTIC_RESTART_COUNT``) is not killed again.
    """
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    rank, ranks = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if ranks == 1:
        me = fsync.ft.Replica.connect(
            args.lighthouse, replica_id=f"replica_{args.replica}", timeout=timeout
        )
    else:
        group_under_torchrun(rank, ranks, timeout)
        me = fsync.ft.Replica.connect(
            args.lighthouse,
            replica_id=f"replica_{args.replica}",
            timeout=timeout,
            rank=rank,
            world_size=ranks,
            store=(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
            within=dist.group.WORLD,
        )
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    die_at = args.die_at if rank == ranks - 1 and first_life else None
    torch.manual_seed(0)  # the same teacher and initial student in every replica
    teacher, model = make_model(64), make_model(args.width)
    params = {name: p.detach() for name, p in model.named_parameters()}
    opt = fsync.optim.adam(args.lr)
    sync = fsync.GradSync(group=me.group, bucket_cap_mb=0.25, first_bucket_mb=0.25)
    state = State(params, opt.init(params), sync.init(params))

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        out = torch.func.functional_call(model, params, (x,))
        if die_at is not None and int(state.sync.step) == die_at:
            out.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        return nn.functional.mse_loss(out, y)

    grad_fn = sync.grad_and_value(loss_fn)
    shard = args.replica * ranks + rank

    def train_step(state: State) -> tuple[State, float]:
        # The batch of the step the job is at (after a heal, the peer's): this rank's shard.
        data = torch.Generator().manual_seed(1000 * int(state.sync.step) + shard)
        x = torch.randn(args.batch, 32, generator=data)
        with torch.no_grad():
            y = teacher(x)
        (grads, loss), sync_state = grad_fn(state.sync, state.params, x, y)
        params, opt_state = opt.update(state.params, grads, state.opt)
        return State(params, opt_state, sync_state), float(loss)

    step = me.step(train_step)
    report = {"committed": 0, "discarded": 0, "healed": 0, "slowest_s": 0.0, "loss": None}
    outcome = None
    while outcome is None or outcome.step < args.steps:
        started = time.perf_counter()
        state, outcome = step(state)
        report["slowest_s"] = max(report["slowest_s"], time.perf_counter() - started)
        report["committed" if outcome.committed else "discarded"] += 1
        report["healed"] += outcome.healed
        if outcome.committed:
            report["loss"] = outcome.value
    torch.save(state, pathlib.Path(args.out) / f"state-{args.replica}-{rank}.pt")
    report_file = pathlib.Path(args.out) / f"report-{args.replica}-{rank}.json"
    report_file.write_text(json.dumps({**report, "restarted_by_torchrun": not first_life}))
    me.close()
    os._exit(0)  # torchft's threads need not be joined


def group_under_torchrun(rank: int, ranks: int, timeout: datetime.timedelta) -> None:
    """This replica group's gloo group, on torchrun's store under a prefix of its own per life.

    torchrun keeps its store across ``--max-restarts``: a plain
    ``init_process_group("gloo")`` in a restarted group can read the dead
    ranks' addresses there and fail ("Gloo connectFullMesh failed ... Connection
    refused"), seen with torch 2.13. Every rank of the group is restarted
    together, so ``TORCHELASTIC_RESTART_COUNT`` names its life on all of them.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"replica_group/{life}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=ranks, timeout=timeout)


def launch(args: argparse.Namespace) -> None:
    """The lighthouse here, each replica group, one restart of a killed one, the checks.

    A group of one rank is a process of this script, restarted here once if it
    died of a signal; a group of several is a torchrun, whose ``--max-restarts 1``
    restarts all of its ranks when one dies.
    """
    minimum = args.replicas if args.min_replicas is None else args.min_replicas
    lighthouse = fsync.ft.lighthouse(min_replicas=minimum, join_timeout_ms=1000)
    try:
        with tempfile.TemporaryDirectory(prefix="fsync-ft-") as out:
            run_replicas(args, lighthouse.address(), pathlib.Path(out))
    finally:
        lighthouse.shutdown()


def run_replicas(args: argparse.Namespace, lighthouse: str, out: pathlib.Path) -> None:
    """Every replica group to the end (a killed one started again once), then the checks:
    the replicas' reports and states, written to ``out``."""
    kill = None if args.kill is None else tuple(int(v) for v in args.kill.split(":"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
    ranks = args.ranks_per_replica

    def start(k: int, die_at: int | None = None) -> subprocess.Popen[bytes]:
        command = [sys.executable, __file__, "--replica", str(k), "--out", str(out)]
        if ranks > 1:  # torchrun's store on a free port; one restart of all the group's ranks
            torchrun = ["-m", "torch.distributed.run", "--standalone", "--max-restarts", "1"]
            logs = ["--log-dir", str(out / "torchrun")]  # else a /tmp/torchelastic_* per run
            command[1:1] = [*torchrun, *logs, "--nproc-per-node", str(ranks)]
        command += ["--lighthouse", lighthouse, "--steps", str(args.steps)]
        command += ["--batch", str(args.batch), "--width", str(args.width), "--lr", str(args.lr)]
        command += ["--timeout", str(args.timeout)]
        command += [] if die_at is None else ["--die-at", str(die_at)]
        return subprocess.Popen(command, env=env)

    print(
        f"fsync {fsync.__version__} on torchft: {args.replicas} replicas"
        + ("" if ranks == 1 else f" of {ranks} ranks")
        + f", {args.steps} steps"
        + ("" if kill is None else f", replica {kill[0]} killed in backward at step {kill[1]}")
    )
    started = time.perf_counter()
    procs = {
        k: start(k, kill[1] if kill is not None and kill[0] == k else None)
        for k in range(args.replicas)
    }
    restarted = set()
    while procs:
        time.sleep(0.1)
        for k, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            if code == -signal.SIGKILL and k not in restarted:
                print(f"replica {k} was killed; restarting it")
                restarted.add(k)
                procs[k] = start(k)
                continue
            if code != 0:  # the others would wait for it until their timeouts
                for other in procs.values():
                    other.terminate()  # torchrun passes it on to its ranks
                raise SystemExit(f"replica {k} failed with exit code {code}")
            del procs[k]
    elapsed = time.perf_counter() - started
    names = [(k, r) for k in range(args.replicas) for r in range(ranks)]
    states = [torch.load(out / f"state-{k}-{r}.pt", weights_only=False) for k, r in names]
    for k, r in names:
        report = json.loads((out / f"report-{k}-{r}.json").read_text())
        print(
            f"replica {k}{'' if ranks == 1 else f' rank {r}'}: {report['committed']} steps "
            f"committed, {report['discarded']} discarded, healed {report['healed']} times, "
            f"slowest step {report['slowest_s']:.2f} s, last loss {report['loss']:.4f}"
            + (" (restarted by torchrun)" if report["restarted_by_torchrun"] else "")
        )
    leaves = [optree.tree_leaves(s) for s in states]
    same = all(
        all(torch.equal(a, b) for a, b in zip(leaves[0], other, strict=True) if not a.is_meta)
        for other in leaves[1:]
    )
    steps = {int(s.sync.step) for s in states}
    print(f"{args.steps} steps in {elapsed:.1f} s; sync steps {sorted(steps)}")
    if not same or steps != {args.steps}:
        raise SystemExit("FAILED: the replicas' states differ")
    everyone = f"all {args.replicas} replicas" + ("" if ranks == 1 else f" x {ranks} ranks")
    print(f"OK: parameters and optimizer states identical on {everyone}")


def main() -> None:
    args = parse_args()
    replica(args) if args.replica is not None else launch(args)


if __name__ == "__main__":
    main()

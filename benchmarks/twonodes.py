"""The hierarchical mean on two nodes: ``python benchmarks/run.py --only twonodes``.

A 2-D mesh pays where the link between nodes is slower than the links within
one, which one shaped loopback cannot show (every byte of it is as slow as
every other). ``../shared/tools/twonodes`` (or ``--twonodes PATH``; it needs
root) makes two network namespaces, each with its own fast loopback, joined by
a cable shaped to a rate. For each rate (10, 4 and 1 Gbit/s) this module
re-runs itself on both nodes as ``torchrun --nnodes 2 --nproc-per-node 2``
(``--child RATE``: 4 ranks as a 2 x 2 mesh, dims ``("node", "local")``); rank 0
writes its results as JSON to a path on the filesystem the nodes share, and the
parent writes ``docs/benchmarks-twonodes.md`` and one figure per question
(:mod:`benchmarks.twonodes_report`). Where ``twonodes`` cannot make its
namespaces (exit status 3: not root) the section says so and is skipped.
``--smoke`` runs tiny sizes in one world of 4 ranks on this machine's loopback
(``--rates local``), without ``twonodes`` (what CI runs); ``--smoke --rates 1gbit``
runs the tiny sizes on two nodes.

By hand, one rate, as the parent launches it (from the repository root)::

    ../shared/tools/twonodes --rate 1gbit -- 'torchrun --nnodes 2 --node-rank $NODE_RANK \\
        --nproc-per-node 2 --master-addr $MASTER_ADDR --master-port 29500 \\
        benchmarks/twonodes.py --child 1gbit --json /tmp/1gbit.json'

What each rate measures, with 4 MiB buckets throughout (fsync and DDP alike):

1. the sync alone, on a tree of 20 MiB in 12 leaves and on the benchmark GPT's
   gradients (21M parameters, 80 MiB): one ``dist.all_reduce`` of a flat tensor
   of all the bytes over the 4 ranks (the flat floor), ``fsync.sync_grads`` over
   the default group, and ``sync_grads(group=mesh)`` eager, under
   ``fsync.compile``, with ``bf16_compress()`` and with
   ``batched_powersgd(4, start_step=0)`` across nodes (the last through
   ``GradSync``, which threads its state); the median of ``--steps`` calls;
2. the GPT's training step (batch 4 sequences of 64 tokens per rank, SGD): DDP
   eager, ``fsync.grad_and_value`` over the default group (flat), and over the
   mesh eager, compiled (``fsync.compile`` of the whole step) and with bf16
   across nodes; ``DeferredSync`` over 4 micro-batches of 1 sequence (``add``
   each, ``finish`` once) against DDP with ``no_sync`` over the same 4; and
   ``fsync.diloco(8, group=mesh, hook=bf16_compress())`` after a compiled local
   step. The settings take turns, a whole round of H = 8 steps each (DiLoCo syncs
   once a round), ``--rounds`` times; a step's figure is the median of its rounds'
   means, after a warm-up (a whole round for DiLoCo). The sync alone's settings
   take turns two calls at a time, the same way.

Beside each time, what crosses nodes per rank per step, from
[fsync.sync_stats][] with ``world_size=(2, 2)`` (``bytes_on(0)``; a flat
all-reduce's bytes all count, as its ring crosses the node boundary), and what
that puts on each direction of the cable in a ring model: a ring all-reduce of
``B`` bytes over ``N`` ranks sends ``2 (N - 1) / N * B`` over each of its
links; the flat ring crosses the cable once each way, the hierarchical
cross-node hop is ``local`` rings of two, all on the cable.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fsync  # noqa: E402
from benchmarks import cases, link, models  # noqa: E402

RATES = ("10gbit", "4gbit", "1gbit")
SMOKE_RATE = "local"  # --smoke: one 4-rank world on this machine's loopback
TWONODES = ROOT.parent / "shared" / "tools" / "twonodes"
NODES, LOCAL = 2, 2
CAP_MB = link.CAP_MB
INNER_STEPS = 8  # DiLoCo's H, and the round every step time is averaged over
MICRO_BATCHES = 4
POWERSGD_RANK = 4
TREE = "20 MiB in 12 leaves"
GPT = "GPT"
# 1. The sync alone, on each tree.
FLAT = "flat all-reduce of all the bytes (dist.all_reduce, 4 ranks)"
SYNC_FLAT = "sync_grads, flat (default group)"
HIER = "sync_grads(group=mesh), eager"
HIER_COMPILED = "sync_grads(group=mesh), compiled"
HIER_BF16 = "group=mesh, bf16 across nodes"
HIER_POWERSGD = f"group=mesh, batched PowerSGD rank {POWERSGD_RANK} across nodes (GradSync)"
SYNC_SETTINGS = (FLAT, SYNC_FLAT, HIER, HIER_COMPILED, HIER_BF16, HIER_POWERSGD)
# 2. The GPT's step on the 2 x 2 mesh.
DDP_EAGER = "DDP eager (all 4 ranks)"
STEP_FLAT = "fsync.grad_and_value, flat, eager"
STEP_HIER = "grad_and_value(group=mesh), eager"
STEP_HIER_COMPILED = "grad_and_value(group=mesh), compiled"
STEP_BF16 = "group=mesh, bf16 across nodes, eager"
DDP_NO_SYNC = f"DDP, no_sync over {MICRO_BATCHES} micro-batches"
DEFERRED = f"DeferredSync(group=mesh), {MICRO_BATCHES} micro-batches"
DILOCO = f"fsync.diloco, H = {INNER_STEPS}, bf16, group=mesh (compiled local step)"
STEP_SETTINGS = (
    DDP_EAGER,
    STEP_FLAT,
    STEP_HIER,
    STEP_HIER_COMPILED,
    STEP_BF16,
    DDP_NO_SYNC,
    DEFERRED,
    DILOCO,
)
# The settings whose cross-node traffic is one flat all-reduce over all ranks.
FLAT_SETTINGS = (FLAT, SYNC_FLAT, DDP_EAGER, STEP_FLAT, DDP_NO_SYNC)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", metavar="RATE", help="measure at one rate (run by torchrun)")
    parser.add_argument(
        "--rates",
        default=None,
        help=f"comma-separated, of {RATES}, or {SMOKE_RATE!r}: one 4-rank world on this "
        f"machine, without twonodes (default: all of them; {SMOKE_RATE!r} with --smoke)",
    )
    parser.add_argument("--twonodes", type=pathlib.Path, default=TWONODES)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (and --rates local)")
    parser.add_argument("--steps", type=int, default=12, help="timed calls of a sync alone")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"timed rounds of {INNER_STEPS} (3; smoke: 1)"
    )
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs")
    parser.add_argument("--json", type=pathlib.Path, help="child: where rank 0 writes results")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.smoke else 3)
    return args


# --- what crosses nodes ------------------------------------------------------------------------


def cable_bytes(cross: float, flat: bool) -> float:
    """Bytes on each direction of the cable for ``cross`` bytes per rank, in a ring model.

    A ring all-reduce of ``B`` bytes over ``N`` ranks sends ``2 (N - 1) / N * B`` on
    each link of the ring. The flat ring over all ``NODES * LOCAL`` ranks (ordered by
    node) crosses the cable once each way: ``2 (N - 1) / N * B``, 1.5 B on 2 x 2. The
    hierarchical hop is ``LOCAL`` rings of ``NODES`` ranks, one per local rank, each
    crossing it: ``LOCAL * 2 (NODES - 1) / NODES * B``, 2 B on 2 x 2 (with B half the
    flat one's, 2/3 of the flat ring's bytes).
    """
    n = NODES * LOCAL if flat else NODES
    return (1 if flat else LOCAL) * 2 * (n - 1) / n * cross


def _cross(tree: Any, setting: str, **options: Any) -> dict[str, float]:
    """``{"cross": bytes per rank, "cable": bytes each way}`` of one step of ``setting``."""
    if setting in FLAT_SETTINGS:  # one all-reduce of every byte, all of it across
        cross = float(sum(t.numel() * t.element_size() for t in tree.values()))
    else:
        shape = (NODES, LOCAL)
        stats = fsync.sync_stats(tree, world_size=shape, bucket_cap_mb=CAP_MB, **options)
        cross = float(stats.bytes_on(0))
    return {"cross": cross, "cable": cable_bytes(cross, setting in FLAT_SETTINGS)}


# --- the workloads -----------------------------------------------------------------------------


def tree_20mib(rank: int, smoke: bool) -> dict[str, torch.Tensor]:
    """12 leaves of 20 MiB: 8 of 512 x 1024 floats (2 MiB) and 4 of 256 x 1024 (1 MiB),
    interleaved; 1/64 of the columns in a smoke run."""
    generator = torch.Generator().manual_seed(2000 + rank)
    columns = 1024 // (64 if smoke else 1)
    rows = [512, 512, 256] * 4
    return {
        f"layer{i}.weight": torch.randn(r, columns, generator=generator) for i, r in enumerate(rows)
    }


def gpt(smoke: bool) -> models.Workload:
    """The benchmark GPT, batch 4 sequences of 64 tokens (a smoke run: 1 layer, narrow)."""
    if smoke:
        return models.gpt(n_layer=1, scale=1 / 8, vocab_size=256, block_size=16)
    return models.gpt(block_size=link.GPT_BLOCK, batch=MICRO_BATCHES)


# --- 1. the sync alone -------------------------------------------------------------------------


def sync_alone(
    grads: dict[str, torch.Tensor], mesh: DeviceMesh, timing: dict[str, int]
) -> dict[str, dict[str, float]]:
    """The median ms of each sync setting on ``grads``, with its cross-node bytes."""
    torch._dynamo.reset()
    options: dict[str, Any] = {"bucket_cap_mb": CAP_MB}
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    bf16 = fsync.ops.bf16_compress()
    powersgd = fsync.ops.batched_powersgd(POWERSGD_RANK, start_step=0)
    compiled = fsync.compile(lambda g: fsync.sync_grads(g, group=mesh, **options))
    stateful = fsync.GradSync(group=mesh, hook=powersgd, **options)
    held = {"state": stateful.init(grads)}
    calls: dict[str, Callable[[], Any]] = {
        FLAT: lambda: dist.all_reduce(flat),
        SYNC_FLAT: lambda: fsync.sync_grads(grads, **options),
        HIER: lambda: fsync.sync_grads(grads, group=mesh, **options),
        HIER_COMPILED: lambda: compiled(grads),
        HIER_BF16: lambda: fsync.sync_grads(grads, group=mesh, hook=bf16, **options),
        HIER_POWERSGD: cases._stateful(stateful, grads, held),
    }
    hooks = {HIER_BF16: bf16, HIER_POWERSGD: powersgd}
    times = cases.interleaved_ms(calls, **timing)
    return {
        name: {
            "ms": times[name],
            **_cross(grads, name, **({"hook": hooks[name]} if name in hooks else {})),
        }
        for name in calls
    }


# --- 2. the GPT's step -------------------------------------------------------------------------


def gpt_steps(
    work: models.Workload, mesh: DeviceMesh, warmup: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Each step setting's mean ms on the GPT, with its cross-node bytes per step."""
    torch._dynamo.reset()
    batch = work.batch(dist.get_rank())
    micro = [tuple(t[i : i + 1] for t in batch) for i in range(MICRO_BATCHES)]
    options: dict[str, Any] = {"bucket_cap_mb": CAP_MB}
    bf16 = fsync.ops.bf16_compress()
    optimizer = fsync.optim.sgd(cases.LR)

    ddp = DDP(copy.deepcopy(work.model), bucket_cap_mb=CAP_MB)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=cases.LR)

    def ddp_step() -> None:
        ddp_optimizer.zero_grad(set_to_none=True)
        work.loss(ddp, batch).backward()
        ddp_optimizer.step()

    def ddp_no_sync() -> None:  # DDP's accumulation: all the gradients, all of them across
        ddp_optimizer.zero_grad(set_to_none=True)
        with ddp.no_sync():
            for m in micro[:-1]:
                (work.loss(ddp, m) / MICRO_BATCHES).backward()
        (work.loss(ddp, micro[-1]) / MICRO_BATCHES).backward()
        ddp_optimizer.step()

    def functional(grad_and_value: Callable[..., Any]) -> Callable[..., Any]:
        def step(params: dict[str, torch.Tensor], state: Any) -> Any:
            grads, _ = grad_and_value(params, batch)
            return optimizer.update(params, grads, state)

        return step

    def synced(group: DeviceMesh | None, **hook: Any) -> Callable[..., Any]:
        return functional(
            fsync.grad_and_value(work.functional_loss, group=group, **options, **hook)
        )

    params = work.params()
    deferred = fsync.DeferredSync(group=mesh, **options)
    local_grad = torch.func.grad(work.functional_loss)
    held = {"p": params, "o": optimizer.init(params), "s": deferred.init(params)}

    def deferred_step() -> None:  # within the node per micro-batch, across once per step
        state = held["s"]
        for m in micro:
            state = deferred.add(local_grad(held["p"], m), state)
        grads, held["s"] = deferred.finish(state)
        held["p"], held["o"] = optimizer.update(held["p"], grads, held["o"])

    local = fsync.compile(functional(lambda p, b: (local_grad(p, b), None)))
    diloco = fsync.diloco(INNER_STEPS, group=mesh, hook=bf16, **options)
    outer = {"p": params, "o": optimizer.init(params), "d": diloco.init(params)}

    def diloco_step() -> None:
        outer["p"], outer["o"] = local(outer["p"], outer["o"])
        outer["p"], outer["d"] = diloco.update(outer["p"], outer["d"])

    steps: dict[str, tuple[Callable[[], None], dict[str, float]]] = {
        DDP_EAGER: (ddp_step, _cross(params, DDP_EAGER)),
        STEP_FLAT: (link._held(work, synced(None)), _cross(params, STEP_FLAT)),
        STEP_HIER: (link._held(work, synced(mesh)), _cross(params, STEP_HIER)),
        STEP_HIER_COMPILED: (
            link._held(work, fsync.compile(synced(mesh))),
            _cross(params, STEP_HIER_COMPILED),
        ),
        STEP_BF16: (
            link._held(work, synced(mesh, hook=bf16)),
            _cross(params, STEP_BF16, hook=bf16),
        ),
        DDP_NO_SYNC: (ddp_no_sync, _cross(params, DDP_NO_SYNC)),
        DEFERRED: (deferred_step, _cross(params, DEFERRED, micro_batches=MICRO_BATCHES)),
        DILOCO: (
            diloco_step,
            {k: v / INNER_STEPS for k, v in _cross(params, DILOCO, hook=bf16).items()},
        ),
    }
    for name, (step, _) in steps.items():
        started = time.perf_counter()
        # DiLoCo's warm-up is a whole round, so that its first sync (and compilation) is in
        # it and every timed block of INNER_STEPS calls holds one outer sync.
        for _ in range(INNER_STEPS if name == DILOCO else warmup):
            step()
        if dist.get_rank() == 0:
            seconds = time.perf_counter() - started
            print(f"twonodes: GPT step, {name}: warmed up ({seconds:.0f} s)", flush=True)
    calls = {name: step for name, (step, _) in steps.items()}
    times = cases.interleaved_ms(calls, warmup=0, steps=rounds * INNER_STEPS, per_round=INNER_STEPS)
    out = {name: {"ms": times[name], **cross} for name, (_, cross) in steps.items()}
    return out


# --- the child: one rate, 4 ranks --------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """Measure at one rate, on every rank of the world torchrun started (2 nodes x 2)."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(1)  # the ranks of a node share its cores
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != NODES * LOCAL:
        raise SystemExit(f"twonodes: needs {NODES} x {LOCAL} ranks; got {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (NODES, LOCAL), mesh_dim_names=("node", "local"))
    timing = {"warmup": args.warmup, "steps": args.steps}
    work = gpt(args.smoke)
    grads = torch.func.grad(work.functional_loss)(work.params(), work.batch(rank))
    results: dict[str, Any] = {"sync": {}, "trees": {}}
    for name, tree in ((TREE, tree_20mib(rank, args.smoke)), (GPT, grads)):
        started = time.perf_counter()
        results["sync"][name] = sync_alone(tree, mesh, timing)
        results["trees"][name] = sum(t.numel() * t.element_size() for t in tree.values())
        if rank == 0:
            seconds = time.perf_counter() - started
            print(f"twonodes {args.child}: the sync alone, {name} ({seconds:.0f} s)", flush=True)
    results["step"] = gpt_steps(work, mesh, args.warmup, args.rounds)
    if rank == 0:
        assert args.json is not None
        args.json.write_text(json.dumps(results))
    cases.leave_group()


# --- the parent: one launch per rate -----------------------------------------------------------


def _launch(args: argparse.Namespace, rate: str, path: pathlib.Path) -> list[str]:
    """The command that measures ``rate`` into ``path``: torchrun on both nodes under
    ``twonodes``, or (smoke) one torchrun of 4 ranks here."""
    script = [str(ROOT / "benchmarks" / "twonodes.py"), "--child", rate, "--json", str(path)]
    script += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--rounds={args.rounds}"]
    script += ["--smoke"] if args.smoke else []
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if rate == SMOKE_RATE:
        return [*torchrun, "--standalone", "--nproc-per-node", str(NODES * LOCAL), *script]
    # One line, run by bash on each node, which expands $NODE_RANK and $MASTER_ADDR there.
    nodes = f"--nnodes {NODES} --node-rank $NODE_RANK --nproc-per-node {LOCAL} "
    nodes += "--master-addr $MASTER_ADDR --master-port 29500"
    line = " ".join([*map(shlex.quote, torchrun), nodes, *map(shlex.quote, script)])
    return [str(args.twonodes), "--rate", rate, "--", line]


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rate, each in a fresh two-node launch; ``None`` where twonodes cannot run."""
    default = [SMOKE_RATE] if args.smoke else RATES
    rates = [r for r in args.rates.split(",") if r] if args.rates else default
    if any(r != SMOKE_RATE for r in rates) and not args.twonodes.exists():
        print(f"twonodes: no {args.twonodes}; skipping the two-node benchmarks", flush=True)
        return None
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fsync-twonodes-") as tmp:
        env = {**os.environ, **cases.inductor_cache(tmp, args.smoke)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        for rate in rates:
            path = pathlib.Path(tmp) / f"{rate}.json"
            started = time.perf_counter()
            done = subprocess.run(_launch(args, rate, path), cwd=ROOT, env=env)
            if done.returncode == 3 and rate != SMOKE_RATE:
                print(
                    "twonodes could not make two network namespaces (it needs root: ip netns "
                    "and tc); skipping the two-node benchmarks. Run as root.",
                    flush=True,
                )
                return None
            done.check_returncode()
            results[rate] = json.loads(path.read_text())
            seconds = time.perf_counter() - started
            ratio = results[rate]["sync"][GPT][HIER]["ms"] / results[rate]["sync"][GPT][FLAT]["ms"]
            print(
                f"twonodes {rate} ({seconds:.0f} s): the GPT's sync, hierarchical eager, "
                f"{ratio:.2f}x the flat all-reduce",
                flush=True,
            )
    results["environment"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "fsync": fsync.__version__,
        "cores": str(os.cpu_count()),
        "sizes": "smoke (tiny)" if args.smoke else "full",
    }
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    from benchmarks import twonodes_report

    results = measure(args)
    if results is not None:
        paths = twonodes_report.write(results, args.out)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())

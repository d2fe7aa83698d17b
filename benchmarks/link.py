"""Step time on a link slower than compute: ``python benchmarks/run.py --only link``.

Between machines, collectives wait on the network rather than on the CPU, and a
step can hide them behind backward. Two ranks on one machine talk over the
loopback, which is as fast as memory, so this section runs each measurement
under ``slownet`` (``../shared/tools/slownet``, or ``--slownet PATH``; it needs
root): a private network namespace whose loopback is shaped to a rate. For each
rate (unshaped, then 16, 8 and 4 Gbit/s) this module re-runs itself in a fresh
namespace (``python -m benchmarks.link --child RATE``), which spawns the ranks,
measures, and hands back JSON; the parent writes ``docs/benchmarks-link.md`` and
one figure per question (:mod:`benchmarks.link_report`).

By hand, one rate: ``slownet --rate 8gbit -- python -m benchmarks.link --child 8gbit``.

The workloads, all with 4 MiB buckets (fsync and DDP alike):

- the benchmark MLP (8.4M parameters, 33.6 MB of gradients) at batch 256, where
  compute is longer than the all-reduce at 8 Gbit/s, at every rate; at 8 Gbit/s
  also at batch 64 (link-bound) and with the default 25 MiB buckets, the sync
  alone, and the ZeRO step;
- a deep MLP (8 equal 1024 x 1024 layers, 8.4M parameters) and the GPT (21M),
  at batch 64 and 256 (the GPT's batch counts tokens: 1 or 4 sequences of 64),
  unshaped and at 8 Gbit/s;
- unshaped, the peak memory of the eager step (deep MLP and GPT at batch 256),
  each setting in a fresh world.

On 2 quiet cores the whole run takes about half an hour, most of it compiling:
each row compiles four steps (the module, DDP, the functional floor and fsync's),
once per process; the rates share one inductor cache.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fsync  # noqa: E402
from benchmarks import cases, models  # noqa: E402

RATES = ("unshaped", "16gbit", "8gbit", "4gbit")
SLOWNET = ROOT.parent / "shared" / "tools" / "slownet"
CAP_MB = 4.0
# The MLP runs at batch 256 at every rate; these beside it, at these batches and rates.
WORKLOADS = ("deep MLP", "GPT")
BATCHES = (64, 256)
WORKLOAD_RATES = ("unshaped", "8gbit")
GPT_BLOCK = 64  # tokens per GPT sequence: its batch of 256 tokens is 4 sequences
# --smoke: each workload once at tiny sizes; the main page's smoke run measures the same.
SMOKE_RUNS = (("MLP", 256), ("deep MLP", 256), ("GPT", 256))
GAV = "fsync eager, grad_and_value"
FUNC = "fsync eager, torch.func + sync_grads"
# What each setting's own compute is: the share of the all-reduce a step hides is
# (own compute + flat all-reduce - step) / flat all-reduce.
SETTINGS = {
    "DDP eager": "compute, module eager",
    "DDP compiled": "compute, module compiled",
    GAV: "compute, functional eager",
    FUNC: "compute, functional eager",
    "fsync compiled": "compute, functional compiled",
}
FLOORS = tuple(dict.fromkeys(SETTINGS.values()))
FLAT = "flat all-reduce of the gradients"
CEILING = "flat all-reduce issued before the compiled compute (ceiling)"
# The memory worlds: the eager step of each setting, alone in its processes.
MEMORY_SETTINGS = ("compute, module eager", "DDP eager", GAV, FUNC)
MEMORY_BATCH = 256
# glibc's malloc gives every block of 64 KiB or more back to the system when it is freed,
# so that RSS follows the tensors alive. By default it keeps freed blocks to reuse, and the
# deep MLP's peak under DDP varied by 3 buckets from one world to the next; fixed, by 2 MiB.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", metavar="RATE", help="measure at one rate (run inside slownet)")
    parser.add_argument("--rates", default=",".join(RATES), help=f"comma-separated, of {RATES}")
    parser.add_argument("--slownet", type=pathlib.Path, default=SLOWNET)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, unshaped only")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs")
    parser.add_argument("--json", type=pathlib.Path, help="child: where to write its results")
    return parser.parse_args(argv)


def _timing(args: argparse.Namespace) -> dict[str, int]:
    return {"warmup": args.warmup, "steps": args.steps}


def workload(name: str, batch: int, smoke: bool) -> models.Workload:
    """The workload ``name`` at ``batch`` samples per rank (the GPT: tokens, in sequences of 64)."""
    scale = 1 / 16 if smoke else 1.0
    if name == "MLP":
        return models.mlp(batch=batch, scale=scale)
    if name == "deep MLP":  # smoke: 3 layers, every code path; more only lengthen compiling
        return models.deep_mlp(batch=batch, scale=scale, **({"depth": 3} if smoke else {}))
    sequences = max(1, batch // GPT_BLOCK)
    if smoke:
        return models.gpt(n_layer=1, scale=1 / 8, vocab_size=256, batch=sequences)
    return models.gpt(block_size=GPT_BLOCK, batch=sequences)


def row_key(name: str, batch: int, cap: float = CAP_MB) -> str:
    """A row's name in the results: workload, batch, and the buckets where not 4 MiB."""
    return f"{name}, batch {batch}" + ("" if cap == CAP_MB else f", {cap:g} MiB buckets")


def _module_step(
    work: models.Workload, model: torch.nn.Module, forward: Callable[..., Any], batch: Any
) -> Callable[[], None]:
    """An autograd step on ``model`` (through ``forward``) with ``torch.optim.SGD``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=cases.LR)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        work.criterion(forward(batch[0]), batch[1]).backward()
        optimizer.step()

    return step


def _functional_step(work: models.Workload, batch: Any, sync: str | None, cap: float) -> Any:
    """A ``torch.func`` step with ``fsync.optim.sgd``; ``sync`` is ``None`` (the floor),
    ``"sync_grads"`` (after ``torch.func.grad_and_value``) or ``"grad_and_value"`` (fsync's)."""
    optimizer = fsync.optim.sgd(cases.LR)
    synced = fsync.grad_and_value(work.functional_loss, bucket_cap_mb=cap)

    def step(params: dict[str, torch.Tensor], state: Any) -> Any:
        if sync == "grad_and_value":
            grads, _ = synced(params, batch)
        else:
            grads, _ = torch.func.grad_and_value(work.functional_loss)(params, batch)
            if sync == "sync_grads":
                grads = fsync.sync_grads(grads, bucket_cap_mb=cap)
        return optimizer.update(params, grads, state)

    return step


def _held(work: models.Workload, fn: Callable[..., Any]) -> Callable[[], None]:
    """``fn`` as a call that threads its parameters and optimizer state from step to step."""
    params = work.params()
    state = {"p": params, "o": fsync.optim.sgd(cases.LR).init(params)}

    def call() -> None:
        state["p"], state["o"] = fn(state["p"], state["o"])

    return call


def _step_times(
    work: models.Workload,
    cap: float,
    timing: dict[str, int],
    floors: dict[str, float] | None = None,
) -> dict[str, float]:
    """The five settings for one workload and bucket size, beside their floors, the flat
    all-reduce and the ceiling.

    ``floors``, the row of the same workload and batch at other buckets, gives those
    figures, which do not depend on the buckets: they are not measured (nor compiled)
    again.
    """
    torch._dynamo.reset()
    batch = work.batch(dist.get_rank())
    measure = floors is None
    calls: dict[str, Callable[[], None]] = {}  # timed in turn, round after round

    def module(name: str, model: torch.nn.Module, compiled: bool) -> None:
        forward = torch.compile(model) if compiled else model
        calls[name] = _module_step(work, model, forward, batch)

    def functional(name: str, sync: str | None, compiled: bool) -> Callable[[], None]:
        step = _functional_step(work, batch, sync, cap)
        calls[name] = _held(work, fsync.compile(step) if compiled else step)
        return calls[name]

    if measure:
        module("compute, module eager", copy.deepcopy(work.model), compiled=False)
        module("compute, module compiled", copy.deepcopy(work.model), compiled=True)
    module("DDP eager", DDP(copy.deepcopy(work.model), bucket_cap_mb=cap), compiled=False)
    module("DDP compiled", DDP(copy.deepcopy(work.model), bucket_cap_mb=cap), compiled=True)
    if measure:
        functional("compute, functional eager", None, compiled=False)
        compute = functional("compute, functional compiled", None, compiled=True)
    functional(GAV, "grad_and_value", compiled=False)
    functional(FUNC, "sync_grads", compiled=False)
    functional("fsync compiled", "grad_and_value", compiled=True)
    if measure:
        flat = torch.cat([p.reshape(-1) for p in work.params().values()])
        calls[FLAT] = lambda: dist.all_reduce(flat)

        def ceiling() -> None:  # the all-reduce in flight during the whole compiled step
            work_ = dist.all_reduce(flat, async_op=True)
            compute()
            work_.wait()

        calls[CEILING] = ceiling
    out = cases.interleaved_ms(calls, **timing)
    if floors is not None:
        out.update({k: floors[k] for k in [*FLOORS, FLAT, CEILING]})
    return {name: out[name] for name in [*SETTINGS, *FLOORS, FLAT, CEILING]}


def _sync_alone(work: models.Workload, timing: dict[str, int]) -> dict[str, float]:
    grads = torch.func.grad(work.functional_loss)(work.params(), work.batch(dist.get_rank()))
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    compiled = fsync.compile(lambda g: fsync.sync_grads(g, bucket_cap_mb=CAP_MB))
    return {
        FLAT: cases.median_ms(lambda: dist.all_reduce(flat), **timing),
        "sync_grads eager": cases.median_ms(
            lambda: fsync.sync_grads(grads, bucket_cap_mb=CAP_MB), **timing
        ),
        "sync_grads compiled": cases.median_ms(lambda: compiled(grads), **timing),
    }


def _runs(rate: str, smoke: bool) -> list[tuple[str, int]]:
    """The (workload, batch) rows measured at ``rate`` with 4 MiB buckets."""
    if smoke:  # each workload once, which is every code path, in the time CI has
        return list(SMOKE_RUNS)
    runs = [("MLP", 256)]
    if rate == "8gbit":
        runs.append(("MLP", 64))
    if rate in WORKLOAD_RATES:
        runs += [(name, batch) for name in WORKLOADS for batch in BATCHES]
    return runs


def _worker(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    timing = _timing(args)
    results: dict[str, Any] = {}
    for name, batch in _runs(args.child, args.smoke):
        started = time.perf_counter()
        work = workload(name, batch, args.smoke)
        results[row_key(name, batch)] = _step_times(work, CAP_MB, timing)
        if rank == 0:  # progress: the full run takes about half an hour
            seconds = time.perf_counter() - started
            print(f"link {args.child}: {row_key(name, batch)} ({seconds:.0f} s)", flush=True)
    if args.child == "8gbit" or args.smoke:
        mlp = workload("MLP", 256, args.smoke)
        results[row_key("MLP", 256, 25.0)] = _step_times(
            mlp, 25.0, timing, floors=results[row_key("MLP", 256)]
        )
        results["sync alone"] = _sync_alone(mlp, timing)
        zero = cases.case_zero(workload("MLP", 64, args.smoke), **timing)
        results["zero"] = {name: row["ms"] for name, row in zero.items()}
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(results))
    cases.leave_group()


def child(args: argparse.Namespace) -> None:
    """Measure at one rate (the namespace's loopback is already shaped); unshaped, the memory."""
    with tempfile.TemporaryDirectory(prefix="fsync-link-") as tmp:
        out = os.path.join(tmp, "results.json")
        init = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(args, init, out), nprocs=2, join=True)
        results = json.loads(pathlib.Path(out).read_text())
    if args.child == "unshaped":
        results["memory"] = memory(args)
    assert args.json is not None
    args.json.write_text(json.dumps(results))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every rate, each in a fresh process (under slownet unless unshaped)."""
    rates = ["unshaped"] if args.smoke else [r for r in args.rates.split(",") if r]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fsync-link-") as tmp:
        env = {**os.environ, **cases.inductor_cache(tmp, args.smoke)}
        for rate in rates:
            path = pathlib.Path(tmp) / f"{rate}.json"
            command = [sys.executable, "-m", "benchmarks.link", "--child", rate, "--json", path]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            command += ["--smoke"] if args.smoke else []
            if rate != "unshaped":
                command = [str(args.slownet), "--rate", rate, "--", *map(str, command)]
            started = time.perf_counter()
            done = subprocess.run(list(map(str, command)), cwd=ROOT, env=env)
            if done.returncode == 3:  # the page then shows what ran: the unshaped rows
                print(
                    f"slownet could not shape a loopback for {rate} (it needs root: unshare -n "
                    "and tc); skipping the shaped rates. Run as root to measure them.",
                    flush=True,
                )
                break
            done.check_returncode()
            results[rate] = json.loads(path.read_text())
            seconds = time.perf_counter() - started
            mlp = results[rate][row_key("MLP", 256)]
            print(f"link {rate} ({seconds:.0f} s): MLP, batch 256: {mlp}", flush=True)
    return results


# --- memory --------------------------------------------------------------------------------------


def _status_mib(field: str) -> float:
    """``field`` of ``/proc/self/status`` (``VmRSS``: resident now, ``VmHWM``: its peak) in MiB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _reset_peak() -> bool:
    """Sets this process's peak RSS (``VmHWM``) to its RSS now; ``False`` where Linux refuses."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _memory_step(work: models.Workload, setting: str) -> Callable[[], None]:
    """One eager step of ``setting`` on ``work``'s own parameters, the only copy kept.

    The module settings train the module with ``torch.optim.SGD``; the fsync ones
    update the same tensors in place as ``torch.optim.SGD`` does on CPU
    (``p.add_(g, alpha=-lr)``), so that the settings differ in their gradients and
    sync alone (``fsync.optim.sgd``, being pure, would hold a second copy of the
    parameters while it makes the new one).
    """
    batch = work.batch(dist.get_rank())
    if setting in ("compute, module eager", "DDP eager"):
        model = DDP(work.model, bucket_cap_mb=CAP_MB) if setting == "DDP eager" else work.model
        return _module_step(work, model, model, batch)
    params = {n: p.detach() for n, p in work.model.named_parameters()}
    synced = fsync.grad(work.functional_loss, bucket_cap_mb=CAP_MB)

    def gradients() -> dict[str, torch.Tensor]:
        if setting == GAV:
            return synced(params, batch)
        grads = torch.func.grad(work.functional_loss)(params, batch)
        return fsync.sync_grads(grads, bucket_cap_mb=CAP_MB)

    def step() -> None:
        grads = gradients()
        with torch.no_grad():
            for name, grad in grads.items():
                params[name].add_(grad, alpha=-cases.LR)

    return step


def _memory_worker(
    rank: int, name: str, setting: str, args: argparse.Namespace, init: str, out: str
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    work = workload(name, MEMORY_BATCH, args.smoke)
    gc.collect()
    built = _status_mib("VmRSS")
    step = _memory_step(work, setting)
    step()  # warm-up: DDP's bucket rebuild, fsync's plan, the allocator's first growth
    warm = _status_mib("VmRSS")
    reset = _reset_peak()
    for _ in range(args.steps):
        step()
    peak = _status_mib("VmHWM")
    if rank == 0:
        row = {"built": built, "warm": warm, "peak": peak, "since start": float(not reset)}
        pathlib.Path(out).write_text(json.dumps(row))
    del step  # the DDP setting's module: freed before its group (``cases.leave_group``)
    cases.leave_group()


def memory(args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    """Peak RSS of the eager step, per workload at batch 256 and setting, on rank 0.

    Each setting runs in a fresh 2-rank world of its own, so that the process's
    peak belongs to it alone: RSS once the model is built (``built``), after one
    warm-up step (``warm``), and the peak over ``args.steps`` more (``peak``:
    ``VmHWM``, reset after the warm-up through ``/proc/self/clear_refs``; where
    Linux refuses the reset, ``since start`` is 1 and the peak is the process's).
    The worlds run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed (``ALLOCATOR``).
    """
    out: dict[str, dict[str, dict[str, float]]] = {}
    saved = {name: os.environ.get(name) for name in ALLOCATOR}
    os.environ.update(ALLOCATOR)  # read by each spawned interpreter as it starts
    try:
        with tempfile.TemporaryDirectory(prefix="fsync-memory-") as tmp:
            for name in WORKLOADS[:1] if args.smoke else WORKLOADS:  # smoke: 4 worlds, not 8
                for k, setting in enumerate(MEMORY_SETTINGS):
                    init, path = (os.path.join(tmp, f"{name}-{k}.{x}") for x in ("init", "json"))
                    spawned = (name, setting, args, init, path)
                    mp.spawn(_memory_worker, args=spawned, nprocs=2, join=True)
                    row = json.loads(pathlib.Path(path).read_text())
                    out.setdefault(name, {})[setting] = row
                    print(f"memory: {name}, {setting}: peak {row['peak']:.0f} MiB", flush=True)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    from benchmarks import link_report

    results = measure(args)
    paths = link_report.write(results, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step time on a link slower than compute: ``python benchmarks/run.py --only link``.

Between machines, collectives wait on the network rather than on the CPU, and a
step can hide them behind backward. Two ranks on one machine talk over the
loopback, which is as fast as memory, so this section runs each measurement
under ``slownet`` (``../shared/tools/slownet``, or ``--slownet PATH``; it needs
root): a private network namespace whose loopback is shaped to a rate. For each
rate (unshaped, then 16, 8 and 4 Gbit/s) this module re-runs itself in a fresh
namespace (``python -m benchmarks.link --child RATE``), which spawns the ranks,
measures, and hands back JSON; the parent writes ``docs/benchmarks-link.md`` and
one figure per question.

By hand, one rate: ``slownet --rate 8gbit -- python -m benchmarks.link --child 8gbit``.

The workload is the benchmark MLP (8.4M parameters, 33.6 MB of gradients) at
batch 256 with 4 MiB buckets (fsync and DDP alike), where compute is longer than
the all-reduce at 8 Gbit/s; also at batch 64 (link-bound) and with the default
25 MiB buckets, the sync alone, and the ZeRO step.
"""

from __future__ import annotations

import argparse
import copy
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
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fsync  # noqa: E402
from benchmarks import cases, models, report  # noqa: E402

RATES = ("unshaped", "16gbit", "8gbit", "4gbit")
SLOWNET = ROOT.parent / "shared" / "tools" / "slownet"
CAP_MB = 4.0
INNER_STEPS = 8  # DiLoCo's H in the mesh rows
# What each setting's own compute is: the share of the all-reduce a step hides is
# (own compute + flat all-reduce - step) / flat all-reduce.
SETTINGS = {
    "DDP eager": "compute, module eager",
    "DDP compiled": "compute, module compiled",
    "fsync eager": "compute, functional eager",
    "fsync compiled": "compute, functional compiled",
}
FLAT = "flat all-reduce of the gradients"
CEILING = "flat all-reduce issued before the compiled compute (ceiling)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", metavar="RATE", help="measure at one rate (run inside slownet)")
    parser.add_argument("--rates", default=",".join(RATES), help=f"comma-separated, of {RATES}")
    parser.add_argument("--slownet", type=pathlib.Path, default=SLOWNET)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, unshaped only")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs")
    parser.add_argument("--json", type=pathlib.Path, help="child: where to write its results")
    parser.add_argument("--world", type=int, default=2, help="child: 2 ranks, or 4 for the mesh")
    return parser.parse_args(argv)


def _timing(args: argparse.Namespace) -> dict[str, int]:
    return {"warmup": args.warmup, "steps": args.steps}


def _step_times(work: models.Workload, cap: float, timing: dict[str, int]) -> dict[str, float]:
    """Floors and the four settings for one workload and bucket size."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    batch = work.batch(rank)
    out: dict[str, float] = {}
    ms = lambda fn: cases.median_ms(fn, **timing)  # noqa: E731

    def module_step(model: torch.nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
        optimizer = torch.optim.SGD(model.parameters(), lr=cases.LR)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            work.criterion(forward(batch[0]), batch[1]).backward()
            optimizer.step()

        return step

    local = copy.deepcopy(work.model)
    out["compute, module eager"] = ms(module_step(local, local))
    local_c = copy.deepcopy(work.model)
    out["compute, module compiled"] = ms(module_step(local_c, torch.compile(local_c)))
    ddp = DDP(copy.deepcopy(work.model), bucket_cap_mb=cap)
    out["DDP eager"] = ms(module_step(ddp, ddp))
    ddp_c = DDP(copy.deepcopy(work.model), bucket_cap_mb=cap)
    out["DDP compiled"] = ms(module_step(ddp_c, torch.compile(ddp_c)))

    optimizer = fsync.optim.sgd(cases.LR)
    params = work.params()

    def functional(sync: bool) -> Callable[..., Any]:
        def step(params: dict[str, torch.Tensor], state: Any) -> Any:
            grads = torch.func.grad(work.functional_loss)(params, batch)
            if sync:
                grads = fsync.sync_grads(grads, bucket_cap_mb=cap)
            return optimizer.update(params, grads, state)

        return step

    def run(fn: Callable[..., Any]) -> Callable[[], None]:
        state = {"p": params, "o": optimizer.init(params)}

        def call() -> None:
            state["p"], state["o"] = fn(state["p"], state["o"])

        return call

    out["compute, functional eager"] = ms(run(functional(False)))
    compute = run(fsync.compile(functional(False)))
    out["compute, functional compiled"] = ms(compute)
    out["fsync eager"] = ms(run(functional(True)))
    out["fsync compiled"] = ms(run(fsync.compile(functional(True))))

    flat = torch.cat([p.reshape(-1) for p in params.values()])
    out[FLAT] = ms(lambda: dist.all_reduce(flat))

    def ceiling() -> None:  # the all-reduce in flight during the whole compiled step
        work_ = dist.all_reduce(flat, async_op=True)
        compute()
        work_.wait()

    out[CEILING] = ms(ceiling)
    return out


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


def _gpt_on_a_mesh(work: models.Workload, timing: dict[str, int]) -> dict[str, dict[str, float]]:
    """The GPT on 4 ranks as 2 nodes x 2: DDP, hierarchical fsync and DiLoCo (H = 8, bf16).

    Step times are means over whole rounds of ``H`` steps (DiLoCo syncs once per
    round); cross-node bytes per step are what each rank hands to collectives
    that cross nodes, from [fsync.sync_stats][] (a flat all-reduce's bytes all
    count: its ring crosses the node boundary).
    """
    torch._dynamo.reset()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    batch = work.batch(rank)
    params = work.params()
    out: dict[str, dict[str, float]] = {}
    rounds = max(2, timing["steps"] // INNER_STEPS)

    def mean_ms(step: Callable[[], None]) -> float:
        for _ in range(INNER_STEPS):  # warm-up: compiles, and one sync for DiLoCo
            step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds * INNER_STEPS):
            step()
        return 1000 * (time.perf_counter() - start) / (rounds * INNER_STEPS)

    ddp = DDP(copy.deepcopy(work.model))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=cases.LR)

    def ddp_step() -> None:
        ddp_opt.zero_grad(set_to_none=True)
        work.loss(ddp, batch).backward()
        ddp_opt.step()

    optimizer = fsync.optim.sgd(cases.LR)

    def functional(group: Any) -> Callable[..., Any]:
        def step(params: dict[str, torch.Tensor], state: Any) -> Any:
            grads = torch.func.grad(work.functional_loss)(params, batch)
            if group is not None:
                grads = fsync.sync_grads(grads, group=group)
            return optimizer.update(params, grads, state)

        return step

    held = {"p": params, "o": optimizer.init(params)}

    def hierarchical() -> None:
        held["p"], held["o"] = synced(held["p"], held["o"])

    synced = fsync.compile(functional(mesh))
    local = fsync.compile(functional(None))
    dl = fsync.diloco(INNER_STEPS, group=mesh, hook=fsync.ops.bf16_compress())
    outer = {"p": params, "o": optimizer.init(params), "d": dl.init(params)}

    def diloco_step() -> None:
        outer["p"], outer["o"] = local(outer["p"], outer["o"])
        outer["p"], outer["d"] = dl.update(outer["p"], outer["d"])

    flat = fsync.sync_stats(params, world_size=4).bytes_on_wire
    tiered = fsync.sync_stats(params, world_size=(2, 2)).bytes_on(0)
    bf16 = fsync.sync_stats(params, world_size=(2, 2), hook=fsync.ops.bf16_compress()).bytes_on(0)
    out["DDP eager (all-reduce over all 4 ranks)"] = {"ms": mean_ms(ddp_step), "bytes": flat}
    out["fsync compiled, hierarchical on the 2 x 2 mesh"] = {
        "ms": mean_ms(hierarchical),
        "bytes": tiered,
    }
    out[f"fsync.diloco, H = {INNER_STEPS}, bf16, hierarchical"] = {
        "ms": mean_ms(diloco_step),
        "bytes": bf16 / INNER_STEPS,
    }
    return out


def _worker(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.world)
    timing = _timing(args)
    scale = 1 / 16 if args.smoke else 1.0
    if args.world == 4:
        gpt = models.gpt(n_layer=1, scale=1 / 8, vocab_size=256) if args.smoke else models.gpt()
        mesh_results = {"gpt on a mesh": _gpt_on_a_mesh(gpt, timing)}
        if rank == 0:
            pathlib.Path(out).write_text(json.dumps(mesh_results))
        dist.barrier()
        dist.destroy_process_group()
        return
    results: dict[str, Any] = {
        "batch 256": _step_times(models.mlp(batch=256, scale=scale), CAP_MB, timing)
    }
    if args.child == "8gbit" or args.smoke:
        results["batch 64"] = _step_times(models.mlp(batch=64, scale=scale), CAP_MB, timing)
        results["batch 256, 25 MiB buckets"] = _step_times(
            models.mlp(batch=256, scale=scale), 25.0, timing
        )
        results["sync alone"] = _sync_alone(models.mlp(scale=scale), timing)
        zero = cases.case_zero(models.mlp(scale=scale), **timing)
        results["zero"] = {name: row["ms"] for name, row in zero.items()}
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def child(args: argparse.Namespace) -> None:
    """Measure at one rate (the namespace's loopback is already shaped)."""
    with tempfile.TemporaryDirectory(prefix="fsync-link-") as tmp:
        out = os.path.join(tmp, "results.json")
        init = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(args, init, out), nprocs=args.world, join=True)
        results = json.loads(pathlib.Path(out).read_text())
    assert args.json is not None
    args.json.write_text(json.dumps(results))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every rate, each in a fresh process (under slownet unless unshaped)."""
    rates = ["unshaped"] if args.smoke else [r for r in args.rates.split(",") if r]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fsync-link-") as tmp:
        # One inductor cache for all rates: the same graphs compile once.
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
        for rate in rates:
            path = pathlib.Path(tmp) / f"{rate}.json"
            command = [sys.executable, "-m", "benchmarks.link", "--child", rate, "--json", path]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            command += ["--smoke"] if args.smoke else []
            if rate != "unshaped":
                command = [str(args.slownet), "--rate", rate, "--", *map(str, command)]
            done = subprocess.run(list(map(str, command)), cwd=ROOT, env=env)
            if done.returncode == 3:
                raise SystemExit(
                    f"slownet could not shape a loopback for {rate} (it needs root: unshare -n "
                    "and tc). Run as root, or pass --rates unshaped."
                )
            done.check_returncode()
            results[rate] = json.loads(path.read_text())
            print(f"link {rate}: {results[rate]['batch 256']}", flush=True)
            if rate == ("unshaped" if args.smoke else "8gbit"):  # the GPT on 4 ranks
                mesh = pathlib.Path(tmp) / f"{rate}-mesh.json"
                run4 = [str(c) for c in command]
                run4[run4.index(str(path))] = str(mesh)
                subprocess.run([*run4, "--world", "4"], cwd=ROOT, env=env).check_returncode()
                results[rate].update(json.loads(mesh.read_text()))
    return results


def hidden(row: dict[str, float], setting: str) -> float:
    """Share of the flat all-reduce a setting hides behind its own compute."""
    return (row[SETTINGS[setting]] + row[FLAT] - row[setting]) / row[FLAT]


# --- the report ----------------------------------------------------------------------------------

TARGETS = (
    ("fsync compiled <= 0.95x DDP eager, 8 Gbit/s, batch 256", "batch 256", "ratio", 0.95),
    (
        "fsync compiled hides >= 40% of the all-reduce, 8 Gbit/s, batch 256",
        "batch 256",
        "hidden",
        0.40,
    ),
    ("fsync compiled <= 1.0x DDP eager, 8 Gbit/s, batch 64", "batch 64", "ratio", 1.0),
)


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) at 8 Gbit/s; ``None`` where that rate was not run."""
    at = results.get("8gbit")
    out: list[tuple[str, str, bool | None]] = []
    for name, key, kind, bound in TARGETS:
        if at is None or key not in at:
            out.append((name, "not run", None))
            continue
        row = at[key]
        if kind == "ratio":
            value = row["fsync compiled"] / row["DDP eager"]
            out.append((name, f"{value:.2f}x", value <= bound))
        else:
            value = hidden(row, "fsync compiled")
            out.append((name, f"{value:.0%}", value >= bound))
    if at is not None and "sync alone" in at:
        sync = at["sync alone"]
        value = sync["sync_grads compiled"] / sync[FLAT]
        out.append(
            (
                "sync alone, compiled <= 1.05x the flat all-reduce, 8 Gbit/s",
                f"{value:.2f}x",
                value <= 1.05,
            )
        )
    if at is not None and "zero" in at:
        zero = at["zero"]
        base = zero["ZeroRedundancyOptimizer + DDP"]
        for name in ("fsync zero sharded", "fsync zero sharded, compiled"):
            value = zero[name] / base
            out.append(
                (
                    f"{name} ahead of ZeroRedundancyOptimizer + DDP, 8 Gbit/s",
                    f"{value:.2f}x",
                    value < 1.0,
                )
            )
    return out


def _rate_table(results: dict[str, Any], key: str) -> list[list[str]]:
    rates = [r for r in results if key in results[r]]
    rows = []
    for name in [*SETTINGS, *SETTINGS.values(), FLAT, CEILING]:
        rows.append([name, *[report._ms(results[r][key][name]) for r in rates]])
    for setting in SETTINGS:
        rows.append(
            [f"{setting}: share of the all-reduce hidden"]
            + [f"{hidden(results[r][key], setting):.0%}" for r in rates]
        )
    return rows


def _one_rate_table(row: dict[str, float]) -> list[list[str]]:
    rows = [
        [name, report._ms(row[name]), report._ratio(row[name] / row["DDP eager"])]
        for name in [*SETTINGS, *SETTINGS.values(), FLAT, CEILING]
    ]
    rows += [
        [f"{s}: share of the all-reduce hidden", f"{hidden(row, s):.0%}", ""] for s in SETTINGS
    ]
    return rows


def plot(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """One figure per question: step time against rate, and the share hidden."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in results if "batch 256" in results[r]]
    rows = [results[r]["batch 256"] for r in rates]
    labels = ["unshaped" if r == "unshaped" else r.replace("gbit", " Gbit/s") for r in rates]
    step = out / "benchmarks-link-step.png"
    figure, ax = plt.subplots(figsize=(7.5, 4.8))
    for setting in SETTINGS:
        ax.plot(labels, [row[setting] for row in rows], "o-", label=setting)
    ax.plot(
        labels,
        [row["compute, functional compiled"] for row in rows],
        "k--",
        label="compute alone (compiled)",
    )
    ax.plot(
        labels,
        [row["compute, functional compiled"] + row[FLAT] for row in rows],
        "k:",
        label="compiled compute + flat all-reduce, one after the other",
    )
    ax.plot(labels, [row[CEILING] for row in rows], "--", color="grey", label=CEILING)
    ax.set_xlabel("link rate (loopback shaped by slownet)")
    ax.set_ylabel("ms per training step (lower is better)")
    ax.set_title("MLP 8.4M parameters, batch 256, 4 MiB buckets, 2 gloo ranks")
    ax.legend(fontsize=8)
    report._save(figure, step)
    share = out / "benchmarks-link-hidden.png"
    figure, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(SETTINGS)
    for k, setting in enumerate(SETTINGS):
        ax.bar(
            [i + k * width for i in range(len(rates))],
            [100 * hidden(row, setting) for row in rows],
            width,
            label=setting,
        )
    ax.set_xticks([i + width * (len(SETTINGS) - 1) / 2 for i in range(len(rates))], labels)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(
        40, color="grey", linestyle="--", linewidth=0.8, label="target for fsync compiled: 40%"
    )
    ax.set_ylabel("% of the flat all-reduce hidden behind own compute")
    ax.set_title("How much communication each step hides (higher is better)")
    ax.legend(fontsize=8)
    return [step, report._save(figure, share)]


def _section(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    return [f"## {title}", "", report._markdown_table(["", *header], rows), ""]


def write(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """``benchmarks-link.md`` and its figures in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    figures = plot(results, out)
    rates = [r for r in results if "batch 256" in results[r]]
    parts = [
        "# Benchmarks on a slow link",
        "",
        "Written by `python benchmarks/run.py --only link` (as root; see `benchmarks/link.py`). "
        "Each rate ran in its own network namespace whose loopback was shaped by "
        "`../shared/tools/slownet`; every figure is the median step on rank 0, every ratio "
        "is between figures of the same rate's run. The share hidden is (own compute + flat "
        "all-reduce - step) / flat all-reduce, with each setting's own compute: the module "
        "rows for DDP, the functional rows for fsync.",
        "",
        *[f"![{f.stem}]({f.name})" for f in figures],
        "",
        "## Targets",
        "",
        report._markdown_table(
            ["target", "measured", "met"],
            [
                [n, m, {True: "yes", False: "**no**", None: "-"}[ok]]
                for n, m, ok in targets(results)
            ],
        ),
        "",
        "## Step time against link rate: MLP, batch 256, 4 MiB buckets (ms)",
        "",
        report._markdown_table(["", *rates], _rate_table(results, "batch 256")),
        "",
    ]
    where = "8gbit" if "8gbit" in results else rates[0]
    at, label = results[where], "8 Gbit/s" if where == "8gbit" else where
    for key in ("batch 64", "batch 256, 25 MiB buckets"):
        if key in at:
            parts += [
                f"## At {label}: MLP, {key}",
                "",
                report._markdown_table(["", "ms", "vs DDP eager"], _one_rate_table(at[key])),
                "",
            ]
    if "sync alone" in at:
        sync = at["sync alone"]
        rows = [[n, report._ms(v), report._ratio(v / sync[FLAT])] for n, v in sync.items()]
        parts += _section(
            f"At {label}: the sync alone, MLP gradients", ["ms", "vs flat all-reduce"], rows
        )
    if "zero" in at:
        zero = at["zero"]
        base = zero["ZeroRedundancyOptimizer + DDP"]
        rows = [[n, report._ms(v), report._ratio(v / base)] for n, v in zero.items()]
        header = ["ms", "vs ZeroRedundancyOptimizer + DDP"]
        parts += _section(f"At {label}: ZeRO, AdamW on the MLP, batch 64", header, rows)
    if "gpt on a mesh" in at:
        mesh = at["gpt on a mesh"]
        ddp = mesh["DDP eager (all-reduce over all 4 ranks)"]
        rows = [
            [
                n,
                report._ms(r["ms"]),
                report._ratio(r["ms"] / ddp["ms"]),
                f"{r['bytes'] / 2**20:.2f}",
                report._ratio(r["bytes"] / ddp["bytes"]),
            ]
            for n, r in mesh.items()
        ]
        parts += [
            f"## At {label}: the GPT on 4 ranks as 2 nodes x 2 (DDP, hierarchical fsync, DiLoCo)",
            "",
            "Mean step over whole rounds of H = 8 steps. Cross-node MiB: what each rank hands "
            "to collectives that cross nodes per step, from `fsync.sync_stats` (all of a flat "
            "all-reduce's bytes count). The four ranks share one shaped loopback, so the "
            "traffic within a node is as slow as across: the times show the cost of the "
            "bytes, not the benefit of a fast link inside a node.",
            "",
            report._markdown_table(
                ["", "ms per step", "vs DDP", "cross-node MiB per step", "vs DDP"], rows
            ),
            "",
        ]
    md = out / "benchmarks-link.md"
    md.write_text("\n".join(parts))
    return [md, *figures]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    results = measure(args)
    paths = write(results, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())

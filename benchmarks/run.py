"""fsync beside DDP on the same work: ``python benchmarks/run.py`` writes ``docs/benchmarks.md``.

Each section's settings take turns, each in a gloo world of its own (2 CPU ranks by
default; :mod:`benchmarks.harness`): 1. the training step of three workloads, with the
overlap that ``fsync.compile`` buys read off inductor's code; 2. the sync alone on the
GPT's gradients; 3. the same bytes as more and more leaves; 4. what each hook sends;
6. the compiled sync taken apart (on a GPU with ``--device cuda``); ZeRO has a section of its
own on the slow-link page. ``--smoke`` runs tiny sizes and few rounds (what CI runs);
``--only`` picks sections. This is also the front door of the other pages: ``link``
(:mod:`benchmarks.link`, a loopback shaped to a rate) and ``twonodes``
(:mod:`benchmarks.twonodes`, two network namespaces joined by a shaped cable) are in the
default run; both need root, and each says so and skips what it cannot run. So is ``ft``
(:mod:`benchmarks.ft`, fault tolerance on torchft; its 8 Gbit/s rows need root).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

if not __package__:  # run as a script: the repository first, not benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

import fsync
from benchmarks import ft, harness, link, page, plot, steps, table, twonodes, zero
from benchmarks.harness import Built, Row, Setting
from benchmarks.models import HOST_BOUND, Load
from benchmarks.steps import setting
from tests._inductor_code import kernels_launched

CASES = ("step", "sync", "leaves", "hooks", "host", "anatomy", "link", "twonodes", "ft")
CUDA_CASES = ("anatomy",)  # what runs on a GPU: the rest compares with DDP on CPU
DDP_EAGER = "DDP eager"
GRAD_AND_VALUE = "fsync eager, grad_and_value"
OVERLAP = "fsync compiled + overlap"
AGREEMENT = "the ranks' agreement alone (in every sync)"
FLAT, PURE_MEAN = steps.FLAT, steps.PURE_MEAN
COPY = "copy of the same bytes (floor)"
COMPILED_SYNC = "sync_grads, compiled"
HOOKS: dict[str, Callable[[], fsync.Hook]] = {
    "allreduce": fsync.ops.allreduce,
    "fp16_compress": fsync.ops.fp16_compress,
    "bf16_compress": fsync.ops.bf16_compress,
    "powersgd(1)": lambda: fsync.ops.powersgd(1, start_step=0),
    "powersgd(4)": lambda: fsync.ops.powersgd(4, start_step=0),
    "quantize(8)": fsync.ops.quantize,
}
READING = (
    "How to read it. Rows marked *no sync* are floors: the module rows train with "
    "autograd as DDP does, the functional rows with `torch.func` as fsync's steps do. "
    "*fsync eager* syncs with `sync_grads` after `torch.func.grad_and_value` returns; *fsync "
    "eager, grad_and_value* is `fsync.grad_and_value`, whose all-reduces start during "
    "backward as each bucket completes, as DDP's do; the compiled fsync steps are "
    "`fsync.compile` of the first. The module steps update with `torch.optim.SGD`, the eager "
    "functional ones with `fsync.optim.sgd(lr, in_place=True)` (the same in-place kernels), "
    "the compiled ones with the pure `fsync.optim.sgd(lr)`, which inductor fuses. "
    "Sync only has two floors: the flat all-reduce sums one preallocated tensor in place, "
    "which a sync may not do (it must leave the caller's gradients alone and return their "
    "mean); the pure mean adds the one scaled copy into fresh memory that any such sync "
    "needs."
)


def flags(parser: argparse.ArgumentParser) -> None:
    """This page's own flags: which sections (and other pages), where, over how many leaves."""
    only = f"comma-separated, of {CASES}"
    parser.add_argument("--only", type=page.listed(CASES), default=list(CASES), help=only)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks on this machine; cuda: NCCL, one rank per GPU, section 6 only",
    )
    parser.add_argument("--world-size", type=int, default=None, help="2 on CPU, 1 on CUDA")
    parser.add_argument(
        "--leaves",
        default="1,100,1000,10000",
        help="leaf counts to scale over (10,000 leaves compile in 2 to 3 minutes on 2 cores)",
    )


def loads(smoke: bool) -> list[Load]:
    """The workloads: the MLP, the deep MLP, and last the GPT (the sync, hook and anatomy
    sections'). A smoke run takes each code path once, at the slow-link page's smoke sizes,
    whose graphs it shares: the steps on the MLP (the GPT's compiled steps took 100 s of the
    suite's CPU to compile the same settings), the rest on the GPT's many leaves."""
    if smoke:
        return [Load("MLP", 256, smoke=True), Load("GPT", 256, smoke=True)]
    return [Load("MLP", 64), Load("deep MLP", 64), Load("GPT", 256)]


# --- 1. the step ----------------------------------------------------------------------------


def step_settings(load: Load) -> list[Setting]:
    """One training step (forward, backward, sync, SGD update) in each setting."""
    module, functional = steps.module, steps.functional
    return [
        setting("local eager (no sync)", module, load=load, ddp=False),
        setting(DDP_EAGER, module, load=load, ddp=True),
        setting("DDP compiled", module, load=load, ddp=True, compiled=True),
        # The eager functional steps update in place, with torch.optim.SGD's kernels, as
        # the module steps do; the compiled ones purely, fused by inductor.
        setting(
            "local functional eager (no sync)", functional, load=load, sync=None, in_place=True
        ),
        setting("local compiled (no sync)", functional, load=load, sync=None, compiled=True),
        setting("fsync eager", functional, load=load, sync="sync_grads", in_place=True),
        setting(GRAD_AND_VALUE, functional, load=load, sync="grad_and_value", in_place=True),
        setting(
            "fsync compiled", functional, load=load, sync="sync_grads", compiled=True, overlap=False
        ),
        setting(OVERLAP, functional, load=load, sync="sync_grads", compiled=True),
        # A 1 ms collective, timed over 25 calls a step: a turn of two would mostly
        # measure how far apart the ranks leave the barrier before it.
        setting(AGREEMENT, steps.agreement, load=load, repeat=25),
    ]


# --- 5. host cost: each eager gradient call beside its DDP counterpart ----------------------

# Each fsync call and the DDP setting it replaces; the floors are read against DDP's call.
COUNTERPART = {
    steps.MODULE_BACKWARD: steps.DDP_BACKWARD,
    steps.TORCH_FUNC: steps.DDP_BACKWARD,
    steps.FSYNC_CALL: steps.DDP_BACKWARD,
    steps.FSYNC_AFTER_BACKWARD: steps.DDP_BACKWARD,
    steps.FSYNC_POWERSGD: steps.DDP_POWERSGD,
    zero.VALUE_AND_STEP: zero.REFERENCE,
}
HOST_WORLDS = (1, 2)
# A host-bound call takes milliseconds: a turn of this many, so that one is not timed
# mostly by how far apart the ranks leave the barrier before it.
HOST_STEPS = 20


def host_settings(load: Load) -> list[Setting]:
    """The eager gradient calls on a step of many small leaves: the floors, DDP's three
    ways (plain, PowerSGD, ZeroRedundancyOptimizer) and fsync's call for each."""
    calls = [steps.MODULE_BACKWARD, steps.TORCH_FUNC, steps.DDP_BACKWARD, steps.FSYNC_CALL]
    calls += [steps.FSYNC_AFTER_BACKWARD, steps.DDP_POWERSGD, steps.FSYNC_POWERSGD]
    return [
        *(setting(how, steps.grad_call, load=load, how=how) for how in calls),
        setting(zero.REFERENCE, zero.torch_zero, load=load, overlap=None),
        setting(zero.VALUE_AND_STEP, zero.fsync_zero, load=load, how="value_and_step"),
    ]


# --- 2. the sync alone, 3. leaf scaling, 4. hooks, 6. anatomy: built in their processes ------


def sync_settings(load: Load) -> list[Setting]:
    names = [FLAT, PURE_MEAN, "sync_grads eager", "sync_grads torch.compile"]
    names += ["sync_grads fsync.compile, overlap off", "sync_grads compiled"]
    return [setting(n, steps.sync_alone, load=load, how=n) for n in names]


def leaves(n: int, total: int, compiled: bool) -> Built:
    """The sync of ``total`` floats as ``n`` leaves; compiled, with its compile time."""
    g = torch.Generator().manual_seed(dist.get_rank())
    grads = {f"leaf{i}": torch.randn(total // n, generator=g) for i in range(n)}
    if not compiled:
        return Built(lambda: fsync.sync_grads(grads))
    sync = fsync.compile(_sync)
    started = time.perf_counter()
    sync(grads)
    seconds = time.perf_counter() - started
    return Built(lambda: sync(grads), lambda: {"compile s": seconds})


def _sync(grads: dict[str, torch.Tensor]) -> Any:
    return fsync.sync_grads(grads)


def hook(load: Load, name: str) -> Built:
    """The eager ``GradSync`` of the model's gradients with one hook, and what it sends."""
    grads = load.build().grads(dist.get_rank())
    sync = fsync.GradSync(hook=HOOKS[name]())
    box = [sync.init(grads)]

    def step() -> None:
        _, box[0] = sync(grads, box[0])

    def info() -> dict[str, Any]:
        size = dist.get_world_size()
        stats = fsync.sync_stats(
            sync.plan(box[0]), hook=sync.hook, state=box[0].hook, world_size=size
        )
        return {
            "bytes on wire": float(stats.bytes_on_wire),
            "relative": stats.bytes_on_wire / stats.bytes_reduced,
            "collectives": float(stats.num_collectives),
        }

    return Built(step, info)


def anatomy(load: Load, what: str, device: str) -> Built:
    """The compiled sync of the model's gradients on ``device``, taken apart: the sync
    (kernels per bucket read off inductor's code, compile time, graphs compiled over more
    calls with new values), packing and unpacking alone, and one copy of the same bytes."""
    where = torch.device(device, dist.get_rank()) if device == "cuda" else torch.device(device)
    grads = {k: g.to(where) for k, g in load.build().grads(dist.get_rank()).items()}
    plan = fsync.plan_buckets(grads)

    def timed(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            fn()
            if where.type == "cuda":
                torch.cuda.synchronize(where)

        return call

    if what == COPY:
        # The same bytes in pieces of the buckets' sizes, so that both sides allocate alike
        # (on CPU one 80 MiB tensor is mapped and faulted in afresh on every call, where a
        # bucket-sized one reuses the heap).
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        pieces = torch.split(flat, [spec.numel for spec in plan.specs])
        return Built(timed(lambda: [piece.clone() for piece in pieces]))
    if what != COMPILED_SYNC:

        def round_trip(g: dict[str, torch.Tensor]) -> Any:
            return fsync.unpack(fsync.pack(g, plan), plan)

        fn = fsync.compile(round_trip) if what == "pack + unpack, compiled" else round_trip
        return Built(timed(lambda: fn(grads)))
    sync = fsync.compile(_sync)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    with torch._inductor.config.patch(force_disable_caches=True):  # the compile time itself
        _, code = run_and_get_code(sync, grads)
    seconds = time.perf_counter() - started
    for s in range(3):
        sync({k: g * (s + 2) for k, g in grads.items()})
    info = {
        "device": str(where),
        "buckets": len(plan.buckets),
        "kernels": kernels_launched(code[-1]),
        "compile s": seconds,
        "recompiles": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs - 1,
        "bytes": float(sum(plan.nbytes)),
    }
    return Built(timed(lambda: sync(grads)), lambda: info)


def measure(args: argparse.Namespace, rate: str, env: Mapping[str, str]) -> dict[str, Any]:
    """Every section asked for, each a round of turns (:func:`benchmarks.harness.turns`), on
    this machine's loopback; ``env`` set in every setting's processes."""
    node = harness.Node(local=args.world_size)
    backend = "nccl" if args.device == "cuda" else "gloo"
    work, results = loads(args.smoke), dict[str, Any]()
    # Floats: 256 KiB or 24 MiB. Under glibc's largest mmap threshold (32 MiB), so that one
    # leaf's bucket reuses heap memory as the split ones do rather than being mapped and
    # faulted in afresh on every call.
    total = 1 << 16 if args.smoke else 6 << 20
    counts = [int(n) for n in args.leaves.split(",")]
    anatomy_names = [COPY, "pack + unpack, eager", "pack + unpack, compiled", COMPILED_SYNC]
    sections: dict[str, Callable[[], list[Setting]]] = {
        "sync": lambda: sync_settings(work[-1]),
        "leaves": lambda: [
            setting(f"{mode} {n}", leaves, n=n, total=total, compiled=mode == "compiled")
            for mode in ("eager", "compiled")
            for n in counts
        ],
        "hooks": lambda: [setting(n, hook, load=work[-1], name=n) for n in HOOKS],
        "anatomy": lambda: [
            setting(n, anatomy, load=work[-1], what=n, device=args.device) for n in anatomy_names
        ],
    }

    def turns(settings: list[Setting], node: harness.Node = node, **timing: Any) -> Row | None:
        timing = page.timing(args) | timing  # this section's own turns over the page's
        return harness.turns(settings, **timing, node=node, backend=backend, env=env)

    if "step" in args.only:
        step_rows = work[:1] if args.smoke else work  # a smoke run: the MLP alone
        results["step"] = {load.name: turns(step_settings(load)) for load in step_rows}
    if "host" in args.only:
        host = host_settings(Load(HOST_BOUND, 1, smoke=args.smoke))
        steps_ = 1 if args.smoke else HOST_STEPS
        results["host"] = {
            world: turns(host, harness.Node(local=world), steps=steps_) for world in HOST_WORLDS
        }
    results |= {name: turns(make()) for name, make in sections.items() if name in args.only}
    results["leaves_bytes"] = total * 4
    results["gpu"] = _gpu_note(args)
    ranks = f"{args.world_size} rank{'s' if args.world_size > 1 else ''}"
    results["backend"] = f"{backend} on {args.device.upper()}, {ranks}, 1 intra-op thread each"
    return results


def environment(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, str]:
    """What the page adds to the table of what it was measured on."""
    return {
        "backend": results["backend"],
        "turns": f"{args.rounds} rounds of {args.steps} steps per setting, after {args.warmup} "
        "steps of warm-up",
        "sizes": "smoke (tiny)" if args.smoke else "full",
    }


def _gpu_note(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        measured = "Section 6 was measured on the GPU."
    elif torch.cuda.is_available():
        measured = "Section 6 ran on CPU; `--device cuda` measures it on the GPU."
    else:
        measured = "No CUDA device in this run: section 6 ran on CPU."
    return (
        f"{measured} Overlap of collectives with backward compute on GPUs needs two or more "
        "GPUs: with one GPU, NCCL has one rank and fsync issues no collective at all."
    )


# --- the page -------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[table.Target]:
    """(target, measured, met) for every target this run can speak to; met: the median."""
    out, check = [], table.check
    for model, row in results.get("step", {}).items():
        over = table.ratio(row, OVERLAP, DDP_EAGER), table.ratio(row, OVERLAP, "DDP compiled")
        out.append(check(f"{model}: fsync compiled <= 0.85 x DDP eager", over[0], 0.85))
        out.append(check(f"{model}: fsync compiled <= DDP compiled", over[1], 1.0))
        for name in ("fsync eager", OVERLAP):
            s = table.ratio(row, AGREEMENT, name)
            text = f"{model}: the ranks' agreement < 1% of the {name} step"
            out.append((text, table.share(s, 2), s.median < 0.01))
    for world, row in results.get("host", {}).items():
        bound = 1.0 if world == 1 else 1.10
        where = f"{HOST_BOUND}, world {world}"
        for name in (steps.FSYNC_CALL, steps.FSYNC_AFTER_BACKWARD):
            s = table.ratio(row, name, steps.DDP_BACKWARD)
            out.append(check(f"{where}: {name} <= {bound:.2f} x DDP", s, bound))
        for name in (steps.FSYNC_POWERSGD, zero.VALUE_AND_STEP):
            s = table.ratio(row, name, COUNTERPART[name])
            out.append(check(f"{where}: {name} <= 1.15 x {COUNTERPART[name]}", s, 1.15))
    for mode in ("compiled", "eager") if "sync" in results else ():
        s = table.ratio(results["sync"], f"sync_grads {mode}", FLAT)
        out.append(check(f"sync only ({mode}) <= 1.10 x flat all-reduce", s, 1.10))
    counts = _counts(results.get("leaves"))
    if len(counts) > 1:
        s = table.ratio(results["leaves"], f"compiled {counts[-1]}", f"compiled {counts[0]}")
        out.append(check(f"compiled sync of {counts[-1]:,} leaves <= 1.3 x 1 leaf", s, 1.3))
    if "anatomy" in results:
        info = results["anatomy"]["info"][COMPILED_SYNC][0]
        on, per_bucket = f"({info['device']})", info["kernels"] / info["buckets"]
        text = f"pack + unpack kernels per bucket <= 2 {on}"
        out.append((text, f"{per_bucket:g}", per_bucket <= 2))
        s = table.ratio(results["anatomy"], COPY, "pack + unpack, compiled")
        text = f"pack + unpack >= 80% of copy bandwidth {on}"
        out.append(check(text, s, 0.8, least=True, percent=True))
        n = info["recompiles"]
        out.append((f"no recompile after the first step {on}", str(n), n == 0))
    if results.get("gpu"):
        out.append(("compute/communication overlap on GPUs, above DDP's", "not measured", None))
    return out


def _counts(row: Row | None) -> list[int]:
    """The leaf counts of the leaf-scaling row, fewest first."""
    return sorted({int(n.split()[1]) for n in row["rounds"]}) if row else []


def tables(results: dict[str, Any]) -> list[table.Table]:
    out: list[table.Table] = []
    for model, row in results.get("step", {}).items():
        n = row["info"][DDP_EAGER][0]["params"]
        title = f"1. Step time, {model} ({n / 1e6:.1f}M parameters): ms per step"
        out.append((title, ["setting", "ms", "vs DDP eager"], table.timings(row, DDP_EAGER)))
    overlap = [
        [f"{model}: {name}", str(info[0]["collectives"]), str(info[0]["overlapped"])]
        for model, row in results.get("step", {}).items()
        for name, info in row["info"].items()
        if "collectives" in info[0]
    ]
    if overlap:
        header = ["", "collectives", "compute kernels launched while one is in flight"]
        out.append(("1b. Overlap in the compiled step (read off inductor's code)", header, overlap))
    if "sync" in results:
        mib = results["sync"]["info"][FLAT][0]["bytes"] / 2**20
        header = ["", "ms", "vs flat all-reduce", "vs pure mean"]
        rows = table.timings(results["sync"], FLAT, PURE_MEAN)
        out.append((f"2. Sync only: the GPT's gradients ({mib:.1f} MiB)", header, rows))
    if counts := _counts(results.get("leaves")):
        row = results["leaves"]
        rows = []
        for n in counts:
            cells = [f"{n:,}"]
            for mode in ("eager", "compiled"):
                ratio = table.ratio(row, f"{mode} {n}", f"{mode} {counts[0]}")
                cells += [table.ms(table.median(row, f"{mode} {n}")), table.spread(ratio)]
            rows.append([*cells, f"{row['info'][f'compiled {n}'][0]['compile s']:.0f}"])
        header = ["leaves", "eager ms", "vs 1", "compiled ms", "vs 1", "compile s (empty cache)"]
        title = f"3. Leaf scaling: {results['leaves_bytes'] / 2**20:.0f} MiB as n leaves"
        out.append((title, header, rows))
    if "hooks" in results:
        info = results["hooks"]["info"]

        def sent(name: str) -> list[str]:
            stats = info[name][0]
            mib = stats["bytes on wire"] / 2**20
            return [f"{mib:.2f}", f"{stats['relative']:.3f}", f"{stats['collectives']:.0f}"]

        header = ["hook", "ms", "ms vs all-reduce", "MiB on wire", "vs all-reduce", "collectives"]
        rows = table.timings(results["hooks"], "allreduce", extra=sent)
        out.append(("4. Hooks on the GPT's gradients (eager GradSync)", header, rows))
    if host := results.get("host"):
        header = ["setting"]
        for world in host:
            header += [f"world {world}: ms", "vs its DDP counterpart"]
        rows = []
        for name in next(iter(host.values()))["rounds"]:
            cells = [name]
            for row in host.values():
                base = COUNTERPART.get(name)
                versus = table.spread(table.ratio(row, name, base)) if base else ""
                cells += [table.ms(table.median(row, name)), versus]
            rows.append(cells)
        title = f"5. Host cost: one eager call on the {HOST_BOUND} (150 leaves), ms"
        out.append((title, header, rows))
    if "anatomy" in results:
        info = results["anatomy"]["info"][COMPILED_SYNC][0]
        nbytes = info["bytes"]

        def rate(name: str) -> list[str]:
            return [f"{2 * nbytes / table.median(results['anatomy'], name) / 1e6:.1f}"]

        header = ["", "ms", "vs copy", "GB/s read + written"]
        rows = table.timings(results["anatomy"], COPY, extra=rate)
        title = f"6. The compiled sync up close, on {info['device']}: the GPT's gradients"
        out.append((f"{title} ({nbytes / 2**20:.1f} MiB)", header, rows))
        per_bucket = f"{info['kernels'] / info['buckets']:g}"
        cells = [str(info["buckets"]), str(info["kernels"]), per_bucket]
        cells += [f"{info['compile s']:.1f}", str(info["recompiles"])]
        header = ["buckets", "kernels", "kernels per bucket", "compile s", "graphs after the first"]
        out.append(("6b. What the compiled sync is made of", header, [cells]))
    return out


def figures(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """One figure per question: step time, leaf scaling, hook bytes."""
    paths = []
    if "step" in results:
        steps_ = results["step"]
        names = list(next(iter(steps_.values()))["rounds"])
        figure, (ax,) = plot.figure(size=(8, 0.35 * len(names) * len(steps_) + 1.5))

        def vs_ddp(name: str, model: str) -> table.Spread:
            return table.ratio(steps_[model], name, DDP_EAGER)

        plot.bars(ax, names, list(steps_), vs_ddp, horizontal=True)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("step time relative to DDP eager, median and range (lower is better)")
        ax.set_title(f"One training step, {results['backend']}")
        ax.legend()
        ax.invert_yaxis()
        paths.append(plot.save(figure, out / "benchmarks-step.png"))
    if counts := _counts(results.get("leaves")):
        figure, (ax,) = plot.figure(size=(6.5, 4.2))
        for mode in ("eager", "compiled"):
            name = f"{mode} {{}}".format
            ratios = [table.ratio(results["leaves"], name(n), name(counts[0])) for n in counts]
            ax.plot(counts, [r.median for r in ratios], "o-", label=mode)
            ax.fill_between(counts, [r.low for r in ratios], [r.high for r in ratios], alpha=0.2)
        ax.set_xscale("log")
        ax.axhline(1.3, color="grey", linestyle="--", linewidth=0.8, label="target 1.3x")
        ax.set_xlabel("leaves (same total bytes)")
        ax.set_ylabel("sync time relative to 1 leaf")
        ax.set_title("Does the sync scale with the number of leaves?")
        ax.legend()
        paths.append(plot.save(figure, out / "benchmarks-leaves.png"))
    if "hooks" in results:
        info = results["hooks"]["info"]
        figure, (ax,) = plot.figure(size=(6.5, 0.4 * len(info) + 1.5))
        ax.barh(list(info), [i[0]["relative"] for i in info.values()])
        ax.set_xscale("log")
        ax.set_xlabel("bytes on the wire relative to all-reduce")
        ax.set_title("What each hook sends")
        ax.invert_yaxis()
        paths.append(plot.save(figure, out / "benchmarks-hooks.png"))
    return paths


INTRO = (
    "Written by `python benchmarks/run.py` (do not edit by hand). Each setting runs in a "
    "gloo world of its own processes; the settings of a table take turns, world after "
    "world, round after round (`benchmarks/harness.py`), so that a drift of the machine "
    "weighs on all alike and no setting shares a process with another. A figure in ms is "
    "the median over the rounds of a turn's time per step on rank 0, after warm-up "
    "(compilation happens in the warm-up); a ratio is taken round by round and given as "
    "`median [lowest, highest]` over the rounds; a target is judged on the median."
)
ELSEWHERE = (
    "Communication on a link slower than compute (overlap, ZeRO at 8 Gbit/s): "
    "[benchmarks on a slow link](benchmarks-link.md), from `--only link`; the hierarchical "
    "mean on two nodes joined by a slower cable: [benchmarks on two nodes]"
    "(benchmarks-twonodes.md), from `--only twonodes`."
)


PAGE = page.Page(
    file="benchmarks.md",
    title="Benchmarks",
    module="benchmarks.run",
    measure=measure,
    targets=targets,
    tables=lambda results: [(t, "") for t in tables(results)],
    intro=(INTRO, ELSEWHERE, READING),
    figures=figures,
    end=lambda results: ["## 7. GPU", "", results["gpu"], ""],
    timing=page.Timing(rounds=10, steps=2, warmup=5),
    environment=environment,
    flags=flags,
)
PAGES = {"link": link.PAGE, "twonodes": twonodes.PAGE, "ft": ft.PAGE}  # the other pages


def main(argv: list[str] | None = None) -> int:
    args = page.parse(PAGE, argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA device; none is visible")
    pages = [c for c in PAGES if c in args.only and args.device == "cpu"]
    args.only = [c for c in args.only if c not in PAGES]
    if args.device == "cuda":
        args.only = [c for c in args.only if c in CUDA_CASES]
    args.world_size = args.world_size or (2 if args.device == "cpu" else 1)
    if args.only:
        page.report(PAGE, args)
    # Each other page takes its own turns, but those of a smoke run.
    common = ["--out", str(args.out), *(page.turn_args(args) if args.smoke else [])]
    for name in pages:  # each says so and skips what it cannot run
        page.main(PAGES[name], common)
    return 0


if __name__ == "__main__":
    from benchmarks import run  # this module by name, so that its builders pickle

    sys.exit(run.main())

"""Step time on a link slower than compute: ``python -m benchmarks.link`` (as root).

Between machines, collectives wait on the network rather than on the CPU, and a step can
hide them behind backward; two ranks on one machine talk over a loopback as fast as
memory. So each shaped rate (16, 8 and 4 Gbit/s) runs in a child of this page (``--child
RATE``) inside ``slownet`` (``../shared/tools/slownet``, as root: a network namespace whose
loopback is shaped to the rate), the unshaped one in the page's own process; each row's
settings take turns in worlds of their own (:mod:`benchmarks.harness`); the page writes
``docs/benchmarks-link.md`` and its figures. The rows are :func:`rows`'s, the method the
page's :data:`READING`. By hand, one rate::

    ../shared/tools/slownet --rate 8gbit -- python -m benchmarks.link --child 8gbit \\
        --json 8gbit.json

On 2 quiet cores the whole run takes about an hour, most of it compiling: each row compiles
five steps, once per process; all processes share one inductor cache.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

if not __package__:  # run as a script: the repository first, not benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

import fsync
from benchmarks import harness, page, plot, steps, table, zero
from benchmarks.constants import CAP_MB, LR
from benchmarks.harness import Row, Setting
from benchmarks.models import Load
from benchmarks.page import Page, label, row_key
from benchmarks.steps import setting
from benchmarks.table import Spread

RATES = ("unshaped", "16gbit", "8gbit", "4gbit")
WORKLOADS, BATCHES, WORKLOAD_RATES = ("deep MLP", "GPT"), (64, 256), ("unshaped", "8gbit")
DDP_EAGER = "DDP eager"
GAV = "fsync eager, grad_and_value"
FUNC = "fsync eager, torch.func + sync_grads"
# Each setting and its own compute: the share of the all-reduce a step hides is
# (own compute + flat all-reduce - step) / flat all-reduce.
SETTINGS = {
    DDP_EAGER: "compute, module eager",
    "DDP compiled": "compute, module compiled",
    GAV: "compute, functional eager",
    FUNC: "compute, functional eager",
    "fsync compiled": "compute, functional compiled",
}
FLOORS = tuple(dict.fromkeys(SETTINGS.values()))
FLAT = "flat all-reduce of the gradients"
CEILING = "flat all-reduce issued before the compiled compute (ceiling)"
SYNC_ALONE = (steps.FLAT, "sync_grads eager", "sync_grads compiled")
MEMORY_SETTINGS = ("compute, module eager", DDP_EAGER, GAV, FUNC)
MEMORY_BATCH = 256


class Rows(NamedTuple):
    """What one rate measures: step rows (workload, bucket MiB), the sync alone's workload,
    ZeRO's rows and the memory's workloads (the last three may be empty)."""

    steps: list[tuple[Load, float]]
    sync: list[Load]
    zero: list[Load]
    memory: list[Load]


def rows(rate: str, smoke: bool) -> Rows:
    """The rows of ``rate``, all with 4 MiB buckets (fsync and DDP alike) unless they say so.

    The benchmark MLP (8.4M parameters, 33.6 MB of gradients) at batch 256, where compute
    is longer than the all-reduce at 8 Gbit/s, at every rate; at 8 Gbit/s also at batch 64
    (link-bound), with the default 25 MiB buckets, and the sync alone. The deep MLP and the
    GPT at batch 64 and 256 (the GPT's batch counts tokens: 1 or 4 sequences of 64),
    unshaped and at 8 Gbit/s, and the same rows for ZeRO (:mod:`benchmarks.zero`).
    Unshaped, the peak memory of the eager steps at batch 256. A smoke run: the MLP and
    the sync alone; ZeRO and memory on the deep MLP; at tiny sizes, unshaped.
    """
    if smoke:
        mlp, deep = Load("MLP", 256, smoke=True), Load("deep MLP", 256, smoke=True)
        return Rows([(mlp, CAP_MB)], [mlp], [deep], [deep])
    work = [(Load("MLP", 256), CAP_MB)]
    if rate == "8gbit":
        work += [(Load("MLP", 64), CAP_MB), (Load("MLP", 256), 25.0)]
    if rate in WORKLOAD_RATES:
        work += [(Load(name, batch), CAP_MB) for name in WORKLOADS for batch in BATCHES]
    memory = [Load(name, MEMORY_BATCH) for name in WORKLOADS] if rate == "unshaped" else []
    sync = [Load("MLP", 256)] if rate == "8gbit" else []
    return Rows(work, sync, zero.loads(rate, smoke), memory)


# --- what each row times, built in the settings' processes ---------------------------------


def row_settings(load: Load, cap: float) -> list[Setting]:
    """The five steps, their floors, the flat all-reduce and the ceiling.

    The eager fsync steps update with ``fsync.optim.sgd(LR, in_place=True)``: the kernels
    ``torch.optim.SGD`` runs in the DDP steps, so that a row compares the gradient calls and
    their sync (a pure update writes a second copy of the parameters: docs/performance.md).
    """
    module, functional = steps.module, steps.functional
    return [
        setting(DDP_EAGER, module, load=load, ddp=True, cap=cap),
        setting("DDP compiled", module, load=load, ddp=True, compiled=True, cap=cap),
        setting(GAV, functional, load=load, sync="grad_and_value", cap=cap, in_place=True),
        setting(FUNC, functional, load=load, sync="sync_grads", cap=cap, in_place=True),
        setting(
            "fsync compiled", functional, load=load, sync="grad_and_value", compiled=True, cap=cap
        ),
        setting("compute, module eager", module, load=load, ddp=False),
        setting("compute, module compiled", module, load=load, ddp=False, compiled=True),
        setting("compute, functional eager", functional, load=load, sync=None, in_place=True),
        setting("compute, functional compiled", functional, load=load, sync=None, compiled=True),
        setting(FLAT, steps.sync_alone, load=load, how=steps.FLAT),
        setting(CEILING, steps.ceiling, load=load),
    ]


def memory_step(load: Load, name: str) -> Callable[[], object]:
    """One eager step of ``name`` on the model's own parameters, the only copy kept.

    The module settings train the module with ``torch.optim.SGD``; the fsync ones update
    the same tensors with ``fsync.optim.sgd(LR, in_place=True)``, the same kernels, so that
    the settings differ in their gradients and sync alone (a pure ``fsync.optim.sgd`` would
    hold a second copy of the parameters while it makes the new one).
    """
    if name in ("compute, module eager", DDP_EAGER):
        return steps.module(load, ddp=name == DDP_EAGER, cap=CAP_MB).step
    work = load.build()
    batch = work.batch(dist.get_rank())
    params = {n: p.detach() for n, p in work.model.named_parameters()}
    synced = fsync.grad(work.functional_loss, bucket_cap_mb=CAP_MB)
    update = fsync.optim.sgd(LR, in_place=True)
    state = update.init(params)

    def step() -> None:
        if name == GAV:
            grads = synced(params, batch)
        else:
            grads = torch.func.grad(work.functional_loss)(params, batch)
            grads = fsync.sync_grads(grads, bucket_cap_mb=CAP_MB)
        update.update(params, grads, state)  # into ``params`` and ``state``

    return step


# --- one rate, in its namespace --------------------------------------------------------------


def measure(args: argparse.Namespace, rate: str, env: Mapping[str, str]) -> dict[str, Any]:
    """Every row of ``rate`` (the loopback already shaped to it); ``env`` set in every
    setting's processes."""
    timing: dict[str, Any] = {**page.timing(args), "env": env}
    memory = {**timing, "rounds": 1, "warmup": 1, "follow_rss": True}

    out: dict[str, Any] = {}
    todo = rows(rate, args.smoke)
    for load, cap in todo.steps:
        started = time.perf_counter()
        out[row_key(load, cap, CAP_MB)] = harness.turns(row_settings(load, cap), **timing)
        print(f"link {rate}: {row_key(load, cap, CAP_MB)} ({time.perf_counter() - started:.0f} s)")
    for load in todo.sync:
        sync = [setting(n, steps.sync_alone, load=load, how=n, cap=CAP_MB) for n in SYNC_ALONE]
        out["sync alone"] = harness.turns(sync, **timing)
    out["zero"] = {str(load): harness.turns(zero.settings(load), **timing) for load in todo.zero}
    # Memory: one turn of each eager step, in processes whose RSS follows the tensors alive.
    eager = [lambda load: [setting(n, memory_step, load=load, name=n) for n in MEMORY_SETTINGS]]
    for key, make in zip(("memory", "zero memory"), [*eager, zero.memory_settings], strict=True):
        out[key] = {load.name: harness.turns(make(load), **memory) for load in todo.memory}
    return out


# --- the page --------------------------------------------------------------------------------


def hidden(row: Row, name: str) -> Spread:
    """The share of the flat all-reduce ``name`` hides behind its own compute, per round."""
    return table.hidden(row, name, SETTINGS[name], FLAT)


def targets(results: dict[str, Any]) -> list[table.Target]:
    """(target, measured, met); met: the median over the rounds; ``not run`` where the rate or
    row was not run."""

    def at(rate: str, key: str) -> Row | None:
        row: Row | None = results.get(rate, {}).get(key)
        return row

    def ratio(rate: str, key: str, name: str) -> Spread | None:
        return table.ran(at(rate, key), name, DDP_EAGER)

    mlp, compiled, out = "MLP, batch 256", "fsync compiled", []
    out.append(
        table.check(
            f"{compiled} <= 0.95x DDP eager, 8 Gbit/s, {mlp}", ratio("8gbit", mlp, compiled), 0.95
        )
    )
    row = at("8gbit", mlp)
    share = hidden(row, compiled) if row else None
    text = f"{compiled} hides >= 40% of the all-reduce, 8 Gbit/s, {mlp}"
    out.append(table.check(text, share, 0.40, least=True, percent=True))
    text = f"{compiled} <= 1.0x DDP eager, 8 Gbit/s, MLP batch 64"
    out.append(table.check(text, ratio("8gbit", "MLP, batch 64", compiled), 1.0))
    keys = [f"{name}, batch {batch}" for name in WORKLOADS for batch in BATCHES]
    for key in keys:
        text = f"{key}: grad_and_value eager <= 1.00x DDP eager, 8 Gbit/s"
        out.append(table.check(text, ratio("8gbit", key, GAV), 1.0))
    for key in keys:  # grad_and_value hides at least DDP's share, medians against medians
        text = f"{key}: grad_and_value eager hides >= DDP eager's share, 8 Gbit/s"
        if (row := at("8gbit", key)) is None:
            out.append((text, "not run", None))
            continue
        mine, ddp = hidden(row, GAV).median, hidden(row, DDP_EAGER).median
        out.append((text, f"{mine:.0%} vs {ddp:.0%}", mine >= ddp))
    for key in keys:
        bound = 0.90 if key.endswith("256") else 1.0
        text = f"{key}: fsync compiled <= {bound:.2f}x DDP eager, 8 Gbit/s"
        out.append(table.check(text, ratio("8gbit", key, compiled), bound))
    for key in keys:
        text = f"{key}: grad_and_value eager <= 1.05x DDP eager, unshaped"
        out.append(table.check(text, ratio("unshaped", key, GAV), 1.05))
    if (sync := at("8gbit", "sync alone")) is not None:
        s = table.ratio(sync, "sync_grads compiled", steps.FLAT)
        out.append(
            table.check("sync alone, compiled <= 1.05x the flat all-reduce, 8 Gbit/s", s, 1.05)
        )
    for name, row in results.get("unshaped", {}).get("memory", {}).items():
        text = f"{name}, batch {MEMORY_BATCH}: grad_and_value eager's peak RSS <= DDP eager's"
        text += f" + one bucket ({CAP_MB:g} MiB)"
        out.append(table.within_bucket(text, row, GAV, DDP_EAGER, CAP_MB))
    zero_rows = {rate: at.get("zero", {}) for rate, at in results.items()}
    return out + zero.targets(zero_rows, results.get("unshaped", {}).get("zero memory", {}))


def _rows_at(results: dict[str, Any], rate: str) -> list[str]:
    """The rows with 4 MiB buckets measured at ``rate``, in a fixed order."""
    keys = ["MLP, batch 64", "MLP, batch 256"]
    keys += [f"{name}, batch {batch}" for name in WORKLOADS for batch in BATCHES]
    return [k for k in keys if k in results.get(rate, {})]


def _columns(results: dict[str, Any], columns: list[tuple[str, str]]) -> list[list[str]]:
    """Every figure of the (rate, row) ``columns`` in ms, one column each, then the shares
    hidden."""
    rows = [
        [name, *[table.ms(table.median(results[r][k], name)) for r, k in columns]]
        for name in [*SETTINGS, *FLOORS, FLAT, CEILING]
    ]
    for name in SETTINGS:
        shares = [table.share(hidden(results[r][k], name)) for r, k in columns]
        rows.append([f"{name}: share of the all-reduce hidden", *shares])
    return rows


def tables(results: dict[str, Any]) -> list[tuple[table.Table, str]]:
    """Every table of the page, with the note printed above it."""
    out: list[tuple[table.Table, str]] = []
    mlp = "MLP, batch 256"
    rates = [r for r in results if mlp in results[r]]
    title = "Step time against link rate: MLP, batch 256, 4 MiB buckets (ms)"
    out.append(
        ((title, ["", *map(label, rates)], _columns(results, [(r, mlp) for r in rates])), "")
    )

    def cell(row: Row, name: str) -> str:
        return f"{table.spread(table.ratio(row, name, DDP_EAGER))}, {hidden(row, name).median:.0%}"

    summary = [
        [f"{k}, {label(rate)}", *[cell(results[rate][k], s) for s in SETTINGS]]
        for rate in results
        for k in _rows_at(results, rate)
    ]
    title = "Every workload: step time relative to DDP eager, and share of the all-reduce hidden"
    out.append(((title, ["", *SETTINGS], summary), WORKLOADS_NOTE))
    for name in WORKLOADS:
        keys = [f"{name}, batch {b}" for b in BATCHES]
        if columns := [(r, k) for k in keys for r in results if k in results[r]]:
            header = ["", *[f"batch {k.rsplit(' ', 1)[1]}, {label(r)}" for r, k in columns]]
            title = f"{name}: step time at batch 64 and 256, unshaped and at 8 Gbit/s (ms)"
            out.append(((title, header, _columns(results, columns)), ""))
    if memory := results.get("unshaped", {}).get("memory"):
        title = f"Memory: peak RSS of the eager step, batch {MEMORY_BATCH}, unshaped"
        out.append((table.memory(title, memory, DDP_EAGER, CAP_MB), MEMORY_NOTE))
    where = "8gbit" if "8gbit" in results else next(iter(results), "")
    at = results.get(where, {})
    for k in ("MLP, batch 64", "MLP, batch 256, 25 MiB buckets"):
        if k in at:
            cells = table.timings(at[k], DDP_EAGER)
            cells += [
                [f"{s}: share of the all-reduce hidden", table.share(hidden(at[k], s)), ""]
                for s in SETTINGS
            ]
            out.append(((f"At {label(where)}: {k}", ["", "ms", "vs DDP eager"], cells), ""))
    if "sync alone" in at:
        cells = table.timings(at["sync alone"], steps.FLAT)
        title = f"At {label(where)}: the sync alone, MLP gradients"
        out.append(((title, ["", "ms", "vs flat all-reduce"], cells), ""))
    zero_rows = {rate: at["zero"] for rate, at in results.items() if at.get("zero")}
    zero_memory = results.get("unshaped", {}).get("zero memory", {})
    for i, t in enumerate(zero.tables(zero_rows, zero_memory)):
        out.append((t, ZERO_NOTE if i == 0 else ""))
    return out


def figures(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """Step time against rate and the share hidden (the MLP), step time relative to DDP
    eager and the share hidden per workload, and the eager step's peak memory."""
    mlp = "MLP, batch 256"
    rates = [r for r in results if mlp in results[r]]
    rows, labels = [results[r][mlp] for r in rates], [label(r) for r in rates]
    figure, (ax,) = plot.figure(size=(7.5, 4.8))
    for name in SETTINGS:
        ax.plot(labels, [table.median(row, name) for row in rows], "o-", label=name)
    compute = [table.median(row, "compute, functional compiled") for row in rows]
    ax.plot(labels, compute, "k--", label="compute alone (compiled)")
    wire = [c + table.median(row, FLAT) for c, row in zip(compute, rows, strict=True)]
    ax.plot(labels, wire, "k:", label="compiled compute + flat all-reduce, one after the other")
    ax.plot(labels, [table.median(row, CEILING) for row in rows], "--", color="grey", label=CEILING)
    ax.set_xlabel("link rate (loopback shaped by slownet)")
    ax.set_ylabel("ms per training step, median over rounds (lower is better)")
    ax.set_title("MLP 8.4M parameters, batch 256, 4 MiB buckets, 2 gloo ranks")
    ax.legend(fontsize=8)
    paths = [plot.save(figure, out / "benchmarks-link-step.png")]
    colors = {s: f"C{i}" for i, s in enumerate(SETTINGS)}

    def shares(at: dict[str, Row], groups: list[str], title: str, path: str) -> None:
        figure, (ax,) = plot.figure(size=(9, 4.4))
        plot.bars(
            ax, groups, list(SETTINGS), lambda g, s: _percent(hidden(at[g], s)), colors=colors
        )
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_ylabel("% of the flat all-reduce hidden behind own compute")
        ax.set_title(f"{title}: how much communication each step hides (higher is better)")
        ax.legend(fontsize=7, ncol=2)
        paths.append(plot.save(figure, out / path))

    shares(
        dict(zip(labels, rows, strict=True)), labels, "MLP, batch 256", "benchmarks-link-hidden.png"
    )
    shown = [r for r in WORKLOAD_RATES if r in results] or list(results)[:1]
    figure, axes = plot.figure(len(shown), size=(9, 3.6 * len(shown) + 0.6))
    for ax, rate in zip(axes, shown, strict=True):
        others = [s for s in SETTINGS if s != DDP_EAGER]
        plot.bars(ax, _rows_at(results, rate), others, _against(results[rate]), colors=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("step / DDP eager's")
        ax.set_title(f"{label(rate)}: step time relative to DDP eager (lower is better)")
    axes[0].legend(fontsize=7, ncol=2)
    paths.append(plot.save(figure, out / "benchmarks-link-workloads.png"))
    rate = "8gbit" if "8gbit" in results else next(iter(results))
    shares(
        results[rate], _rows_at(results, rate), label(rate), "benchmarks-link-workloads-hidden.png"
    )
    if memory := results.get("unshaped", {}).get("memory"):
        figure, (ax,) = plot.figure(size=(7.5, 4.2))

        def peak(workload: str, name: str) -> float:
            m = memory[workload]["memory"]
            return float(m[name]["peak"] - m[DDP_EAGER]["peak"])

        plot.bars(
            ax, list(memory), [s for s in MEMORY_SETTINGS if s != DDP_EAGER], peak, colors=colors
        )
        ax.axhline(0, color="black", linewidth=0.8)
        target = f"target for grad_and_value: DDP's + one bucket ({CAP_MB:g} MiB)"
        ax.axhline(CAP_MB, color="grey", linestyle="--", linewidth=0.8, label=target)
        ax.set_ylabel("peak RSS - DDP eager's peak RSS (MiB)")
        ax.set_title(f"Memory of the eager step, batch {MEMORY_BATCH}, rank 0 (lower is better)")
        ax.legend(fontsize=7)
        paths.append(plot.save(figure, out / "benchmarks-link-memory.png"))
    return paths


def _against(at: dict[str, Row]) -> Callable[[str, str], Spread]:
    """A setting's step relative to DDP eager's, in the row of ``at`` a figure's group names."""
    return lambda row, name: table.ratio(at[row], name, DDP_EAGER)


def _percent(s: Spread) -> Spread:
    return Spread(100 * s.low, 100 * s.median, 100 * s.high)


READING = (
    "Written by `python benchmarks/run.py --only link` (as root; see `benchmarks/link.py`). "
    "Each rate ran in its own network namespace whose loopback was shaped by "
    "`../shared/tools/slownet`. Within a rate, each setting of a row ran in a gloo world of "
    "its own processes, and the settings took turns, world after world, round after round "
    "(`benchmarks/harness.py`): a figure in ms is the median over the rounds of a turn's "
    "time per step on rank 0; a ratio and a share hidden are taken round by round and "
    "given as `median [lowest, highest]` over the rounds; a target is judged on the median. "
    "The share hidden is (own compute + flat all-reduce - step) / flat all-reduce, with "
    "each setting's own compute: the module rows for DDP, the functional rows for fsync. "
    "Every setting uses 4 MiB buckets (`bucket_cap_mb=4`, DDP and fsync alike) unless its "
    "row says otherwise. *fsync eager, grad_and_value* is `fsync.grad_and_value`, which "
    "starts each bucket's all-reduce as backward completes it; *fsync eager, torch.func + "
    "sync_grads* syncs after `torch.func.grad_and_value` returns; *fsync compiled* is "
    "`fsync.compile` of the whole step calling `fsync.grad_and_value`; *DDP compiled* is "
    "`torch.compile` of the DDP module. DDP's steps update with `torch.optim.SGD`, the eager "
    "fsync steps (and their floor) with `fsync.optim.sgd(lr, in_place=True)`, the same "
    "in-place kernels, the compiled ones with the pure `fsync.optim.sgd(lr)`."
)
WORKLOADS_NOTE = (
    "The deep MLP: 8 equal `nn.Linear(1024, 1024)` layers with GELU between them, "
    "cross-entropy over 1024 classes (8.4M parameters, 33.6 MB of gradients). The GPT: "
    "6 layers, d_model 512, 21M parameters; its batch counts tokens per rank per step: "
    "batch 64 is 1 sequence of 64 tokens, batch 256 is 4 sequences of 64. A cell: the step "
    "relative to DDP eager's, then the median share of the all-reduce hidden."
)
MEMORY_NOTE = (
    "Each setting ran in a 2-rank gloo world of its own (unshaped) for one turn, so that the "
    "peak belongs to it: RSS of rank 0 once the setting is built (model, DDP), and its peak "
    "(`VmHWM`, reset after one warm-up step) over the timed steps, with glibc's mmap "
    "threshold fixed at 64 KiB (`mallopt`) so that freed tensors go back to the system and "
    "RSS follows the tensors alive (with glibc's default, which keeps freed memory to reuse, "
    "the peak varies by a few buckets from one run to the next). Every setting keeps one "
    "copy of the parameters: the fsync steps update them with `fsync.optim.sgd(lr, "
    "in_place=True)`, the kernels of `torch.optim.SGD`, so the settings differ in their "
    "gradients and sync alone. One bucket is 4 MiB."
)
ZERO_NOTE = (
    "AdamW (lr 1e-3): `torch.optim.AdamW` in `ZeroRedundancyOptimizer`, `fsync.optim.adamw` "
    "in `fsync.ops.zero(..., bucket_cap_mb=4)`. *after torch.func.grad*: `params, state = "
    "step(params, grads, state)` once `torch.func.grad` returns; *value_and_step*: `call = "
    "step.value_and_step(loss)`, `(params, loss), state = call(state, params, batch)`, one "
    "backward that reduce-scatters each bucket as backward completes it, then updates each "
    "shard and all-gathers it (after backward: `update_in_backward`'s default on the CPU); "
    "*compiled*: `fsync.compile` of the whole step. The share hidden is "
    "(own compute + RS/AG alone - step) / RS/AG alone, where RS/AG alone is a reduce-scatter "
    "and an all-gather of each of fsync's 4 MiB buckets with no compute, and own compute is "
    "the floor below each step's kind (module or functional, eager or compiled), which runs "
    "the same forward, backward and AdamW of this rank's part. torch's overlapped "
    "`ZeroRedundancyOptimizer(overlap_with_ddp=True)` with `hook_with_zero_step` refuses "
    "gloo (pytorch/pytorch#62300), so on these CPU ranks it cannot run: its rows say so."
)


PAGE = Page(
    file="benchmarks-link.md",
    title="Benchmarks on a slow link",
    module="benchmarks.link",
    measure=measure,
    targets=targets,
    tables=tables,
    intro=(READING,),
    figures=figures,
    timing=page.Timing(rounds=10, steps=2, warmup=3),
    rates=RATES,
    environment=lambda args, results: {"rounds": str(args.rounds), "rates": ",".join(args.rates)},
    saved="benchmarks-link.json",  # what the page was written from, beside it
)


if __name__ == "__main__":
    from benchmarks import link  # this module by name, so that its builders pickle

    sys.exit(page.main(link.PAGE))

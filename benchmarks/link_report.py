"""The slow-link page: targets, tables and figures of :mod:`benchmarks.link`'s results.

``write(results, out)`` writes ``benchmarks-link.md`` and one figure per question:
step time against link rate and the share hidden (the MLP), step time relative to
DDP eager and the share hidden per workload and batch, and the eager step's peak
memory.
"""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

from benchmarks import report
from benchmarks.link import (
    BATCHES,
    CAP_MB,
    CEILING,
    FLAT,
    FLOORS,
    GAV,
    MEMORY_BATCH,
    MEMORY_SETTINGS,
    SETTINGS,
    WORKLOAD_RATES,
    WORKLOADS,
    row_key,
)

BUCKET_MIB = CAP_MB  # one bucket: the unit of the memory target


def hidden(row: dict[str, float], setting: str) -> float:
    """Share of the flat all-reduce a setting hides behind its own compute."""
    return (row[SETTINGS[setting]] + row[FLAT] - row[setting]) / row[FLAT]


def vs_ddp(row: dict[str, float], setting: str) -> float:
    """A setting's step time relative to DDP eager's, in the same row."""
    return row[setting] / row["DDP eager"]


# --- targets -------------------------------------------------------------------------------------


class Target(NamedTuple):
    """A target on one row of one rate: ``setting``'s step relative to DDP eager's
    (``kind="ratio"``) at most ``bound``, or its share hidden (``kind="hidden"``) at least
    ``bound``, a number or the share another setting hides in the same row."""

    name: str
    rate: str
    row: str
    setting: str
    kind: str
    bound: float | str


def _targets() -> tuple[Target, ...]:
    mlp, compiled = row_key("MLP", 256), "fsync compiled"
    out = [
        Target(
            "fsync compiled <= 0.95x DDP eager, 8 Gbit/s, MLP batch 256",
            "8gbit",
            mlp,
            setting=compiled,
            kind="ratio",
            bound=0.95,
        ),
        Target(
            "fsync compiled hides >= 40% of the all-reduce, 8 Gbit/s, MLP batch 256",
            "8gbit",
            mlp,
            setting=compiled,
            kind="hidden",
            bound=0.40,
        ),
        Target(
            "fsync compiled <= 1.0x DDP eager, 8 Gbit/s, MLP batch 64",
            "8gbit",
            row_key("MLP", 64),
            setting=compiled,
            kind="ratio",
            bound=1.0,
        ),
    ]
    # Per row of the deep MLP and the GPT; fsync compiled's bound is 0.90x at batch 256,
    # 1.00x at batch 64 (``None`` below).
    per_row: tuple[tuple[str, str, str, str, float | str | None], ...] = (
        ("grad_and_value eager <= {:.2f}x DDP eager", "8gbit", GAV, "ratio", 1.0),
        ("grad_and_value eager hides >= DDP eager's share", "8gbit", GAV, "hidden", "DDP eager"),
        ("fsync compiled <= {:.2f}x DDP eager", "8gbit", compiled, "ratio", None),
        ("grad_and_value eager <= {:.2f}x DDP eager", "unshaped", GAV, "ratio", 1.05),
    )
    for question, rate, setting, kind, bound in per_row:
        for name in WORKLOADS:
            for batch in BATCHES:
                row, at = row_key(name, batch), "8 Gbit/s" if rate == "8gbit" else rate
                b = (0.90 if batch == 256 else 1.0) if bound is None else bound
                text = f"{row}: {question.format(b)}, {at}"
                out.append(Target(text, rate, row, setting, kind, b))
    return tuple(out)


TARGETS = _targets()


def _measured(target: Target, row: dict[str, float]) -> tuple[str, bool]:
    if target.kind == "ratio":
        value = vs_ddp(row, target.setting)
        assert isinstance(target.bound, float)
        return report._ratio(value), value <= target.bound
    value = hidden(row, target.setting)
    if isinstance(target.bound, str):
        bound = hidden(row, target.bound)
        return f"{value:.0%} vs {bound:.0%}", value >= bound
    return f"{value:.0%}", value >= target.bound


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met); ``None`` where that rate or row was not run."""
    out: list[tuple[str, str, bool | None]] = []
    for target in TARGETS:
        row = results.get(target.rate, {}).get(target.row)
        out.append(
            (target.name, *_measured(target, row)) if row else (target.name, "not run", None)
        )
    at = results.get("8gbit")
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
    for name, rows in results.get("unshaped", {}).get("memory", {}).items():
        extra = rows[GAV]["peak"] - rows["DDP eager"]["peak"]
        out.append(
            (
                f"{name}, batch {MEMORY_BATCH}: grad_and_value eager's peak RSS <= DDP eager's "
                f"+ one bucket ({BUCKET_MIB:g} MiB)",
                f"{extra:+.1f} MiB ({extra / BUCKET_MIB:+.2f} buckets)",
                extra <= BUCKET_MIB,
            )
        )
    return out


# --- tables --------------------------------------------------------------------------------------


def _rows_at(results: dict[str, Any], rate: str) -> list[str]:
    """The rows with 4 MiB buckets measured at ``rate``, in a fixed order."""
    keys = [row_key("MLP", 64), row_key("MLP", 256)]
    keys += [row_key(name, batch) for name in WORKLOADS for batch in BATCHES]
    return [k for k in keys if k in results.get(rate, {})]


def _label(rate: str) -> str:
    return "unshaped" if rate == "unshaped" else rate.replace("gbit", " Gbit/s")


def _slowest(results: dict[str, Any]) -> str:
    """The rate the one-rate sections and targets read: 8 Gbit/s, else the first run."""
    return "8gbit" if "8gbit" in results else next(iter(results))


def _columns_table(results: dict[str, Any], columns: list[tuple[str, str]]) -> list[list[str]]:
    """Every figure of the (rate, row) ``columns``, one column each, and the shares hidden."""
    rows = []
    for name in [*SETTINGS, *FLOORS, FLAT, CEILING]:
        rows.append([name, *[report._ms(results[r][k][name]) for r, k in columns]])
    for setting in SETTINGS:
        rows.append(
            [f"{setting}: share of the all-reduce hidden"]
            + [f"{hidden(results[r][k], setting):.0%}" for r, k in columns]
        )
    return rows


def _one_rate_table(row: dict[str, float]) -> list[list[str]]:
    rows = [
        [name, report._ms(row[name]), report._ratio(vs_ddp(row, name))]
        for name in [*SETTINGS, *FLOORS, FLAT, CEILING]
    ]
    rows += [
        [f"{s}: share of the all-reduce hidden", f"{hidden(row, s):.0%}", ""] for s in SETTINGS
    ]
    return rows


def _summary_table(results: dict[str, Any]) -> list[list[str]]:
    """Per row and rate, each setting's step relative to DDP eager's and the share it hides."""
    out = []
    for rate in results:
        for k in _rows_at(results, rate):
            row = results[rate][k]
            out.append(
                [
                    f"{k}, {_label(rate)}",
                    *[f"{report._ratio(vs_ddp(row, s))}, {hidden(row, s):.0%}" for s in SETTINGS],
                ]
            )
    return out


def _memory_table(memory: dict[str, dict[str, dict[str, float]]]) -> list[list[str]]:
    out = []
    for name, rows in memory.items():
        ddp = rows["DDP eager"]["peak"]
        for setting, row in rows.items():
            extra = row["peak"] - ddp
            out.append(
                [
                    f"{name}: {setting}",
                    f"{row['built']:.0f}",
                    f"{row['peak']:.0f}",
                    f"{row['peak'] - row['built']:.0f}",
                    f"{extra:+.1f}",
                    f"{extra / BUCKET_MIB:+.2f}",
                ]
            )
    return out


# --- figures -------------------------------------------------------------------------------------


def _plot_rates(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """The MLP at batch 256 against link rate: step time per setting, and the share hidden."""
    import matplotlib.pyplot as plt

    mlp = row_key("MLP", 256)
    rates = [r for r in results if mlp in results[r]]
    rows = [results[r][mlp] for r in rates]
    labels = [_label(r) for r in rates]
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
    ax.set_title("MLP, batch 256: how much communication each step hides (higher is better)")
    ax.legend(fontsize=8)
    return [step, report._save(figure, share)]


# One colour per setting in every figure (matplotlib's first five); floors in grey.
COLORS = {setting: f"C{i}" for i, setting in enumerate(SETTINGS)}


def _bars(
    ax: Any,
    groups: list[str],
    settings: list[str],
    values: Any,
    colors: dict[str, str] | None = None,
) -> None:
    """Grouped bars: one group per ``groups`` entry, one bar per setting, ``values(g, s)``,
    coloured by ``colors`` (default: this page's settings), grey where it names none."""
    colors = COLORS if colors is None else colors
    width = 0.8 / len(settings)
    for k, setting in enumerate(settings):
        ax.bar(
            [i + k * width for i in range(len(groups))],
            [values(g, setting) for g in groups],
            width,
            label=setting,
            color=colors.get(setting, "grey"),
        )
    ax.set_xticks(
        [i + width * (len(settings) - 1) / 2 for i in range(len(groups))],
        [g.replace(", ", "\n") for g in groups],
        fontsize=8,
    )


def _plot_workloads(results: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    """Step time relative to DDP eager, per workload, batch and setting, one panel per rate."""
    import matplotlib.pyplot as plt

    rates = [r for r in WORKLOAD_RATES if r in results] or list(results)[:1]
    settings = [s for s in SETTINGS if s != "DDP eager"]
    figure, axes = plt.subplots(len(rates), 1, figsize=(9, 3.6 * len(rates) + 0.6), squeeze=False)
    for ax, rate in zip(axes[:, 0], rates, strict=True):
        at = results[rate]
        _bars(ax, _rows_at(results, rate), settings, lambda g, s, at=at: vs_ddp(at[g], s))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("step / DDP eager's")
        ax.set_title(f"{_label(rate)}: step time relative to DDP eager (lower is better)")
    axes[0, 0].legend(fontsize=7, ncol=2)
    return report._save(figure, out / "benchmarks-link-workloads.png")


def _plot_workloads_hidden(results: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    """The share of the all-reduce each setting hides, per workload and batch, at 8 Gbit/s."""
    import matplotlib.pyplot as plt

    rate = _slowest(results)
    figure, ax = plt.subplots(figsize=(9, 4.4))
    _bars(
        ax,
        _rows_at(results, rate),
        list(SETTINGS),
        lambda g, s: 100 * hidden(results[rate][g], s),
    )
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("% of the flat all-reduce hidden")
    ax.set_title(f"{_label(rate)}: how much communication each step hides (higher is better)")
    ax.legend(fontsize=7, ncol=2)
    return report._save(figure, out / "benchmarks-link-workloads-hidden.png")


def _plot_memory(memory: dict[str, dict[str, dict[str, float]]], out: pathlib.Path) -> pathlib.Path:
    """Peak RSS of each eager step against DDP eager's, per workload, in MiB."""
    import matplotlib.pyplot as plt

    settings = [s for s in MEMORY_SETTINGS if s != "DDP eager"]
    figure, ax = plt.subplots(figsize=(7.5, 4.2))
    _bars(
        ax,
        list(memory),
        settings,
        lambda g, s: memory[g][s]["peak"] - memory[g]["DDP eager"]["peak"],
    )
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(
        BUCKET_MIB,
        color="grey",
        linestyle="--",
        linewidth=0.8,
        label=f"target for grad_and_value: DDP's + one bucket ({BUCKET_MIB:g} MiB)",
    )
    ax.set_ylabel("peak RSS - DDP eager's peak RSS (MiB)")
    ax.set_title(f"Memory of the eager step, batch {MEMORY_BATCH}, rank 0 (lower is better)")
    ax.legend(fontsize=7)
    return report._save(figure, out / "benchmarks-link-memory.png")


def plot(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """One figure per question: step time against rate and the share hidden (the MLP), step
    time relative to DDP eager and the share hidden per workload, and peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    paths = _plot_rates(results, out)
    paths += [_plot_workloads(results, out), _plot_workloads_hidden(results, out)]
    memory = results.get("unshaped", {}).get("memory")
    return paths + ([_plot_memory(memory, out)] if memory else [])


# --- the page ------------------------------------------------------------------------------------


def _section(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    return [f"## {title}", "", report._markdown_table(["", *header], rows), ""]


READING = (
    "Written by `python benchmarks/run.py --only link` (as root; see `benchmarks/link.py`). "
    "Each rate ran in its own network namespace whose loopback was shaped by "
    "`../shared/tools/slownet`; every figure is the median step on rank 0, the settings "
    "of a row timed in turn (two steps each, round after round, so that a drift of the "
    "machine weighs on all alike), every ratio is between figures of the same rate's run. "
    "The share hidden is (own compute + flat "
    "all-reduce - step) / flat all-reduce, with each setting's own compute: the module "
    "rows for DDP, the functional rows for fsync. Every setting uses 4 MiB buckets "
    "(`bucket_cap_mb=4`, DDP and fsync alike) unless its row says otherwise. "
    "*fsync eager, grad_and_value* is `fsync.grad_and_value`, which starts each bucket's "
    "all-reduce as backward completes it; *fsync eager, torch.func + sync_grads* syncs after "
    "`torch.func.grad_and_value` returns; *fsync compiled* is `fsync.compile` of the whole "
    "step calling `fsync.grad_and_value`; *DDP compiled* is `torch.compile` of the DDP module."
)
WORKLOADS_NOTE = (
    "The deep MLP: 8 equal `nn.Linear(1024, 1024)` layers with GELU between them, "
    "cross-entropy over 1024 classes (8.4M parameters, 33.6 MB of gradients). The GPT: "
    "6 layers, d_model 512, 21M parameters; its batch counts tokens per rank per step: "
    "batch 64 is 1 sequence of 64 tokens, batch 256 is 4 sequences of 64."
)
MEMORY_NOTE = (
    "Each setting ran alone in a fresh 2-rank gloo world (unshaped), so that the peak belongs "
    "to it: RSS of rank 0 once the model is built, and its peak (`VmHWM`, reset after one "
    "warm-up step) over the timed steps, with glibc's `MALLOC_MMAP_THRESHOLD_=65536` so "
    "that freed tensors go back to the system and RSS follows the tensors alive (with "
    "glibc's default, which keeps freed memory to reuse, the peak varies by a few buckets "
    "from one run to the next). Every setting keeps one copy of the parameters: the "
    "fsync steps update them in place as `torch.optim.SGD` does, so the settings differ in "
    "their gradients and sync alone. One bucket is 4 MiB."
)


def write(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """``benchmarks-link.md`` and its figures in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    figures = plot(results, out)
    mlp = row_key("MLP", 256)
    rates = [r for r in results if mlp in results[r]]
    parts = [
        "# Benchmarks on a slow link",
        "",
        READING,
        "",
        *[f"![{f.stem}]({f.name})" for f in figures],
        "",
        "## Targets",
        "",
        report.targets_table(targets(results)),
        "",
        "## Step time against link rate: MLP, batch 256, 4 MiB buckets (ms)",
        "",
        report._markdown_table(["", *rates], _columns_table(results, [(r, mlp) for r in rates])),
        "",
        "## Every workload: step time relative to DDP eager, and share of the all-reduce hidden",
        "",
        WORKLOADS_NOTE,
        "",
        report._markdown_table(["", *SETTINGS], _summary_table(results)),
        "",
    ]
    for name in WORKLOADS:
        columns = [
            (r, k)
            for k in (row_key(name, batch) for batch in BATCHES)
            for r in results
            if k in results[r]
        ]
        if columns:
            header = [f"batch {k.rsplit(' ', 1)[1]}, {_label(r)}" for r, k in columns]
            parts += _section(
                f"{name}: step time at batch 64 and 256, unshaped and at 8 Gbit/s (ms)",
                header,
                _columns_table(results, columns),
            )
    memory = results.get("unshaped", {}).get("memory")
    if memory:
        parts += [
            f"## Memory: peak RSS of the eager step, batch {MEMORY_BATCH}, unshaped",
            "",
            MEMORY_NOTE,
            "",
            report._markdown_table(
                [
                    "",
                    "MiB, model built",
                    "peak MiB",
                    "peak - built",
                    "peak - DDP eager's, MiB",
                    "in buckets",
                ],
                _memory_table(memory),
            ),
            "",
        ]
    where = _slowest(results)
    at, label = results[where], _label(where)
    for k in (row_key("MLP", 64), row_key("MLP", 256, 25.0)):
        if k in at:
            parts += [
                f"## At {label}: {k}",
                "",
                report._markdown_table(["", "ms", "vs DDP eager"], _one_rate_table(at[k])),
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
    md = out / "benchmarks-link.md"
    md.write_text("\n".join(parts))
    return [md, *figures]

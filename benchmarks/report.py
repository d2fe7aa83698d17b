"""Tables, targets and the plot of a benchmark run."""

from __future__ import annotations

import pathlib
from collections.abc import Iterable
from typing import Any

PURE_MEAN = "scaled copy + flat all-reduce (pure mean)"
# The step table's row for the ranks' agreement (benchmarks/cases.py writes it).
AGREEMENT = "the ranks' agreement alone (in every sync)"

READING = (
    "How to read it. Rows marked *no sync* are floors: the module rows train with "
    "autograd as DDP does, the functional rows with `torch.func` as fsync's steps do. "
    "*fsync eager* syncs with `sync_grads` after `torch.func.grad_and_value` returns; *fsync "
    "eager, grad_and_value* is `fsync.grad_and_value`, whose all-reduces start during "
    "backward as each bucket completes, as DDP's do; the compiled fsync steps are "
    "`fsync.compile` of the first. "
    "Sync only has two floors: the flat all-reduce sums one preallocated tensor in place, "
    "which a sync may not do (it must leave the caller's gradients alone and return their "
    "mean); the pure mean adds the one scaled copy into fresh memory that any such sync "
    "needs."
)

Table = tuple[str, list[str], list[list[str]]]


def _ms(x: float) -> str:
    return f"{x:.1f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}x"


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for every target of the issue this run can speak to."""
    out: list[tuple[str, str, bool | None]] = []
    for model, row in results.get("step", {}).items():
        ratio = row["fsync compiled + overlap"] / row["DDP eager"]
        out.append((f"{model}: fsync compiled <= 0.85 x DDP eager", _ratio(ratio), ratio <= 0.85))
        ratio = row["fsync compiled + overlap"] / row["DDP compiled"]
        out.append((f"{model}: fsync compiled <= DDP compiled", _ratio(ratio), ratio <= 1.0))
        if AGREEMENT in row:
            for setting in ("fsync eager", "fsync compiled + overlap"):
                share = row[AGREEMENT] / row[setting]
                text = f"{model}: the ranks' agreement < 1% of the {setting} step"
                out.append((text, f"{share:.2%}", share < 0.01))
    if "sync" in results:
        sync = results["sync"]
        for mode in ("compiled", "eager"):
            ratio = sync[f"sync_grads {mode}"] / sync["flat all-reduce (floor)"]
            out.append(
                (f"sync only ({mode}) <= 1.10 x flat all-reduce", _ratio(ratio), ratio <= 1.10)
            )
    leaves = results.get("leaves", {}).get("compiled", {})
    if "1" in leaves and len(leaves) > 1:
        most = max(leaves, key=int)
        ratio = leaves[most] / leaves["1"]
        out.append(
            (f"compiled sync of {int(most):,} leaves <= 1.3 x 1 leaf", _ratio(ratio), ratio <= 1.3)
        )
    if "anatomy" in results:
        anatomy = results["anatomy"]
        on = f"({anatomy['device']})"
        per_bucket = anatomy["kernels"] / anatomy["buckets"]
        out.append(
            (f"pack + unpack kernels per bucket <= 2 {on}", f"{per_bucket:g}", per_bucket <= 2)
        )
        ms = anatomy["ms"]
        share = ms["copy of the same bytes (floor)"] / ms["pack + unpack, compiled"]
        out.append((f"pack + unpack >= 80% of copy bandwidth {on}", f"{share:.0%}", share >= 0.8))
        recompiles = anatomy["recompiles"]
        out.append((f"no recompile after the first step {on}", str(recompiles), recompiles == 0))
    if isinstance(results.get("gpu"), str):
        out.append(("compute/communication overlap on GPUs, above DDP's", "not measured", None))
    return out


def tables(results: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    if "step" in results:
        for model, row in results["step"].items():
            n = results.get("params", {}).get(model, 0)
            ddp = row["DDP eager"]
            rows = [[name, _ms(ms), _ratio(ms / ddp)] for name, ms in row.items()]
            out.append(
                (
                    f"1. Step time, {model} ({n / 1e6:.1f}M parameters): ms per step",
                    ["setting", "ms", "vs DDP eager"],
                    rows,
                )
            )
    if results.get("overlap"):
        rows = [
            [f"{model}: {setting}", str(issued), str(overlapped)]
            for model, counts in results["overlap"].items()
            for setting, (issued, overlapped) in counts.items()
        ]
        out.append(
            (
                "1b. Overlap in the compiled step (read off inductor's output code)",
                ["", "collectives", "compute kernels launched while one is in flight"],
                rows,
            )
        )
    if "sync" in results:
        sync = dict(results["sync"])
        nbytes = sync.pop("bytes")
        floor = sync["flat all-reduce (floor)"]
        pure = sync.get(PURE_MEAN, float("nan"))
        out.append(
            (
                f"2. Sync only: the GPT's gradients ({nbytes / 2**20:.1f} MiB)",
                ["", "ms", "vs flat all-reduce", "vs pure mean"],
                [
                    [name, _ms(ms), _ratio(ms / floor), _ratio(ms / pure)]
                    for name, ms in sync.items()
                ],
            )
        )
    if "leaves" in results:
        leaves = results["leaves"]
        counts = sorted(leaves["eager"], key=int)
        rows = [
            [
                f"{int(n):,}",
                _ms(leaves["eager"][n]),
                _ratio(leaves["eager"][n] / leaves["eager"][counts[0]]),
                _ms(leaves["compiled"][n]),
                _ratio(leaves["compiled"][n] / leaves["compiled"][counts[0]]),
                f"{leaves['compile seconds'][n]:.0f}",
            ]
            for n in counts
        ]
        out.append(
            (
                f"3. Leaf scaling: {results['leaves_bytes'] / 2**20:.0f} MiB as n leaves",
                ["leaves", "eager ms", "vs 1", "compiled ms", "vs 1", "compile s (empty cache)"],
                rows,
            )
        )
    if "hooks" in results:
        rows = [
            [
                name,
                f"{row['bytes on wire'] / 2**20:.2f}",
                f"{row['relative']:.3f}",
                f"{row['collectives']:.0f}",
                _ms(row["ms"]),
            ]
            for name, row in results["hooks"].items()
        ]
        out.append(
            (
                "4. Hooks on the GPT's gradients (eager GradSync)",
                ["hook", "MiB on wire", "vs all-reduce", "collectives", "ms"],
                rows,
            )
        )
    if "zero" in results:
        rows = [
            [name, _ms(row["ms"]), f"{row['state bytes'] / 2**20:.2f}"]
            for name, row in results["zero"].items()
        ]
        out.append(
            (
                "5. ZeRO on the MLP: AdamW step (forward, backward, sync, update)",
                ["", "ms", "optimizer state MiB per rank"],
                rows,
            )
        )
    if "anatomy" in results:
        anatomy = results["anatomy"]
        nbytes = anatomy["bytes"]
        copy = anatomy["ms"]["copy of the same bytes (floor)"]
        rows = [
            [name, _ms(ms), f"{2 * nbytes / ms / 1e6:.1f}", _ratio(ms / copy)]
            for name, ms in anatomy["ms"].items()
        ]
        out.append(
            (
                f"6. The compiled sync up close, on {anatomy['device']}: the GPT's gradients "
                f"({nbytes / 2**20:.1f} MiB)",
                ["", "ms", "GB/s read + written", "vs copy"],
                rows,
            )
        )
        out.append(
            (
                "6b. What the compiled sync is made of",
                ["buckets", "kernels", "kernels per bucket", "compile s", "graphs after the first"],
                [
                    [
                        str(anatomy["buckets"]),
                        str(anatomy["kernels"]),
                        f"{anatomy['kernels'] / anatomy['buckets']:g}",
                        f"{anatomy['compile s']:.1f}",
                        str(anatomy["recompiles"]),
                    ]
                ],
            )
        )
    return out


def print_tables(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console()
    for title, header, rows in tables(results):
        table = RichTable(title=title, title_justify="left")
        for i, column in enumerate(header):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    table = RichTable(title="Targets", title_justify="left")
    for column in ("target", "measured", "met"):
        table.add_column(column)
    for name, measured, met in targets(results):
        table.add_row(name, measured, {True: "yes", False: "NO", None: "-"}[met])
    console.print(table)


def targets_table(targets: Iterable[tuple[str, str, bool | None]]) -> str:
    """Targets as a markdown table: each one's name, what was measured, and whether it is met
    (``None``: not run)."""
    rows = [[n, m, {True: "yes", False: "**no**", None: "-"}[ok]] for n, m, ok in targets]
    return _markdown_table(["target", "measured", "met"], rows)


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plot(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """One figure per question (step time, leaf scaling, hook bytes), as PNGs in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    backend = results["environment"]["backend"]
    if "step" in results:
        models = list(results["step"])
        names = list(results["step"][models[0]])
        figure, ax = plt.subplots(figsize=(8, 0.35 * len(names) * len(models) + 1.5))
        width = 0.8 / len(models)
        for m, model in enumerate(models):
            values = [
                results["step"][model][n] / results["step"][model]["DDP eager"] for n in names
            ]
            ax.barh([i + m * width for i in range(len(names))], values, height=width, label=model)
        ax.set_yticks([i + width * (len(models) - 1) / 2 for i in range(len(names))], names)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("step time relative to DDP eager (lower is better)")
        ax.set_title(f"One training step, {backend}")
        ax.legend()
        ax.invert_yaxis()
        paths.append(_save(figure, out / "benchmarks-step.png"))
    if "leaves" in results:
        leaves = results["leaves"]
        counts = sorted(leaves["eager"], key=int)
        figure, ax = plt.subplots(figsize=(6.5, 4.2))
        for mode in ("eager", "compiled"):
            base = leaves[mode][counts[0]]
            ax.plot(
                [int(n) for n in counts], [leaves[mode][n] / base for n in counts], "o-", label=mode
            )
        ax.set_xscale("log")
        ax.axhline(1.3, color="grey", linestyle="--", linewidth=0.8, label="target 1.3x")
        ax.set_xlabel("leaves (same total bytes)")
        ax.set_ylabel("sync time relative to 1 leaf")
        ax.set_title("Does the sync scale with the number of leaves?")
        ax.legend()
        paths.append(_save(figure, out / "benchmarks-leaves.png"))
    if "hooks" in results:
        hooks = results["hooks"]
        names = list(hooks)
        figure, ax = plt.subplots(figsize=(6.5, 0.4 * len(names) + 1.5))
        ax.barh(names, [hooks[n]["relative"] for n in names])
        ax.set_xscale("log")
        ax.set_xlabel("bytes on the wire relative to all-reduce")
        ax.set_title("What each hook sends")
        ax.invert_yaxis()
        paths.append(_save(figure, out / "benchmarks-hooks.png"))
    return paths


def _save(figure: Any, path: pathlib.Path) -> pathlib.Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(results, out)
    env = results["environment"]
    parts = [
        "# Benchmarks",
        "",
        "Written by `python benchmarks/run.py` (do not edit by hand). Every figure is the "
        "median wall time per step on rank 0 after warm-up (compilation happens during the "
        "warm-up); the step settings take turns, two steps each, round after round, so that "
        "a drift of the machine weighs on all alike; every comparison is a ratio of figures "
        "from this one run.",
        "",
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in env.items()],
        "",
        *[f"![{png.stem}]({png.name})" for png in pngs],
        "",
        "Communication on a link slower than compute (overlap, ZeRO at 8 Gbit/s): "
        "[benchmarks on a slow link](benchmarks-link.md), from `--only link`; the hierarchical "
        "mean on two nodes joined by a slower cable: [benchmarks on two nodes]"
        "(benchmarks-twonodes.md), from `--only twonodes`.",
        "",
        READING,
        "",
        "## Targets",
        "",
        targets_table(targets(results)),
        "",
    ]
    for title, header, rows in tables(results):
        parts += [f"## {title}", "", _markdown_table(header, rows), ""]
    if isinstance(results.get("gpu"), str):
        parts += ["## 7. GPU", "", results["gpu"], ""]
    md = out / "benchmarks.md"
    md.write_text("\n".join(parts))
    return [md, *pngs]

"""The two-node page: targets, tables and figures of :mod:`benchmarks.twonodes`' results.

``write(results, out)`` writes ``benchmarks-twonodes.md`` and one figure per question:
the sync alone relative to the flat all-reduce per rate, the GPT's step relative to DDP
eager per rate, and the bytes each setting puts across nodes.
"""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

from benchmarks import link_report, report
from benchmarks.twonodes import (
    CAP_MB,
    DDP_EAGER,
    DILOCO,
    FLAT,
    GPT,
    HIER,
    HIER_BF16,
    HIER_COMPILED,
    INNER_STEPS,
    LOCAL,
    MICRO_BATCHES,
    NODES,
    STEP_FLAT,
    STEP_HIER,
    STEP_HIER_COMPILED,
    STEP_SETTINGS,
    SYNC_FLAT,
    SYNC_SETTINGS,
    TREE,
)

MiB = 2**20
# The cable's floors for the hierarchical mean on 2 x 2 against the flat ring (ring model):
# S of 1.5 S in fp32, S / 2 of 1.5 S with bf16 across nodes.
FLOORS = {"fp32 across nodes: 2/3": 2 / 3, "bf16 across nodes: 1/3": 1 / 3}


def _colors(settings: list[str]) -> dict[str, str]:
    """One colour per setting of a figure (matplotlib's ten, in order)."""
    return {s: f"C{i}" for i, s in enumerate(settings)}


def label(rate: str) -> str:
    """``"1gbit"`` -> ``"1 Gbit/s"``; the smoke run's ``"local"`` says what it was."""
    return rate.replace("gbit", " Gbit/s") if rate.endswith("gbit") else f"{rate} (one loopback)"


def rates(results: dict[str, Any]) -> list[str]:
    """The rates measured, fastest first, as run."""
    return [r for r in results if r != "environment"]


def ratio(
    results: dict[str, Any], rate: str, part: str, row: str, setting: str, base: str
) -> float:
    """``setting``'s ms over ``base``'s, at ``rate`` in section ``part`` (``"sync"``, with
    ``row`` a tree, or ``"step"``, with ``row`` ignored)."""
    table = results[rate][part]
    table = table[row] if part == "sync" else table
    return table[setting]["ms"] / table[base]["ms"]


# --- targets -------------------------------------------------------------------------------------


class Target(NamedTuple):
    """``setting``'s time over ``base``'s at ``rate``, at most ``bound``."""

    name: str
    rate: str
    part: str
    row: str
    setting: str
    base: str
    bound: float


def _targets() -> tuple[Target, ...]:
    out = []
    for tree in (TREE, GPT):
        what = f"sync alone, {tree if tree == TREE else 'the GPT'}"
        for setting, bound in ((HIER, 0.75), (HIER_COMPILED, 0.75), (HIER_BF16, 0.45)):
            text = f"{what}: {setting} <= {bound:.2f}x the flat all-reduce, 1 Gbit/s"
            out.append(Target(text, "1gbit", "sync", tree, setting, FLAT, bound))
    out += [
        Target(
            f"GPT step: {STEP_HIER_COMPILED} <= 0.80x DDP eager, 1 Gbit/s",
            "1gbit",
            "step",
            GPT,
            STEP_HIER_COMPILED,
            DDP_EAGER,
            0.80,
        ),
        Target(
            f"GPT step: fsync.diloco (H = {INNER_STEPS}) <= 0.25x DDP eager, 1 Gbit/s",
            "1gbit",
            "step",
            GPT,
            DILOCO,
            DDP_EAGER,
            0.25,
        ),
    ]
    for tree in (TREE, GPT):
        what = f"sync alone, {tree if tree == TREE else 'the GPT'}"
        text = f"{what}: hierarchical eager <= 1.05x sync_grads flat, 10 Gbit/s"
        out.append(Target(text, "10gbit", "sync", tree, HIER, SYNC_FLAT, 1.05))
    text = "GPT step: grad_and_value hierarchical eager <= 1.05x flat eager, 10 Gbit/s"
    out.append(Target(text, "10gbit", "step", GPT, STEP_HIER, STEP_FLAT, 1.05))
    return tuple(out)


TARGETS = _targets()


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met); ``None`` where that rate was not run."""
    out: list[tuple[str, str, bool | None]] = []
    for t in TARGETS:
        if t.rate not in results:
            out.append((t.name, "not run", None))
            continue
        value = ratio(results, t.rate, t.part, t.row, t.setting, t.base)
        out.append((t.name, report._ratio(value), value <= t.bound))
    return out


# --- tables --------------------------------------------------------------------------------------


def _table(results: dict[str, Any], part: str, row: str, base: str) -> list[list[str]]:
    """Per setting: MiB across per rank, the cable's floor relative to ``base``'s, and per rate
    the ms and the ratio to ``base``."""
    first = results[rates(results)[0]][part]
    settings = first[row] if part == "sync" else first
    out = []
    for setting, cross in settings.items():
        cells = [
            setting,
            f"{cross['cross'] / MiB:.2f}",
            report._ratio(cross["cable"] / settings[base]["cable"]),
        ]
        for rate in rates(results):
            at = results[rate][part]
            ms = (at[row] if part == "sync" else at)[setting]["ms"]
            relative = ratio(results, rate, part, row, setting, base)
            cells.append(f"{report._ms(ms)} ({report._ratio(relative)})")
        out.append(cells)
    return out


def _header(results: dict[str, Any], base: str) -> list[str]:
    return [
        "",
        "MiB across nodes per rank",
        f"cable each way vs {base} (floor)",
        *[f"{label(r)}: ms (vs {base})" for r in rates(results)],
    ]


# --- figures -------------------------------------------------------------------------------------


def _floors(ax: Any) -> None:
    for (name, floor), style in zip(FLOORS.items(), ("--", ":"), strict=True):
        ax.axhline(
            floor, color="grey", linestyle=style, linewidth=0.8, label=f"cable floor, {name}"
        )
    ax.axhline(1.0, color="black", linewidth=0.8)


def _plot_sync(results: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    """The sync alone relative to the flat all-reduce, per rate, one panel per tree."""
    import matplotlib.pyplot as plt

    settings = list(SYNC_SETTINGS[1:])
    groups = [label(r) for r in rates(results)]
    figure, axes = plt.subplots(2, 1, figsize=(9, 8.4))
    for ax, tree in zip(axes, (TREE, GPT), strict=True):
        link_report._bars(
            ax,
            groups,
            settings,
            lambda g, s, tree=tree: ratio(
                results, rates(results)[groups.index(g)], "sync", tree, s, FLAT
            ),
            colors=_colors(settings),
        )
        _floors(ax)
        size = results[rates(results)[0]]["trees"][tree] / MiB
        ax.set_ylabel("time / flat all-reduce's")
        ax.set_title(
            f"The sync alone, {tree} ({size:.1f} MiB): 2 nodes x 2 ranks (lower is better)"
        )
    axes[0].legend(fontsize=7, ncol=2)
    return report._save(figure, out / "benchmarks-twonodes-sync.png")


def _plot_step(results: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    """The GPT's step relative to DDP eager, per rate."""
    import matplotlib.pyplot as plt

    settings = list(STEP_SETTINGS[1:])
    groups = [label(r) for r in rates(results)]
    figure, ax = plt.subplots(figsize=(9, 4.8))
    link_report._bars(
        ax,
        groups,
        settings,
        lambda g, s: ratio(results, rates(results)[groups.index(g)], "step", GPT, s, DDP_EAGER),
        colors=_colors(settings),
    )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("step / DDP eager's")
    ax.set_title(
        "The GPT's training step on 2 nodes x 2 ranks, relative to DDP eager (lower is better)"
    )
    ax.legend(fontsize=7, ncol=2)
    return report._save(figure, out / "benchmarks-twonodes-step.png")


def _plot_bytes(results: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    """What each GPT step setting puts on the cable, each way, relative to DDP's flat ring."""
    import matplotlib.pyplot as plt

    step = results[rates(results)[0]]["step"]
    names = list(step)
    figure, ax = plt.subplots(figsize=(10, 0.4 * len(names) + 1.6))
    base = step[DDP_EAGER]["cable"]
    colors = {DDP_EAGER: "grey", **_colors(names[1:])}
    values = [step[n]["cable"] / base for n in names]
    ax.barh(names, values, color=[colors[n] for n in names])
    for y, value in enumerate(values):
        ax.annotate(f" {value:.2f}x", (value, y), va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes on the cable per step, each way, relative to DDP's (ring model)")
    ax.set_title("The GPT's step, 2 nodes x 2 ranks: what crosses nodes (lower is better)")
    ax.invert_yaxis()
    return report._save(figure, out / "benchmarks-twonodes-bytes.png")


def plot(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """One figure per question: the sync alone, the GPT's step, the bytes across nodes."""
    import matplotlib

    matplotlib.use("Agg")
    if not rates(results):
        return []
    return [_plot_sync(results, out), _plot_step(results, out), _plot_bytes(results, out)]


# --- the page ------------------------------------------------------------------------------------

READING = (
    "Written by `python benchmarks/run.py --only twonodes` (as root; see "
    "`benchmarks/twonodes.py`). "
    f"Each rate ran as two nodes of {LOCAL} gloo ranks (`torchrun --nnodes {NODES} "
    f"--nproc-per-node {LOCAL}`) in two network namespaces made by `../shared/tools/twonodes`, "
    "each node with its own fast loopback, joined by a cable shaped to the rate; the mesh is "
    f'`init_device_mesh("cpu", ({NODES}, {LOCAL}), mesh_dim_names=("node", "local"))`. '
    "The settings take turns, so that a drift of the machine weighs on all alike: the sync "
    "alone two calls each, round after round (the median on rank 0), the step a whole round "
    f"of H = {INNER_STEPS} steps each (the median of the rounds' means); every ratio is "
    "between figures of the same rate's run. "
    f"Every setting uses {CAP_MB:g} MiB buckets (`bucket_cap_mb={CAP_MB:g}`, DDP and fsync "
    "alike). *MiB across nodes per rank*: what each rank hands to collectives that cross nodes "
    "per call or step, from `fsync.sync_stats(tree, world_size=(2, 2)).bytes_on(0)` (a flat "
    "all-reduce's bytes all count). *Cable each way (floor)*: what that puts on each direction "
    "of the cable in a ring model, relative to the flat ring's: a ring all-reduce of B bytes "
    "over N ranks sends 2 (N - 1) / N * B on each link; the flat ring over 4 ranks crosses the "
    "cable once each way (1.5 B), the hierarchical hop is 2 rings of 2 ranks, both on the "
    "cable (2 x B, B half the flat one's): the least time a cable-bound sync can take, as a "
    'share of the flat one\'s (`docs/hierarchical.md`, "When the hierarchical mean pays").'
)
STEP_NOTE = (
    f"The GPT: 6 layers, d_model 512, 21M parameters, batch 4 sequences of 64 tokens per rank, "
    f"SGD. The accumulating settings split the same 4 sequences into {MICRO_BATCHES} "
    "micro-batches of one "
    "(DDP: `no_sync` for the first three; `DeferredSync`: `add` each, `finish` once), so that "
    "every step trains on the same tokens. DiLoCo's local steps are one compiled "
    f"`torch.func` step; its cross-node bytes are a bf16 sync's over H = {INNER_STEPS}."
)


def write(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """``benchmarks-twonodes.md`` and its figures in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    figures = plot(results, out)
    env = results.get("environment", {})
    parts = [
        "# Benchmarks on two nodes",
        "",
        READING,
        "",
        *([report._markdown_table(["", ""], [[k, v] for k, v in env.items()]), ""] if env else []),
        *[f"![{f.stem}]({f.name})" for f in figures],
        "",
        "## Targets",
        "",
        report.targets_table(targets(results)),
        "",
    ]
    if rates(results):
        for tree in (TREE, GPT):
            size = results[rates(results)[0]]["trees"][tree] / MiB
            parts += link_report._section(
                f"The sync alone: {tree} ({size:.1f} MiB)",
                _header(results, "flat all-reduce")[1:],
                _table(results, "sync", tree, FLAT),
            )
        parts += [
            "## The GPT's training step on 2 nodes x 2 ranks",
            "",
            STEP_NOTE,
            "",
            report._markdown_table(
                _header(results, "DDP eager"), _table(results, "step", GPT, DDP_EAGER)
            ),
            "",
        ]
    else:
        parts += [
            "Not run yet: `python benchmarks/run.py --only twonodes` (as root) writes this page.",
            "",
        ]
    md = out / "benchmarks-twonodes.md"
    md.write_text("\n".join(parts))
    return [md, *figures]

"""One plot helper for every page: grouped bars of medians with their spread, and saving."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.table import Spread


def figure(rows: int = 1, size: tuple[float, float] = (8, 4.5)) -> tuple[Any, Any]:
    """A matplotlib figure (drawn off screen) with ``rows`` axes, one above the other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(rows, 1, figsize=size, squeeze=False)
    return figure, axes[:, 0]


def bars(
    ax: Any,
    groups: Sequence[str],
    series: Sequence[str],
    value: Callable[[str, str], Spread | float],
    *,
    colors: dict[str, str] | None = None,
    horizontal: bool = False,
) -> None:
    """One group of bars per ``groups`` entry, one bar per ``series`` entry, of height
    ``value(group, series)``; a :class:`Spread` draws its median with a bar from its lowest
    to its highest. Colours: ``colors`` where it names the series, else matplotlib's
    cycle in the order of ``series``."""
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        values = [value(g, name) for g in groups]
        middle = [v.median if isinstance(v, Spread) else v for v in values]
        error = [
            (v.median - v.low, v.high - v.median) if isinstance(v, Spread) else (0.0, 0.0)
            for v in values
        ]
        where = [i + k * width for i in range(len(groups))]
        color = (colors or {}).get(name, f"C{k % 10}")
        spread = list(zip(*error, strict=True)) if error else None
        draw = ax.barh if horizontal else ax.bar
        extent = {"xerr" if horizontal else "yerr": spread}
        draw(where, middle, width, label=name, color=color, capsize=2, **extent)
    ticks = [i + width * (len(series) - 1) / 2 for i in range(len(groups))]
    labels = [g.replace(", ", "\n") for g in groups]
    (ax.set_yticks if horizontal else ax.set_xticks)(ticks, labels, fontsize=8)


def save(figure: Any, path: pathlib.Path) -> pathlib.Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

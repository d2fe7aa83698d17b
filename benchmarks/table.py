"""The figures of every page and their writer: a ratio over the rounds with its spread,
cells, the tables pages share, targets, the page file."""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import re
import socket
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from benchmarks.harness import Row

# A table: its title, its header and its rows of cells.
Table = tuple[str, list[str], list[list[str]]]
# A target: what it asks, what was measured, whether it is met (``None``: not run).
Target = tuple[str, str, bool | None]


class Spread(NamedTuple):
    """A figure over the rounds: the lowest, the median and the highest."""

    low: float
    median: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        """The spread of ``values``, one a round."""
        ordered = sorted(values)
        return cls(ordered[0], statistics.median(ordered), ordered[-1])


def per_round(row: Row, fn: Callable[[Mapping[str, float]], float]) -> Spread:
    """The spread of ``fn`` over the rounds, ``fn`` reading each round's ms by setting."""
    rounds = row["rounds"]
    n = min(len(v) for v in rounds.values())
    return Spread.of(fn({name: ms[r] for name, ms in rounds.items()}) for r in range(n))


def ratio(row: Row, name: str, base: str) -> Spread:
    """``name``'s step time over ``base``'s, round by round."""
    return per_round(row, lambda ms: ms[name] / ms[base])


def ran(row: Row | None, name: str, base: str) -> Spread | None:
    """:func:`ratio` where ``row`` ran both settings; ``None`` where it did not (its target
    then says so: :func:`check`)."""
    return ratio(row, name, base) if row and {name, base} <= row["rounds"].keys() else None


def hidden(row: Row, name: str, own: str, alone: str) -> Spread:
    """The share of its communication that ``name`` hides behind its own compute, round by
    round: (``own`` compute + the communication ``alone`` - ``name``'s step) / ``alone``."""
    return per_round(row, lambda ms: (ms[own] + ms[alone] - ms[name]) / ms[alone])


def median(row: Row, name: str) -> float:
    """``name``'s median ms per step over the rounds."""
    return statistics.median(row["rounds"][name])


def ms(x: float) -> str:
    return f"{x:.1f}"


def times(x: float) -> str:
    return f"{x:.2f}x"


def spread(s: Spread) -> str:
    """A ratio over the rounds: ``"0.93x [0.90, 0.97]"``, the median [lowest, highest]."""
    return f"{s.median:.2f}x [{s.low:.2f}, {s.high:.2f}]"


def share(s: Spread, digits: int = 0) -> str:
    """A share over the rounds: ``"34% [20%, 41%]"``, with ``digits`` decimals."""
    return f"{s.median:.{digits}%} [{s.low:.{digits}%}, {s.high:.{digits}%}]"


def timings(
    row: Row, *bases: str, extra: Callable[[str], list[str]] = lambda name: [], prefix: str = ""
) -> list[list[str]]:
    """A line per setting that ran: its name (after ``prefix``), its ms, its ratio to each of
    ``bases``, then ``extra(name)``."""
    return [
        [prefix + n, ms(median(row, n)), *[spread(ratio(row, n, b)) for b in bases], *extra(n)]
        for n in row["rounds"]
    ]


def memory(title: str, rows: dict[str, Row], base: str, bucket_mib: float) -> Table:
    """Rank 0's resident memory per workload and setting: once built, its peak, and its peak
    against ``base``'s in MiB and in buckets of ``bucket_mib``."""
    header = ["", "MiB, built", "peak MiB", "peak - built", f"peak - {base}'s, MiB", "in buckets"]
    lines = []
    for workload, row in rows.items():
        for name, m in row["memory"].items():
            extra = m["peak"] - row["memory"][base]["peak"]
            cells = [f"{m['built']:.0f}", f"{m['peak']:.0f}", f"{m['peak'] - m['built']:.0f}"]
            lines.append(
                [f"{workload}: {name}", *cells, f"{extra:+.1f}", f"{extra / bucket_mib:+.2f}"]
            )
    return title, header, lines


def check(
    name: str, value: Spread | None, bound: float, *, least: bool = False, percent: bool = False
) -> Target:
    """A target on a spread's median: at most ``bound`` (at least, with ``least``); a
    ``value`` of ``None`` was not run."""
    if value is None:
        return name, "not run", None
    met = value.median >= bound if least else value.median <= bound
    return name, share(value) if percent else spread(value), met


def within_bucket(text: str, row: Row | None, name: str, base: str, bucket_mib: float) -> Target:
    """A target on rank 0's peak RSS in ``row``: ``name``'s at most ``base``'s plus one
    bucket of ``bucket_mib``."""
    if row is None or name not in row["memory"]:
        return text, "not run", None
    extra = row["memory"][name]["peak"] - row["memory"][base]["peak"]
    return text, f"{extra:+.1f} MiB ({extra / bucket_mib:+.2f} buckets)", extra <= bucket_mib


def environment(**more: str) -> dict[str, str]:
    """What a page was measured on: the date, the machine, the versions, and ``more``."""
    import torch

    import fsync

    cpu = platform.processor() or "unknown CPU"
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{socket.gethostname()}: {cpu}, {os.cpu_count()} cores, {platform.system()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fsync": fsync.__version__,
        **more,
    }


def cpu_jiffies() -> tuple[int, int]:
    """This machine's CPU time so far, ``(stolen, all)``, in jiffies: ``/proc/stat``'s
    first line (user, nice, system, idle, iowait, irq, softirq, steal); ``(0, 0)`` where
    there is no such file."""
    try:
        fields = pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return 0, 0
    values = [int(field) for field in fields]
    return (values[7] if len(values) > 7 else 0), sum(values)


def stolen_since(start: tuple[int, int]) -> str:
    """The share of this machine's CPU time the hypervisor took since ``start`` (a
    :func:`cpu_jiffies`), for a page's table of what it ran on: a noisy run says so."""
    now = cpu_jiffies()
    stolen, total = now[0] - start[0], now[1] - start[1]
    if total <= 0:
        return "unknown (no /proc/stat)"
    return f"{100 * stolen / total:.1f} % of the CPU time while it ran (/proc/stat)"


def met(ok: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "-"}[ok]


def markdown(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; each cell on one line, its ``|`` escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: object) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def section(table: Table, note: str = "") -> list[str]:
    """A table as a page section: its title as a heading, ``note``, the table."""
    title, header, rows = table
    return [*heading(title, note), markdown(header, rows), ""]


def heading(title: str, note: str = "") -> list[str]:
    """A section's heading and the ``note`` below it."""
    return [f"## {title}", "", *([note, ""] if note else [])]


def targets(found: Iterable[Target]) -> Table:
    return "Targets", ["target", "measured", "met"], [[n, m, met(ok)] for n, m, ok in found]


def console(tables: Iterable[Table]) -> None:
    """Prints ``tables`` with rich, the way a person reads them in a terminal."""
    from rich.console import Console
    from rich.table import Table as RichTable

    out = Console()
    for title, header, rows in tables:
        table = RichTable(title=title, title_justify="left")
        for i, column in enumerate(header):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in rows:  # markdown's bold (a target not met) as plain text
            table.add_row(*[re.sub(r"\*\*(.*?)\*\*", r"\1", cell) for cell in row])
        out.print(table)


def page(
    path: pathlib.Path,
    title: str,
    intro: Iterable[str],
    figures: Iterable[pathlib.Path],
    sections: Iterable[tuple[Table, str]],
    end: Iterable[str] = (),
) -> list[pathlib.Path]:
    """Writes a page: its title, the ``intro`` paragraphs, its figures, each section (a table
    and the note above it), then ``end``; returns the page and its figures."""
    figures = list(figures)
    parts = [f"# {title}", ""]
    for paragraph in [*intro, "\n".join(f"![{f.stem}]({f.name})" for f in figures)]:
        parts += [paragraph, ""] if paragraph else []
    for table, note in sections:
        parts += section(table, note)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*parts, *end]))
    return [path, *figures]

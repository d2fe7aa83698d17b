"""Every page's command line: a :class:`Page` value per page, one :func:`main` for all.

A page measures its settings at one or more *rates* and writes one file of ``docs/``. A
rate is the network the settings run on: ``unshaped`` (this machine's loopback as it is)
and ``local`` (four ranks on it, standing for two nodes) are measured in the page's own
process; any other rate runs in a child of the page (``python -m MODULE --child RATE
--json PATH``) inside the tool that shapes the network (``../shared/tools/slownet``: a
loopback shaped to the rate; ``twonodes``: two network namespaces joined by a shaped
cable, the command run on both), which writes what it measured as JSON for the parent.
Where the tool cannot make its network (exit 3: not root) the page is written from the
rates that ran, and not at all where none did. A page without rates (``run.py``'s own
sections) is measured once, in its own process.

Every page takes ``--smoke`` (tiny sizes and :data:`SMOKE` turns at the local rate: what
CI runs), ``--rounds``, ``--steps``, ``--warmup`` (the page's own defaults otherwise),
``--out`` (the page's folder) and ``--no-report`` (print only); a page with rates
``--rates`` and its tool's path (``--slownet PATH`` or ``--twonodes PATH``); a page that
saves its results beside it ``--from-json PATH`` (the page written from them, nothing
measured). The page prints its tables and targets, then writes its file: a title, the
intro, the figures, the targets, the tables (each with the note above it).

``gpu.py``, whose parts are not rates, runs them as children the same way
(:func:`child_json`, each under a time limit, a part saving what it has found as it goes:
:func:`save_json`) and writes its page with the same tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from benchmarks import table
from benchmarks.constants import DOCS, ROOT, TOOLS

LOCAL = ("unshaped", "local")  # the rates a page measures in its own process
NOT_ROOT = 3  # slownet's and twonodes' exit status where they cannot make their network

Results = dict[str, Any]
Measure = Callable[[argparse.Namespace, str, Mapping[str, str]], Results | None]


class Timing(NamedTuple):
    """A page's turns by default: rounds of turns, steps a turn, untimed steps before."""

    rounds: int
    steps: int
    warmup: int


SMOKE = Timing(rounds=2, steps=1, warmup=1)  # --smoke's turns, on every page


def _none(*_: Any) -> list[Any]:
    return []


@dataclasses.dataclass(frozen=True)
class Page:
    """A page: where it is written, what it measures at a rate, how it reads.

    ``measure(args, rate, env)`` returns the rate's results (JSON; ``None`` on a node that
    only runs ranks), ``env`` set in every process of its settings. ``targets(results)``,
    ``tables(results)`` (each a table and the note above it) and ``figures(results, out)``
    read the results by rate (a page without rates: as measured). ``intro`` holds the
    paragraphs above the figures, the table of what the page was measured on after the first
    (:func:`benchmarks.table.environment`, with what ``environment(args, results)`` adds);
    ``end(results)`` the lines below the last table. ``timing`` gives the
    turns of a full run; ``flags(parser)`` adds the page's own flags; ``saved`` names the
    JSON of the results written beside the page.
    """

    file: str
    title: str
    module: str
    measure: Measure
    targets: Callable[[Results], list[table.Target]]
    tables: Callable[[Results], list[tuple[table.Table, str]]]
    intro: tuple[str, ...]
    timing: Timing
    rates: tuple[str, ...] = ()
    smoke_rates: tuple[str, ...] = ("unshaped",)
    tool: str = "slownet"
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    figures: Callable[[Results, pathlib.Path], list[pathlib.Path]] = _none
    end: Callable[[Results], list[str]] = _none
    environment: Callable[[argparse.Namespace, Results], dict[str, str]] = lambda args, r: {}
    flags: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    saved: str | None = None


def parse(page: Page, argv: Sequence[str] | None, description: str = "") -> argparse.Namespace:
    """``page``'s flags read from ``argv``; ``--smoke`` and the page's defaults applied. The
    help's description: the first paragraph of the page module's docstring, unless given."""
    doc = importlib.import_module(page.module).__doc__ or ""
    parser = argparse.ArgumentParser(description=description or doc.split("\n\n")[0])
    turn_flags(parser, page.timing)
    parser.add_argument("--out", type=pathlib.Path, default=DOCS, help="the page's folder")
    parser.add_argument("--no-report", action="store_true", help="print only")
    if page.rates:
        rates = f"comma-separated, of {page.rates} (default all; {page.smoke_rates} with --smoke)"
        known = listed(list(dict.fromkeys([*page.rates, *page.smoke_rates])))
        parser.add_argument("--rates", type=known, default=None, help=rates)
        tool = TOOLS / page.tool
        help = "the tool that shapes the network"
        parser.add_argument(
            f"--{page.tool}", dest="tool", type=pathlib.Path, default=tool, help=help
        )
        parser.add_argument("--child", metavar="RATE", help="measure one rate (inside the tool)")
        parser.add_argument("--json", type=pathlib.Path, help="--child: where to write results")
    if page.saved:
        help = f"write the page from a run's {page.saved}, measuring nothing"
        parser.add_argument("--from-json", type=pathlib.Path, help=help)
    page.flags(parser)
    args = settle(parser.parse_args(argv), page.timing)
    if page.rates and args.rates is None:
        args.rates = list(page.smoke_rates if args.smoke else page.rates)
    return args


def turn_flags(parser: argparse.ArgumentParser, timing: Timing) -> None:
    """``--smoke``, ``--rounds``, ``--steps`` and ``--warmup``, ``timing`` their defaults."""
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few turns (CI)")
    meaning = ("turns per setting", "steps per turn", "untimed steps per world")
    for name, what, default, smoke in zip(Timing._fields, meaning, timing, SMOKE, strict=True):
        help = f"{what} (default {default}; {smoke} with --smoke)"
        parser.add_argument(f"--{name}", type=int, default=None, help=help)


def settle(args: argparse.Namespace, timing: Timing) -> argparse.Namespace:
    """``args`` with the turns not given set: :data:`SMOKE`'s with ``--smoke``, else
    ``timing``'s."""
    for name, default, smoke in zip(Timing._fields, timing, SMOKE, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else default)
    return args


def turn_args(args: argparse.Namespace) -> list[str]:
    """The flags that give a child (a rate, a part, another page) this run's turns."""
    turns = [f"--{name}={getattr(args, name)}" for name in Timing._fields]
    return ["--smoke", *turns] if args.smoke else turns


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """This run's turns, as :func:`benchmarks.harness.turns` takes them."""
    return {name: getattr(args, name) for name in Timing._fields}


def listed(options: Sequence[str]) -> Callable[[str], list[str]]:
    """A flag's type: a comma-separated list of ``options``."""

    def words(text: str) -> list[str]:
        found = [word for word in text.split(",") if word]
        if unknown := set(found) - set(options):
            raise argparse.ArgumentTypeError(f"{sorted(unknown)}; choose from {tuple(options)}")
        return found

    return words


def main(page: Page, argv: Sequence[str] | None = None) -> int:
    """``page``'s command line: a child measures its rate; else the page is made."""
    return run(page, parse(page, argv))


def run(page: Page, args: argparse.Namespace) -> int:
    """A child measures its rate and writes it to ``--json``; else :func:`report`."""
    if getattr(args, "child", None):
        found = page.measure(args, args.child, {})
        if found is not None:  # on two nodes: node 0's
            assert args.json is not None, "--child writes to --json PATH"
            save_json(args.json, found)
        return 0
    report(page, args)
    return 0


def report(page: Page, args: argparse.Namespace) -> None:
    """Measures ``page`` (or reads ``--from-json``), prints its tables and writes it."""
    if getattr(args, "from_json", None):
        saved = json.loads(args.from_json.read_text())
        results, environment = saved["rates"], saved["environment"]
    else:
        start = table.cpu_jiffies()
        results = measure(page, args)
        steal = table.stolen_since(start)
        environment = table.environment(**page.environment(args, results), steal=steal)
    if not results:
        print(f"{page.file}: nothing ran, so nothing is written", flush=True)
        return
    targets = table.targets(page.targets(results))
    table.console([*(t for t, _ in page.tables(results)), targets])
    if not args.no_report:
        print("wrote " + ", ".join(map(str, write(page, results, environment, args.out))))


def measure(page: Page, args: argparse.Namespace) -> Results:
    """Every rate asked for: the local ones here, each other one in a child inside the
    page's tool; a page without rates, once here."""
    results: Results = {}
    with tempfile.TemporaryDirectory(prefix="fsync-bench-") as tmp:
        env = {**page.env, **inductor_cache(tmp, args.smoke)}
        if not page.rates:
            return page.measure(args, "", env) or {}
        for rate in args.rates:
            started = time.perf_counter()
            if rate in LOCAL:
                found = page.measure(args, rate, env)
            else:
                command = [sys.executable, "-m", page.module, "--child", rate, *turn_args(args)]
                found = at_rate(command, rate, args, env)
            if found is None:  # not root: the page shows what ran
                break
            results[rate] = found
            print(f"{page.file}, {rate}: {time.perf_counter() - started:.0f} s", flush=True)
    return results


def write(
    page: Page, results: Results, environment: dict[str, str] | None, out: pathlib.Path
) -> list[pathlib.Path]:
    """The page and its figures in ``out`` (and its results, where it saves them)."""
    out.mkdir(parents=True, exist_ok=True)
    if page.saved:
        saved = {"environment": environment, "rates": results}
        (out / page.saved).write_text(json.dumps(saved, indent=1) + "\n")
    facts = table.markdown(["", ""], environment.items()) if environment else ""
    sections = [(table.targets(page.targets(results)), ""), *page.tables(results)]
    figures = page.figures(results, out)
    intro = [page.intro[0], facts, *page.intro[1:]]
    return table.page(out / page.file, page.title, intro, figures, sections, page.end(results))


def inductor_cache(tmp: str, smoke: bool) -> dict[str, str]:
    """The environment a page's processes compile in: an empty inductor cache under ``tmp``
    for a real run (compile times of a first run, not of whatever an earlier run left in
    ``/tmp/torchinductor_$USER``; the page's settings and ranks share it, so that a graph
    compiles once and its recompiles are cache hits); for a smoke run the caller's, so that
    the pages of one test session reuse each other's graphs (their workloads are the same)."""
    return {} if smoke else {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}


def at_rate(
    command: list[str], rate: str, args: argparse.Namespace, env: Mapping[str, str]
) -> Results | None:
    """Runs a page's child ``command`` for one shaped ``rate`` under ``args.tool --rate RATE
    --`` (``slownet`` takes the command's words; ``twonodes`` runs it on both nodes, as one
    line for bash) and returns the JSON it writes (:func:`child_json`). ``None`` where the
    tool cannot make its network (not root)."""
    tool: pathlib.Path = args.tool

    def inside(line: list[str]) -> list[str]:
        words = [shlex.join(line)] if tool.name == "twonodes" else line
        return [str(tool), "--rate", rate, "--", *words]

    done, results = child_json(command, wrap=inside, env=children_env(env), capture=False)
    if done.code == NOT_ROOT:
        print(f"{tool.name} could not make its network for {rate} (it needs root)", flush=True)
        return None
    if done.status != "ok":
        raise RuntimeError(f"{shlex.join(inside(command))}: {done.status} (exit {done.code})")
    return results  # type: ignore[no-any-return]


def children_env(more: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, and ``more``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **more}


def save_json(path: pathlib.Path, found: Any) -> None:
    """``found`` as JSON at ``path``, whole or not at all (a child may be killed meanwhile:
    what it saved last is still read)."""
    draft = path.with_suffix(".draft")
    draft.write_text(json.dumps(found))
    draft.replace(path)


def child_json(
    command: Sequence[str],
    *,
    wrap: Callable[[list[str]], list[str]] = list,
    limit_s: float | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = True,
) -> tuple[Child, Any]:
    """Runs ``command --json PATH`` (:func:`run_child`; ``wrap`` makes the line that runs it,
    inside a tool) and returns how it ended and the JSON it left at ``PATH`` (``None``:
    none)."""
    with tempfile.TemporaryDirectory(prefix="fsync-child-") as tmp:
        path = pathlib.Path(tmp) / "found.json"
        line = wrap([*command, "--json", str(path)])
        done = run_child(line, limit_s=limit_s, env=env, capture=capture)
        return done, json.loads(path.read_text()) if path.exists() else None


class Child(NamedTuple):
    """How a child process ended: ``status`` ok, failed or timed out; its exit ``code``
    (``None``: killed at its limit), its ``seconds`` and its ``output`` (where captured)."""

    status: str
    code: int | None
    seconds: float
    output: str


def run_child(
    command: Sequence[str],
    *,
    limit_s: float | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = True,
) -> Child:
    """Runs ``command`` from the repository's root, its output captured or left on ours.

    The child gets a process session of its own, so that at ``limit_s`` it is killed
    with every process it started (the test worlds' ranks, inductor's compile workers).
    """
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=None if env is None else dict(env),
            stdout=log if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            text=True,
            start_new_session=True,
        )
        try:
            code: int | None = child.wait(timeout=limit_s)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code, status = None, "timed out"
        except BaseException:  # interrupted: the child and its own go with this process
            os.killpg(child.pid, signal.SIGKILL)
            raise
        log.seek(0)
        output = log.read()
    return Child(status, code, time.monotonic() - started, output)


def label(rate: str) -> str:
    """A rate as a page prints it: ``"8gbit"`` -> ``"8 Gbit/s"``; the local rate says what
    it was; ``"unshaped"`` stays."""
    if rate == "local":
        return "local (one loopback)"
    return rate.replace("gbit", " Gbit/s") if rate.endswith("gbit") else rate


def row_key(load: object, cap: float | None, default: float | None) -> str:
    """A row's name: the workload and batch, and its buckets where not the page's
    ``default`` (``None``: each library's own)."""
    return str(load) if cap == default else f"{load}, {cap:g} MiB buckets"

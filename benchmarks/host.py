"""What an eager gradient call costs the host, per step and per leaf, beside DDP's.

``python -m benchmarks.host`` measures one gradient call of the host-bound GPT
(``benchmarks.models``, 12 blocks of width 32: 150 leaves) and of the same GPT with 3 and 48
blocks (42 and 582 leaves), at world 1 and 2: the module's ``loss.backward()`` and DDP's,
``torch.autograd.grad`` on the functional loss and ``fsync.grad_and_value``. A call's host
cost is the CPU time its process spends on it (``time.process_time``: every thread, the
starter's and gloo's included). The calls take turns in one world (a turn of ``--steps``
calls of each, round after round), so that what one process's memory layout adds weighs on
all of them alike: here a difference of a millisecond is the quantity measured, and two
processes of the same call differ by more. What a call adds to its floor (DDP to the
module's backward, fsync to the functional call it makes, without a sync) is the median
over the rounds of rank 0's CPU per call, fitted as ``fixed + per leaf x leaves`` over the
three sizes (least squares), and printed beside the wall-clock ratio of fsync to DDP at
150 leaves. ``docs/performance.md`` quotes it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness, page, steps, table
from benchmarks.harness import Built
from benchmarks.models import host_bound
from benchmarks.steps import setting
from benchmarks.table import Spread

BLOCKS = (3, 12, 48)  # 6 + 12 x blocks leaves: 42, 150, 582
HOWS = ("module", "DDP", "autograd", "fsync")
# The calls :mod:`benchmarks.steps` makes, by their names there ("autograd" is this module's).
SHARED = {"module": steps.MODULE_BACKWARD, "DDP": steps.DDP_BACKWARD, "fsync": steps.FSYNC_CALL}
CALLS = {"DDP": "module", "fsync": "autograd"}  # each call and the floor it adds to
TIMING = page.Timing(rounds=15, steps=20, warmup=5)


def _call(blocks: int, how: str) -> Callable[[], object]:
    """One gradient call, ``how``: ``"module"``, ``"DDP"``, ``"autograd"`` (the functional
    loss's leaves made differentiable, then ``torch.autograd.grad``) or ``"fsync"``."""
    work = host_bound(blocks)
    if how in SHARED:
        return steps.gradient_call(work, SHARED[how])
    params, batch = work.params(), work.batch(dist.get_rank())

    def autograd() -> None:
        leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
        torch.autograd.grad(work.functional_loss(leaves, batch), list(leaves.values()))

    return autograd


def measured(rounds: int, steps: int, warmup: int) -> Built:
    """Every call of every size, in turns in this world; ``info`` holds, per call, each
    round's CPU and wall ms per call."""
    calls = {f"{how} {b}": _call(b, how) for b in BLOCKS for how in HOWS}
    found = harness.in_turns(
        {name: functools.partial(_ignoring_step, call) for name, call in calls.items()},
        rounds=rounds,
        steps=steps,
        warmup=warmup,
        before=dist.barrier,
    )
    return Built(lambda: None, lambda: found)


def _ignoring_step(call: Callable[[], object], step: int) -> object:
    return call()


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: ``(a, b)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    b /= sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _rows(world: int, info: dict[str, Any]) -> list[list[str]]:
    cpu, wall, leaves = info["cpu"], info["wall"], [6 + 12 * b for b in BLOCKS]

    def added(name: str, floor: str) -> Spread:
        return Spread.of(c - f for c, f in zip(cpu[name], cpu[floor], strict=True))

    rows = []
    for name, floor in CALLS.items():
        spreads = [added(f"{name} {b}", f"{floor} {b}") for b in BLOCKS]
        fixed, per_leaf = fit([float(n) for n in leaves], [s.median for s in spreads])
        cells = [f"world {world}: {name} over {floor}"]
        cells += [f"{s.median:.2f} [{s.low:.2f}, {s.high:.2f}]" for s in spreads]
        cells += [f"{fixed:.2f}", f"{per_leaf * 1000:.1f}"]
        if name == "fsync":
            ratios = [f / d for f, d in zip(wall["fsync 12"], wall["DDP 12"], strict=True)]
            cells.append(table.spread(Spread.of(ratios)))
        else:
            cells.append("")
        rows.append(cells)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    page.turn_flags(parser, TIMING)
    parser.add_argument("--worlds", default="1,2", help="ranks of each world, comma-separated")
    args = page.settle(parser.parse_args(argv), TIMING)
    rows = []
    for world in map(int, args.worlds.split(",")):
        only = setting("all calls", measured, **page.timing(args))
        row = harness.turns([only], rounds=1, steps=1, warmup=0, node=harness.Node(local=world))
        assert row is not None
        rows += _rows(world, row["info"]["all calls"][0])
    leaves = [6 + 12 * b for b in BLOCKS]
    header = ["call", *(f"added CPU ms, {n} leaves" for n in leaves), "fixed ms", "us per leaf"]
    header.append("fsync / DDP wall, 150 leaves")
    table.console([("Host cost of one eager gradient call (rank 0's CPU)", header, rows)])
    return 0


if __name__ == "__main__":
    from benchmarks import host  # this module by name, so that its builders pickle

    sys.exit(host.main())

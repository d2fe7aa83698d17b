"""What an eager gradient call costs the host, per step and per leaf, beside DDP's.

``python -m benchmarks.host`` times, in turns (:mod:`benchmarks.harness`), one gradient call
of the host-bound GPT (``benchmarks.models``, 12 blocks of width 32: 150 leaves) and of the
same GPT with 3 and 48 blocks (42 and 582 leaves), at world 1 and 2: the module's
``loss.backward()`` and DDP's, ``torch.autograd.grad`` on the functional loss and
``fsync.grad_and_value``. What a call adds to its floor (DDP to the module's backward,
fsync to the functional call it makes, without a sync) is fitted as ``fixed + per leaf x
leaves`` over the three sizes, least squares on the medians, and printed with each size's
spread over the rounds. ``docs/performance.md`` quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from benchmarks import harness, table
from benchmarks.harness import Built, Spread
from benchmarks.models import gpt
from benchmarks.steps import setting

BLOCKS = (3, 12, 48)  # 6 + 12 x blocks leaves: 42, 150, 582
CALLS = {  # each call and the floor it adds to
    "DDP": "module",
    "fsync": "autograd",
}


def call(blocks: int, how: str) -> Built:
    """One gradient call, ``how``: ``"module"``, ``"DDP"``, ``"autograd"`` (the functional
    loss's leaves made differentiable, ``torch.autograd.grad``) or ``"fsync"``."""
    work = gpt(n_layer=blocks, d_model=32, vocab_size=64, block_size=8, batch=1, n_head=2)
    batch = work.batch(dist.get_rank())
    if how in ("module", "DDP"):
        model = work.model if how == "module" else DDP(work.model)

        def backward() -> None:
            model.zero_grad(set_to_none=True)
            torch.autograd.backward(work.loss(model, batch))

        return Built(backward)
    params = work.params()
    if how == "fsync":
        synced = fsync.grad_and_value(work.functional_loss)
        return Built(lambda: synced(params, batch))

    def autograd() -> None:
        leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
        torch.autograd.grad(work.functional_loss(leaves, batch), list(leaves.values()))

    return Built(autograd)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: ``(a, b)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    b /= sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worlds", default="1,2")
    args = parser.parse_args(argv)
    hows = ("module", "DDP", "autograd", "fsync")
    settings = [setting(f"{h} {b}", call, blocks=b, how=h) for b in BLOCKS for h in hows]
    leaves = [6 + 12 * b for b in BLOCKS]
    rows = []
    for world in map(int, args.worlds.split(",")):
        row = harness.turns(
            settings, rounds=args.rounds, steps=args.steps, warmup=5, node=harness.Node(local=world)
        )
        assert row is not None
        for name, floor in CALLS.items():
            added = [_added(row, f"{name} {b}", f"{floor} {b}") for b in BLOCKS]
            fixed, per_leaf = fit([float(n) for n in leaves], [s.median for s in added])
            cells = [f"world {world}: {name} over {floor}"]
            cells += [_ms(s) for s in added]
            cells += [f"{fixed:.2f}", f"{per_leaf * 1000:.1f}"]
            ratio = harness.ratio(row, "fsync 12", "DDP 12") if name == "fsync" else None
            cells.append(table.spread(ratio) if ratio else "")
            rows.append(cells)
    header = ["call", *(f"added ms, {n} leaves" for n in leaves), "fixed ms", "us per leaf"]
    header.append("fsync / DDP, 150 leaves")
    table.console([("Host cost of one eager gradient call", header, rows)])
    return 0


def _added(row: harness.Row, name: str, floor: str) -> Spread:
    """What ``name`` adds to ``floor``, ms per call, round by round."""
    return harness.per_round(row, lambda ms: ms[name] - ms[floor])


def _ms(s: Spread) -> str:
    return f"{s.median:.2f} [{s.low:.2f}, {s.high:.2f}]"


if __name__ == "__main__":
    from benchmarks import host  # this module by name, so that its builders pickle

    sys.exit(host.main())

"""When each bucket leaves, eagerly: DDP beside ``fsync.grad_and_value``, one call at a time.

The step pages give step times; this gives what bounds them on a slow link. Each
setting runs in a 2-rank world of its own, the two taking turns
(:mod:`benchmarks.harness`); each rank records, for every call, when the forward pass
ended, when each bucket's all-reduce was issued and when the call returned, all
relative to the call's start, and the page prints the medians over the timed calls.
Both settings issue through a hook that records the time and then runs the plain mean
(DDP: a comm hook, all-reduce then divide; fsync: a bucketwise [fsync.Hook][] around
``fsync.ops.allreduce()``), so both lose the fused ``1/world_size`` of their default
and are compared on equal terms. Run it under the link it is about::

    ../shared/tools/slownet --rate 8gbit -- python -m benchmarks.timeline \\
        --workload "deep MLP" --batch 64

When the link is the bottleneck, the buckets queue behind each other on it from the
first one on, and a step ends when the last has crossed: its time is when the first
left plus the wire time of all of them. What a setting does before its first bucket
leaves (forward, the agreement, the first layers of backward, the hooks) is then what
tells two settings apart.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from typing import Any

if not __package__:  # run as a script: the repository first, not benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from benchmarks import harness, page, table
from benchmarks.constants import CAP_MB
from benchmarks.harness import Built
from benchmarks.models import Load
from benchmarks.steps import setting

COLUMNS = ("forward done", "first bucket issued", "last bucket issued", "returned")
SETTINGS = ("DDP eager", "fsync.grad_and_value")
TIMING = page.Timing(rounds=15, steps=2, warmup=3)  # 30 timed calls of each setting


class Clock:
    """The events of the call in progress, in ms since it started; every call's, kept."""

    def __init__(self) -> None:
        self.start = 0.0
        self.events: dict[str, list[float]] = {}
        self.calls: list[dict[str, list[float]]] = []

    def mark(self, event: str) -> None:
        self.events.setdefault(event, []).append(1000 * (time.perf_counter() - self.start))

    def timed(self, call: Any) -> Any:
        """``call`` with its events recorded: the clock starts with it, ``returned`` ends it."""

        def run() -> None:
            self.start, self.events = time.perf_counter(), {}
            call()
            self.mark("returned")
            self.calls.append(self.events)

        return run

    def medians(self, skip: int) -> list[float]:
        """Per column, the median over the calls after the first ``skip``."""
        picks = {
            "forward done": lambda e: e["forward done"][0],
            "first bucket issued": lambda e: e["issued"][0],
            "last bucket issued": lambda e: e["issued"][-1],
            "returned": lambda e: e["returned"][0],
        }
        return [statistics.median(picks[c](e) for e in self.calls[skip:]) for c in COLUMNS]


def recorded(load: Load, name: str, warmup: int) -> Built:
    """``name``'s gradient call on ``load``, its events recorded; ``info``: the medians."""
    work, clock = load.build(), Clock()
    batch = work.batch(dist.get_rank())
    if name == "DDP eager":
        ddp = DDP(work.model, bucket_cap_mb=CAP_MB)
        world = dist.get_world_size()

        # Unannotated: DDP reads the annotations, which this module's postponed evaluation
        # turns into strings it refuses.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            clock.mark("issued")
            future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return future.then(lambda f: f.value()[0].div_(world))

        ddp.register_comm_hook(None, hook)

        def call() -> None:
            ddp.zero_grad(set_to_none=True)
            loss = work.loss(ddp, batch)
            clock.mark("forward done")
            torch.autograd.backward(loss)

    else:
        mean = fsync.ops.allreduce()

        def apply(buckets: Any, state: Any, ctx: fsync.SyncContext) -> Any:
            clock.mark("issued")
            return mean.apply(buckets, state, ctx)

        fsync_hook = fsync.Hook(mean.init, apply, spec="recorded allreduce(mean)", bucketwise=True)

        def loss(params: Any, batch: Any) -> torch.Tensor:
            value = work.functional_loss(params, batch)
            clock.mark("forward done")
            return value

        grad = fsync.grad_and_value(loss, hook=fsync_hook, bucket_cap_mb=CAP_MB)
        params = work.params()

        def call() -> None:
            grad(params, batch)

    return Built(clock.timed(call), lambda: {"medians": clock.medians(skip=warmup)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="deep MLP", help="MLP, deep MLP or GPT")
    parser.add_argument("--batch", type=int, default=64)
    page.turn_flags(parser, TIMING)
    args = page.settle(parser.parse_args(argv), TIMING)
    load = Load(args.workload, args.batch, args.smoke)
    settings = [setting(n, recorded, load=load, name=n, warmup=args.warmup) for n in SETTINGS]
    row = harness.turns(settings, **page.timing(args))
    assert row is not None  # one node: this one
    print(f"{args.workload}, batch {args.batch}, 2 ranks (ms since the call began)")
    cells = [
        [name, str(rank), *map(table.ms, info["medians"])]
        for name, infos in row["info"].items()
        for rank, info in enumerate(infos)
    ]
    print(table.markdown(["setting", "rank", *COLUMNS], cells))


if __name__ == "__main__":
    from benchmarks import timeline  # this module by name, so that its builders pickle

    timeline.main()

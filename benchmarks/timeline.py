"""When each bucket leaves, eagerly: DDP beside ``fsync.grad_and_value``, one call at a time.

The step pages give step times; this gives what bounds them on a slow link. Each
rank records, for every call of each setting (the settings taking turns), when the
forward pass ended, when each bucket's all-reduce was issued and when the call
returned, all relative to the call's start, and prints the medians. Both settings
issue through a hook that records the time and then runs the plain mean (DDP: a comm
hook, all-reduce then divide; fsync: a bucketwise [fsync.Hook][] around
``fsync.ops.allreduce()``), so both lose the fused ``1/world_size`` of their default
and are compared on equal terms. Run it under the link it is about::

    ../shared/tools/slownet --rate 8gbit -- torchrun --standalone --nproc-per-node 2 \\
        benchmarks/timeline.py --workload "deep MLP" --batch 64

When the link is the bottleneck, the buckets queue behind each other on it from the
first one on, and a step ends when the last has crossed: its time is when the first
left plus the wire time of all of them. What a setting does before its first bucket
leaves (forward, the agreement, the first layers of backward, the hooks) is then what
tells two settings apart.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fsync  # noqa: E402
from benchmarks import cases, link  # noqa: E402

COLUMNS = ("forward done", "first bucket issued", "last bucket issued", "returned")


class Clock:
    """The events of the call in progress, in ms since it started; every call's, kept."""

    def __init__(self) -> None:
        self.start = 0.0
        self.events: dict[str, list[float]] = {}
        self.calls: list[dict[str, list[float]]] = []

    def begin(self) -> None:
        self.start, self.events = time.perf_counter(), {}

    def mark(self, event: str) -> None:
        self.events.setdefault(event, []).append(1000 * (time.perf_counter() - self.start))

    def end(self) -> None:
        self.mark("returned")
        self.calls.append(self.events)

    def medians(self, skip: int) -> list[float]:
        """Per column, the median over the calls after the first ``skip``."""
        calls = self.calls[skip:]
        picks = {
            "forward done": lambda e: e["forward done"][0],
            "first bucket issued": lambda e: e["issued"][0],
            "last bucket issued": lambda e: e["issued"][-1],
            "returned": lambda e: e["returned"][0],
        }
        return [statistics.median(picks[c](e) for e in calls) for c in COLUMNS]


def _ddp_call(work: Any, batch: Any, clock: Clock) -> Callable[[], None]:
    ddp = DDP(copy.deepcopy(work.model), bucket_cap_mb=link.CAP_MB)
    world = dist.get_world_size()

    # Unannotated: DDP reads the annotations, which this module's postponed evaluation
    # turns into strings it refuses.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        clock.mark("issued")
        future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()  # type: ignore[union-attr]
        return future.then(lambda f: f.value()[0].div_(world))

    ddp.register_comm_hook(None, hook)

    def call() -> None:
        ddp.zero_grad(set_to_none=True)
        loss = work.criterion(ddp(batch[0]), batch[1])
        clock.mark("forward done")
        loss.backward()

    return call


def _fsync_call(work: Any, batch: Any, clock: Clock) -> Callable[[], None]:
    mean = fsync.ops.allreduce()

    def apply(buckets: Any, state: Any, ctx: fsync.SyncContext) -> Any:
        clock.mark("issued")
        return mean.apply(buckets, state, ctx)

    hook = fsync.Hook(mean.init, apply, spec="recorded allreduce(mean)", bucketwise=True)

    def loss(params: Any, batch: Any) -> torch.Tensor:
        value = work.functional_loss(params, batch)
        clock.mark("forward done")
        return value

    grad = fsync.grad_and_value(loss, hook=hook, bucket_cap_mb=link.CAP_MB)
    params = work.params()

    def call() -> None:
        grad(params, batch)

    return call


def _timed(call: Callable[[], None], clock: Clock) -> Callable[[], None]:
    def timed() -> None:
        clock.begin()
        call()
        clock.end()

    return timed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="deep MLP", help="MLP, deep MLP or GPT")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="timed calls of each setting")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = link.workload(args.workload, args.batch, args.smoke)
    batch = work.batch(rank)
    clocks = {"DDP eager": Clock(), "fsync.grad_and_value": Clock()}
    makers = {"DDP eager": _ddp_call, "fsync.grad_and_value": _fsync_call}
    calls = {
        name: _timed(makers[name](work, batch, clock), clock) for name, clock in clocks.items()
    }
    warmup = 3
    cases.interleaved_ms(calls, warmup=warmup, steps=args.steps, per_round=2)
    mine = torch.tensor([clock.medians(skip=warmup) for clock in clocks.values()])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        print(f"{args.workload}, batch {args.batch}, {world} ranks (ms since the call began)")
        print("| setting | rank | " + " | ".join(COLUMNS) + " |")
        print("|---" * (len(COLUMNS) + 2) + "|")
        for r, rows in enumerate(every):
            for name, row in zip(clocks, rows.tolist(), strict=True):
                print(f"| {name} | {r} | " + " | ".join(f"{x:.1f}" for x in row) + " |")
    cases.leave_group()


if __name__ == "__main__":
    main()

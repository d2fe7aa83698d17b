"""The ZeRO section of the slow-link page: fsync's ZeRO step beside ``ZeroRedundancyOptimizer``.

Its rows are the deep MLP and the GPT at batch 64 and 256, at the rates the slow-link page
runs them (unshaped and 8 Gbit/s); its settings, with 4 MiB buckets and AdamW at
``LR`` throughout (``torch.optim.AdamW`` against ``fsync.optim.adamw``):

- ``ZeroRedundancyOptimizer(AdamW)`` + DDP, the reference, after backward;
- ``ZeroRedundancyOptimizer(overlap_with_ddp=True)`` with DDP's
  ``hook_with_zero_step`` and ``hook_with_zero_step_interleaved``, which step each bucket's
  shard as DDP's all-reduce of it completes, where the backend allows it (torch refuses gloo:
  the page quotes its error);
- ``fsync.ops.zero``, after ``torch.func.grad`` (``params, state = step(params, grads,
  state)``): eager, eager with whole buckets (``shard_buckets=False``), and compiled;
- ``step.value_and_step(loss)``, the overlapped call (one backward that reduce-scatters each
  bucket as backward completes it; then, on these CPU ranks after backward by default, updates
  the shard and all-gathers it): eager and under
  ``fsync.compile``. Where this fsync has no ``ZeroStep.value_and_step`` the page says so.

Beside them, each one's own compute with no communication (its floor) and the fsync
collectives alone, so that the page gives each step's share of the reduce-scatter and
all-gather time hidden behind its compute: (own compute + RS/AG alone - step) / RS/AG
alone. The memory rows time each eager step once more in processes that follow their RSS.

``python -m benchmarks.zero [--rate 8gbit]`` times the rows of one rate alone and prints
their tables (no page written): at 8 Gbit/s under ``../shared/tools/slownet --rate 8gbit``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from benchmarks import harness, page, table
from benchmarks.constants import CAP_MB, LR
from benchmarks.harness import Built, Row, Setting, UnavailableError
from benchmarks.models import Load
from benchmarks.page import label
from benchmarks.steps import Held, autograd_step, setting

REFERENCE = "ZeroRedundancyOptimizer + DDP"
TORCH_OVERLAP = {
    "ZeroRedundancyOptimizer(overlap_with_ddp=True), hook_with_zero_step": "hook_with_zero_step",
    "ZeroRedundancyOptimizer(overlap_with_ddp=True), hook_with_zero_step_interleaved": (
        "hook_with_zero_step_interleaved"
    ),
}
EAGER = "fsync zero, eager"
WHOLE = "fsync zero, whole buckets, eager"
COMPILED = "fsync zero, compiled"
VALUE_AND_STEP = "fsync zero value_and_step, eager"
VALUE_AND_STEP_COMPILED = "fsync zero value_and_step, compiled"
MODULE_FLOOR = "compute, module eager + this rank's AdamW"
FUNCTIONAL_FLOOR = "compute, functional eager + AdamW of a shard"
COMPILED_FLOOR = "compute, functional compiled + AdamW of a shard"
RSAG = "reduce-scatter + all-gather of the buckets alone"
# Each step and its own compute: the share hidden is measured against it.
OWN = {
    REFERENCE: MODULE_FLOOR,
    EAGER: FUNCTIONAL_FLOOR,
    WHOLE: FUNCTIONAL_FLOOR,
    COMPILED: COMPILED_FLOOR,
    VALUE_AND_STEP: FUNCTIONAL_FLOOR,
    VALUE_AND_STEP_COMPILED: COMPILED_FLOOR,
}
FSYNC = {EAGER: "eager", WHOLE: "whole", COMPILED: "compiled"}
FSYNC |= {VALUE_AND_STEP: "value_and_step", VALUE_AND_STEP_COMPILED: "value_and_step compiled"}
WORKLOADS, BATCHES, RATES = ("deep MLP", "GPT"), (64, 256), ("unshaped", "8gbit")
MEMORY = (REFERENCE, EAGER, VALUE_AND_STEP)
TIMING = page.Timing(rounds=5, steps=2, warmup=3)  # ``python -m benchmarks.zero``'s turns


# --- the settings, built in their processes --------------------------------------------------


def _state_mib(tree: Any) -> float:
    leaves = fsync._tree.flatten(tree)[0]  # step counters (0-d) aside
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def torch_zero(load: Load, overlap: str | None, cap_mb: float = CAP_MB) -> Built:
    """``ZeroRedundancyOptimizer(AdamW)`` on DDP's parameters, stepped after backward, or
    (``overlap``: a hook of ``ddp_zero_hook``) from DDP's buckets as their all-reduce ends."""
    work = load.build()
    batch = work.batch(dist.get_rank())
    ddp = DDP(work.model, bucket_cap_mb=cap_mb)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        optimizer_class=torch.optim.AdamW,
        overlap_with_ddp=overlap is not None,
        lr=LR,
    )
    if overlap is not None:
        try:
            ddp.register_comm_hook(None, getattr(ddp_zero_hook, overlap)(allreduce_hook, ddp, zero))
        except RuntimeError as error:  # gloo: "... may meet hangs"; every rank raises it
            raise UnavailableError(f"torch raises `RuntimeError: {error}`") from error

    step = autograd_step(work, ddp, batch, zero)
    return Built(step, lambda: {"state MiB": _state_mib(zero.optim.state_dict()["state"])})


def fsync_zero(load: Load, how: str, cap_mb: float = CAP_MB) -> Built:
    """``fsync.ops.zero(fsync.optim.adamw(LR))``: ``how`` is ``"eager"``, ``"whole"``
    (``shard_buckets=False``), ``"compiled"``, ``"value_and_step"`` or ``"value_and_step
    compiled"``; compiled is ``fsync.compile`` of the whole train step."""
    work = load.build()
    batch = work.batch(dist.get_rank())
    sharded = how != "whole"
    step = fsync.ops.zero(fsync.optim.adamw(LR), shard_buckets=sharded, bucket_cap_mb=cap_mb)
    params = work.params()
    if how.startswith("value_and_step"):
        call = step.value_and_step(work.functional_loss)

        def train(params: Any, state: Any) -> Any:
            (params, _), state = call(state, params, batch)
            return params, state

    else:

        def train(params: Any, state: Any) -> Any:
            grads = torch.func.grad(work.functional_loss)(params, batch)
            return step(params, grads, state)

    fn = fsync.compile(train) if how.endswith("compiled") else train
    run = Held(fn, params, step.init(params))
    return Built(run, lambda: {"state MiB": _state_mib(run.state.opt)})


def functional_floor(load: Load, compiled: bool, cap_mb: float = CAP_MB) -> Callable[[], None]:
    """What an fsync ZeRO step computes, with no communication: ``torch.func.grad``, then
    per bucket of fsync's plan (4 MiB) the gradients and parameters packed flat
    (``fsync.pack``) and AdamW on this rank's 1/world of them, as the step does. (One
    AdamW over the whole shard works on tensors of tens of MB, each a fresh ``mmap``
    eagerly: on the GPT it took longer than the step it is the floor of.)"""
    work = load.build()
    batch = work.batch(dist.get_rank())
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = fsync.optim.adamw(LR)
    params = work.params()
    plan = fsync.plan_buckets(params, bucket_cap_mb=cap_mb)

    def shard(tree: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [bucket.chunk(world)[rank] for bucket in fsync.pack(tree, plan)]

    def train(params: dict[str, torch.Tensor], state: Any) -> Any:
        grads = torch.func.grad(work.functional_loss)(params, batch)
        _, state = optimizer.update(shard(params), shard(grads), state)
        return params, state

    return Held(fsync.compile(train) if compiled else train, params, optimizer.init(shard(params)))


def module_floor(load: Load) -> Callable[[], None]:
    """What ``ZeroRedundancyOptimizer`` + DDP computes, with no communication: the module's
    backward and the AdamW of this rank's parameters (``ZeroRedundancyOptimizer.optim``)."""
    work = load.build()
    batch = work.batch(dist.get_rank())
    zero = ZeroRedundancyOptimizer(
        work.model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
    )

    def step() -> None:
        zero.zero_grad(set_to_none=True)
        torch.autograd.backward(work.loss(work.model, batch))
        zero.optim.step()

    return step


def collectives(load: Load, cap_mb: float = CAP_MB) -> Callable[[], None]:
    """The fsync collectives of a ZeRO step alone: per bucket of fsync's plan (4 MiB), a
    reduce-scatter of the bucket, then an all-gather of the shards, on buffers made once."""
    world = dist.get_world_size()
    plan = fsync.plan_buckets(load.build().params(), bucket_cap_mb=cap_mb)
    buckets = [torch.zeros(-(-spec.numel // world) * world) for spec in plan.specs]
    shards = [torch.zeros(b.numel() // world) for b in buckets]
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def step() -> None:
        for pending in [scatter(s, b, async_op=True) for s, b in zip(shards, buckets, strict=True)]:
            pending.wait()
        for pending in [gather(b, s, async_op=True) for s, b in zip(shards, buckets, strict=True)]:
            pending.wait()

    return step


def settings(load: Load, cap_mb: float = CAP_MB) -> list[Setting]:
    """The settings of one row, every bucket ``cap_mb``: the steps, then their floors."""
    out = [setting(REFERENCE, torch_zero, load=load, overlap=None, cap_mb=cap_mb)]
    out += [
        setting(name, torch_zero, load=load, overlap=hook, cap_mb=cap_mb)
        for name, hook in TORCH_OVERLAP.items()
    ]
    out += [
        setting(name, fsync_zero, load=load, how=how, cap_mb=cap_mb) for name, how in FSYNC.items()
    ]
    floors = [
        setting(MODULE_FLOOR, module_floor, load=load),
        setting(FUNCTIONAL_FLOOR, functional_floor, load=load, compiled=False, cap_mb=cap_mb),
        setting(COMPILED_FLOOR, functional_floor, load=load, compiled=True, cap_mb=cap_mb),
        setting(RSAG, collectives, load=load, cap_mb=cap_mb),
    ]
    return out + floors


def memory_settings(load: Load) -> list[Setting]:
    """The eager steps whose peak RSS the memory rows compare."""
    return [s for s in settings(load) if s.name in MEMORY]


def loads(rate: str, smoke: bool) -> list[Load]:
    """The rows at ``rate``: every workload and batch (a smoke run: the deep MLP at 256)."""
    if smoke:
        return [Load("deep MLP", 256, smoke=True)]
    return [Load(n, b) for n in WORKLOADS for b in BATCHES] if rate in RATES else []


# --- the section ------------------------------------------------------------------------------


def hidden(row: Row, name: str) -> table.Spread:
    """The share of the RS/AG time ``name`` hides behind its own compute, round by round."""
    return table.hidden(row, name, OWN[name], RSAG)


# Issue 27's targets for the overlapped call: its step against the reference's, at every
# rate and on every row; the share of its RS/AG time hidden where the link waits.
WITHIN = {VALUE_AND_STEP: 0.95, VALUE_AND_STEP_COMPILED: 0.85}
HIDDEN, HIDDEN_RATE = 0.40, "8gbit"


def targets(results: dict[str, dict[str, Row]], memory: dict[str, Row]) -> list[table.Target]:
    """value_and_step, eager and compiled: within :data:`WITHIN` of the reference at every
    rate, hiding :data:`HIDDEN` of its RS/AG at 8 Gbit/s; its peak RSS within one bucket of
    the non-overlapped step's."""

    out: list[table.Target] = []
    for name, within in WITHIN.items():
        for rate in RATES:
            for load in loads(rate, smoke=False):
                text = f"ZeRO, {load}: {name} <= {within:.2f}x {REFERENCE}, {label(rate)}"
                row = results.get(rate, {}).get(str(load))
                out.append(table.check(text, table.ran(row, name, REFERENCE), within))
        for load in loads(HIDDEN_RATE, smoke=False):
            text = f"ZeRO, {load}: {name} hides >= {HIDDEN:.0%} of its RS/AG, {label(HIDDEN_RATE)}"
            row = results.get(HIDDEN_RATE, {}).get(str(load))
            share = hidden(row, name) if row and name in row["rounds"] else None
            out.append(table.check(text, share, HIDDEN, least=True, percent=True))
    for workload, row in memory.items():
        text = f"ZeRO, {workload}: value_and_step eager's peak RSS <= fsync zero eager's"
        out.append(table.within_bucket(f"{text} + one bucket", row, VALUE_AND_STEP, EAGER, CAP_MB))
    return out


def tables(results: dict[str, dict[str, Row]], memory: dict[str, Row]) -> list[table.Table]:
    """Per rate and row: each step's ms, its ratio to the reference, its share hidden and its
    optimizer state per rank, or why it did not run; the floors; the eager steps' memory."""
    out: list[table.Table] = []
    header = ["", "ms", f"vs {REFERENCE}", "share of RS/AG hidden", "optimizer MiB per rank"]
    for rate, rows in results.items():
        for key, row in rows.items():

            def more(name: str, row: Row = row) -> list[str]:
                if name not in OWN:  # a floor
                    return ["", ""]
                return [table.share(hidden(row, name)), f"{row['info'][name][0]['state MiB']:.2f}"]

            cells = table.timings(row, REFERENCE, extra=more)
            cells += [[n, f"not run: {why}", "", "", ""] for n, why in row["unavailable"].items()]
            out.append((f"ZeRO, AdamW: {key}, {label(rate)}", header, cells))
    if memory:
        title = "ZeRO memory: peak RSS of the eager steps, unshaped"
        out.append(table.memory(title, memory, EAGER, CAP_MB))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The ZeRO rows of one rate, printed.")
    parser.add_argument(
        "--rate", choices=RATES, default=RATES[0], help="the rate the loopback is shaped to"
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=CAP_MB,
        help=f"every setting's bucket size, fsync's and DDP's (default {CAP_MB:g}; DDP's own: 25)",
    )
    page.turn_flags(parser, TIMING)
    args = page.settle(parser.parse_args(argv), TIMING)
    rows: dict[str, Row] = {}
    for load in loads(args.rate, args.smoke):
        row = harness.turns(settings(load, args.bucket_mb), **page.timing(args))
        assert row is not None  # one node: this process coordinates
        rows[str(load)] = row
    table.console(tables({args.rate: rows}, {}))
    return 0


if __name__ == "__main__":
    from benchmarks import zero  # this module by name, so that its builders pickle

    sys.exit(zero.main())

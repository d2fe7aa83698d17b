"""The eager gradient call's stream handoff on a GPU, under stress, against DDP every step.

``fsync.grad_and_value`` fills each bucket in the backward of the bucket's autograd node,
which autograd runs on the stream the call began on (the caller's) once that stream has
waited for every stream that produced one of the bucket's gradients; a starter thread
issues each complete bucket's collective on the caller's stream too (``fsync/_backward.py``,
``_Issuing``), so that the collective follows the copy in stream order. A collective issued
on any other stream does not fail: it sends half-written gradients. So these tests hold the
race wide open and compare every step with DDP, bit for bit (two ranks on the one GPU over
gloo; see ``tests/test_cuda.py``):

- the call (fsync's and DDP's) runs on a side stream of the caller's, and the forward pass,
  and so the gradients, on further side streams (one, or two branches with a stream each);
- after every layer, backward first queues milliseconds of GPU sleep on the producing
  stream (``_Queued``), so the CPU completes and issues buckets long before the GPU has
  written them; each run records whether the producing streams were still busy when the
  first bucket was issued;
- each check has teeth: the same run with the starter issuing on its thread's default
  stream instead of the caller's (a test-only patch of ``_Issuing.stream``) must differ
  from DDP, in both stream settings.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsync
from fsync import _backward
from tests import _cuda
from tests._cuda import needs_cuda
from tests._models import params_of
from tests._world import World

pytestmark = needs_cuda  # every test here

WIDTH, BATCH, STEPS = 1024, 128, 6
# GPU clock cycles of sleep (torch.cuda._sleep) before each layer's backward: about 3 ms
# at an H100's 1.6-2 GHz, against the microseconds the CPU takes to issue a bucket.
SLEEP = 5_000_000
TIMEOUT = 180


class _Queued(torch.autograd.Function):
    """The identity; its backward first queues ``cycles`` of sleep on the stream it runs on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cycles: int) -> torch.Tensor:
        ctx.cycles = cycles
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.cycles:
            torch.cuda._sleep(ctx.cycles)
        return grad, None


class _Branches(nn.Module):
    """Branches of square layers on one input, summed; each branch on its stream if given.

    Every layer is ``Linear``, GELU, then ``_Queued`` with its branch's sleep.
    """

    def __init__(self, depth: int, sleeps: tuple[int, ...]) -> None:
        super().__init__()
        self.sleeps = sleeps
        self.branches = nn.ModuleList(
            nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth)) for _ in sleeps
        )

    def forward(self, x: torch.Tensor, streams: list[Any] | None = None) -> torch.Tensor:
        total = None
        for k, branch in enumerate(self.branches):
            stream = None if streams is None else streams[k]
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # None: the current stream
                h = x
                for layer in branch:
                    h = _Queued.apply(nn.functional.gelu(layer(h)), self.sleeps[k])
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
                h.record_stream(torch.cuda.current_stream())  # read here, made there
            total = h if total is None else total + h
        assert total is not None
        return total


class _Setting(NamedTuple):
    """A model whose buckets its streams fill, and the bucket size that cuts it."""

    depth: int
    sleeps: tuple[int, ...]
    bucket_mb: float


SETTINGS = {
    # One branch of 8 layers on one side stream; 1 MiB buckets hold one 4 MiB layer each,
    # the first issued while seven layers are still queued behind sleeps.
    "one stream": _Setting(8, (SLEEP,), 1.0),
    # Two branches of 2 layers in one bucket, each branch on its own stream, one of them
    # sleeping: the bucket's node waits for both producers, the later one asleep while the
    # CPU has long issued the bucket.
    "two streams": _Setting(2, (0, 4 * SLEEP), 1000.0),
}
# How a run patches _Issuing, test-only: "" as shipped.
DEFAULT_STREAM = "issued on the starter's default stream"


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    return x.to(device), y.to(device)


def _on_rank_stress(setting: str, patch: str) -> dict:
    device = _cuda.device()
    rank = dist.get_rank()
    depth, sleeps, bucket_mb = SETTINGS[setting]
    torch.manual_seed(0)
    model = _Branches(depth, sleeps).to(device)
    streams = [torch.cuda.Stream(device) for _ in sleeps]
    ddp = _cuda.ddp(model, device)
    params = params_of(model)

    def loss_fn(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        out = torch.func.functional_call(model, params, (x,), {"streams": streams})
        return nn.functional.mse_loss(out, y)

    options = {"bucket_cap_mb": bucket_mb, "first_bucket_mb": bucket_mb}
    # The premise: on this rank alone (no hook: nothing read early), the gradients made on
    # the side streams are autograd's on the module, bit for bit.
    x, y = _batch(rank, 0, device)
    local = copy.deepcopy(model)
    nn.functional.mse_loss(local(x), y).backward()
    alone, _ = fsync.grad_and_value(loss_fn, hook=fsync.ops.noop(), **options)(params, (x, y))
    premise = all(torch.equal(alone[n], p.grad) for n, p in local.named_parameters())

    busy: list[bool] = []
    start, stream = _backward.Reducer.start, _backward._Issuing.stream

    def patched_start(reducer: Any, k: int, buffer: torch.Tensor) -> None:
        if k == 0:  # the first bucket is issued now: is backward still writing?
            busy.append(not all(s.query() for s in streams))
        start(reducer, k, buffer)

    _backward.Reducer.start = patched_start
    if patch == DEFAULT_STREAM:
        _backward._Issuing.stream = lambda issuing: contextlib.nullcontext()
    caller = torch.cuda.Stream(device)
    equal, worst = [], 0.0
    try:
        grad_fn = fsync.grad_and_value(loss_fn, **options)
        for step in range(STEPS):
            batch = _batch(rank, step, device)
            caller.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(caller):
                ddp.zero_grad(set_to_none=True)
                nn.functional.mse_loss(ddp(batch[0]), batch[1]).backward()
                grads, _ = grad_fn(params, batch)
            torch.cuda.current_stream(device).wait_stream(caller)
            expected = {n: p.grad for n, p in ddp.module.named_parameters()}
            equal.append(all(torch.equal(grads[n], g) for n, g in expected.items()))
            for n, g in expected.items():  # garbage read too early may hold NaNs: infinite
                diff = (grads[n].double() - g.double()).abs().max()
                worst = max(worst, float(diff.nan_to_num(nan=float("inf"))))
    finally:
        _backward.Reducer.start, _backward._Issuing.stream = start, stream
    plan = fsync.plan_buckets(params, **options)
    return {
        "setting": setting,
        "patch": patch or "as shipped",
        "layers": depth * len(sleeps),
        "buckets": len(plan.specs),
        "sleep_cycles": list(sleeps),
        "steps": STEPS,
        "equal": sum(equal),
        "busy": sum(busy),
        "max_diff": worst,
        "premise": premise,
    }


def _run(world: World, setting: str, patch: str) -> dict:
    reports = world.run(_on_rank_stress, setting, patch, timeout=TIMEOUT)
    merged = {
        **reports[0],
        "equal": min(r["equal"] for r in reports),
        "busy": min(r["busy"] for r in reports),
        "max_diff": max(r["max_diff"] for r in reports),
        "premise": all(r["premise"] for r in reports),
    }
    name = f"streams {setting}, {merged['patch']}".replace(" ", "_").replace(",", "")
    _cuda.report(name, merged)
    assert merged["premise"], merged  # else the comparisons below would test nothing
    return merged


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_buckets_issued_while_backward_writes_equal_ddp_every_step(world: World, setting):
    run = _run(world, setting, "")
    assert run["busy"] == STEPS, run  # the producing streams were busy at every first issue
    assert run["equal"] == STEPS, run


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_issued_on_another_stream_the_check_fails(world: World, setting):
    """The check has teeth: issued on a stream that did not fill them, buckets go out
    half-written."""
    run = _run(world, setting, DEFAULT_STREAM)
    assert run["equal"] < STEPS, run

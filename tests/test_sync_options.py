"""The DDP options of sync_grads/GradSync: unused parameters, uneven inputs, mixed precision.

Each is checked against DDP itself (find_unused_parameters, join) or against the
exact mean of the per-rank gradients gathered in the test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from fsync._comm import _recorder
from fsync._comm._recorder import Collective
from tests._models import func_loss, params_of, ref_batch, ref_loss, ref_model
from tests._numerics import assert_same_as_ddp, gathered
from tests._world import World

# --- unused parameters (find_unused_parameters) -------------------------------------------------


class Branchy(nn.Module):
    """A trunk every rank uses, a branch only rank 0 uses, and a layer nobody uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.only_rank0 = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + self.only_rank0(h)
        return self.head(h)


def _on_rank_unused():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ddp(x, rank == 0).sum().backward()
    expected = {n: p.grad for n, p in ddp.module.named_parameters()}

    local = copy.deepcopy(model)
    local(x, rank == 0).sum().backward()
    grads = {n: p.grad for n, p in local.named_parameters()}  # None where unused here
    sync = fsync.GradSync(find_unused=True)
    state = sync.init(params_of(model))
    synced, _ = sync(grads, state)
    parts = gathered(
        {
            n: torch.zeros_like(p) if g is None else g
            for (n, g), p in zip(grads.items(), model.parameters(), strict=True)
        }
    )
    for name, ref in expected.items():
        if ref is None:  # unused on every rank: DDP leaves .grad alone, fsync returns None
            assert name.startswith("never") and synced[name] is None, name
            continue
        assert_same_as_ddp(synced[name], ref, parts[name], name)
    assert synced["only_rank0.weight"] is not None  # used on rank 0 only: averaged

    # Without find_unused, DDP's semantics or an error on every rank: a leaf unused on
    # every rank comes back None; one unused on some ranks only is an error, naming it.
    plain = fsync.GradSync()
    unused_everywhere = {**grads, "only_rank0.weight": None, "only_rank0.bias": None}
    out, _ = plain(unused_everywhere, plain.init(params_of(model)))
    assert out["never.weight"] is None and out["only_rank0.weight"] is None
    assert torch.equal(out["trunk.weight"], synced["trunk.weight"])
    with pytest.raises(ValueError, match=r"leaf 'only_rank0.weight' has a gradient on rank 0 "):
        plain(grads, plain.init(params_of(model)))

    compiled = torch.compile(lambda g, st: sync(g, st), fullgraph=True)
    with pytest.raises(Exception, match=r"find_unused=True cannot run inside torch\.compile"):
        compiled(grads, state)


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_unused_parameters_as_ddp_find_unused(world: World):
    world.run(_on_rank_unused, timeout=300)


# --- uneven inputs (join) -----------------------------------------------------------------------


def _on_rank_join(divide_by):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = ref_model()
    steps = 2 + rank  # rank r has 2 + r batches
    ddp = DDP(copy.deepcopy(model))
    expected = []
    with ddp.join(divide_by_initial_world_size=divide_by == "world"):
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            ref_loss(ddp, ref_batch(rank, step)).backward()
            expected.append({n: p.grad.clone() for n, p in ddp.module.named_parameters()})

    grad_fn = torch.func.grad(func_loss(model))
    sync = fsync.GradSync(divide_by=divide_by)
    state = sync.init(params_of(model))
    for step in range(2 + world_size - 1):
        active = step < steps
        grads = grad_fn(params_of(model), ref_batch(rank, step)) if active else None
        synced, state = sync(grads, state, active=active)
        n_active = sum(step < 2 + r for r in range(world_size))
        divisor = world_size if divide_by == "world" else n_active
        parts = gathered(grads or {k: torch.zeros_like(v) for k, v in synced.items()})
        results = gathered(synced)
        for name in synced:
            # The inactive ranks receive the same result as the active ones.
            assert all(torch.equal(r, synced[name]) for r in results[name]), name
            if active:
                assert_same_as_ddp(synced[name], expected[step][name], parts[name], name, divisor)


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("divide_by", ["world", "active"])
def test_uneven_inputs_as_ddp_join(world: World, divide_by):
    world.run(_on_rank_join, divide_by)


def _on_rank_inactive_sync_grads():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grads = {"w": torch.full((4,), float(rank + 1))}
    active = rank != 0
    out = fsync.sync_grads(grads, active=active, divide_by="active")
    expected = sum(range(2, world_size + 1)) / (world_size - 1)
    # W = 3: (2 + 3) * 0.5, every term and partial sum exact whatever the order: bitwise.
    assert torch.equal(out["w"], torch.full((4,), expected))
    out = fsync.sync_grads(grads, active=active)  # divided by the world size
    # x * 1/W rounds 1/W and the product, the W - 1 additions once each, the float32
    # expected once: W + 2 roundings of positive terms, u = eps / 2 each (eps: room for
    # second-order terms).
    expected = sum(range(2, world_size + 1)) / world_size
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(
        out["w"], torch.full((4,), expected), rtol=(world_size + 2) * eps, atol=0
    )
    nobody = fsync.sync_grads(grads, active=False, divide_by="active")
    assert torch.equal(nobody["w"], torch.zeros(4))  # no contributor: zeros, not NaN


@pytest.mark.parametrize("world", [3], indirect=True)
def test_inactive_ranks_in_sync_grads(world: World):
    world.run(_on_rank_inactive_sync_grads)


def test_call_options_are_checked(single_rank):
    with pytest.raises(ValueError, match="divide_by must be 'world' or 'active'"):
        fsync.sync_grads({"w": torch.ones(1)}, divide_by="initial")
    with pytest.raises(TypeError, match="active must be a bool"):
        fsync.sync_grads({"w": torch.ones(1)}, active=1)
    with pytest.raises(TypeError, match="find_unused must be a bool"):
        fsync.GradSync(find_unused="yes")
    with pytest.raises(TypeError, match="reduce_dtype must be None or a floating point"):
        fsync.sync_grads({"w": torch.ones(1)}, reduce_dtype=torch.int32)


# --- mixed precision (reduce_dtype) -------------------------------------------------------------


def _assert_reduced_mean(out, parts, reduce_dtype, name):
    """``out`` is the mean of ``parts`` reduced in ``reduce_dtype``, returned in the parts' dtype.

    Two ranks: each term ``p * 0.5`` is exact and ``a + b`` rounds once, so the result
    is the exact mean (of the terms cast to ``reduce_dtype``) rounded to
    ``reduce_dtype``, then cast back: bitwise. More ranks, against the float64 mean:
    casting a term, scaling it and each of the W - 1 additions round once each in
    ``reduce_dtype`` (at most ``(W + 1) * eps / 2`` relative to sum|terms|; ``W * eps``
    leaves a factor 2 for second-order terms), and the cast back to the leaf's dtype
    rounds once more.
    """
    world_size = len(parts)
    dtype = parts[0].dtype
    assert out.dtype == dtype, name
    scale = 1.0 / world_size
    if world_size == 2:
        exact = torch.stack([p.to(reduce_dtype) * scale for p in parts]).sum(0)
        assert torch.equal(out, exact.to(dtype)), name
        return
    exact64 = torch.stack([p.double() * scale for p in parts]).sum(0)
    terms = torch.stack([p.double().abs() * scale for p in parts]).sum(0)
    reduced = world_size * torch.finfo(reduce_dtype).eps * terms
    bound = reduced + torch.finfo(dtype).eps * (exact64.abs() + reduced)
    diff = (out.double() - exact64).abs()
    assert torch.all(diff <= bound), (name, diff.max(), bound.max())


def _on_rank_reduce_dtype():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    grads = {
        "low": torch.randn(300, generator=g).to(torch.bfloat16),
        "half": torch.randn(7, 3, generator=g).to(torch.float16),
        "full": torch.randn(50, generator=g),
    }
    parts = gathered(grads)

    # bf16/fp16 gradients reduced in fp32: one fp32 bucket, results in their own dtype.
    up = fsync.sync_grads(grads, reduce_dtype=torch.float32)
    assert fsync.plan_buckets(grads, reduce_dtype=torch.float32).nbytes == ((300 + 21 + 50) * 4,)
    sync = fsync.GradSync(reduce_dtype=torch.float32)
    state = sync.init(grads)
    assert [spec.dtype for spec in sync.plan(state).specs] == [torch.float32]
    for _ in range(2):  # the same result on a later step (nothing kept between steps)
        up_gradsync, state = sync(grads, state)
        for name in grads:
            _assert_reduced_mean(up[name], parts[name], torch.float32, name)
            # The same plan and the same operations as sync_grads: the same bits.
            assert torch.equal(up_gradsync[name], up[name]), name

    # fp32 gradients reduced in bf16: the same as bf16 compression, then back to fp32.
    full = {"full": grads["full"]}
    down = fsync.sync_grads(full, reduce_dtype=torch.bfloat16)
    _assert_reduced_mean(down["full"], parts["full"], torch.bfloat16, "full")
    sync = fsync.GradSync(reduce_dtype=torch.bfloat16)
    down_gradsync, _ = sync(full, sync.init(full))
    assert torch.equal(down_gradsync["full"], down["full"])
    # Lower precision really went over the wire: half the bytes.
    stats = fsync.sync_stats(full, world_size=world_size)
    bf16_plan = fsync.plan_buckets(full, reduce_dtype=torch.bfloat16)
    assert fsync.sync_stats(bf16_plan, world_size=world_size).bytes_on_wire * 2 == (
        stats.bytes_on_wire
    )

    # Compiled, the cast is fused into pack and unpack and the result is the same.
    compiled = torch.compile(fsync.sync_grads, fullgraph=True)
    again = compiled(grads, reduce_dtype=torch.float32)
    assert all(torch.equal(again[k], up[k]) for k in grads)


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_reduce_dtype(world: World):
    world.run(_on_rank_reduce_dtype, timeout=300)


# --- the control collective (find_unused, divide_by="active") -----------------------------------


def _steps_recorded(params, grads, **options):
    """The collectives of two GradSync steps after init, recorded as if on two ranks."""
    recorder = _recorder.Recorder(2)
    sync = fsync.GradSync(group=recorder, **options)
    steps = []
    calls = recorder.calls
    state = sync.init(params)  # its plan check is not a step's
    for _ in range(2):
        start = len(calls)
        _, state = sync(grads, state)
        steps.append(calls[start:])
    buckets = [Collective("all_reduce", spec.dtype, spec.numel) for spec in sync.plan(state).specs]
    return steps, buckets


_AGREEMENT = Collective("all_reduce", torch.int64, 13, control=True)
_COUNTS = Collective("all_reduce", torch.int64, 3, control=True)


@pytest.mark.parametrize(
    ("options", "control"),
    [
        ({}, [_AGREEMENT, _COUNTS]),
        ({"find_unused": True}, [_AGREEMENT, _COUNTS]),
        ({"divide_by": "active"}, [_AGREEMENT, _COUNTS]),
        ({"find_unused": True, "divide_by": "active"}, [_AGREEMENT, _COUNTS]),
    ],
    ids=["world", "find_unused", "active", "both"],
)
def test_control_collective_only_when_needed(single_rank, options, control):
    # Recorded by fsync's comm module, the one place that calls torch.distributed.
    # Three tensor leaves (one unused on this rank) and a None leaf, in two dtypes.
    params = {
        "w": torch.zeros(64, 32),
        "b": torch.zeros(32),
        "frozen": None,
        "h": torch.zeros(8, dtype=torch.bfloat16),
    }
    grads = {**params, "w": torch.ones(64, 32), "b": None}
    steps, buckets = _steps_recorded(params, grads, **options)
    assert len(buckets) == 2
    # The agreement, then (a gradient being None on this rank, or find_unused) one int64
    # count per tensor leaf, before the buckets, every step; a step is nothing else.
    assert steps == [[*control, *buckets]] * 2


def test_options_stay_constants_when_dynamo_makes_numbers_symbolic(single_rank):
    """Two syncs with other bucket sizes through one compiled function (torch.compile's
    default dynamic=None): dynamo makes the float it saw change symbolic (automatic
    dynamic shapes), and no constant function takes a symbolic size. A GradSync's state is
    fitted to its plan with DDP's loop over the sizes traced (its comparisons guards), so
    each sync still plans and compiles."""
    grads = {"w": torch.ones(300), "v": torch.ones(300), "b": torch.ones(7)}

    def step(sync, state, grads):
        return sync(grads, state)

    compiled = torch.compile(step, fullgraph=True)
    for cap in (25.0, 0.001, 0.0005):
        sync = fsync.GradSync(bucket_cap_mb=cap, first_bucket_mb=cap)
        out, state = compiled(sync, sync.init(grads), grads)
        assert torch.equal(out["w"], grads["w"]) and int(state.step) == 1
        assert len(sync.plan(state).buckets) == (1 if cap == 25.0 else 2)

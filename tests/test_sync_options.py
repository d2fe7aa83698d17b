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

    # Without find_unused a None gradient is a zero gradient: same values, never None.
    plain, _ = (s := fsync.GradSync()).__call__(grads, s.init(params_of(model)))
    assert torch.count_nonzero(plain["never.weight"]) == 0
    assert torch.equal(plain["only_rank0.weight"], synced["only_rank0.weight"])

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
    assert torch.allclose(out["w"], torch.full((4,), expected))
    out = fsync.sync_grads(grads, active=active)  # divided by the world size
    assert torch.allclose(out["w"], torch.full((4,), sum(range(2, world_size + 1)) / world_size))
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


def _on_rank_reduce_dtype():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    grads = {
        "low": torch.randn(300, generator=g).to(torch.bfloat16),
        "half": torch.randn(7, 3, generator=g).to(torch.float16),
        "full": torch.randn(50, generator=g),
    }
    parts = gathered(grads)
    scale = 1.0 / world_size

    # bf16/fp16 gradients reduced in fp32: one fp32 bucket, results in their own dtype.
    up = fsync.sync_grads(grads, reduce_dtype=torch.float32)
    assert fsync.plan_buckets(grads, reduce_dtype=torch.float32).nbytes == ((300 + 21 + 50) * 4,)
    for name in grads:
        exact = torch.stack([p.float() * scale for p in parts[name]]).sum(0)
        assert up[name].dtype == grads[name].dtype
        if world_size == 2:  # one fp32 rounding of the sum, then the cast back: bitwise
            assert torch.equal(up[name], exact.to(grads[name].dtype)), name
        else:
            # Against the float64 mean: each fp32 term and the fp32 sum round (within
            # W * eps32 * sum|terms|), then the cast to the leaf's dtype rounds once more.
            exact64 = torch.stack([p.double() * scale for p in parts[name]]).sum(0)
            terms = torch.stack([p.double().abs() * scale for p in parts[name]]).sum(0)
            fp32 = world_size * torch.finfo(torch.float32).eps * terms
            bound = fp32 + torch.finfo(grads[name].dtype).eps * (exact64.abs() + fp32)
            assert torch.all((up[name].double() - exact64).abs() <= bound), name

    # fp32 gradients reduced in bf16: the same as bf16 compression, then back to fp32.
    down = fsync.sync_grads({"full": grads["full"]}, reduce_dtype=torch.bfloat16)
    compressed = torch.stack([p.to(torch.bfloat16) * scale for p in parts["full"]])
    assert down["full"].dtype == torch.float32
    if world_size == 2:  # a bf16 add of two bf16 terms is one rounding either way round
        assert torch.equal(down["full"], compressed.sum(0).float())
    # Lower precision really went over the wire: half the bytes.
    stats = fsync.sync_stats({"full": grads["full"]}, world_size=world_size)
    bf16_plan = fsync.plan_buckets({"full": grads["full"]}, reduce_dtype=torch.bfloat16)
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

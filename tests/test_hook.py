"""Hooks: the Hook pair, chain, SyncContext.divide and the allreduce hook's modes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsync
from fsync._pack import shard_numel
from tests._world import World


def _ctx(world_size=1, divisor=None, scatter=False, rank=0):
    plan = fsync.plan_buckets({"w": torch.zeros(5)})
    divisor = world_size if divisor is None else divisor
    return fsync.SyncContext(plan, plan.specs, None, rank, world_size, divisor, scatter)


def test_chain_threads_buckets_and_states_in_order():
    calls = []

    def counter(name, scale):
        def init(plan):
            return (torch.zeros(()),)

        def apply(buckets, state, ctx):
            calls.append(name)
            return [b * scale for b in buckets], (state[0] + 1,)

        return fsync.Hook(init, apply)

    hook = fsync.chain(counter("a", 2.0), counter("b", 3.0))
    state = hook.init(None)
    out, state = hook.apply([torch.ones(2)], state, _ctx())
    assert calls == ["a", "b"] and torch.equal(out[0], torch.full((2,), 6.0))
    assert [s[0].item() for s in state] == [1.0, 1.0]
    with pytest.raises(ValueError, match="chain of 2 hooks got a state of list"):
        hook.apply([torch.ones(2)], [(), ()], _ctx())
    assert fsync.chain().apply([torch.ones(1)], (), _ctx())[0][0].item() == 1.0


def test_chain_rejects_non_hooks():
    with pytest.raises(TypeError, match=r"hook is a function; expected an fsync\.Hook"):
        fsync.chain(fsync.ops.allreduce(), lambda b: b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_divide_is_ddp_scaling_for_int_and_tensor_divisors(dtype):
    x = torch.randn(1000, dtype=torch.float64).to(dtype)
    expected = torch.mul(x, 1.0 / 3)  # DDP: mul_out(bucket, grad, 1 / world_size)
    assert torch.equal(_ctx(3).divide(x), expected)
    assert torch.equal(_ctx(3, divisor=torch.tensor(3)).divide(x), expected)
    assert _ctx(1).divide(x) is x


def _on_rank_scatter():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plan = fsync.plan_buckets({"a": torch.zeros(7), "b": torch.zeros(2)})
    buckets = [torch.arange(9, dtype=torch.float32) * (rank + 1)]
    ctx = fsync.SyncContext(plan, plan.specs, None, rank, world_size, world_size, True)
    (shard,), _ = fsync.ops.allreduce().apply(buckets, (), ctx)
    full = torch.arange(9, dtype=torch.float32) * sum(range(1, world_size + 1)) / world_size
    n = shard_numel(9, world_size)
    expected = torch.nn.functional.pad(full, (0, n * world_size - 9))[rank * n : (rank + 1) * n]
    torch.testing.assert_close(shard, expected)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_allreduce_scatter_mode_returns_this_ranks_padded_shard(world: World):
    world.run(_on_rank_scatter)

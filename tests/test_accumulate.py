"""Gradient accumulation (DDP's no_sync) as accumulate + one sync, against DDP itself."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from tests._models import func_loss, params_of, ref_batch, ref_loss, ref_model
from tests._numerics import assert_same_as_ddp, gathered
from tests._world import World


def test_accumulate_adds_leafwise_and_keeps_none():
    a = {"w": torch.ones(2), "b": None, "c": torch.ones(1)}
    b = {"w": torch.full((2,), 2.0), "b": torch.ones(3), "c": None}
    total = fsync.accumulate(a, b)
    assert torch.equal(total["w"], torch.full((2,), 3.0))
    assert torch.equal(total["b"], torch.ones(3)) and torch.equal(total["c"], torch.ones(1))
    assert fsync.accumulate(None, b) is b
    # The inputs are untouched.
    assert torch.equal(a["w"], torch.ones(2)) and torch.equal(b["w"], torch.full((2,), 2.0))


def test_accumulate_rejects_other_trees():
    with pytest.raises(ValueError, match="accumulate got trees of different structure"):
        fsync.accumulate({"w": torch.ones(2)}, {"v": torch.ones(2)})
    with pytest.raises(ValueError, match=r"leaf 'w' is torch\.float32\[2\] in the total"):
        fsync.accumulate({"w": torch.ones(2)}, {"w": torch.ones(3)})


def _on_rank_no_sync(micro_batches):
    rank = dist.get_rank()
    model = ref_model()
    ddp = DDP(copy.deepcopy(model))
    with ddp.no_sync():
        for k in range(micro_batches - 1):
            ref_loss(ddp, ref_batch(rank, k)).backward()
    ref_loss(ddp, ref_batch(rank, micro_batches - 1)).backward()  # this one syncs
    expected = {n: p.grad for n, p in ddp.module.named_parameters()}

    grad_fn = torch.func.grad(func_loss(model))
    total = None
    for k in range(micro_batches):
        total = fsync.accumulate(total, grad_fn(params_of(model), ref_batch(rank, k)))
    synced = fsync.sync_grads(total)
    parts = gathered(total)
    for name, ref in expected.items():
        assert_same_as_ddp(synced[name], ref, parts[name], name)


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_equals_ddp_no_sync(world: World):
    world.run(_on_rank_no_sync, 3)

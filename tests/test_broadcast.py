"""broadcast and sync_buffers: DDP's start-up broadcast and broadcast_buffers, as functions."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from tests._numerics import gathered, summation_bound
from tests._world import World


def _model_with_buffers() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2)).to(
        memory_format=torch.channels_last
    )


def _on_rank_broadcast(src):
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank starts different
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 2))
    model = model.to(memory_format=torch.channels_last)
    model.train()(torch.randn(2, 3, 4, 4))  # running stats and num_batches_tracked move
    state = {n: t.detach() for n, t in model.state_dict().items()}
    before = copy.deepcopy(state)
    out = fsync.broadcast(state, src=src)
    reference = gathered(state)
    for name, value in out.items():
        assert torch.equal(value, reference[name][src]), name
        assert value.dtype == state[name].dtype and value.stride() == state[name].stride()
        assert not value.requires_grad
        assert torch.equal(state[name], before[name])  # the input is untouched
    assert out["1.num_batches_tracked"].dtype == torch.int64

    # DDP's constructor does the same to a module's parameters and buffers.
    ddp_model = copy.deepcopy(model)
    DDP(ddp_model)  # broadcasts from rank 0
    if src == 0:
        for name, value in ddp_model.state_dict().items():
            assert torch.equal(value, out[name]), name


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_gives_src_values(world: World, src):
    world.run(_on_rank_broadcast, src)


def _on_rank_sync_buffers():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    bn = nn.BatchNorm1d(3)
    bn.train()(torch.randn(8, 3, generator=torch.Generator().manual_seed(rank)) + rank)
    buffers = dict(bn.named_buffers())
    parts = gathered(buffers)
    broadcast = fsync.sync_buffers(buffers)
    assert all(torch.equal(broadcast[n], parts[n][0]) for n in buffers)
    mean = fsync.sync_buffers(buffers, mode="mean", src=world_size - 1)
    for name in ("running_mean", "running_var"):
        expected = torch.stack([p * (1.0 / world_size) for p in parts[name]]).sum(0)
        # The same terms summed in another order: within (W - 1) * eps * sum|terms|,
        # elementwise (summation_bound), whatever the signs.
        diff = (mean[name] - expected).abs()
        assert torch.all(diff <= summation_bound(parts[name], world_size)), (name, diff.max())
    assert torch.equal(mean["num_batches_tracked"], parts["num_batches_tracked"][-1])
    with pytest.raises(ValueError, match="mode must be 'broadcast' or 'mean'"):
        fsync.sync_buffers(buffers, mode="max")


@pytest.mark.parametrize("world", [3], indirect=True)
def test_sync_buffers(world: World):
    world.run(_on_rank_sync_buffers)


def _on_rank_broadcast_errors():
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"src must be a rank of the group, 0 to 1; got 2"):
        fsync.broadcast({"w": torch.ones(1)}, src=2)
    with pytest.raises(TypeError, match=r"broadcast leaf 'w' is sparse"):
        fsync.broadcast({"w": torch.ones(2).to_sparse()})
    with pytest.raises(TypeError, match=r"broadcast leaf 'lr' is a float"):
        fsync.broadcast({"w": torch.ones(1), "lr": 0.1})
    tree = {"w": torch.ones(2 + rank)}
    with pytest.raises(ValueError, match=r"trees passed to fsync\.broadcast differ across ranks"):
        fsync.broadcast(tree)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_broadcast_errors(world: World):
    world.run(_on_rank_broadcast_errors)

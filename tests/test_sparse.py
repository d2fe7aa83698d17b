"""Sparse gradients (nn.Embedding(sparse=True)) against DDP with a sparse embedding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from tests._numerics import assert_same_as_ddp, gathered
from tests._world import World


class SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(tokens).mean(1))


def _on_rank_sparse():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SparseModel()
    # Overlapping and distinct rows across ranks, repeated rows within a rank.
    tokens = torch.randint(0, 12, (5, 3), generator=torch.Generator().manual_seed(rank))
    ddp = DDP(copy.deepcopy(model))
    ddp(tokens).sum().backward()
    expected = {n: p.grad for n, p in ddp.module.named_parameters()}

    local = copy.deepcopy(model)
    local(tokens).sum().backward()
    grads = {n: p.grad for n, p in local.named_parameters()}
    assert grads["emb.weight"].is_sparse
    plan = fsync.plan_buckets(grads)
    assert [s.sparse for s in plan.specs] == [False, True]  # its own bucket, last in order
    synced = fsync.sync_grads(grads)
    assert synced["emb.weight"].is_sparse and synced["emb.weight"].is_coalesced()
    dense = {n: g.to_dense() for n, g in grads.items()}
    parts = gathered(dense)
    for name, ref in expected.items():
        assert_same_as_ddp(synced[name].to_dense(), ref.to_dense(), parts[name], name)

    # A rank may have no gradient at all for the embedding: with find_unused (DDP's
    # find_unused_parameters) the others' entries are averaged with nothing from it.
    sync = fsync.GradSync(find_unused=True)
    state = sync.init(grads)
    empty = {**grads, "emb.weight": None} if rank == 0 else grads
    out, _ = sync(empty, state)
    kept = {**dense, "emb.weight": torch.zeros(20, 4)} if rank == 0 else dense
    emb_parts = gathered(kept)["emb.weight"]
    world_size = dist.get_world_size()
    expected_emb = torch.stack(emb_parts).sum(0) / world_size
    # A row's d occurrences on a rank are summed (coalesce here, to_dense there, maybe in
    # other orders: d - 1 roundings each), divided by W (1) and summed over ranks (W - 1):
    # within (d + W - 1) * eps * sum|rank sums| / W of each other, all occurrences of a row
    # on a rank being the same vector (the embedding's gradient is fc's column sum / 3).
    d = tokens.numel()
    terms = torch.stack([p.abs() for p in emb_parts]).sum(0) / world_size
    diff = (out["emb.weight"].to_dense() - expected_emb).abs()
    assert torch.all(diff <= (d + world_size - 1) * torch.finfo(diff.dtype).eps * terms), diff.max()

    # Sparse leaves sync eagerly only: torch.compile itself refuses sparse tensors, and
    # a plan with a sparse leaf used in a trace (no sparse input) gets fsync's error.
    with pytest.raises(Exception, match=r"torch\.compile does not support sparse Tensors"):
        torch.compile(fsync.sync_grads, fullgraph=True)(grads)
    inactive = torch.compile(lambda st: sync(None, st, active=False), fullgraph=True)
    with pytest.raises(Exception, match=r"sparse gradient 'emb\.weight' cannot be synced inside"):
        inactive(state)


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_sparse_embedding_as_ddp(world: World):
    world.run(_on_rank_sparse, timeout=300)

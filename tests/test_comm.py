"""Groups: the default group, new_group subsets, DeviceMesh dimensions, one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsync
from fsync import _comm
from tests._world import World


def _on_rank_mesh():
    rank = dist.get_rank()
    # Ranks 0..3 as a 2 x 2 mesh: dim 0 ("dp") pairs {0, 2} and {1, 3}.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    grads = {"w": torch.full((3, 2), float(rank)), "b": torch.full((2,), float(rank) * 10)}
    partner = (rank + 2) % 4
    for group in ((mesh, 0), mesh["dp"]):
        out = fsync.sync_grads(grads, group=group)
        assert torch.equal(out["w"], torch.full((3, 2), (rank + partner) / 2)), group
        assert torch.equal(out["b"], torch.full((2,), (rank + partner) * 5.0)), group
    sync = fsync.GradSync(group=(mesh, 1))
    out, _ = sync(grads, sync.init(grads))
    tp_partner = rank ^ 1  # dim 1 pairs {0, 1} and {2, 3}
    assert torch.equal(out["w"], torch.full((3, 2), (rank + tp_partner) / 2))
    compiled = torch.compile(fsync.sync_grads, fullgraph=True)
    out = compiled(grads, group=(mesh, 0))
    assert torch.equal(out["w"], torch.full((3, 2), (rank + partner) / 2))
    # A 2-D mesh is a hierarchical reduce (tests/test_hierarchy.py); it needs its dims' names,
    # and a mesh of more dims needs the data-parallel one named.
    unnamed = init_device_mesh("cpu", (2, 2))
    with pytest.raises(ValueError, match="a 2-D DeviceMesh needs mesh_dim_names"):
        fsync.sync_grads(grads, group=unnamed)
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    with pytest.raises(ValueError, match=r"a 3-D DeviceMesh needs a dim: pass group=\(mesh, dim\)"):
        fsync.sync_grads(grads, group=cube)
    with pytest.raises(ValueError, match="mesh dim 2 is out of range for a 2-D DeviceMesh"):
        fsync.sync_grads(grads, group=(mesh, 2))
    with pytest.raises(TypeError, match=r"group tuple must be \(DeviceMesh, mesh_dim\)"):
        fsync.sync_grads(grads, group=(mesh, "dp"))


@pytest.mark.parametrize("world", [4], indirect=True)
def test_device_mesh_dimension(world: World):
    world.run(_on_rank_mesh, timeout=300)


def _on_rank_subgroup():
    rank = dist.get_rank()
    members = [0, 2]
    group = dist.new_group(members)
    grads = {"w": torch.full((5,), float(rank))}
    if rank in members:
        out = fsync.sync_grads(grads, group=group)
        assert torch.equal(out["w"], torch.full((5,), 1.0))  # mean of ranks 0 and 2
        sync = fsync.GradSync(group=group)
        out, _ = sync(grads, sync.init(grads))
        assert torch.equal(out["w"], torch.full((5,), 1.0))
        params = fsync.broadcast(grads, src=1, group=group)  # src counts within the group
        assert torch.equal(params["w"], torch.full((5,), 2.0))


@pytest.mark.parametrize("world", [3], indirect=True)
def test_new_group_subset(world: World):
    world.run(_on_rank_subgroup)


def test_group_must_be_initialised(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        fsync.sync_grads({"w": torch.ones(1)})


def _on_rank_gloo_compositions():
    # On gloo, fsync's reduce-scatter is an all-to-all plus a local sum and its all-gather
    # one broadcast per rank (see _comm.on_gloo): checked against c10d's own collectives.
    rank, n = dist.get_rank(), dist.get_world_size()
    assert _comm.on_gloo(None)
    gen = torch.Generator().manual_seed(rank)
    compiled_rs = torch.compile(_comm.reduce_scatter, fullgraph=True)
    compiled_ag = torch.compile(_comm.all_gather, fullgraph=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n * 5, 3, generator=gen).to(dtype)
        before = x.clone()
        ref = torch.empty(5, 3, dtype=dtype)
        dist.reduce_scatter(ref, list(x.chunk(n)))
        for rs in (_comm.reduce_scatter, compiled_rs):
            # Two ranks: a + b is one rounding in either order, the same bits as gloo's.
            # Three: both add three terms in some order; each partial sum rounds once
            # more than the exact sum, so they differ by at most 2 * (n - 1) ulps of
            # the sum of magnitudes (gamma_{n-1} bound, both ways).
            out = _comm.wait(rs(x, "sum", None))
            if n <= 2:
                assert torch.equal(out, ref), (dtype, rs)
            else:
                magnitude = _comm.wait(_comm.all_reduce(x.abs().float(), "sum", None))[
                    rank * 5 : (rank + 1) * 5
                ]
                eps = torch.finfo(dtype).eps
                bound = 2 * (n - 1) * eps * magnitude + torch.finfo(dtype).tiny
                assert ((out.float() - ref.float()).abs() <= bound).all(), (dtype, rs)
        assert torch.equal(x, before)  # the input is left alone
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
        for ag in (_comm.all_gather, compiled_ag):
            assert torch.equal(_comm.wait(ag(x, None)), torch.cat(parts)), (dtype, ag)
    # A scalar gathers into a vector, as c10d's all-gather does.
    scalar = torch.tensor(float(rank))
    assert torch.equal(_comm.wait(_comm.all_gather(scalar, None)), torch.arange(n).float())


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_gloo_reduce_scatter_and_all_gather_match_c10d(world: World):
    world.run(_on_rank_gloo_compositions)

"""The hierarchical reduce on a 2-D DeviceMesh, and DeferredSync, on a 2 x 2 gloo mesh.

Four ranks make a mesh of 2 nodes (dim 0) of 2 local ranks (dim 1). Every result is
checked against the exact mean of all ranks' gradients (computed in float64 from
every rank's copy), every rank must hold the same bits, and inputs stay untouched.
Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsync
from fsync._hierarchy import shard_plan
from fsync._pack import shard_numel
from tests._numerics import AGREEMENT, gamma, linear_loss
from tests._world import World

NODES, LOCAL = 2, 2
W = NODES * LOCAL
# Small buckets: the tree below spans three, [d], [c] and [b, a].
SMALL = {"bucket_cap_mb": 0.00005, "first_bucket_mb": 0.000001}


def _mesh():
    return init_device_mesh("cpu", (NODES, LOCAL), mesh_dim_names=("node", "local"))


def _grads(rank: int, dtype: torch.dtype, micro: int = 0) -> dict:
    """Odd leaf sizes (none divides by LOCAL except by chance), a None leaf, two dtypes."""
    g = torch.Generator().manual_seed(100 * rank + micro)
    return {
        "a": torch.randn(7, 5, generator=g).to(dtype),
        "b": torch.randn(3, generator=g).to(dtype),
        "none": None,
        "c": torch.randn(13, 3, generator=g).to(dtype),
        "d": torch.randn(1, generator=g).to(dtype),
    }


def _everyone(tree: dict) -> dict:
    """{name: [rank 0's tensor, ...]} of a dict of tensors (None leaves left out)."""
    out = {}
    for name, t in tree.items():
        if t is None:
            continue
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        out[name] = parts
    return out


def _check_mean(out: dict, parts: dict, bound_of) -> None:
    """``out`` within ``bound_of(sum |g|)`` of the exact mean, and the same bits everywhere."""
    for name, ranks in parts.items():
        exact = torch.stack([p.double() for p in ranks]).sum(0) / len(ranks)
        magnitude = torch.stack([p.double().abs() for p in ranks]).sum(0) / len(ranks)
        diff = (out[name].double() - exact).abs()
        assert out[name].dtype == ranks[0].dtype, name
        assert torch.all(diff <= bound_of(magnitude)), (name, diff.max().item())
        everyone = [torch.empty_like(out[name]) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, out[name])
        assert all(torch.equal(e, out[name]) for e in everyone), f"{name}: ranks differ"


def _hierarchical_bound(dtype: torch.dtype):
    # Node sums (LOCAL - 1 additions), the product by 1/W (exact for W = 4, one rounding
    # in general) and the sum across nodes (NODES - 1 additions): every element goes
    # through at most W roundings, each relative to a partial sum bounded by sum |g|;
    # Higham's gamma_W times sum |g| = W * mean |g| bounds the error of the mean.
    return lambda mean_abs: gamma(W, dtype) * mean_abs


def _on_rank_sync(dtype):
    mesh = _mesh()
    rank = dist.get_rank()
    grads = _grads(rank, dtype)
    before = {k: None if v is None else v.clone() for k, v in grads.items()}
    parts = _everyone(grads)

    out = fsync.sync_grads(grads, group=mesh, **SMALL)
    assert len(fsync.plan_buckets(grads, **SMALL).buckets) >= 3
    assert out["none"] is None
    _check_mean(out, parts, _hierarchical_bound(dtype))

    sync = fsync.GradSync(group=mesh, **SMALL)
    state = sync.init(grads)
    for _ in range(2):
        again, state = sync(grads, state)
        for name in parts:  # the same path as sync_grads: the same bits
            assert torch.equal(again[name], out[name]), name

    for name, value in grads.items():  # inputs untouched
        assert (value is None and before[name] is None) or torch.equal(value, before[name])


@pytest.mark.parametrize("world", [4], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hierarchical_mean_equals_the_exact_mean_on_every_rank(world: World, dtype):
    world.run(_on_rank_sync, dtype, timeout=300)


def _on_rank_cross_node_hooks():
    mesh = _mesh()
    rank = dist.get_rank()
    grads = _grads(rank, torch.float32)
    parts = _everyone(grads)

    # bf16 across nodes, full precision within: the node's fp32 sum is rounded to bf16
    # once, scaled and summed across NODES in bf16 (NODES + 1 roundings of bf16, relative
    # to sums bounded by sum |g|), after LOCAL - 1 fp32 additions within the node.
    sync = fsync.GradSync(group=mesh, hook=fsync.ops.bf16_compress(), **SMALL)
    state = sync.init(grads)
    out, state = sync(grads, state)
    bf16 = gamma(NODES + 1, torch.bfloat16) + gamma(LOCAL, torch.float32)
    _check_mean(out, parts, lambda mean_abs: W * bf16 * mean_abs)

    # PowerSGD across nodes keeps its state for the shards: the plan its init sees is the
    # shards' plan, one flat leaf of ceil(numel / LOCAL) elements per bucket.
    grads = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(rank))}
    plan = fsync.plan_buckets(grads)
    psgd = fsync.GradSync(group=mesh, hook=fsync.ops.batched_powersgd(1, start_step=0))
    state = psgd.init(grads)
    assert int(state.hook.fingerprint) == shard_plan(plan, LOCAL).fingerprint
    # The shard, 2048 elements, is compressed as a square of side ceil(sqrt(2048)) = 46:
    # error feedback for 46 * 46 elements, where the whole bucket would need 64 * 64.
    assert [e.numel() for e in state.hook.error] == [46 * 46]
    for _ in range(2):
        out, state = psgd(grads, state)
    assert state.hook.error[0].abs().sum() > 0  # rank 1 of a random matrix loses something
    everyone = [torch.empty_like(out["w"]) for _ in range(W)]
    dist.all_gather(everyone, out["w"])
    assert all(torch.equal(e, out["w"]) for e in everyone)  # lossy, but the same everywhere


def _on_rank_disagreement(node_differs: bool):
    mesh = _mesh()
    rank = dist.get_rank()
    odd = rank == (2 if node_differs else 1)  # rank 2 is on the other node than rank 0
    grads = {"w": torch.ones(5 if odd else 4)}
    with pytest.raises(ValueError, match="leaf 'w' has"):
        fsync.sync_grads(grads, group=mesh)
    # A rank that skipped a micro-batch is caught before its collectives pair wrongly.
    sync = fsync.DeferredSync(group=mesh)
    state = sync.init({"w": torch.ones(4)})
    state = sync.add({"w": torch.ones(4)}, state)

    def step_end(state):  # the odd rank finishes while the others add a second micro-batch
        return sync.finish(state if odd else sync.add({"w": torch.ones(4)}, state))

    with pytest.raises(ValueError, match=r"deferred: add on rank 0 but .* deferred: finish on"):
        step_end(state)
    # And a hook that differs from one node to the other.
    hook = fsync.ops.bf16_compress() if odd else None
    with pytest.raises(ValueError, match="sync options differ: hook"):
        fsync.sync_grads({"w": torch.ones(4)}, group=mesh, hook=hook)


@pytest.mark.parametrize("world", [4], indirect=True)
def test_cross_node_hooks_and_every_disagreement_is_an_error_everywhere(world: World):
    world.run(_on_rank_cross_node_hooks, timeout=300)
    world.run(_on_rank_disagreement, True, timeout=300)
    world.run(_on_rank_disagreement, False, timeout=300)


def _on_rank_default_buckets_on_a_mesh():
    """No bucket size given: 4 MiB buckets on the 2-D mesh, DDP's 25 MiB on a flat group."""
    mesh = _mesh()
    rank = dist.get_rank()
    tree = {f"l{i}": torch.full((1 << 18,), float(rank)) for i in range(12)}  # 12 x 1 MiB
    on_mesh, flat = fsync.plan_buckets(tree, bucket_cap_mb=4.0), fsync.plan_buckets(tree)
    assert len(on_mesh.specs) == 4 and len(flat.specs) == 2  # [1 MiB, 4, 4, 3] and [1, 11]
    for sync in (fsync.GradSync(group=mesh), fsync.DeferredSync(group=mesh)):
        assert sync.plan(sync.init(tree)) == on_mesh, type(sync).__name__
    for sync in (fsync.GradSync(), fsync.GradSync(group=mesh, bucket_cap_mb=25.0)):
        assert sync.plan(sync.init(tree)) == flat
    step = fsync.ops.zero(fsync.optim.sgd(0.1), group=mesh)
    assert step.layout(step.init(tree)).plan == on_mesh
    assert fsync.sync_stats(tree, world_size=(2, 2)).buckets == 4
    assert fsync.sync_stats(tree, world_size=4).buckets == 2
    # The mean of 0, 1, 2 and 3, exact in float32 whatever the buckets.
    out = fsync.sync_grads(tree, group=mesh)
    assert all(torch.equal(g, torch.full_like(g, 1.5)) for g in out.values())


@pytest.mark.parametrize("world", [4], indirect=True)
def test_a_mesh_plans_smaller_buckets_unless_told(world: World):
    world.run(_on_rank_default_buckets_on_a_mesh, timeout=300)


def _on_rank_deferred(dtype, k):
    mesh = _mesh()
    rank = dist.get_rank()
    micro = [_grads(rank, dtype, m) for m in range(k)]
    before = [{n: None if v is None else v.clone() for n, v in g.items()} for g in micro]
    everyone = [_everyone(g) for g in micro]
    parts = {name: [p for e in everyone for p in e[name]] for name in everyone[0]}

    sync = fsync.DeferredSync(group=mesh, **SMALL)
    state = sync.init(micro[0])
    plan = sync.plan(state)
    # The accumulated state is 1/LOCAL of the gradients (each bucket padded to LOCAL shards).
    assert [s.numel() for s in state.shards] == [shard_numel(s.numel, LOCAL) for s in plan.specs]
    for step in range(2):
        for g in micro:
            state = sync.add(g, state)
        held = [s.clone() for s in state.shards]
        out, new_state = sync.finish(state)
        assert all(torch.equal(a, b) for a, b in zip(held, state.shards, strict=True))
        state = new_state
        assert int(state.micro) == 0 and int(state.step) == (k + 1) * (step + 1)
        # k * W gradients: node sums of k * LOCAL terms, the product by 1/(k W) and the sum
        # across NODES: at most k * W + 1 roundings on any element's path.
        _check_mean(out, parts, lambda mean_abs: gamma(k * W + 1, dtype) * mean_abs)
        assert out["none"] is None
    for g, b in zip(micro, before, strict=True):
        for name, value in g.items():
            assert (value is None and b[name] is None) or torch.equal(value, b[name])
    with pytest.raises(ValueError, match="no micro-batch added"):
        sync.finish(state)


@pytest.mark.parametrize("world", [4], indirect=True)
@pytest.mark.parametrize(("dtype", "k"), [(torch.float32, 3), (torch.bfloat16, 2)])
def test_deferred_sync_is_the_mean_over_ranks_and_micro_batches(world: World, dtype, k):
    world.run(_on_rank_deferred, dtype, k, timeout=300)


def _on_rank_deferred_1d(k):
    # A 1-D group: every rank a node of its own, and DeferredSync is DDP's no_sync.
    micro = [_grads(dist.get_rank(), torch.float32, m) for m in range(k)]
    everyone = [_everyone(g) for g in micro]
    parts = {name: [p for e in everyone for p in e[name]] for name in everyone[0]}
    sync = fsync.DeferredSync()
    state = sync.init(micro[0])
    assert [s.numel() for s in state.shards] == [s.numel for s in sync.plan(state).specs]
    for g in micro:
        state = sync.add(g, state)
    out, _ = sync.finish(state)
    # The local sum (k - 1 additions), the product by 1/(k W) (two roundings: the factor
    # and the product) and W - 1 additions across ranks.
    _check_mean(out, parts, lambda mean_abs: gamma(k * W, torch.float32) * mean_abs)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_deferred_sync_on_a_1d_group_is_no_sync(world: World):
    world.run(_on_rank_deferred_1d, 3, timeout=300)


# --- what goes on the wire -----------------------------------------------------------------


def test_cross_node_bytes_are_one_local_th_of_ddps():
    tree = {"w": torch.zeros(1024, 64), "b": torch.zeros(64), "v": torch.zeros(4096)}
    options = {"bucket_cap_mb": 0.1, "first_bucket_mb": 0.1}
    ddp = fsync.sync_stats(tree, world_size=8, **options)
    for local in (2, 4):
        mesh = fsync.sync_stats(tree, world_size=(8 // local, local), **options)
        assert mesh.mesh_shape == (8 // local, local) and mesh.world_size == 8
        assert mesh.bytes_on(0) * local == ddp.bytes_on_wire  # every bucket divides by 4
        assert [c.op for c in mesh.collectives_on(0)] == ["all_reduce"] * ddp.buckets
        # Within: the whole bucket into the reduce-scatter, this rank's shard into the
        # all-gather.
        assert mesh.bytes_on(1) == ddp.bytes_on_wire + ddp.bytes_on_wire // local
        assert mesh.control == ddp.control == (fsync._comm._recorder.Collective(*AGREEMENT, True),)


def test_buckets_cross_nodes_while_others_are_reduced_within():
    """The stages overlap: bucket k crosses while k + 1 is reduce-scattered and k - 1 gathered.

    The recorded order of the collectives is what every rank issues (sync_stats runs
    the reduce itself over a recording group): every reduce-scatter first (each starts
    as soon as its bucket is packed), then each bucket's crossing, the gather of the
    bucket before the previous one following every new crossing; a bucket's gather is
    never issued before its own crossing. A deferred finish crosses its held shards so.
    """
    tree = {
        "a": torch.zeros(1000),
        "b": torch.zeros(1000),
        "c": torch.zeros(1000),
        "d": torch.zeros(1000),
    }
    options = {"bucket_cap_mb": 0.003, "first_bucket_mb": 0.003}  # a bucket per leaf
    stats = fsync.sync_stats(tree, world_size=(2, 2), **options)
    assert stats.buckets == 4
    within, crossed, gathered = ("reduce_scatter", 1), ("all_reduce", 0), ("all_gather", 1)
    order = [(c.op, c.dim) for c in stats.collectives]
    assert (
        order
        == [within] * 4 + [crossed, crossed, gathered, crossed, gathered, crossed] + [gathered] * 2
    ), order
    deferred = fsync.sync_stats(tree, world_size=(2, 2), micro_batches=2, **options)
    finish = [(c.op, c.dim) for c in deferred.collectives][8:]  # after the 2 x 4 adds
    assert finish == [crossed, crossed, gathered, crossed, gathered, crossed] + [gathered] * 2


def test_cross_node_bytes_of_odd_buckets_are_their_padded_shards():
    tree = {"a": torch.zeros(7, 5), "b": torch.zeros(3)}
    plan = fsync.plan_buckets(tree, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    stats = fsync.sync_stats(plan, world_size=(3, 4), hook=fsync.ops.bf16_compress())
    # bf16 across nodes: two bytes per element of each padded shard; fp32 within.
    assert stats.bytes_on(0) == sum(2 * shard_numel(s.numel, 4) for s in plan.specs)
    assert [c.dtype for c in stats.collectives_on(1)] == [torch.float32] * 2 * len(plan.specs)
    assert "a 3x4 mesh" in str(stats)


def test_deferred_cross_node_bytes_do_not_grow_with_micro_batches():
    tree = {"w": torch.zeros(1024, 64), "b": torch.zeros(64)}
    one = fsync.sync_stats(tree, world_size=(2, 4))
    steps = {k: fsync.sync_stats(tree, world_size=(2, 4), micro_batches=k) for k in (1, 2, 8)}
    for k, stats in steps.items():
        assert stats.bytes_on(0) == one.bytes_on(0)
        rs = one.collectives_on(1)[: one.buckets]
        # k reduce-scatters of every bucket within the node, one all-gather per bucket.
        assert stats.collectives_on(1)[: k * one.buckets] == rs * k
        assert len(stats.control) == k + 1  # the ranks agree at every add and the finish
    # no_sync on a 1-D group: everything crosses, once per step whatever k.
    flat = [fsync.sync_stats(tree, world_size=8, micro_batches=k).bytes_on_wire for k in (1, 8)]
    assert flat[0] == flat[1] == fsync.sync_stats(tree, world_size=8).bytes_on_wire


def test_world_size_and_micro_batches_are_checked():
    tree = {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"a pair \(nodes, local\)"):
        fsync.sync_stats(tree, world_size=(2, 0))
    with pytest.raises(ValueError, match="micro_batches must be an int >= 0"):
        fsync.sync_stats(tree, micro_batches=-1)
    with pytest.raises(ValueError, match="find_unused and"):
        fsync.DeferredSync(find_unused=True)


# --- compiled, and the ZeRO step ----------------------------------------------------------


def _on_rank_compiled():
    mesh = _mesh()
    rank = dist.get_rank()
    # One bucket of the default size (odd sizes, a None leaf): compile time grows with the
    # number of buckets, and the eager tests cover several.
    grads = [_grads(rank, torch.float32, m) for m in range(2)]
    params = {n: None if g is None else torch.zeros_like(g) for n, g in grads[0].items()}
    sync = fsync.GradSync(group=mesh, hook=fsync.ops.bf16_compress())
    deferred = fsync.DeferredSync(group=mesh)
    zero = fsync.ops.zero(fsync.optim.sgd(1.0), group=mesh)

    def step(micro, sync_state, deferred_state, zero_state):
        plain = fsync.sync_grads(micro[0], group=mesh)
        compressed, sync_state = sync(micro[0], sync_state)
        for g in micro:
            deferred_state = deferred.add(g, deferred_state)
        accumulated, deferred_state = deferred.finish(deferred_state)
        updated, zero_state = zero(params, micro[0], zero_state)
        return plain, compressed, accumulated, updated, (sync_state, deferred_state, zero_state)

    compiled = fsync.compile(step)
    states = (sync.init(grads[0]), deferred.init(grads[0]), zero.init(params))
    eager_states = states
    for s in range(2):  # the second step runs the same graph: tensor values changed only
        with torch._dynamo.config.patch(error_on_recompile=s > 0):
            *out, states = compiled(grads, *states)
        *ref, eager_states = step(grads, *eager_states)
        # The same collectives on the same bytes, the same elementwise arithmetic: the
        # compiled step gives the eager step's bits.
        for got, want in zip(out, ref, strict=True):
            for name, value in want.items():
                assert (value is None and got[name] is None) or torch.equal(got[name], value)
        assert [int(state.step) for state in states] == [s + 1, 3 * (s + 1), s + 1]
    parts = _everyone(grads[0])
    _check_mean(out[0], parts, _hierarchical_bound(torch.float32))


@pytest.mark.parametrize("world", [4], indirect=True)
def test_compiled_hierarchical_sync_deferred_sync_and_zero_equal_eager(world: World):
    world.run(_on_rank_compiled, timeout=500)


def _on_rank_zero():
    mesh = _mesh()
    grads = _grads(dist.get_rank(), torch.float32)
    params = {n: None if g is None else torch.zeros_like(g) for n, g in grads.items()}
    parts = _everyone(grads)
    for shard_buckets in (True, False):
        step = fsync.ops.zero(
            fsync.optim.sgd(1.0), shard_buckets=shard_buckets, group=mesh, **SMALL
        )
        new, state = step(params, grads, step.init(params))
        assert int(state.step) == 1
        # The overlapped call over a loss whose gradient is ``grads``, exactly: the same bits
        # (on a mesh it reduces every bucket before the first update).
        (overlapped, _), o_state = step.value_and_step(linear_loss)(
            step.init(params), params, grads
        )
        assert int(o_state.step) == 1
        assert all(
            (a is None and b is None) or torch.equal(a, b)
            for a, b in zip(overlapped.values(), new.values(), strict=True)
        )
        # SGD with lr 1 from zeros: the parameters are minus the synced gradients (a
        # negation and a subtraction from zero are exact).
        _check_mean(
            {n: -p for n, p in new.items() if p is not None},
            parts,
            _hierarchical_bound(torch.float32),
        )


@pytest.mark.parametrize("world", [4], indirect=True)
def test_zero_step_on_a_mesh_updates_with_the_hierarchical_mean(world: World):
    world.run(_on_rank_zero, timeout=300)

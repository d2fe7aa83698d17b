"""fsync.diloco against torch's PeriodicModelAverager and an outer torch.optim.SGD by hand.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`. Tolerances
are derived where they are used, with ``eps = torch.finfo(dtype).eps`` (twice
the unit roundoff ``u``, which leaves room for second-order terms).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.device_mesh import init_device_mesh

import fsync
from fsync._comm import Recorder
from tests._models import params_of, ref_batch, ref_loss, ref_model
from tests._numerics import AGREEMENT, gamma, gathered
from tests._world import World

H = 3  # inner steps between syncs
ROUNDS = 3

# Each leaf in a bucket of its own: the reference all-reduces leaf by leaf, so both
# reduce the same bytes in buffers of the same sizes and gloo sums them in the same order.
ONE_LEAF_PER_BUCKET = {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}


def _moved(params: dict[str, torch.Tensor], rank: int, step: int) -> dict[str, torch.Tensor]:
    """``params`` after a pretend inner step: a different move on every rank and step."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return {k: p - 0.1 * torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()}


def _mean_abs(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([p.double().abs() for p in parts]).mean(0)


# --- local SGD: PeriodicModelAverager ------------------------------------------------------


def _on_rank_local_sgd_vs_averager():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = ref_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    averager = PeriodicModelAverager(period=H, warmup_steps=H - 1)
    local_sgd = fsync.diloco(H, fsync.optim.sgd(1.0))
    state = local_sgd.init(params_of(model))
    eps = torch.finfo(torch.float32).eps
    syncs = 0
    # The reference drives: torch.optim steps the model, the averager averages it; diloco
    # gets the same parameters at every call and must give what the averager made.
    for step in range(ROUNDS * H):
        opt.zero_grad()
        ref_loss(model, ref_batch(rank, step)).backward()
        opt.step()
        before = {k: p.clone() for k, p in params_of(model).items()}
        anchor = state.anchor
        out, state = local_sgd.update(before, state)
        averager.average_parameters(model.parameters())
        after = params_of(model)
        assert int(state.step) == step + 1
        if (step + 1) % H:
            assert out is before  # not a sync: the parameters as given
            assert all(torch.equal(after[k], before[k]) for k in after)
            continue
        syncs += 1
        for name, parts in gathered(before).items():
            a = anchor[name].double()
            # The averager: fl(p / W) summed over W ranks: within gamma_W * mean|p| of
            # the exact mean. diloco: d = fl(a - p) (u |a - p|), fl(d * fl(1/W)) (2u),
            # summed (W - 1 roundings), then fl(a - m) (u |out|): within
            # gamma_{W+2} * mean|a - p| + eps * |out| of it.
            bound = (
                gamma(world_size + 2) * _mean_abs([a - p.double() for p in parts])
                + gamma(world_size) * _mean_abs(parts)
                + eps * after[name].double().abs()
            )
            diff = (out[name].double() - after[name].double()).abs()
            assert torch.all(diff <= bound), (name, (diff / bound).max())
            assert not any(out[name] is p for p in state.anchor.values())
    assert syncs == ROUNDS
    fsync.verify(state.anchor, values=True)  # every rank holds the same anchor


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_local_sgd_equals_periodic_model_averager(world: World):
    world.run(_on_rank_local_sgd_vs_averager)


# --- DiLoCo: the outer Nesterov SGD written with torch.optim --------------------------------


def _on_rank_outer_nesterov_by_hand(mesh):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = None
    if mesh:
        group = init_device_mesh("cpu", (world_size,))
    params = params_of(ref_model())
    dl = fsync.diloco(H, group=group, **ONE_LEAF_PER_BUCKET)  # default outer optimizer
    state = dl.init(params)
    anchor = {k: p.clone().requires_grad_(True) for k, p in params.items()}
    outer = torch.optim.SGD(anchor.values(), lr=0.7, momentum=0.9, nesterov=True)
    for step in range(ROUNDS * H):
        moved = _moved(params, rank, step)
        params, state = dl.update(moved, state)
        if (step + 1) % H:
            assert params is moved
            continue
        for name, a in anchor.items():
            g = (a.detach() - moved[name]) * (1.0 / world_size)  # DDP's mean: scale, sum
            dist.all_reduce(g)
            a.grad = g
        outer.step()
        # Same pseudo-gradient bytes through the same all-reduce, and fsync.optim.sgd is
        # torch.optim.SGD operation by operation: bit for bit on any world size.
        for name, a in anchor.items():
            assert torch.equal(params[name], a.detach()), name
            assert torch.equal(state.anchor[name], a.detach()), name
            buf = outer.state[a]["momentum_buffer"]
            assert torch.equal(state.outer.momentum[name], buf), name
    assert int(state.outer.step) == ROUNDS


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("mesh", [False, True])
def test_default_outer_equals_nesterov_sgd_by_hand(world: World, mesh):
    world.run(_on_rank_outer_nesterov_by_hand, mesh)


# --- a compression hook ----------------------------------------------------------------------


def _on_rank_bf16_within_its_rounding():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    params = params_of(ref_model())
    compressed = fsync.diloco(H, fsync.optim.sgd(1.0), hook=fsync.ops.bf16_compress())
    plain = fsync.diloco(H, fsync.optim.sgd(1.0))
    state, plain_state = compressed.init(params), plain.init(params)
    u32, ub = torch.finfo(torch.float32).eps / 2, torch.finfo(torch.bfloat16).eps / 2
    for step in range(ROUNDS * H):
        moved = _moved(params, rank, step)
        anchor = state.anchor
        params, state = compressed.update(moved, state)
        plain_params, plain_state = plain.update(moved, plain_state)
        if (step + 1) % H:
            continue
        differs = False
        for name, parts in gathered(moved).items():
            a = anchor[name].double()
            d = [a - p.double() for p in parts]
            exact = torch.stack([p.double() for p in parts]).mean(0)
            # bf16_compress: d = fl32(a - p) (u32), cast to bfloat16 (ub), times 1/W
            # (the factor held in float32, u32; the product rounded to bfloat16, ub),
            # W - 1 bfloat16 additions (ub each, if the backend rounds each), cast back
            # (exact); then fl32(a - m) (u32 |out|). First order: (W + 1) ub + 2 u32
            # <= (W + 2) ub + u32 of mean|a - p|, and u32 |out|; the bound doubles that
            # for the second-order terms.
            bound = 2 * (
                ((world_size + 2) * ub + u32) * _mean_abs(d) + u32 * params[name].double().abs()
            )
            diff = (params[name].double() - exact).abs()
            assert torch.all(diff <= bound), (name, (diff / bound).max())
            differs |= not torch.equal(params[name], plain_params[name])
        assert differs  # the pseudo-gradient did go through bfloat16
    fsync.verify(params, values=True)


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_bf16_pseudo_gradients_within_the_hooks_rounding(world: World):
    world.run(_on_rank_bf16_within_its_rounding)


# --- a stateful hook: PowerSGD's error feedback lives in the state ---------------------------


def _on_rank_powersgd_state():
    rank = dist.get_rank()
    params = {"w": torch.randn(16, 12, generator=torch.Generator().manual_seed(0)), "b": None}
    hook = fsync.ops.powersgd(1, start_step=1)
    dl = fsync.diloco(H, hook=hook)
    state = dl.init(params)
    # The same transform written out: GradSync with the hook on the pseudo-gradient, the
    # default outer optimizer on the anchor.
    sync = fsync.GradSync(hook=hook)
    outer = fsync.optim.sgd(0.7, momentum=0.9, nesterov=True)
    anchor, sync_state, outer_state = params, sync.init(params), outer.init(params)
    restored = None
    for step in range(ROUNDS * H):
        moved = _moved({"w": params["w"]}, rank, step) | {"b": None}
        hook_before = state.sync.hook
        params, state = dl.update(moved, state)
        if (step + 1) % H:
            assert state.sync.hook is hook_before  # no sync, no change to the hook's state
            continue
        pseudo = {"w": anchor["w"] - moved["w"], "b": None}
        pseudo, sync_state = sync(pseudo, sync_state._replace(step=torch.tensor(step)))
        anchor, outer_state = outer.update(anchor, pseudo, outer_state)
        assert torch.equal(params["w"], anchor["w"]) and params["b"] is None
        assert torch.equal(state.sync.hook.error[0], sync_state.hook.error[0])
        if step + 1 == H:  # checkpoint after the first round, weights-only
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            restored = torch.load(buffer)
            assert isinstance(restored, fsync.DiLoCoState)
    assert state.sync.hook.error[0].abs().sum() > 0  # rank 1 of a 16 x 12 leaves an error
    # The restored state continues exactly as the one that was never saved.
    assert restored is not None
    params = dict(restored.anchor)
    for step in range(H, ROUNDS * H):
        params, restored = dl.update(_moved({"w": params["w"]}, rank, step) | {"b": None}, restored)
    assert torch.equal(params["w"], state.anchor["w"])


@pytest.mark.parametrize("world", [2], indirect=True)
def test_powersgd_error_feedback_is_threaded_and_checkpointed(world: World):
    world.run(_on_rank_powersgd_state)


# --- agreement -------------------------------------------------------------------------------


def _on_rank_different_inner_steps():
    rank = dist.get_rank()
    dl = fsync.diloco(2 if rank == 0 else 4)
    params = {"w": torch.ones(3)}
    state = dl.init(params)
    for _ in range(1 if rank == 0 else 3):  # the calls before each rank's first sync
        params, state = dl.update(params, state)
    with pytest.raises(ValueError, match="ranks are at different syncs") as info:
        dl.update(params, state)  # rank 0's 2nd call and rank 1's 4th meet
    return str(info.value)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_ranks_syncing_after_different_numbers_of_calls_raise_on_every_rank(world: World):
    # Rank 0 syncs at its 2nd call, rank 1 at its 4th: the call counts differ, so the
    # average of two different steps' parameters is refused instead of made.
    messages = world.run(_on_rank_different_inner_steps)
    assert all("rank 0 at sync 1, rank 1 at sync 3" in m for m in messages), messages


# --- compile ---------------------------------------------------------------------------------


def _on_rank_compiled_equals_eager(outer_kind):
    rank = dist.get_rank()
    outer = fsync.optim.sgd(1.0) if outer_kind == "sgd" else None
    dl = fsync.diloco(2, outer, hook=fsync.ops.bf16_compress())
    params = params_of(ref_model())
    # fsync.compile: fullgraph, and dynamic=False, without which the outer lr (a Python
    # float compiled before with another value, by the other case) would become a graph
    # input read inside the torch.cond branch, which inductor fails to lower (torch 2.13).
    compiled = fsync.compile(dl.update)
    torch._dynamo.utils.counters.clear()
    eager_state = compiled_state = dl.init(params)
    eps = torch.finfo(torch.float32).eps
    for step in range(3 * 2):
        moved = _moved(params, rank, step)
        eager, eager_state = dl.update(moved, eager_state)
        # One artefact for every call, syncing or not: after the first, a recompile
        # (a guard on the step count, say) raises.
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            out, compiled_state = compiled(moved, compiled_state)
        assert int(compiled_state.step) == step + 1
        for name in eager:
            if outer_kind == "sgd":
                # a - p, the bf16 mean, a - m: single roundings that inductor cannot
                # contract; the same bits.
                assert torch.equal(out[name], eager[name]), name
            else:
                # Nesterov's buf = m buf + g, g + m buf and a - lr g may each be
                # contracted into one rounding by inductor where eager rounds twice:
                # per round at most three ulps of |a| + lr (|g| + 2 m |buf|) apart, summed
                # over the rounds so far (the momentum carries them on, scaled by < 1).
                scale = (
                    eager_state.anchor[name].abs()
                    + 0.7 * 2.8 * eager_state.outer.momentum[name].abs()
                ).max()
                rounds = (step + 1) // 2
                diff = (out[name] - eager[name]).abs().max()
                assert diff <= 3 * rounds * eps * scale * 2, (name, diff)
        params = eager
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 1, dict(stats)


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize("outer_kind", ["sgd", "nesterov"])
def test_compiled_update_is_one_graph_and_equals_eager(world: World, outer_kind):
    world.run(_on_rank_compiled_equals_eager, outer_kind, timeout=400)


def _on_rank_compiled_powersgd():
    rank = dist.get_rank()
    dl = fsync.diloco(2, hook=fsync.ops.powersgd(1, start_step=0))
    params = {"w": torch.randn(16, 12, generator=torch.Generator().manual_seed(0))}
    state = dl.init(params)
    compiled = fsync.compile(dl.update)
    torch._dynamo.utils.counters.clear()
    for step in range(3 * 2):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            params, state = compiled(_moved(params, rank, step), state)
    # PowerSGD's state keeps its fingerprint as it is, an input the torch.cond branch
    # may not return as such: copied, it compiles into the same one graph.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert int(state.sync.hook.step) == 3 and state.sync.hook.error[0].abs().sum() > 0
    fsync.verify(params, values=True)  # the last call synced: every rank agrees


@pytest.mark.parametrize("world", [2], indirect=True)
def test_compiled_update_threads_powersgd_state_in_one_graph(world: World):
    world.run(_on_rank_compiled_powersgd, timeout=400)


# --- one process: what goes on the wire, inputs, errors --------------------------------------


def test_only_every_hth_call_communicates():
    group = Recorder(world_size=4)
    params = {"w": torch.zeros(256, 64), "b": torch.zeros(64)}
    dl = fsync.diloco(4, group=group, hook=fsync.ops.bf16_compress())
    state = dl.init(params)
    counts = []
    for step in range(8):
        before = len(group.calls)
        moved = _moved(params, 0, step)
        kept = {k: v.clone() for k, v in moved.items()}
        _, state = dl.update(moved, state)
        assert all(torch.equal(moved[k], kept[k]) for k in kept)  # nothing modified
        counts.append(group.calls[before:])
    for step, calls in enumerate(counts):
        if (step + 1) % 4:
            assert calls == [], step
        else:  # the agreement, then one bfloat16 bucket: what sync_stats counts
            stats = fsync.sync_stats(params, world_size=4, hook=fsync.ops.bf16_compress())
            assert [(c.op, c.dtype, c.numel) for c in calls if c.control] == [AGREEMENT]
            assert tuple(c for c in calls if not c.control) == stats.collectives
            assert stats.bytes_on_wire == 2 * (256 * 64 + 64)


def test_returned_parameters_never_share_memory_with_the_state(single_rank):
    # Five elements: a tree of its own, so that no other test's cached plan is this one's.
    params = {"w": torch.ones(5)}
    dl = fsync.diloco(1, fsync.optim.sgd(1.0))
    state = dl.init(params)
    assert state.anchor["w"].data_ptr() != params["w"].data_ptr()
    out, state = dl.update({"w": torch.full((5,), 2.0)}, state)
    assert torch.equal(out["w"], torch.full((5,), 2.0))  # one rank: the mean is itself
    assert out["w"].data_ptr() != state.anchor["w"].data_ptr()
    out["w"].add_(1.0)  # an in-place inner optimizer must not move the anchor
    assert torch.equal(state.anchor["w"], torch.full((5,), 2.0))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0,), {}, ValueError, "inner_steps must be a positive int"),
        ((2.0,), {}, ValueError, "inner_steps must be a positive int"),
        ((True,), {}, ValueError, "inner_steps must be a positive int"),
        ((2, torch.optim.SGD), {}, TypeError, "expected an fsync.optim.Optimizer"),
        ((2,), {"find_unused": True}, ValueError, "does not take find_unused"),
        ((2,), {"bucket_cap": 1.0}, TypeError, "unknown options"),
    ],
)
def test_bad_settings_say_how_to_fix_them(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fsync.diloco(*args, **kwargs)


def test_bad_calls_say_how_to_fix_them(single_rank):
    dl = fsync.diloco(2)
    state = dl.init({"w": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"leaf 'w' is torch.float32\[4\]; expected the anchor"):
        dl.update({"w": torch.zeros(4), "b": torch.zeros(2)}, state)
    with pytest.raises(ValueError, match="params have structure"):
        dl.update({"w": torch.zeros(3)}, state)
    with pytest.raises(TypeError, match="expected the DiLoCoState"):
        dl.update({"w": torch.zeros(3), "b": torch.zeros(2)}, state.sync)
    with pytest.raises(TypeError, match="expected a floating point tensor"):
        dl.init({"w": torch.zeros(3, dtype=torch.int64)})


# --- a 2-D mesh: the pseudo-gradient is reduced hierarchically ----------------------------------


def _on_rank_local_sgd_on_a_mesh():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    params = params_of(ref_model())
    local_sgd = fsync.diloco(H, fsync.optim.sgd(1.0), group=mesh)
    state = local_sgd.init(params)
    eps = torch.finfo(torch.float32).eps
    for step in range(2 * H):
        moved = _moved(params, rank, step)
        anchor = state.anchor
        params, state = local_sgd.update(moved, state)
        if (step + 1) % H:
            assert params is moved
            continue
        for name, parts in gathered(moved).items():
            a = anchor[name].double()
            exact = torch.stack([p.double() for p in parts]).mean(0)
            # The pseudo-gradient's mean: fl(a - p), scaled, reduce-scattered within the
            # node, all-reduced across, all-gathered (W - 1 additions in some order),
            # then fl(a - m): gamma_{W+2} * mean|a - p| + eps * |result|, as above.
            bound = (
                gamma(world_size + 2) * _mean_abs([a - p.double() for p in parts])
                + eps * exact.abs()
            )
            diff = (params[name].double() - exact).abs()
            assert torch.all(diff <= bound), (name, (diff / bound).max())
        fsync.verify(state.anchor, values=True)  # the same bits on every rank of the mesh


@pytest.mark.parametrize("world", [4], indirect=True)
def test_local_sgd_on_a_2d_mesh_is_the_mean_of_all_ranks(world: World):
    world.run(_on_rank_local_sgd_on_a_mesh)

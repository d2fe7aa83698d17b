"""The hooks together: noop, composition, and every compressing hook under torch.compile.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import fsync
from fsync import _comm
from fsync._compile import CACHE_OPTIONS
from tests._models import func_loss, params_of, ref_batch, ref_model
from tests._numerics import powersgd_full_rank_bound
from tests._world import World

CAP = {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001}  # several buckets


def _on_rank_noop():
    model = ref_model()
    grads = torch.func.grad(func_loss(model))(params_of(model), ref_batch(dist.get_rank()))
    fsync.sync_grads(grads, **CAP)  # the one-off check that all ranks have the same plan
    calls = []
    originals = (_comm.all_reduce, _comm.all_gather)
    _comm.all_reduce = lambda *a, **k: calls.append("all_reduce") or originals[0](*a, **k)
    _comm.all_gather = lambda *a, **k: calls.append("all_gather") or originals[1](*a, **k)
    try:
        out = fsync.sync_grads(grads, hook=fsync.ops.noop(), **CAP)
    finally:
        _comm.all_reduce, _comm.all_gather = originals
    assert calls == ["all_reduce"]  # fsync's agreement (13 int64); no bucket is sent
    for k in grads:  # each rank keeps its own gradients, layouts included
        assert torch.equal(out[k], grads[k]) and out[k].stride() == grads[k].stride()


@pytest.mark.parametrize("world", [2], indirect=True)
def test_noop_communicates_nothing(world: World):
    world.run(_on_rank_noop)


def _on_rank_composition():
    rank = dist.get_rank()
    model = ref_model()
    params = params_of(model)
    inner = fsync.ops.bf16_compress(fsync.ops.powersgd(4, start_step=1))
    composed = fsync.GradSync(hook=fsync.chain(fsync.ops.noop(), inner), **CAP)
    alone = fsync.GradSync(hook=inner, **CAP)
    state_c, state_a = composed.init(params), alone.init(params)
    assert state_c.hook[0] == () and isinstance(state_c.hook[1], fsync.ops.PowerSGDState)
    for step in range(3):
        grads = torch.func.grad(func_loss(model))(params, ref_batch(rank, step))
        out_c, state_c = composed(grads, state_c)
        out_a, state_a = alone(grads, state_a)
        assert all(torch.equal(out_c[k], out_a[k]) for k in grads), step
        assert all(out_c[k].dtype == torch.float32 for k in grads)
    assert int(state_c.hook[1].step) == 3
    # Stateless hooks compose in sync_grads too: quantise, then average the result again
    # (x * 0.5 + x * 0.5 == x on two ranks: the values are already equal everywhere).
    twice = fsync.chain(fsync.ops.quantize(8), fsync.ops.allreduce())
    once = fsync.sync_grads(grads, hook=fsync.ops.quantize(8), **CAP)
    again = fsync.sync_grads(grads, hook=twice, **CAP)
    assert all(torch.equal(again[k], once[k]) for k in grads)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_hooks_compose_like_functions(world: World):
    world.run(_on_rank_composition)


# --- compile -----------------------------------------------------------------------------------


def _relative_error(out, ref):
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def _on_rank_compiled_hooks():
    """Every hook, the wrappers and a composition in one compiled sync, across start_step.

    One graph holds them all, so inductor compiles once for the lot (a graph per hook would
    cost a compile each).
    """
    rank = dist.get_rank()
    shapes = {"w": (24, 16), "b": (24,), "v": (16, 8)}
    params = {k: torch.zeros(shape) for k, shape in shapes.items()}
    syncs = {
        "fp16": fsync.GradSync(hook=fsync.ops.fp16_compress(), **CAP),
        "bf16": fsync.GradSync(hook=fsync.ops.bf16_compress(), **CAP),
        "powersgd": fsync.GradSync(hook=fsync.ops.powersgd(2, start_step=2), **CAP),
        "batched": fsync.GradSync(hook=fsync.ops.batched_powersgd(1, start_step=2), **CAP),
        # A composition and a chain at once: noop, then PowerSGD run in bfloat16.
        "chain": fsync.GradSync(
            hook=fsync.chain(
                fsync.ops.noop(), fsync.ops.bf16_compress(fsync.ops.powersgd(2, start_step=2))
            ),
            **CAP,
        ),
    }
    stateless = {
        "quantize": fsync.ops.quantize(4, per_channel=True, channel_size=64),
        "noop": fsync.ops.noop(),
    }
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        # Cached as fsync.compile caches it (its PowerSGD conds bypassed inductor's cache:
        # 26.7 s in every run, warm or not).
        return compile_fx(gm, example_inputs, config_patches=CACHE_OPTIONS)

    def sync_all(grads, states):
        out = {name: fsync.sync_grads(grads, hook=hook, **CAP) for name, hook in stateless.items()}
        new_states = {}
        for name, sync in syncs.items():
            out[name], new_states[name] = sync(grads, states[name])
        return out, new_states

    compiled = torch.compile(sync_all, fullgraph=True, backend=backend)
    eager_states = compiled_states = {name: sync.init(params) for name, sync in syncs.items()}
    worst = dict.fromkeys(("powersgd", "batched", "chain"), 0.0)
    for s in range(4):
        g = torch.Generator().manual_seed(10 * s + rank)
        grads = {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}
        eager, eager_states = sync_all(grads, eager_states)
        # After the first call a recompile (a guard on the step counter, say) is an error.
        with torch._dynamo.config.patch(error_on_recompile=s > 0):
            out, compiled_states = compiled(grads, compiled_states)
        for k in grads:
            assert torch.equal(out["quantize"][k], eager["quantize"][k]), (s, k)
            assert torch.equal(out["noop"][k], grads[k]) and torch.equal(eager["noop"][k], grads[k])
            # Inductor scales the float32 value and rounds to float16 once, where eager
            # rounds to float16 before scaling too. Scaling by 1/2 is exact but for
            # subnormal results: one float16 subnormal step (2**-24) per rank, and one
            # float16 rounding (eps) where that moves the sum across a rounding point.
            torch.testing.assert_close(
                out["fp16"][k], eager["fp16"][k], rtol=torch.finfo(torch.float16).eps, atol=2**-23
            )
            # The same reasoning for bfloat16, whose subnormals (below 1e-38) standard
            # normal gradients never reach: rounding then halving equals halving then
            # rounding, so compiled and eager agree bit for bit.
            assert torch.equal(out["bf16"][k], eager["bf16"][k]), (s, k)
            # PowerSGD's matmuls and norms are reductions, which inductor may order
            # differently: a few float32 ulps, spread by the matmuls over a leaf
            # (measured: relative error under 1e-6 per leaf).
            for name in ("powersgd", "batched"):
                torch.testing.assert_close(out[name][k], eager[name][k], rtol=1e-5, atol=1e-6)
                worst[name] = max(worst[name], _relative_error(out[name][k], eager[name][k]))
            # The chain runs PowerSGD in bfloat16: the same few float32 ulps of a reduction
            # flip a bfloat16 rounding here and there (eps = 2**-7, relative), and the
            # power iteration's matmuls and orthogonalisation spread it over the leaf, so
            # compare leaf norms: within 4 bfloat16 eps of the leaf (measured: 0, the bfloat16
            # roundings absorbed every difference on these inputs).
            worst["chain"] = max(
                worst["chain"], _relative_error(out["chain"][k], eager["chain"][k])
            )
            assert worst["chain"] <= 4 * torch.finfo(torch.bfloat16).eps, (s, k, worst)
        for name in ("powersgd", "batched"):
            assert int(compiled_states[name].hook.step) == s + 1
        assert int(compiled_states["chain"].hook[1].step) == s + 1
        assert compiled_states["chain"].hook[1].q[0].dtype == torch.bfloat16
    assert len(graphs) == 1, "recompiled"
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    # start_step is one torch.cond per PowerSGD hook (powersgd, batched, inside the chain).
    assert sum("cond" in t for t in targets) == 3, "start_step should be a torch.cond"
    return worst


@pytest.mark.parametrize("world", [2], indirect=True)
def test_hooks_compile_without_graph_breaks_or_recompiles(world: World):
    worst = world.run(_on_rank_compiled_hooks, timeout=500)
    print(f"compiled vs eager, worst relative error per leaf: {worst}")


def _on_rank_one_rank():
    """With one rank nothing is communicated, and each hook is its own local round trip."""
    g = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(24, 16, generator=g), "b": torch.randn(24, generator=g)}
    fp16 = fsync.sync_grads(grads, hook=fsync.ops.fp16_compress())
    assert all(torch.equal(fp16[k], grads[k].half().float()) for k in grads)
    values = torch.cat([v.reshape(-1) for v in grads.values()])  # one bucket
    spread = values.max().clamp(min=0) - values.min().clamp(max=0)
    for per_channel in (False, True):
        hook = fsync.ops.quantize(8, per_channel=per_channel, channel_size=100)
        out = fsync.sync_grads(grads, hook=hook)
        for k in grads:
            # Half a level of 255 over the bucket's range (a channel's is smaller), plus
            # float32 rounding: x / scale, low / scale (zero point), range / 255 and the
            # dequantising product, u * 255 levels each (u = eps / 2), and the scale's u.
            eps = torch.finfo(torch.float32).eps
            assert (out[k] - grads[k]).abs().max() <= (0.5 + (2 * 255 + 1) * eps) * spread / 255, k
    sync = fsync.GradSync(hook=fsync.ops.powersgd(16, start_step=0, min_compression_rate=0.0))
    out, _ = sync(grads, sync.init(grads))
    for k in grads:  # full rank: see test_powersgd.test_full_rank_gives_the_exact_mean
        # Derived in tests/_numerics.py, for each leaf's own rows x cols matrix (one rank).
        err = torch.linalg.vector_norm(out[k] - grads[k])
        rows = grads[k].shape[0]
        norm = torch.linalg.vector_norm(grads[k]).item()
        assert err <= powersgd_full_rank_bound(norm, rows, grads[k].numel() // rows, 1), k


@pytest.mark.parametrize("world", [1], indirect=True)
def test_every_hook_runs_on_one_rank(world: World):
    world.run(_on_rank_one_rank)

"""fsync.compile: torch.compile with the overlap settings, same results as without."""

from __future__ import annotations

import functools
import re
import sys

import optree
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fsync
from fsync import _tree
from fsync._compile import FUSED_CAT_LEAVES, PackPass
from tests import _models as models
from tests._inductor_code import overlapped_kernels
from tests._launch import bounded
from tests._models import func_loss, params_of, ref_batch, ref_model
from tests._world import World


def _sgd_step():
    """The reference model and an SGD step over it that syncs three small buckets."""
    model = ref_model()
    loss_fn = func_loss(model)

    def step(params, batch):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
        grads = fsync.sync_grads(grads, bucket_cap_mb=0.001, first_bucket_mb=0.001)
        return {k: p - 0.1 * grads[k] for k, p in params.items()}, loss

    return model, step


def _on_rank_overlap_settings():
    rank = dist.get_rank()
    model, step = _sgd_step()

    results = {}
    for overlap in (True, False):
        compiled = fsync.compile(step, overlap=overlap)
        params = params_of(model)
        for s in range(3):
            with torch._dynamo.config.patch(error_on_recompile=s > 0):
                params, _ = compiled(params, ref_batch(rank, s))
        results[overlap] = params
    # Reordering moves collectives and waits, not arithmetic: bit for bit the same.
    for k in results[True]:
        assert torch.equal(results[True][k], results[False][k]), k
    fsync.verify(results[True], values=True)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_overlap_settings_change_no_result(world: World):
    world.run(_on_rank_overlap_settings, timeout=400)


def _on_rank_overlap_in_code():
    rank = dist.get_rank()
    model, step = _sgd_step()

    counts = {}
    for overlap in (True, False):
        torch._dynamo.reset()  # a fresh compile, so that its code is captured
        _, code = run_and_get_code(
            fsync.compile(step, overlap=overlap), params_of(model), ref_batch(rank, 0)
        )
        counts[overlap] = overlapped_kernels(code[-1])
    return counts


@pytest.mark.parametrize("world", [2], indirect=True)
def test_overlap_moves_backward_compute_under_the_collectives(world: World):
    counts = world.run(_on_rank_overlap_in_code, timeout=400)[0]
    (issued_on, overlapped_on), (issued_off, overlapped_off) = counts[True], counts[False]
    assert issued_on == issued_off >= 3  # one all-reduce per bucket either way
    # Without the passes inductor waits for each all-reduce right after issuing it, before
    # the rest of the backward pass; with them, backward kernels run while it is in flight.
    assert overlapped_on > overlapped_off, counts


def _on_rank_schedule():
    """Per collective in the compiled code of a GPT step: (matmuls before it, waits before it)."""
    work = models.gpt(n_layer=2, scale=1 / 8, vocab_size=256)
    batch = work.batch(dist.get_rank())
    optimizer = fsync.optim.sgd(0.1)

    def step(params, state):
        grads = torch.func.grad(work.functional_loss)(params, batch)
        grads = fsync.sync_grads(grads, bucket_cap_mb=0.05, first_bucket_mb=0.05)
        return optimizer.update(params, grads, state)

    params = work.params()
    torch._dynamo.reset()  # a fresh compile, so that its code is captured
    _, code = run_and_get_code(fsync.compile(step), params, optimizer.init(params))
    out, matmuls, waits = [], 0, 0
    for line in code[-1].splitlines():
        if re.match(r"\s*extern_kernels\.(addmm|mm|bmm)\(", line):
            matmuls += 1
        elif "_c10d_functional.all_reduce_" in line:
            out.append((matmuls, waits))
        elif "_c10d_functional.wait_tensor" in line:
            waits += 1
    return out, matmuls


@pytest.mark.parametrize("world", [2], indirect=True)
def test_overlap_waits_for_no_bucket_during_backward(world: World):
    (issued, matmuls), _ = world.run(_on_rank_schedule, timeout=400)
    assert len(issued) >= 6, issued  # a bucket per few layers
    # Each bucket leaves during backward, while later gradients are computed ...
    assert issued[0][0] < matmuls // 2 and issued[-2][0] < matmuls, (issued, matmuls)
    # ... and the step waits for none of them before the last has left: a wait in the
    # middle of backward would stall the compute until the link has delivered that bucket.
    # (Inductor's recommended passes waited for some buckets mid-backward on this model.)
    assert all(waits == 0 for _, waits in issued), issued


def test_overlapped_kernels_reads_inductor_code():
    code = """
    cpp_fused_cat_0 = async_compile.cpp_pybinding(['const float*'], 'x')
    def call(args):
        cpp_fused_cat_0(buf1, buf2)
        torch.ops._c10d_functional.all_reduce_.default(buf2, 'sum', '0')
        extern_kernels.mm(buf3, buf4, out=buf5)
        buf6 = torch.ops.aten.convolution_backward.default(buf5, buf7)
        torch.ops._c10d_functional.wait_tensor.default(buf2)
        extern_kernels.mm(buf5, buf4, out=buf8)
    """
    assert overlapped_kernels(code) == (1, 2)


def _packed_graph(parts, *, factor=1 / 3, dtype=torch.float32, users=1):
    """make_fx's graph of a pack of ``parts`` (behind the agreement's token), then scaled."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(token, *parts):
        bucket = torch.ops.fsync.pack(list(parts), token, dtype, 1.0)
        scaled = bucket * (factor(token) if callable(factor) else factor)
        return (scaled,) if users == 1 else (scaled, bucket)

    args = (torch.ones((), dtype=torch.bool, device=parts[0].device), *parts)
    return make_fx(fn, tracing_mode="fake")(*args), args


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_pack_pass_folds_the_scale_and_lowers_to_one_cat_on_the_cpu():

    g = torch.Generator().manual_seed(0)
    parts = [
        torch.randn(5, generator=g, dtype=torch.float64),
        torch.randn(2, 3, generator=g, dtype=torch.float64),
        torch.randn(3, 4, generator=g, dtype=torch.float64).t(),  # a leaf in its memory order
    ]
    gm, args = _packed_graph(parts)
    expected = gm(*args)  # the op's own kernel, then the product
    PackPass()(gm.graph)
    gm.recompile()
    aten = torch.ops.aten
    targets = _targets(gm)
    # One cat of the parts, each times the token, cast and scaled on its way in: the
    # arithmetic inductor's C++ backend fuses into one loop.
    assert torch.ops.fsync.pack.default not in targets and targets.count(aten.cat.default) == 1
    assert targets.count(aten.mul.Tensor) == 2 * len(parts), targets
    assert targets.count(torch.ops.prims.convert_element_type.default) == len(parts)
    # 1/3 is inexact: equal bits only if every element is cast, then scaled once by the same
    # float, as the op does.
    for got, want in zip(gm(*args), expected, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("where", ["meta", "many leaves"])
def test_pack_pass_keeps_the_pack_whole_off_the_cpu_and_for_many_leaves(where):

    device, count = ("meta", 3) if where == "meta" else ("cpu", FUSED_CAT_LEAVES + 1)
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(4, generator=g).to(device) for _ in range(count)]
    gm, args = _packed_graph(parts)
    expected = None if device == "meta" else gm(*args)
    PackPass()(gm.graph)
    gm.recompile()
    (pack,) = [n for n in gm.graph.nodes if n.target is torch.ops.fsync.pack.default]
    # One op with all the bucket's leaves, the scale folded into it: nothing else computes.
    assert len(pack.args[0]) == count and pack.args[3] == 1 / 3
    assert torch.ops.aten.mul.Tensor not in _targets(
        gm
    ) and torch.ops.aten.cat.default not in _targets(gm)
    if expected is not None:
        assert all(torch.equal(a, b) for a, b in zip(gm(*args), expected, strict=True))


def test_pack_pass_leaves_a_pack_with_other_users_or_a_tensor_factor_alone():

    x = torch.ones(4, device="meta")
    for name, (gm, _) in {
        "second user": _packed_graph([x, x], users=2),  # a folded scale would copy twice
        "tensor factor": _packed_graph([x, x], factor=lambda token: token * 0.5),
        "another dtype": _packed_graph([x, x], factor=2, dtype=torch.int64),  # x * 2 is int
    }.items():
        before = str(gm.graph)
        PackPass()(gm.graph)
        folded = [n.args[3] for n in gm.graph.nodes if n.target is torch.ops.fsync.pack.default]
        assert folded == [1.0], (name, folded, before)


# A fresh interpreter: fsync imports neither dynamo nor inductor, and the mark it sets on a
# function for dynamo (fsync._trace) is the one torch.compiler.assume_constant_result sets.
_IMPORT_AND_MARK = """
import sys
import fsync
from fsync import _trace
heavy = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
assert not heavy, f"import fsync imported {heavy}"
def ours(): return 1
def torchs(): return 1
_trace.constant_result(ours)
import torch
torch.compiler.assume_constant_result(torchs)
assert vars(ours) == vars(torchs) != {}, (vars(ours), vars(torchs))
"""


@pytest.mark.timeout(120)
def test_import_fsync_loads_no_compiler_and_marks_constants_as_torch_does():
    bounded([sys.executable, "-c", _IMPORT_AND_MARK], 100, "import fsync")


def test_fsync_compile_keeps_inductors_cache_with_its_pass():
    # PackPass is registered as inductor's CustomGraphPass when fsync.compile is
    # called (not subclassed, so that import fsync does not load inductor): a pass that is
    # not one makes inductor bypass its graph cache, recompiling in every process.
    counters.clear()
    step = fsync.compile(lambda a, b: torch.cat([a + 1, b * 3]) * 0.5)
    x = torch.arange(8.0)  # small integers and halves: every result exact in float32
    assert torch.equal(step(x, x), torch.cat([x + 1, x * 3]) * 0.5)
    cache = {k: n for k, n in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    assert "fxgraph_cache_bypass" not in cache and sum(cache.values()) == 1, cache


def test_fsync_compile_caches_a_step_with_a_cond_by_its_branches(tmp_path, monkeypatch):
    # Inductor bypassed its caches for any graph with a torch.cond (PowerSGD's start_step,
    # DiLoCo's outer step): every process compiled such a step cold. fsync.compile marks
    # cond cacheable (CACHE_OPTIONS), which is sound because both caches' keys hash the
    # branches with the graph: the same step again is a hit, one whose branch adds another
    # constant a miss, and each call returns its own branch's result.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # empty: the first is a miss

    def branchy(c: float):
        return lambda x, n: torch.cond(n > 2, lambda x: x + c, lambda x: x - 1.0, (x,))

    x, on, off = torch.arange(4.0), torch.tensor(5), torch.tensor(0)
    seen = []
    for c in (1.0, 1.0, 2.0):
        torch._dynamo.reset()
        counters.clear()
        step = fsync.compile(branchy(c))
        assert torch.equal(step(x, on), x + c) and torch.equal(step(x, off), x - 1.0), c
        cache = {k: n for k, n in counters["inductor"].items() if k.startswith("fxgraph_cache")}
        seen.append((cache, dict(counters["aot_autograd"])))
    assert [cache for cache, _ in seen] == [
        {"fxgraph_cache_miss": 1},
        {"fxgraph_cache_hit": 1},
        {"fxgraph_cache_miss": 1},
    ], seen
    assert [aot.get("autograd_cache_hit", 0) for _, aot in seen] == [0, 1, 0], seen
    assert not any("autograd_cache_bypass" in aot for _, aot in seen), seen


class _Recording(PackPass):
    """fsync's pass, noting the packs it is given: per pack, its leaves and factor."""

    def __init__(self):
        self.packs = []

    def __call__(self, graph):
        target = torch.ops.fsync.pack.default
        self.packs += [len(n.args[0]) for n in graph.nodes if n.target is target]
        super().__call__(graph)

    def uuid(self):
        return None  # no cache key: inductor compiles afresh, so that the pass sees the graph


def _on_rank_fsync_compile_bitwise():
    rank = dist.get_rank()
    model = ref_model()
    grads = torch.func.grad(func_loss(model))(params_of(model), ref_batch(rank))
    g = torch.Generator().manual_seed(rank)
    # Beside the model's, a bucket's worth of small leaves: more than a CUDA cat lowers as
    # one kernel (8), and more than the CPU's lowering makes one cat of (FUSED_CAT_LEAVES).
    grads |= {f"many.{i:02d}": torch.randn(3, 5, generator=g) for i in range(FUSED_CAT_LEAVES + 8)}
    found = []
    for options in (
        {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001},  # buckets of a few leaves
        {"bucket_cap_mb": 25, "first_bucket_mb": 25},  # one of them all
    ):
        torch._dynamo.reset()  # a fresh compile, so that its code and its passes are seen
        recording = _Recording()
        compiled = fsync.compile(
            functools.partial(fsync.sync_grads, **options),
            options={"post_grad_custom_post_pass": recording},
        )
        out, (code,) = run_and_get_code(compiled, grads)
        ref = fsync.sync_grads(grads, **options)
        # With three ranks 1/3 is inexact: the bits only agree if every element is scaled
        # once, by the same float, before the sum, wherever the scaling happens.
        for k in grads:
            assert torch.equal(out[k], ref[k]), k
        plan = fsync.plan_buckets(grads, **options)
        found.append(
            (
                recording.packs,
                [len(spec.leaves) for spec in plan.specs],
                code.count("torch.ops.fsync.pack.default("),
                len(re.findall(r"^cpp_fused\w* = async_compile", code, re.MULTILINE)),
                code.count("_c10d_functional.all_reduce_.default("),
            )
        )
    return found


@pytest.mark.parametrize("world", [3], indirect=True)
def test_fsync_compile_packs_each_bucket_in_one_op_with_eagers_bits(world: World):
    (few, one), *_ = world.run(_on_rank_fsync_compile_bitwise, timeout=400)
    packs, leaves, opaque, kernels, reduces = few
    # The post-grad graph holds one pack per bucket, with all its leaves; on the CPU each
    # becomes one fused loop (a kernel per bucket, with one more at most for the agreement).
    assert packs == leaves and len(leaves) >= 3 and max(leaves) <= FUSED_CAT_LEAVES, few
    assert opaque == 0 and len(leaves) <= kernels <= len(leaves) + 1 and reduces == len(leaves)
    # A bucket of more leaves than one loop is worth compiling stays one op.
    packs, leaves, opaque, kernels, reduces = one
    assert packs == leaves and len(leaves) == 1 and leaves[0] > FUSED_CAT_LEAVES, one
    assert opaque == 1 and reduces == 1, one


@pytest.mark.parametrize(
    ("torch_version", "optree_version", "refused"),
    [
        ("2.11.0+cu130", "0.20.0", True),  # seen failing on the GPU machines
        ("2.12.1", "0.21.0", True),  # not checked: refused
        ("2.11.0+cu130", "0.19.1", False),  # seen passing (0.14.1 and 0.17.0 too)
        ("2.13.0+cpu", "0.20.0", False),  # CI's pair
    ],
)
def test_compile_refuses_a_torch_and_optree_its_dynamo_cannot_trace(
    monkeypatch, torch_version, optree_version, refused
):
    """torch 2.11's dynamo cannot trace optree 0.20's namespace lookup: a clear error first."""
    # Its defaults are the installed versions, which CI's pair passes.
    assert _tree.compile_problem.__defaults__ == (torch.__version__, optree.__version__)
    found = _tree.compile_problem(torch_version, optree_version)
    assert (found is not None) == refused
    if refused:
        assert f"got torch {torch_version} and optree {optree_version}" in found
        assert "pip install 'optree>=0.13,<0.20'" in found
        monkeypatch.setattr(_tree, "compile_problem", lambda: found)
        with pytest.raises(RuntimeError, match=re.escape(found)):
            fsync.compile(lambda x: x)

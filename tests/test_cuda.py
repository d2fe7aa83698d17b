"""fsync on a GPU: CUDA tensors through every entry point, against DDP in the same processes.

Every test here skips without a CUDA device (CI has none); ``benchmarks/gpu.py`` runs
them on a lent GPU and puts the figures each test reports into
``docs/benchmarks-gpu.md``. Cross-rank tests run two ranks on the one GPU over gloo
(NCCL refuses two ranks on one device); DDP supports gloo with CUDA tensors, so DDP in
the same processes is the reference. On two ranks a mean ``a * 0.5 + b * 0.5`` is the
exact mean rounded once, whatever the bucket layout and summation order, so results
equal DDP's bit for bit wherever the local gradients do (each test checks that premise
first: ``torch.func`` against autograd on the module). Where a hook has no DDP
counterpart that runs here, the reference is the same sync of the same gradients as CPU
tensors. The eager gradient call's stream handoff under stress is in
``tests/test_cuda_streams.py``.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from tests import _cuda
from tests._cuda import compare, needs_cuda
from tests._ddp_quantization import ddp_quantized_mean
from tests._launch import RUN_TIMEOUT, torchrun
from tests._models import func_loss, params_of, ref_batch, ref_loss, ref_model
from tests._world import World

pytestmark = needs_cuda  # every test here

# Buckets of about one leaf each: the parity model's 2,000 parameters span several.
CAP = 0.001
OPTIONS = {"bucket_cap_mb": CAP, "first_bucket_mb": CAP}
STEPS = 3
# Seconds for one test's ranks: start-up of CUDA in both, and a compiled sync.
TIMEOUT = 240
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in ref_batch(rank, step))


def _ddp_grads(ddp: DDP, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    ddp.zero_grad(set_to_none=True)
    ref_loss(ddp, batch).backward()
    return {n: p.grad.clone() for n, p in ddp.module.named_parameters()}


def _ddp_order(ddp: DDP) -> list[int]:
    """DDP's bucket layout (after its rebuild), as fsync's ``order`` option."""
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [index[id(p)] for b in buckets for p in b.parameters()]


def _local_premise(model, params, batch) -> dict:
    """``torch.func.grad`` against autograd on the module, on this rank alone."""
    local = copy.deepcopy(model)
    ref_loss(local, batch).backward()
    grads = torch.func.grad(func_loss(model))(params, batch)
    autograd = {n: p.grad for n, p in local.named_parameters()}
    return compare("local gradients: torch.func.grad", "autograd on the module", grads, autograd)


def _check(world: World, name: str, fn, *args) -> None:
    """Runs ``fn`` on every rank, reports its rows (merged over ranks) and checks them."""
    rows = _cuda.across_ranks(world.run(fn, *args, timeout=TIMEOUT))
    _cuda.report(name, rows)
    assert not _cuda.failed(rows), _cuda.failed(rows)


# --- one process -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_pack_and_unpack_keep_a_gpu_tree_eagerly_and_compiled():
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    tree = {
        "conv": torch.randn(8, 3, 3, 3, generator=g).to(device, memory_format=torch.channels_last),
        "t": torch.randn(5, 7, generator=g).to(device).t(),
        "bf16": torch.randn(33, generator=g).to(device, torch.bfloat16),
        "fp16": torch.randn(4, 4, generator=g).to(device, torch.float16),
        "none": None,
        "scalar": torch.tensor(2.5, device=device),
    }
    plan = fsync.plan_buckets(tree, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    assert all(spec.device == device for spec in plan.specs)
    buffers = fsync.pack(tree, plan)
    assert all(b.device == device for b in buffers)
    eager = fsync.unpack(buffers, plan)
    compiled = fsync.compile(lambda t: fsync.unpack(fsync.pack(t, plan), plan))(tree)
    for out in (eager, compiled):
        assert out["none"] is None
        for name, leaf in tree.items():
            if leaf is None:
                continue
            got = out[name]
            assert got.device == device and got.dtype == leaf.dtype, name
            assert got.stride() == leaf.stride() and torch.equal(got, leaf), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_place", [False, True], ids=["pure", "in_place"])
def test_fused_optimizers_equal_torch_optim_fused_on_the_gpu(in_place):
    """``fused=True`` on CUDA tensors: torch's CUDA kernels, which read the step count as a
    float32 tensor on the device (fsync keeps an int64 one on the CPU), so the bits of
    ``torch.optim`` with ``fused=True`` after a few steps, bf16 and a channels_last weight
    included."""
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    start = {
        "conv": torch.randn(8, 3, 3, 3, generator=g).to(device, memory_format=torch.channels_last),
        "w": torch.randn(33, 17, generator=g).to(device),
        "bf16": torch.randn(65, generator=g).to(device, torch.bfloat16),
    }
    cases = [
        (fsync.optim.adamw, torch.optim.AdamW, {"weight_decay": 0.1}),
        (fsync.optim.adam, torch.optim.Adam, {"weight_decay": 0.1}),
        (fsync.optim.sgd, torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01}),
    ]
    for make, cls, kwargs in cases:
        ref = {k: v.clone().requires_grad_() for k, v in start.items()}
        torch_opt = cls(list(ref.values()), lr=1e-2, fused=True, **kwargs)
        opt = make(1e-2, fused=True, in_place=in_place, **kwargs)
        params = {k: v.clone() for k, v in start.items()}
        state = opt.init(params)
        for _ in range(STEPS):
            grads = {k: torch.randn_like(v) for k, v in start.items()}  # v's layout
            params, state = opt.update(params, grads, state)
            for k, p in ref.items():
                p.grad = grads[k]
            torch_opt.step()
        for k, p in ref.items():
            assert params[k].device == device and params[k].stride() == p.stride(), k
            assert torch.equal(params[k], p.detach()), (make.__name__, k)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_train_example_runs_compiled_on_the_gpu_over_nccl():
    """``examples/train.py --device cuda``: NCCL with one rank, the step under fsync.compile."""
    out = torchrun("examples/train.py", "--device", "cuda", "--steps", "40", nproc=1)
    first = float(re.search(r"^loss ([\d.]+) ->", out, flags=re.M).group(1))
    last = float(re.search(r"-> ([\d.]+) in 40 steps", out).group(1))
    assert last < 0.5 * first, out
    assert "OK: parameters identical on all 1 ranks" in out


# --- two ranks, gloo, CUDA tensors ---------------------------------------------------------------


def _on_rank_entry_points():
    device = _cuda.device()
    rank = dist.get_rank()
    model = ref_model().to(device)
    ddp = _cuda.ddp(model, device, bucket_cap_mb=CAP)
    for step in range(2):  # the second step runs on DDP's rebuilt buckets
        expected = _ddp_grads(ddp, _batch(rank, step, device))
    # DDP's bucket layout: the same all-reduces of the same bytes.
    options = {**OPTIONS, "order": _ddp_order(ddp)}
    params, batch, loss_fn = params_of(model), _batch(rank, 1, device), func_loss(model)
    func_grads = torch.func.grad(loss_fn)(params, batch)
    rows = [_local_premise(model, params, batch)]

    grads, _ = fsync.grad_and_value(loss_fn, **options)(params, batch)
    rows.append(compare("fsync.grad_and_value", "DDP", grads, expected, strides=True))
    grads = fsync.grad(loss_fn, **options)(params, batch)
    rows.append(compare("fsync.grad", "DDP", grads, expected))
    synced = fsync.sync_grads(func_grads, **options)
    rows.append(
        compare("torch.func.grad, then fsync.sync_grads", "DDP", synced, expected, strides=True)
    )
    compiled = fsync.compile(lambda g: fsync.sync_grads(g, **options))
    rows.append(compare("fsync.compile(sync_grads)", "DDP", compiled(func_grads), expected))
    sync = fsync.GradSync(**options)
    state = sync.init(params)
    out, state = sync(func_grads, state)
    rows.append(compare("fsync.GradSync", "DDP", out, expected))
    (out, _), state = sync.grad_and_value(loss_fn)(state, params, batch)
    rows.append(compare("GradSync.grad_and_value", "DDP", out, expected))
    return rows


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("world", [2], indirect=True)
def test_every_entry_point_equals_ddp_bit_for_bit(world: World):
    _check(world, "entry_points", _on_rank_entry_points)


def _ddp_bf16_compress_hook(state, bucket):
    """DDP's ``bf16_compress_hook`` under another name, which DDP lets gloo run (see
    ``tests/test_compress.py``: its registration check reads the hook's name)."""
    return default_hooks.bf16_compress_hook(state, bucket)


# The CPU and the GPU round PowerSGD's matrix products, its orthonormalisation and the
# Gaussian draws of its first Q differently (other summation orders, other libraries): a
# few float32 ulps, which the projections spread over a leaf (relative 1e-6 or so).
POWERSGD = 1e-4
# The same inside bf16_compress: the inner PowerSGD's products are rounded to bfloat16 (8
# bits), where a different order moves an element by up to an ulp, 2**-8 relative.
POWERSGD_BF16 = 1e-2


class _Hook(NamedTuple):
    """A hook to check: how to make it, DDP's counterpart, the tolerance against the CPU.

    ``ddp`` is ``(words, DDP's hook)`` where DDP has a counterpart that runs here (its
    hook ``None`` for DDP's default), else ``None``: DDP's PowerSGD draws its first Q from
    numpy (tests/test_powersgd.py hands it fsync's and compares them on the CPU), and its
    quantisation hooks fail on gloo (tests/test_quantize.py). ``tolerance`` ``None``: the
    CUDA sync equals the same sync of the same gradients as CPU tensors bit for bit.
    ``bucketwise``: ``(words, function)``, a reference run on the GPU bucket by bucket, in
    place of the CPU: for quantisation, DDP's hooks' operations step by step
    (``tests/_ddp_quantization.py``). The min-max observer divides by the number of
    levels, a Python number, which CUDA computes as a product by its reciprocal (the CPU
    divides): the scale, and so the result, differs from the CPU's in its last bits as
    DDP's own would (seen: 1.5e-8 on an H100).
    """

    make: Callable[[], fsync.Hook]
    ddp: tuple[str, Callable | None] | None = None
    tolerance: float | None = None
    bucketwise: tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None = None


HOOKS = {
    "allreduce()": _Hook(fsync.ops.allreduce, ("its default hook", None)),
    'allreduce("sum")': _Hook(functools.partial(fsync.ops.allreduce, "sum")),
    "fp16_compress()": _Hook(
        fsync.ops.fp16_compress, ("fp16_compress_hook", default_hooks.fp16_compress_hook)
    ),
    "bf16_compress()": _Hook(
        fsync.ops.bf16_compress, ("bf16_compress_hook", _ddp_bf16_compress_hook)
    ),
    "quantize(8)": _Hook(
        fsync.ops.quantize,
        bucketwise=(
            "DDP's quantization_pertensor_hook, step by step",
            functools.partial(ddp_quantized_mean, per_channel=False),
        ),
    ),
    "noop()": _Hook(fsync.ops.noop),
    "powersgd(1)": _Hook(
        functools.partial(fsync.ops.powersgd, 1, start_step=0), tolerance=POWERSGD
    ),
    "batched_powersgd(3)": _Hook(
        functools.partial(fsync.ops.batched_powersgd, 3, start_step=0), tolerance=POWERSGD
    ),
    "bf16_compress(powersgd(4))": _Hook(
        lambda: fsync.ops.bf16_compress(fsync.ops.powersgd(4, start_step=0)),
        tolerance=POWERSGD_BF16,
    ),
}


def _on_rank_hook(name):
    """``GradSync(hook=...)`` on CUDA for ``STEPS`` steps, each step against its references."""
    hook = HOOKS[name]
    device = _cuda.device()
    rank = dist.get_rank()
    model = ref_model().to(device)
    params, loss_fn = params_of(model), func_loss(model)
    on_gpu, on_cpu, called = (fsync.GradSync(hook=hook.make(), **OPTIONS) for _ in range(3))
    gpu_state, called_state = on_gpu.init(params), called.init(params)
    cpu_state = on_cpu.init(_cuda.on(params, "cpu"))
    ddp = None
    if hook.ddp is not None:
        ddp = _cuda.ddp(model, device, bucket_cap_mb=CAP)
        if hook.ddp[1] is not None:
            ddp.register_comm_hook(None, hook.ddp[1])
    found: dict[str, list[dict]] = {"cpu": [], "call": [], "ddp": []}
    for step in range(STEPS):
        batch = _batch(rank, step, device)
        grads = torch.func.grad(loss_fn)(params, batch)
        out, gpu_state = on_gpu(grads, gpu_state)
        (out_call, _), called_state = called.grad_and_value(loss_fn)(called_state, params, batch)
        if hook.bucketwise is None:
            out_cpu, cpu_state = on_cpu(_cuda.on(grads, "cpu"), cpu_state)
            reference = "the same sync of the same gradients as CPU tensors"
            found["cpu"].append(compare("", reference, out, out_cpu, tolerance=hook.tolerance))
        else:
            reference, per_bucket = hook.bucketwise
            plan = on_gpu.plan(gpu_state, device=device)  # the sync's own buckets
            expected = fsync.unpack([per_bucket(b) for b in fsync.pack(grads, plan)], plan)
            found["ddp"].append(compare("", reference, out, expected))
        reference = "GradSync on torch.func.grad's gradients, on CUDA"
        found["call"].append(compare("", reference, out_call, out))
        if ddp is not None:
            reference = f"DDP with {hook.ddp[0]}"
            found["ddp"].append(compare("", reference, out, _ddp_grads(ddp, batch)))
    checks = {
        "cpu": f"GradSync(hook={name}), {STEPS} steps",
        "call": f"GradSync(hook={name}).grad_and_value, {STEPS} steps",
        "ddp": f"GradSync(hook={name}), {STEPS} steps",
    }
    return [_cuda.merge(rows, checks[kind]) for kind, rows in found.items() if rows]


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("world", [2], indirect=True)
def test_gradsync_with_every_hook(world: World):
    rows = []
    for name in HOOKS:
        rows += _cuda.across_ranks(world.run(_on_rank_hook, name, timeout=TIMEOUT))
    _cuda.report("hooks", rows)
    assert not _cuda.failed(rows), _cuda.failed(rows)


def _on_rank_zero():
    device = _cuda.device()
    rank = dist.get_rank()
    model = ref_model().to(device)
    loss_fn = func_loss(model)
    batch = _batch(rank, 0, device)
    rows = [_local_premise(model, params_of(model), batch)]
    for shard_buckets in (True, False):
        layout = "sharded buckets" if shard_buckets else "whole buckets"
        step = fsync.ops.zero(fsync.optim.adamw(**ADAMW), shard_buckets=shard_buckets, **OPTIONS)
        params = params_of(model)
        state = step.init(params)
        # The overlapped call: each bucket reduced, updated and gathered as backward
        # completes it, the update on the GPU while autograd still runs.
        overlapped, overlapped_state = params_of(model), step.init(params_of(model))
        value_and_step = step.value_and_step(loss_fn)
        adamw = fsync.optim.adamw(**ADAMW)
        whole = params_of(model)
        whole_state = adamw.init(whole)
        ddp = _cuda.ddp(model, device, bucket_cap_mb=CAP)
        torch_zero = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, foreach=False, **ADAMW
        )
        for s in range(STEPS):
            batch = _batch(rank, s, device)
            params, state = step(params, torch.func.grad(loss_fn)(params, batch), state)
            (overlapped, _), overlapped_state = value_and_step(overlapped_state, overlapped, batch)
            synced = fsync.sync_grads(torch.func.grad(loss_fn)(whole, batch))
            whole, whole_state = adamw.update(whole, synced, whole_state)
            torch_zero.zero_grad(set_to_none=True)
            ref_loss(ddp, batch).backward()
            torch_zero.step()
        reference = "fsync.sync_grads, then fsync.optim.adamw on every parameter"
        rows.append(compare(f"ZeRO step, {layout}, {STEPS} steps", reference, params, whole))
        reference = "the ZeRO step on torch.func.grad's gradients"
        check = f"ZeroStep.value_and_step, {layout}, {STEPS} steps"
        rows.append(compare(check, reference, overlapped, params))
        # CUDA's addcdiv kernel computes p + v * (m / d) in one expression (a fused
        # multiply-add where the compiler makes one); fsync.optim spells out (m * v) / d + p,
        # as torch's CPU kernel rounds it (its v is a tensor, which addcdiv does not take).
        # The update differs in its last bits: the parameters by about an ulp a step.
        tolerance = 4 * STEPS * torch.finfo(torch.float32).eps
        theirs = {n: p.detach() for n, p in ddp.module.named_parameters()}
        reference = "DDP + ZeroRedundancyOptimizer(AdamW)"
        check = f"ZeRO step, {layout}, {STEPS} steps"
        rows.append(compare(check, reference, params, theirs, tolerance=tolerance))
    return rows


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("world", [2], indirect=True)
def test_zero_step(world: World):
    _check(world, "zero", _on_rank_zero)


# DeferredSync's mean over 2 micro-batches and 2 ranks is a product by 1/4, exact like DDP's
# 1/2 after no_sync summed the micro-batches: twice fsync's result is DDP's, bit for bit.
MICRO = 2


def _on_rank_deferred():
    device = _cuda.device()
    rank = dist.get_rank()
    model = ref_model().to(device)  # CUDA is initialised before the mesh asks which device
    mesh = init_device_mesh(device.type, (2, 1), mesh_dim_names=("node", "local"))
    params, loss_fn = params_of(model), func_loss(model)
    sync = fsync.DeferredSync(group=mesh, **OPTIONS)
    state = sync.init(params)
    ddp = _cuda.ddp(model, device, bucket_cap_mb=CAP)
    rows = [_local_premise(model, params, _batch(rank, 0, device))]
    found = []
    for step in range(STEPS):
        micro = [_batch(rank, MICRO * step + k, device) for k in range(MICRO)]
        for batch in micro:
            state = sync.add(torch.func.grad(loss_fn)(params, batch), state)
        out, state = sync.finish(state)
        ddp.zero_grad(set_to_none=True)
        with ddp.no_sync():
            for batch in micro[:-1]:
                ref_loss(ddp, batch).backward()
        ref_loss(ddp, micro[-1]).backward()
        expected = {n: p.grad for n, p in ddp.module.named_parameters()}
        found.append(compare("", "", {k: v * MICRO for k, v in out.items()}, expected))
    check = f"DeferredSync on a 2 x 1 mesh, {MICRO} micro-batches (times {MICRO}), {STEPS} steps"
    rows.append({**_cuda.merge(found, check), "reference": "DDP's no_sync"})
    return rows


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("world", [2], indirect=True)
def test_deferred_sync_on_a_2x1_mesh_equals_ddp_no_sync(world: World):
    _check(world, "deferred", _on_rank_deferred)

"""fp16_compress / bf16_compress: against DDP's hooks, as wrappers, and their errors.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from fsync.ops._compress import cast_plan
from tests._models import func_loss, params_of, ref_batch, ref_loss, ref_model
from tests._world import World


def _gathered(tree):
    """Every rank's copy of a dict of tensors: {name: [rank0, rank1, ...]}."""
    out = {}
    for name, t in tree.items():
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        out[name] = parts
    return out


def _half_bound(parts, dtype):
    """How far two implementations of "cast, scale by 1/W, sum in ``dtype``" may be apart.

    Both cast each gradient to ``dtype`` identically (a_i). DDP then divides by W,
    fsync multiplies by 1/W: each result is within one rounding (u = eps/2,
    relative) of a_i / W, so they are within eps * |a_i| / W of each other. The
    W terms are then summed with W - 1 roundings each, possibly in different
    orders: within (W - 1) * u * sum|terms| of the exact sum each, so (W - 1) *
    eps * sum|a_i| / W apart. Total: eps * sum|a_i|, plus, where results are
    subnormal, half the smallest subnormal for each of the 2 * (2W - 1)
    roundings of the two (W scalings and W - 1 additions each).
    """
    info = torch.finfo(dtype)
    world_size = len(parts)
    a = torch.stack([p.to(dtype).double().abs() for p in parts]).sum(0)
    return info.eps * a + 2 * world_size * info.smallest_normal * info.eps


# --- parity with DDP ---------------------------------------------------------------------------


def _ddp_bf16_compress_hook(state, bucket):
    """DDP's own ``bf16_compress_hook``, registered under another name.

    ``DistributedDataParallel.register_comm_hook`` refuses a hook whose ``__name__`` is
    ``bf16_compress_hook`` unless CUDA with NCCL >= 2.10 (or XPU with XCCL) is present:
    the check (``_check_comm_hook``) reads the name, not the backend. The hook itself only
    casts the bucket to bfloat16, divides it by the world size and calls
    ``dist.all_reduce``, which gloo does in bfloat16. Forwarding to it runs DDP's real
    hook, on DDP's real ``GradBucket``s, on gloo.
    """
    return default_hooks.bf16_compress_hook(state, bucket)


_DDP_HOOKS = {
    torch.float16: (default_hooks.fp16_compress_hook, fsync.ops.fp16_compress),
    torch.bfloat16: (_ddp_bf16_compress_hook, fsync.ops.bf16_compress),
}


def _on_rank_ddp_parity(dtype):
    rank = dist.get_rank()
    ddp_hook, fsync_hook = _DDP_HOOKS[dtype]
    model = ref_model()
    cap = 0.001  # several buckets
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=cap)
    ddp.register_comm_hook(None, ddp_hook)
    for step in range(2):  # the second step runs on DDP's rebuilt buckets
        ddp.zero_grad(set_to_none=True)
        ref_loss(ddp, ref_batch(rank, step)).backward()
    ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
    # DDP's hook did run: every gradient it left is a half precision value.
    assert all(torch.equal(g, g.to(dtype).float()) for g in ddp_grads.values())

    grads = torch.func.grad(func_loss(model))(params_of(model), ref_batch(rank, 1))
    synced = fsync.sync_grads(grads, hook=fsync_hook(), bucket_cap_mb=cap, first_bucket_mb=cap)
    exact = {}
    for name, parts in _gathered(grads).items():
        assert synced[name].dtype == torch.float32
        assert synced[name].stride() == ddp_grads[name].stride(), name
        diff = (synced[name].double() - ddp_grads[name].double()).abs()
        assert torch.all(diff <= _half_bound(parts, dtype)), (name, diff.max())
        exact[name] = torch.equal(synced[name], ddp_grads[name])
    # The rounding is real: the half precision mean differs from the float32 one.
    plain = fsync.sync_grads(grads, bucket_cap_mb=cap, first_bucket_mb=cap)
    assert not all(torch.equal(plain[k], synced[k]) for k in grads)
    return exact


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_matches_ddp_compress_hook(world: World, dtype):
    """fp16_compress() / bf16_compress() against DDP's fp16_compress_hook / bf16_compress_hook.

    Both of DDP's hooks run for real, registered on a DDP model over gloo; see
    _ddp_bf16_compress_hook for how the bfloat16 one gets past DDP's NCCL-only name check.
    """
    reports = world.run(_on_rank_ddp_parity, dtype)
    if world.size == 2:
        # Two ranks: a * 0.5 is exact and a + b is one rounding in either order: bitwise.
        assert all(all(r.values()) for r in reports), reports


# --- wrapping another hook ---------------------------------------------------------------------


def _recording_inner(seen):
    def init(plan):
        seen["init_dtypes"] = [spec.dtype for spec in plan.specs]
        return (torch.zeros(2, dtype=plan.specs[0].dtype),)

    def apply(buckets, state, ctx):
        seen["bucket_dtypes"] = [b.dtype for b in buckets]
        seen["spec_dtypes"] = [spec.dtype for spec in ctx.buckets]
        seen["plan_dtypes"] = [leaf.dtype for leaf in ctx.plan.leaves if leaf is not None]
        return [b * 3 for b in buckets], (state[0] + 1,)

    return fsync.Hook(init, apply)


@pytest.mark.parametrize(
    ("wrapper", "dtype"),
    [(fsync.ops.fp16_compress, torch.float16), (fsync.ops.bf16_compress, torch.bfloat16)],
)
def test_wrapper_gives_inner_hook_a_consistent_half_precision_world(wrapper, dtype):
    tree = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(5)}
    plan = fsync.plan_buckets(tree, bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
    seen = {}
    hook = wrapper(_recording_inner(seen))
    state = hook.init(plan)
    assert seen["init_dtypes"] == [dtype, dtype] and state[0].dtype == dtype
    buckets = fsync.pack(tree, plan)
    ctx = fsync.SyncContext(plan, plan.specs, None, 0, 1, 1)
    out, state = hook.apply(buckets, state, ctx)
    assert seen == {
        "init_dtypes": [dtype] * 2,
        "bucket_dtypes": [dtype] * 2,
        "spec_dtypes": [dtype] * 2,
        "plan_dtypes": [dtype] * 2,
    }
    for o, b in zip(out, buckets, strict=True):
        assert o.dtype == b.dtype  # cast back to each bucket's own dtype
        assert torch.equal(o, (b.to(dtype) * 3).to(b.dtype))
    assert torch.equal(state[0], torch.ones(2, dtype=dtype))
    assert cast_plan(plan, dtype).buckets == plan.buckets


def _on_rank_wrapped_powersgd_is_powersgd_in_half():
    """fp16_compress(powersgd) on float32 grads == powersgd on the float16 grads, cast back.

    That is DDP's fp16_compress_wrapper: the inner hook runs on the float16 bucket.
    One bucket either way (a large cap), so both plans hold the same leaves.
    """
    rank = dist.get_rank()
    model = ref_model()
    params = params_of(model)
    inner = {"rank": 2, "start_step": 1, "min_compression_rate": 1.0}
    wrapped = fsync.GradSync(hook=fsync.ops.fp16_compress(fsync.ops.powersgd(**inner)))
    direct = fsync.GradSync(hook=fsync.ops.powersgd(**inner))
    state_w = wrapped.init(params)
    state_d = direct.init({k: v.half() for k, v in params.items()})
    assert all(q.dtype == torch.float16 for q in state_w.hook.q)
    for step in range(3):
        grads = torch.func.grad(func_loss(model))(params, ref_batch(rank, step))
        out_w, state_w = wrapped(grads, state_w)
        out_d, state_d = direct({k: v.half() for k, v in grads.items()}, state_d)
        for k in grads:
            assert out_w[k].dtype == torch.float32
            assert torch.equal(out_w[k], out_d[k].float()), (step, k)
        ours, reference = state_w.hook, state_d.hook
        for a, b in zip(ours.error + ours.q, reference.error + reference.q, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_wrapping_powersgd_runs_it_in_half_precision(world: World):
    world.run(_on_rank_wrapped_powersgd_is_powersgd_in_half)


# --- misuse ------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", [fsync.ops.fp16_compress, fsync.ops.bf16_compress])
def test_compressing_an_integer_bucket_raises(wrapper):
    tree = {"steps": torch.zeros(3, dtype=torch.int64), "w": torch.zeros(2)}
    plan = fsync.plan_buckets(tree, bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
    name = wrapper.__name__
    match = rf"{name} got bucket 1 of dtype torch.int64 \(first leaf 'steps'\); it works on"
    with pytest.raises(TypeError, match=match):
        wrapper().init(plan)
    ctx = fsync.SyncContext(plan, plan.specs, None, 0, 1, 1)
    with pytest.raises(TypeError, match=match):
        wrapper().apply(fsync.pack(tree, plan), (), ctx)
    with pytest.raises(TypeError, match=r"expected an fsync\.Hook"):
        wrapper(torch.float16)

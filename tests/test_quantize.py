"""quantize: against DDP's quantisation hooks' own operations, accuracy, wire size, misuse.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

import fsync
from fsync import _comm
from tests._ddp_quantization import all_gather, ddp_quantized_mean
from tests._models import func_loss, params_of, ref_batch, ref_model
from tests._world import World

CAP = {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001}  # several buckets
EPS = torch.finfo(torch.float32).eps


def _on_rank_ddp_parity(per_channel):
    rank = dist.get_rank()
    model = ref_model()
    grads = torch.func.grad(func_loss(model))(params_of(model), ref_batch(rank))
    plan = fsync.plan_buckets(grads, **CAP)
    hook = fsync.ops.quantize(8, per_channel=per_channel, channel_size=64)
    synced = fsync.pack(fsync.sync_grads(grads, hook=hook, **CAP), plan)
    exact = []
    for ours, bucket in zip(synced, fsync.pack(grads, plan), strict=True):
        reference = ddp_quantized_mean(bucket, per_channel, 64)
        # Same operations in the same order but the last: DDP divides by W (one
        # rounding), fsync multiplies by 1/W rounded to float32 (two): three roundings
        # of the same quotient, within gamma_3 = 3u / (1 - 3u) (u = eps / 2) of DDP's
        # result, and equal when 1/W is a power of two.
        u = EPS / 2
        assert torch.all((ours - reference).abs() <= 3 * u / (1 - 3 * u) * reference.abs())
        exact.append(torch.equal(ours, reference))
    return exact


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_8_bits_match_ddp_quantization_hooks(world: World, per_channel):
    reports = world.run(_on_rank_ddp_parity, per_channel)
    if world.size == 2:
        assert all(all(r) for r in reports), reports


def _on_rank_error_bound(bits, per_channel):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    # Magnitudes that vary along the bucket, a constant stretch and an exact zero.
    grads = {
        "w": torch.randn(40, 30, generator=g) * torch.logspace(-3, 1, 30),
        "c": torch.full((100,), 0.25 * (rank + 1)),
        "z": torch.zeros(7),
    }
    hook = fsync.ops.quantize(bits, per_channel=per_channel, channel_size=100)
    plan = fsync.plan_buckets(grads)
    (bucket,) = fsync.pack(grads, plan)
    (out,) = fsync.pack(fsync.sync_grads(grads, hook=hook), plan)
    levels = 2**bits - 1
    # Each rank's scale per element, as the min-max observer computes it.
    observer_cls = PerChannelMinMaxObserver if per_channel else MinMaxObserver
    observer = observer_cls(quant_min=0, quant_max=levels)
    if per_channel:
        channels = math.ceil(len(bucket) / 100)
        observer(torch.nn.functional.pad(bucket, (0, channels * 100 - len(bucket))).view(-1, 100))
        scale = observer.calculate_qparams()[0].repeat_interleave(100)[: len(bucket)]
    else:
        observer(bucket)
        scale = observer.calculate_qparams()[0].expand(len(bucket))
    scales = torch.stack(all_gather(scale.contiguous()))
    mean = torch.stack([p.double() for p in all_gather(bucket)]).mean(0)
    # Rounding to the nearest level is off by at most half a scale per rank (the
    # clamp at the ends included: min and max are within half a level of the
    # grid). In float32, with u = eps / 2 and L = levels: x / scale, the zero point's
    # low / scale, range / L and the dequantising product round once each, each at
    # most u * L scales (4 u L = 2 L eps at the clamp); the W - 1 additions of the
    # dequantised values (each at most L scales) (W - 1) u L scales; 1/W and the
    # product 2 u of the result (eps |mean|, and eps / 2 scales for its own error).
    per_scale = 0.5 + ((world_size + 3) / 2 * levels + 1) * EPS
    bound = per_scale * scales.double().sum(0) / world_size + EPS * mean.abs()
    err = (out.double() - mean).abs()
    assert torch.all(err <= bound), (err - bound).max()
    # And it is not the exact mean: quantisation did happen.
    assert not torch.equal(out.double(), mean)


# Three ranks (a mean that is not a power-of-two scaling); 8 bits is DDP's, checked above.
@pytest.mark.parametrize("world", [3], indirect=True)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_each_rank_is_off_by_at_most_half_its_scale(world: World, bits, per_channel):
    world.run(_on_rank_error_bound, bits, per_channel)


# --- what goes on the wire -----------------------------------------------------------------------


def _on_rank_wire(bits, per_channel):
    calls = []
    originals = (_comm.all_gather, _comm.all_reduce)

    def gather(x, group):
        calls.append(("all_gather", x.numel() * x.element_size(), x.dtype))
        return originals[0](x, group)

    def reduce(x, op, group, **kwargs):
        calls.append(("all_reduce", x.numel() * x.element_size(), x.dtype))
        return originals[1](x, op, group, **kwargs)

    _comm.all_gather, _comm.all_reduce = gather, reduce
    try:
        model = ref_model()
        grads = torch.func.grad(func_loss(model))(params_of(model), ref_batch(0))
        hook = fsync.ops.quantize(bits, per_channel=per_channel, channel_size=100)
        fsync.sync_grads(grads, hook=hook, **CAP)
    finally:
        _comm.all_gather, _comm.all_reduce = originals
    return calls, [spec.numel for spec in fsync.plan_buckets(grads, **CAP).specs]


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("bits", [2, 8])
def test_one_all_gather_of_the_quantised_bucket_and_its_scales(world: World, bits, per_channel):
    calls, numels = world.run(_on_rank_wire, bits, per_channel)[0]
    expected = []
    for numel in numels:
        channels = math.ceil(numel / 100) if per_channel else 1
        values = channels * 100 if per_channel else numel
        # bits per value, rounded up to whole bytes, and a float32 scale and zero point
        # per channel.
        expected.append(("all_gather", math.ceil(values * bits / 8) + 8 * channels, torch.uint8))
    # sync_grads first has the ranks agree (one all-reduce of 13 int64), then the buckets.
    check, *calls = calls
    assert check == ("all_reduce", 13 * 8, torch.int64)
    assert calls == expected
    if bits == 8 and not per_channel:  # a quarter of the float32 payload, plus 8 bytes
        assert [c[1] for c in calls] == [n + 8 for n in numels]


# --- misuse --------------------------------------------------------------------------------------


def test_bad_settings_and_integer_buckets_raise():
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 4, 8\); got 3"):
        fsync.ops.quantize(3)
    with pytest.raises(ValueError, match="channel_size must be an int >= 1; got 0"):
        fsync.ops.quantize(per_channel=True, channel_size=0)
    tree = {"n": torch.zeros(4, dtype=torch.int64)}
    plan = fsync.plan_buckets(tree)
    ctx = fsync.SyncContext(plan, plan.specs, None, 0, 1, 1)
    with pytest.raises(
        TypeError,
        match=r"quantize got bucket 0 of dtype torch\.int64 \(first leaf 'n'\); it works on",
    ):
        fsync.ops.quantize().apply(fsync.pack(tree, plan), (), ctx)

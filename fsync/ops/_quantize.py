"""Quantised all-gather: DDP's ``quantization_pertensor_hook`` and ``..._perchannel_hook``.

Each rank quantises its bucket to ``bits``-bit unsigned integers with an affine
scale and zero point (computed as ``torch.ao.quantization``'s min-max observer
computes them), gathers every rank's quantised bucket with its parameters,
dequantises all of them and takes the mean. Quantisation is not linear, so the
sum cannot be taken on the wire: this is an all-gather, whose traffic grows
with the number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from fsync import _comm
from fsync._checks import check_floating
from fsync._hook import Buckets, Hook, SyncContext, spec_of

BITS = (1, 2, 4, 8)
# The observer's floor on the scale, so that a constant bucket does not divide by zero.
_MIN_SCALE = torch.finfo(torch.float32).eps


def _qparams(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of ``x`` (float32): the min-max observer's affine ones."""
    low = torch.clamp(x.amin(dim=1), max=0.0)
    high = torch.clamp(x.amax(dim=1), min=0.0)
    scale = torch.clamp((high - low) / float(levels), min=_MIN_SCALE)
    zero_point = torch.clamp(0.0 - torch.round(low / scale), 0, levels)
    return scale, zero_point


def _pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``8 // bits`` values of ``bits`` bits per byte (the first in the lowest bits)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return q
    q = torch.nn.functional.pad(q, (0, -q.numel() % per_byte)).view(-1, per_byte)
    packed = q[:, 0]
    for j in range(1, per_byte):
        packed = packed | (q[:, j] << (bits * j))
    return packed


def _unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[..., :numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    values: torch.Tensor = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return values.flatten(-2)[..., :numel]


def _message_size(numel: int, bits: int, per_channel: bool, channel_size: int) -> tuple[int, int]:
    """(channels, bytes) of one rank's message for a bucket of ``numel`` elements."""
    channels = -(-numel // channel_size) if per_channel else 1
    values = channels * channel_size if per_channel else numel
    per_byte = 8 // bits
    return channels, 8 * channels + -(-values // per_byte)


def quantize(bits: int = 8, *, per_channel: bool = False, channel_size: int = 512) -> Hook:
    """Averages ``bits``-bit quantised buckets, gathered from every rank.

    DDP's ``quantization_pertensor_hook`` (``per_channel=False``) and
    ``quantization_perchannel_hook`` (``per_channel=True``, one scale per
    ``channel_size`` elements), with ``bits=8`` giving their results. Each rank
    maps its bucket onto ``2**bits`` levels between ``min(x, 0)`` and
    ``max(x, 0)``, all ranks exchange their levels and scales in a single
    all-gather per bucket (DDP needs two, one after the other), and every rank
    dequantises and averages them in rank order. Each rank's contribution is
    off by at most half its scale, ``(max - min) / (2**bits - 1) / 2``; values
    below 8 bits are packed several to a byte.

    Bytes on the wire per step: every rank sends ``numel * bits / 8`` bytes
    plus 8 per scale, a quarter of a float32 all-reduce's payload at 8 bits.
    But an all-gather delivers every rank's message to every rank: with a ring
    each rank moves ``(W - 1) * numel * bits / 8`` bytes against
    ``2 * (W - 1) / W * numel * 4`` for a float32 all-reduce, a ratio of
    ``W * bits / 64``: less traffic than all-reduce only below ``64 / bits``
    ranks (8 ranks at 8 bits).

    Args:
        bits: Bits per value: 1, 2, 4 or 8.
        per_channel: One scale per ``channel_size`` elements instead of one per
            bucket: more accurate where magnitudes vary along the bucket.
        channel_size: Elements per channel (DDP's ``bucket_size``, 512).

    Returns:
        A stateless [fsync.Hook][].

    Raises:
        ValueError: ``bits`` is not 1, 2, 4 or 8, or ``channel_size < 1``;
            at ``apply``: a bucket is not floating point.

    Example:
        >>> import torch, fsync
        >>> grads = {"w": torch.tensor([-1.0, 0.0, 0.25, 3.0])}
        >>> fsync.sync_grads(grads, hook=fsync.ops.quantize(bits=4))["w"]  # levels of 4 / 15
        tensor([-1.0667,  0.0000,  0.2667,  2.9333])
    """
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}; got {bits!r}.")
    if isinstance(channel_size, bool) or not isinstance(channel_size, int) or channel_size < 1:
        raise ValueError(f"channel_size must be an int >= 1; got {channel_size!r}.")
    levels = 2**bits - 1

    def init(plan: Any) -> tuple[()]:
        return ()

    def reduce(bucket: torch.Tensor, ctx: SyncContext) -> torch.Tensor:
        numel = bucket.numel()
        if numel == 0:
            return bucket
        channels, message = _message_size(numel, bits, per_channel, channel_size)
        x = bucket.to(torch.float32)
        if per_channel:
            x = torch.nn.functional.pad(x, (0, channels * channel_size - numel))
        x = x.view(channels, -1)
        scale, zero_point = _qparams(x, levels)
        q = torch.clamp(torch.round(x / scale[:, None]) + zero_point[:, None], 0, levels)
        header = torch.cat([scale, zero_point]).view(torch.uint8)
        payload = torch.cat([header, _pack_bits(q.to(torch.uint8).view(-1), bits)])
        gathered = _comm.wait(_comm.all_gather(payload, ctx.group)).view(-1, message)
        world_size = gathered.shape[0]
        params = gathered[:, : header.numel()].reshape(-1).view(torch.float32)
        scales, zero_points = params.view(world_size, 2, channels).unbind(1)
        received = _unpack_bits(gathered[:, header.numel() :], bits, x.numel())
        total = torch.zeros_like(x)
        for r in range(world_size):  # dequantised and summed in rank order, as DDP sums them
            values = received[r].view(channels, -1).to(torch.float32)
            total = total + scales[r, :, None] * (values - zero_points[r, :, None])
        return ctx.divide(total.view(-1)[:numel]).to(bucket.dtype)

    def apply(buckets: Buckets, state: Any, ctx: SyncContext) -> tuple[Buckets, Any]:
        check_floating("quantize", ctx.plan, ctx.buckets)
        return [reduce(b, ctx) for b in buckets], state

    settings = {"per_channel": per_channel, "channel_size": channel_size}
    spec = spec_of("quantize", bits=bits, **settings)
    return Hook(init, apply, spec, bucketwise=True)

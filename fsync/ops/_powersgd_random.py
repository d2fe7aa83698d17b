"""PowerSGD's random Q: a counter-based draw, the same on every rank and traceable.

Without warm start (and for the first Q of a state) PowerSGD starts its power
iteration from a standard normal matrix. DDP reseeds torch's global generator
from a NumPy ``RandomState`` kept in its hook state; here the draw is a pure function
of ``(seed, bucket, step)``: a 32-bit integer hash of a counter, turned into normal
values by Box-Muller. Nothing is kept between draws, so every rank draws the same
values, and the draw traces under ``torch.compile`` with the step read from the
state's tensor counter.

Owns: the key of a bucket's stream and the draw from it. May import: torch only.
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch

_MASK32 = 0xFFFFFFFF

_Int = TypeVar("_Int", int, torch.Tensor)  # a Python int or an int64 tensor of values < 2**32


def _mul32(x: _Int, c: int) -> _Int:
    """``x * c`` modulo 2**32 for ``0 <= x, c < 2**32``, without leaving int64's range."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: _Int) -> _Int:
    """A 32-bit integer hash (Wellons' lowbias32): every input bit flips about half the output."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def key(seed: int, bucket: int, step: torch.Tensor) -> torch.Tensor:
    """The random stream of one bucket at one step, as a 0-d int64 tensor."""
    seed %= 2**64
    base = _mix32(_mix32(_mix32(seed & _MASK32) ^ (seed >> 32)) ^ bucket)
    return _mix32((step & _MASK32) ^ base)


def gaussian(
    numel: int, key: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``numel`` standard normal values, a pure function of ``key`` (Box-Muller over a hash).

    A counter-based draw rather than a ``torch.Generator``: the values depend on
    nothing but the key, so every rank draws the same ones, and the draw traces
    under ``torch.compile`` with the key coming from the tensor step counter.
    """
    pairs = (numel + 1) // 2
    counter = torch.arange(2 * pairs, dtype=torch.int64, device=device)
    bits = _mix32(_mix32(counter) ^ key.to(device))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24  # in (0, 1)
    radius = torch.sqrt(-2.0 * torch.log(uniform[:pairs]))
    angle = (2.0 * math.pi) * uniform[pairs:]
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:numel].to(dtype)

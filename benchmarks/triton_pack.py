"""A candidate CUDA kernel for ``fsync::pack``: one Triton kernel copies and scales a bucket.

``benchmarks/gpu.py`` times it beside the op's own CUDA kernels (``fsync._pack.pack_parts``:
a batched copy, then the scale in place, two passes over the bucket): ``install`` makes
the op's CUDA kernel one that runs this kernel inside ``using()`` and the op's own outside.
One program per block of 1,024 elements of one leaf: it reads its leaf's address from a
table made on every call (the gradients are new tensors each step), casts to the
bucket's dtype, multiplies by ``float32(factor)`` in float32 (DDP's arithmetic on CUDA)
and stores into the bucket. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (float32
bit for bit; the interpreter truncates float32 to bfloat16 where a GPU rounds to nearest).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
import triton
import triton.language as tl

from fsync._pack import pack_parts

BLOCK = 1024
_ACTIVE = [False]  # whether the op's CUDA kernel is this one (``using``)


@triton.jit
def _pack_kernel(  # type: ignore[no-untyped-def]
    sources, starts, block_leaf, block_inner, numels, out, factor, size: tl.constexpr,
    scaled: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    leaf = tl.load(block_leaf + pid)
    inner = tl.load(block_inner + pid)
    n = tl.load(numels + leaf)
    start = tl.load(starts + leaf)
    source = tl.load(sources + leaf).to(tl.pointer_type(out.dtype.element_ty))
    index = inner + tl.arange(0, size)
    mask = index < n
    x = tl.load(source + index, mask=mask)
    if scaled:
        x = (x.to(tl.float32) * factor).to(out.dtype.element_ty)
    tl.store(out + start + index, x, mask=mask)


@functools.lru_cache(maxsize=64)
def _tables(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per leaf its start in the bucket and its size; per block its leaf and offset in it."""
    starts, leaf_of, inner = [], [], []
    at = 0
    for j, n in enumerate(numels):
        starts.append(at)
        at += n
        leaf_of += [j] * -(-n // BLOCK)
        inner += list(range(0, n, BLOCK))
    return tuple(
        torch.tensor(xs, dtype=torch.int64, device=device)
        for xs in (starts, leaf_of, inner, list(numels))
    )


def pack(
    parts: Sequence[torch.Tensor], after: torch.Tensor | None, dtype: torch.dtype, factor: float
) -> torch.Tensor:
    """``fsync::pack``'s result (``fsync._pack.pack_op``) from one kernel launch."""
    flat = [part.reshape(-1) for part in parts]
    flat = [f if f.dtype == dtype else f.to(dtype) for f in flat]  # the op's order: cast, scale
    device = flat[0].device
    starts, leaf_of, inner, numels = _tables(tuple(f.numel() for f in flat), device)
    out = torch.empty(sum(f.numel() for f in flat), dtype=dtype, device=device)
    sources = torch.tensor([f.data_ptr() for f in flat], dtype=torch.int64).to(device)
    _pack_kernel[(leaf_of.numel(),)](
        sources, starts, leaf_of, inner, numels, out, factor, size=BLOCK, scaled=factor != 1.0
    )
    return out


def install() -> None:
    """Registers ``fsync::pack``'s CUDA kernel as this one inside ``using()``, the op's own
    outside it (once per process)."""

    def kernel(
        parts: Sequence[torch.Tensor], after: torch.Tensor | None, dtype: torch.dtype, factor: float
    ) -> torch.Tensor:
        return pack(parts, after, dtype, factor) if _ACTIVE[0] else pack_parts(parts, dtype, factor)

    torch.library.register_kernel("fsync::pack", "cuda", kernel)


@contextlib.contextmanager
def using() -> Iterator[None]:
    """``fsync::pack`` on CUDA through this kernel (``install`` first)."""
    _ACTIVE[0] = True
    try:
        yield
    finally:
        _ACTIVE[0] = False

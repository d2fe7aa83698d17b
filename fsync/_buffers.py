"""The CPU memory a plan's buckets are packed into, kept from one eager call to the next.

DDP keeps its buckets for the life of the module. A fresh buffer per call costs the CPU
the page faults of memory that glibc gave back to the system when the last call's
buffers were freed: on the GPT's 80 MiB of gradients, about 20,000 faults a step and 4 %
of its CPU-bound step on 2 cores (the guide "Performance").
So each plan keeps, per bucket, up to two buffers (a training loop still holds the
previous step's gradients while the next call packs) and hands one out again only when
nothing of its last hand-out is alive. A hand-out is a tensor with a storage of its own
over the kept memory (``torch.from_dlpack``), watched through a weak reference to that
storage: while the caller holds any result, view or storage of it, a later call packs
elsewhere, so no result is ever written by a later call.

Only on the CPU (CUDA's caching allocator reuses freed memory already) and for buckets of
256 KiB or more (glibc keeps smaller blocks in its free lists); a plan keeps memory while
it is one of the last ``KEPT_PLANS`` planned.

Owns: the kept bucket memory. May import: ``_plan`` (layer 2).
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.utils.dlpack
from torch.multiprocessing.reductions import StorageWeakRef

from fsync._plan import BucketPlan, BucketSpec

# Plans whose buckets keep memory (a training loop syncs one or a few trees), the buffers
# kept per bucket, and the smallest bucket worth keeping, in bytes.
KEPT_PLANS = 4
PER_BUCKET = 2
SMALLEST = 256 * 1024


class Kept:
    """The kept buffers of one plan's buckets (thread-safe: the buckets of one call are
    packed on autograd's thread, and calls may run on several)."""

    def __init__(self, plan: BucketPlan) -> None:
        self._lock = threading.Lock()
        # Per bucket: (kept memory, weak reference to the storage of its last hand-out).
        self._held: list[list[tuple[torch.Tensor, StorageWeakRef]]] = [[] for _ in plan.specs]

    def buffer(self, k: int, spec: BucketSpec) -> torch.Tensor:
        """An uninitialised buffer for bucket ``k`` (of ``spec``): kept memory that nothing
        handed out before still uses, or new memory."""
        if spec.device.type != "cpu" or spec.numel * spec.dtype.itemsize < SMALLEST:
            return torch.empty(spec.numel, dtype=spec.dtype, device=spec.device)
        with self._lock:
            held = self._held[k]
            for j, (memory, handed_out) in enumerate(held):
                if handed_out.expired():  # type: ignore[no-untyped-call]
                    buffer, held[j] = _hand_out(memory)
                    return buffer
            memory = torch.empty(spec.numel, dtype=spec.dtype, device=spec.device)
            if len(held) == PER_BUCKET:  # every kept buffer is still in use: a new one
                return memory
            buffer, entry = _hand_out(memory)
            held.append(entry)
            return buffer


def _hand_out(memory: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, StorageWeakRef]]:
    """A tensor over ``memory`` with a storage of its own, and the entry that watches it."""
    buffer = torch.utils.dlpack.from_dlpack(memory)
    return buffer, (memory, StorageWeakRef(buffer.untyped_storage()))  # type: ignore[no-untyped-call]


@functools.lru_cache(maxsize=KEPT_PLANS)
def kept(plan: BucketPlan) -> Kept:
    """The kept buffers of ``plan``'s buckets."""
    return Kept(plan)

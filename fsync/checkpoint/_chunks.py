"""A rank's elements of a leaf, described to DCP as chunks of the leaf's global tensor.

A ZeRO step's rank holds, of each leaf of each per-parameter slot of the optimizer
state, a contiguous range ``[lo, hi)`` of the leaf's elements in the plan's memory
order (``_zero._layout``: a bucket's shard crosses leaves where it likes). DCP
(``torch.distributed.checkpoint``) reshards tensors made of rectangular chunks
(offsets and sizes per dimension), so ``boxes`` cuts such a range into the few
rectangles it covers (at most two per dimension, plus one), each of them one run of
consecutive elements, and ``Chunks`` is the tensor DCP is handed: its shape and dtype
are the leaf's, its data only this rank's rectangles, views of the rank's flat piece.

``Chunks`` speaks DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, as ``DTensor`` and torch's
``LocalShardsWrapper`` do), so ``dcp.save`` writes each rectangle where it lies and
``dcp.load`` reads into the rectangles whatever chunks another world wrote; and the
few operations ``dcp.async_save``'s staging runs on it (``new_empty``, ``detach``,
``_to_copy``, ``clone``), so that it stages to the CPU without a global copy. Nothing
else is defined on it: it is a description for DCP, not a tensor to compute with.

Owns: the rectangles of a flat range and the tensor that carries them. May import:
``_comm`` (for DCP's types) and torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fsync import _comm

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of a rectangle, one entry per dimension."""


def boxes(shape: Sequence[int], lo: int, hi: int) -> Iterator[Box]:
    """The rectangles of row-major elements ``[lo, hi)`` of a tensor of ``shape``, in order.

    Each rectangle is a fixed index in the leading dimensions, a range in one, and
    every index in the trailing ones, so its elements are consecutive in row-major
    order: rectangle ``k`` holds the next ``prod(sizes)`` elements after those before it.

    Example:
        >>> list(boxes((3, 4), 2, 11))
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    shape = tuple(shape)
    if lo >= hi:
        return
    if not shape:
        yield (), ()
        return
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    first, last = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0:
        yield (first, *zeros), (hi // inner - first, *shape[1:])
        return
    if first == last:
        base = first * inner
        for offsets, sizes in boxes(shape[1:], lo - base, hi - base):
            yield (first, *offsets), (1, *sizes)
        return
    start = first
    if lo % inner:
        for offsets, sizes in boxes(shape[1:], lo % inner, inner):
            yield (first, *offsets), (1, *sizes)
        start = first + 1
    stop = hi // inner
    if stop > start:
        yield (start, *zeros), (stop - start, *shape[1:])
    if hi % inner:
        for offsets, sizes in boxes(shape[1:], 0, hi % inner):
            yield (stop, *offsets), (1, *sizes)


def range_chunks(
    flat: torch.Tensor, shape: Sequence[int], perm: Sequence[int], lo: int
) -> tuple[list[Box], list[torch.Tensor]]:
    """The rectangles of a leaf of ``shape`` that the 1-D ``flat`` holds, and their views.

    ``flat`` is the leaf's elements ``[lo, lo + len(flat))`` in the memory order
    ``perm`` (the plan's ``LeafSpec.perm``: dimension ``perm[0]`` outermost). The
    rectangles are in the leaf's own dimensions, each view shaped like its rectangle
    and sharing ``flat``'s memory (a load writes through it into ``flat``).
    """
    ordered = [shape[d] for d in perm]
    back = sorted(range(len(perm)), key=lambda k: perm[k])  # the inverse permutation
    found: list[Box] = []
    views: list[torch.Tensor] = []
    start = 0
    for offsets, sizes in boxes(ordered, lo, lo + flat.numel()):
        n = math.prod(sizes)
        views.append(flat[start : start + n].view(sizes).permute(back))
        found.append((tuple(offsets[k] for k in back), tuple(sizes[k] for k in back)))
        start += n
    return found, views


class Chunks(torch.Tensor):
    """A tensor of ``shape`` of which this rank holds only ``parts`` at ``offsets``.

    For DCP only (``dcp.save``, ``dcp.async_save``, ``dcp.load``): its shape, dtype and
    device are the global tensor's, its data the parts (views that a load writes into).
    An empty list of parts is a rank that holds nothing of it.
    """

    __slots__ = ("_offsets", "_parts")
    _offsets: list[tuple[int, ...]]
    _parts: list[torch.Tensor]

    @staticmethod
    def __new__(
        cls,
        parts: Sequence[torch.Tensor],
        offsets: Sequence[Sequence[int]],
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> Chunks:
        made = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        made._parts = list(parts)
        made._offsets = [tuple(o) for o in offsets]
        return made

    def _with(self, parts: Sequence[torch.Tensor], device: torch.device | None = None) -> Chunks:
        """The same rectangles over other ``parts``."""
        device = self.device if device is None else device
        return Chunks(parts, self._offsets, self.shape, self.dtype, device)

    @property
    def parts(self) -> list[torch.Tensor]:
        """This rank's rectangles, each shaped as its chunk."""
        return self._parts

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        aten = torch.ops.aten
        self = args[0]
        if func is aten.new_empty.default:  # staging: parts of the same shapes
            device = kwargs.get("device") or self.device
            return self._with([torch.empty_like(p, device=device) for p in self._parts], device)
        if func is aten.detach.default:
            return self._with([p.detach() for p in self._parts])
        if func is aten._to_copy.default:
            parts = [aten._to_copy.default(p, *args[1:], **kwargs) for p in self._parts]
            return self._with(parts, parts[0].device if parts else kwargs.get("device"))
        if func is aten.clone.default:
            return self._with([p.clone() for p in self._parts])
        raise NotImplementedError(
            f"{func} is not defined on fsync.checkpoint's chunks: they describe a rank's part "
            "of a tensor to torch.distributed.checkpoint and hold nothing to compute with."
        )

    def _chunk(self, k: int) -> Any:
        dcp = _comm.checkpointing()
        return dcp.metadata.ChunkStorageMetadata(
            offsets=torch.Size(self._offsets[k]), sizes=self._parts[k].shape
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        dcp = _comm.checkpointing()
        properties = dcp.metadata.TensorProperties(dtype=self.dtype)
        return [
            dcp.planner.WriteItem(
                index=dcp.metadata.MetadataIndex(fqn, torch.Size(self._offsets[k])),
                type=dcp.planner.WriteItemType.SHARD,
                tensor_data=dcp.planner.TensorWriteData(
                    chunk=self._chunk(k), properties=properties, size=self.shape
                ),
            )
            for k in range(len(self._parts))
        ]

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk(k) for k in range(len(self._parts))]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        k: int | None = index.index
        if k is not None and k < len(self._parts) and self._offsets[k] == tuple(index.offset):
            return self._parts[k]
        for offsets, part in zip(self._offsets, self._parts, strict=True):
            if offsets == tuple(index.offset or ()):
                return part
        raise ValueError(f"no chunk of {index.fqn!r} at offsets {tuple(index.offset or ())}")

    def __repr__(self) -> str:  # type: ignore[override]
        held = ", ".join(
            f"{o} {tuple(p.shape)}" for o, p in zip(self._offsets, self._parts, strict=True)
        )
        return f"Chunks({tuple(self.shape)}, {self.dtype}: {held or 'none here'})"

"""A stand-in group that records the collectives of a sync instead of issuing them.

``fsync.sync_stats`` runs a sync over a ``Recorder`` to count its bytes and collectives
without a process group; ``_comm`` answers every collective over one with a tensor of
the right shape.

Owns: the recorder and what it records. May import: torch only (layer 1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Collective(NamedTuple):
    """One collective as a recorder saw it: what this rank put on the wire.

    ``control`` marks fsync's own small collectives (the ranks' agreement), as
    opposed to those that move the buckets.
    """

    op: str
    dtype: torch.dtype
    numel: int
    control: bool = False
    dim: int | None = None
    """The mesh dim the collective ran over (0 across nodes, 1 within a node); ``None``
    for a whole group."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Recorder:
    """A stand-in group whose collectives are recorded instead of issued.

    Pass it wherever a group goes: every fsync collective over it appends a
    ``Collective`` to ``calls`` and returns a tensor of the right
    shape (the input's values, repeated for an all-gather, this rank's chunk
    for a reduce-scatter), as if on ``world_size`` ranks, so a sync runs to the
    end without a process group. For diagnostics ([fsync.sync_stats][]), never
    training.

    Attributes:
        world_size: The number of ranks the recorded collectives are sized for.
        rank: The rank this process plays.
        calls: The collectives issued so far, in order.
        shape: ``(nodes, local)`` when the recorder stands in for a 2-D mesh (see
            ``hierarchy``), else ``()``.
        dim: The mesh dim this recorder stands for (one of a 2-D recorder's
            ``hierarchy``), else ``None``.
    """

    def __init__(
        self,
        world_size: int,
        rank: int = 0,
        *,
        shape: tuple[int, ...] = (),
        dim: int | None = None,
        calls: list[Collective] | None = None,
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.shape = shape
        self.dim = dim
        self.calls: list[Collective] = [] if calls is None else calls

    def record(self, op: str, x: torch.Tensor, *, control: bool = False) -> None:
        """Appends one collective of ``op`` on ``x`` to ``calls``."""
        self.calls.append(Collective(op, x.dtype, x.numel(), control, self.dim))

    def answer(
        self, op: str, x: torch.Tensor, reduce_op: str = "sum", *, control: bool = False
    ) -> torch.Tensor:
        """Records ``op`` on ``x`` and returns its result as if every rank held ``x``: the
        ranks' ``x`` concatenated for an all-gather, this rank's chunk for a reduce-scatter,
        a sum ``world_size`` times ``x``."""
        self.record(op, x, control=control)
        if op == "all_gather":
            return torch.cat([x] * self.world_size)
        if op == "reduce_scatter":
            x = x.chunk(self.world_size)[self.rank]
        if op != "broadcast" and reduce_op == "sum":
            return x * self.world_size
        return x.clone()

    def along(self, dim: int) -> Recorder:
        """The recorder of one dim of a 2-D recorder: it appends to the same ``calls``."""
        return Recorder(self.shape[dim], 0, dim=dim, calls=self.calls)

    def __repr__(self) -> str:
        shape = f", shape={self.shape}" if self.shape else ""
        return f"Recorder(world_size={self.world_size}, rank={self.rank}{shape})"

"""A replica group of several ranks as one two-level fsync group: ``ReplicaMesh``.

Within it, its own c10d group (its ranks, torchrun's, say); across, the
``ManagerGroup`` of each rank. Rank ``r`` of a replica group crosses to the other
replicas with rank ``r`` of theirs, so a crossing is waited for as it is issued and
its outcome agreed by the group's ranks (``_InStep``): all of them go on, or all stop.
``meet_within`` is the group's ranks meeting (before their Managers start, before
they close).

Owns: the two-level group over replica groups and its ranks' meetings. May import:
``_comm`` (with ``_comm._groups``), ``fsync.ft._manager_group``.
"""

from __future__ import annotations

from typing import Any

import torch

from fsync import _comm
from fsync._comm import _groups
from fsync.ft._manager_group import ManagerGroup

_WITHIN = "the replica group's own collective, within it"


class _OverReplicas(_groups.ReplicaGroup):
    """A group made over the replicas' group ``across`` (``ReplicaMesh``, ``_InStep``): each
    crossing waited for as it is issued, control tensors where ``across`` keeps them, and
    what a failed crossing leaves for a wait ``across``'s to settle (``Replica.step``
    settles its ``ManagerGroup``)."""

    across: _groups.ReplicaGroup

    @property
    def unsettled(self) -> list[torch.Tensor]:
        """The replicas' group's: the step settles that one."""
        return self.across.unsettled

    @property
    def device(self) -> torch.device:
        """Where fsync puts this group's small control tensors (``across``'s place)."""
        return self.across.device


class ReplicaMesh(_OverReplicas):
    """Replica groups of several ranks and the live replicas, as one two-level fsync group.

    Its levels are a 2-D mesh's (``_comm.hierarchy``): ``within``, the ranks of this
    replica group (a c10d group of fixed members, torchrun's, say), and ``across``, rank
    ``r`` of every live replica (the ``ManagerGroup`` of this rank's Manager). A sync over
    it is hierarchical, as over a ``(nodes, local)`` mesh: each bucket reduce-scattered
    within, this rank's ``1/local`` shard reduced across replicas through the Manager, the
    shards gathered within; a hook (and its state) sees the shards. Its own collectives
    (the agreement, the gathers that name a disagreement) run within, then across.

    Args:
        within: This replica group's ranks (``dist.group.WORLD`` under a torchrun of its
            own).
        across: The live replicas (``Replica``'s ``ManagerGroup``). Its crossings are
            waited for as they are issued, and their outcome agreed within (``_InStep``),
            whatever ``across`` does alone, where its all-reduces stay in flight.
    """

    def __init__(self, within: Any, across: ManagerGroup) -> None:
        self.within, self.across = within, across
        self._crossing = _InStep(across, within)

    def __repr__(self) -> str:
        return f"ReplicaMesh(within={self.within!r}, across={self.across!r})"

    def levels(self) -> tuple[_comm.Group, _comm.Group]:
        """``(across, within)``: the replicas (each crossing agreed within, see ``_InStep``),
        then this replica group's ranks."""
        return self._crossing, self.within

    def size(self) -> int:
        """Every rank of the quorum's replica groups; this group's ranks between steps."""
        return self.across.size() * _comm.size(self.within)

    def rank(self) -> int:
        """This rank among them, replica by replica (as a mesh's ranks, row-major)."""
        return self.across.rank() * _comm.size(self.within) + _comm.rank(self.within)

    def all_reduce(self, x: torch.Tensor, op: str) -> _groups.Pending:
        """``x`` reduced within this replica group, then across the replicas."""
        x = _comm.wait(_comm.all_reduce(x, op, self.within, inplace=True), _WITHIN)
        return _pending(_comm.all_reduce(x, op, self._crossing, inplace=True))

    def all_gather(self, x: torch.Tensor) -> _groups.Pending:
        """Every rank's ``x`` along dim 0, replica by replica."""
        x = _comm.wait(_comm.all_gather(x, self.within), _WITHIN)
        return _pending(_comm.all_gather(x, self._crossing))

    def broadcast(self, x: torch.Tensor, src: int) -> _groups.Pending:
        """Rank ``src``'s ``x``: from its place in every replica group, then from its replica."""
        local = _comm.size(self.within)
        x = _comm.wait(_comm.broadcast(x, src % local, self.within), _WITHIN)
        return _pending(_comm.broadcast(x, src // local, self._crossing))


_AGREEING = "the replica group's ranks agreeing on a crossing to the other replicas"
_PEER_FAILED = (
    "{n} other rank(s) of this replica group failed to cross to the other replicas in this "
    "collective (their peer replica died or timed out), while this rank's crossing went "
    "through: the step is lost on every rank of the group."
)


class _InStep(_OverReplicas):
    """A ``ReplicaMesh``'s level across: each collective of ``across`` waited for as it is
    issued, and whether it failed agreed by the replica group's ranks (one all-reduce
    within, of a count of failures), so that all of them go on or all stop.

    Rank ``r`` of a replica group crosses with rank ``r`` of the others: when a peer
    replica dies during a bucket, one rank's crossing can fail while another's went
    through (its peer had answered first). Stopping only the first would leave the
    others waiting within for it, in the gather that follows, past ``should_commit``.
    """

    def __init__(self, across: _groups.ReplicaGroup, within: Any) -> None:
        self.across, self.within = across, within

    def __repr__(self) -> str:
        return f"_InStep({self.across!r}, within={self.within!r})"

    def size(self) -> int:
        return self.across.size()

    def rank(self) -> int:
        return self.across.rank()

    def all_reduce(self, x: torch.Tensor, op: str) -> _groups.Pending:
        return self._agreed(self.across.all_reduce(x, op))

    def all_gather(self, x: torch.Tensor) -> _groups.Pending:
        return self._agreed(self.across.all_gather(x))

    def broadcast(self, x: torch.Tensor, src: int) -> _groups.Pending:
        return self._agreed(self.across.broadcast(x, src))

    def _agreed(self, crossing: _groups.Pending) -> _groups.Pending:
        """``crossing`` waited for, then its outcome on every rank of the replica group: done,
        or a ``Pending`` whose wait raises (this rank's own failure, else its peers')."""
        failure: RuntimeError | None = None
        try:
            for work in crossing.works:
                work.wait()
        except RuntimeError as error:
            failure = error
        count = torch.tensor([failure is not None], dtype=torch.int64, device=self.device)
        failed = int(_comm.wait(_comm.all_reduce(count, "sum", self.within), _AGREEING))
        if failure is None and failed:
            failure = RuntimeError(_PEER_FAILED.format(n=failed))
        return _groups.Pending(
            crossing.tensor, () if failure is None else (_groups.Failed(failure),)
        )


def _pending(x: _groups.Issued) -> _groups.Pending:
    """``x`` as a ``Pending`` (``_comm`` returns a plain tensor where it issued nothing)."""
    return x if isinstance(x, _groups.Pending) else _groups.Pending(x, ())


def meet_within(within: Any, stage: str) -> None:
    """Every rank of a replica group (its c10d group ``within``) here before any goes on:
    one all-reduce, waited for (a ``CollectiveError`` naming ``stage`` if a rank is gone)."""
    one = torch.ones(1, device=_comm.default_device(within))  # on the GPU over NCCL
    _comm.wait(_comm.all_reduce(one, "sum", within), stage)

"""The group kinds fsync knows besides c10d's: the live replicas and this rank alone.

A ``ReplicaGroup`` (subclassed by ``fsync.ft``) issues its collectives through a
fault-tolerance runtime and hands back ``Pending`` results; ``ALONE`` is this rank by
itself. ``_comm`` takes either wherever a group goes, beside c10d's ``ProcessGroup``,
``DeviceMesh`` and the ``Recorder``.

Owns: those kinds, their interface (``Standalone``) and the ``Pending`` results they
return. May import: torch only
(layer 1).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Pending(NamedTuple):
    """A result still on the wire as c10d ``Work``s: ``wait`` returns ``tensor`` once
    ``works`` are done (what an eager gloo all-gather returns, see ``_comm.all_gather``)."""

    tensor: torch.Tensor
    works: tuple[Any, ...]


Issued = torch.Tensor | Pending
"""What a collective returns before ``wait``: a tensor (plain, or a functional
collective's, which waits on first use) or a ``Pending``."""


class Failed:
    """A collective's ``Work`` that failed already: its wait raises ``error``."""

    def __init__(self, error: RuntimeError) -> None:
        self._error = error

    def wait(self) -> bool:
        raise self._error


class Standalone:
    """A group no c10d ``ProcessGroup`` stands behind: it says its own size, rank, levels
    and device, which ``_comm`` asks it for where it would ask c10d."""

    def size(self) -> int:
        """The number of members taking part."""
        raise NotImplementedError

    def rank(self) -> int:
        """This process's rank among them."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where small control tensors live."""
        return torch.device("cpu")

    def levels(self) -> tuple[Any, Any] | None:
        """``(across, within)``, two groups, where the group has two levels (replica groups
        of several ranks, reduced hierarchically as a 2-D mesh is); ``None`` for one level."""
        return None


class ReplicaGroup(Standalone):
    """The live replicas of a fault-tolerant job as a group: its members change step by step.

    A fault-tolerance runtime (``fsync.ft``'s, over torchft) subclasses it: each
    collective is issued through the runtime, which learns of a failure itself, and
    returns a ``Pending`` whose wait raises ``RuntimeError`` when the collective (or
    an earlier one of the step) failed, so that fsync raises ``CollectiveError``
    and the step is discarded. ``_comm.all_reduce`` returns that result as a tensor
    that waits on first use, so that several buckets are on the wire at once, as over
    a c10d group; a subclass that must wait for each collective as it issues it (a
    two-level group's crossing) waits inside its ``all_reduce`` and returns a
    ``Pending`` with no works left, or with one ``Failed``: the failure is still raised
    where the caller waits, which names the stage (the bucket) it broke.
    ``fsync.ft`` settles what a failed step left in flight. ``size`` is the
    number of replicas in this step's quorum, the divisor of a mean. Eager only: under
    ``torch.compile`` it raises ``REPLICAS_UNDER_COMPILE``. No store is read to name a
    failure: the runtime decides what a failure means.
    """

    @property
    def unsettled(self) -> list[torch.Tensor]:
        """Results of ``all_reduce`` returned in flight and not yet ``settle``d."""
        found: list[torch.Tensor] = self.__dict__.setdefault("_unsettled", [])
        return found

    def all_reduce(self, x: torch.Tensor, op: str) -> Pending:
        """Reduces ``x`` itself (the caller owns it) with ``op`` across the replicas."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> Pending:
        """Every replica's ``x`` concatenated along dim 0, in rank order."""
        raise NotImplementedError

    def broadcast(self, x: torch.Tensor, src: int) -> Pending:
        """Replica ``src``'s ``x``, received into ``x`` itself (the caller owns it)."""
        raise NotImplementedError


class Alone(Standalone):
    """This rank by itself: a group of one, over which every collective is the identity.

    The group a step splits its optimizer update over where nothing is split
    (``fsync.ops.replicated``): every rank updates the whole of every bucket, so
    there is nothing to gather. Use ``ALONE``.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "ALONE (this rank by itself)"


ALONE = Alone()
"""The one ``Alone`` group."""


REPLICAS_UNDER_COMPILE = (
    "a ReplicaGroup (fsync.ft) runs eagerly only: its members change from one step to the "
    "next, and torch's functional collectives need a c10d group of fixed size, by name, at "
    "trace time. Call the step without torch.compile / fsync.compile (compile the loss "
    "function inside it instead)."
)

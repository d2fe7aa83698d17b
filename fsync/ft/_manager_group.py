"""The live replicas of a torchft job as an fsync group: ``ManagerGroup``.

torchft (``pip install 'fsync[ft]'``) forms a quorum of replica groups at every
step (a lighthouse decides who is in), gives each replica group a ``Manager``
whose process group spans the live replicas, and heals a replica that joins
from a peer. ``ManagerGroup`` is that process group as an fsync group
(``_groups.ReplicaGroup``): its collectives go to the Manager's process group (an
all-reduce as a sum: fsync divides a mean itself, by the step's participant
count), after the Manager's quorum, and a failure of any of them is reported to
the Manager; the wait then raises, so that fsync's sync stops at the first
failed bucket with a ``CollectiveError`` and the step (``_transaction``) is
discarded. (``Manager.allreduce`` does the same with a timer and callbacks
around each collective, a few tenths of a millisecond more each; see
``ManagerGroup.all_reduce``.)

Owns: the replicas as an fsync group and a step's quorum on it (``begin``, ``meet``).
May import: ``_comm`` (with ``_comm._groups``), ``fsync.ft._quorum``, ``fsync.ft._torchft``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from fsync import _comm
from fsync._comm import _groups
from fsync.ft import _torchft
from fsync.ft._quorum import QuorumError, lost_quorum, quorum_held

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


class _Checked:
    """A ``Work`` whose ``wait`` raises when the Manager has seen a failure this step: at
    once where it had before the wait (the step is lost; a bucket still in flight behind
    the one that failed need not be waited for)."""

    def __init__(self, work: Any, manager: Any) -> None:
        self._work, self._manager = work, manager

    def wait(self) -> bool:
        ok = True
        if self._manager.errored() is None:  # else the step is lost: nothing to wait for
            try:
                ok = self._work.wait()
            except RuntimeError as error:  # the process group's own collectives raise
                self._manager.report_error(error)
                raise
        failed = self._manager.errored()
        if failed is not None or ok is False:
            raise RuntimeError(f"torchft's Manager reported a failure this step: {failed}")
        return True


class ManagerGroup(_groups.ReplicaGroup):
    """The replicas of a torchft ``Manager``'s quorum, as an fsync group (eager only).

    Inside a step of [fsync.ft.Replica][] (after its quorum) the group is the
    quorum's replicas; between steps it is this replica alone, so that
    ``GradSync.init`` and ``diloco(...).init`` plan without a collective (the
    first step's agreement and every heal compare the plans across replicas).

    Args:
        manager: A ``torchft.Manager`` (one per rank of a replica group).
        device: Where small control tensors live (the GPU with NCCL).
        lighthouse: The lighthouse's address, named where a quorum cannot be had
            (``$TORCHFT_LIGHTHOUSE`` if not given).

    Attributes:
        manager: The ``torchft.Manager`` given.
        lighthouse: The lighthouse's address as given (``$TORCHFT_LIGHTHOUSE`` if not;
            ``""`` if neither).
        live: Whether a step's quorum is on (set by [fsync.ft.Replica][]).
        issued: The collectives issued across replicas so far (a transaction
            reads whether its step issued any).
    """

    def __init__(
        self, manager: Any, *, device: torch.device | str = "cpu", lighthouse: str | None = None
    ) -> None:
        self.manager = manager
        self._device = torch.device(device)
        self.live = False
        self.issued = 0
        # Where the lighthouse is, for the words of a lost quorum (torchft's own fallback).
        self.lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        self._quorum: Any = None  # the number of the last step's quorum (Renumbered's)
        self._last: tuple[Any, int, int] | None = None  # (lighthouse's id, participants, step)
        self._silent: tuple[bool, int] = (False, 0)  # (quorum changed, issued at its start)

    def __repr__(self) -> str:
        return f"ManagerGroup({self.manager!r})"

    @property
    def device(self) -> torch.device:
        """Where fsync puts this group's small control tensors."""
        return self._device

    def size(self) -> int:
        """The replicas in this step's quorum; 1 between steps."""
        return int(self.manager.num_participants()) if self.live else 1

    def rank(self) -> int:
        """This replica's place in the quorum; 0 between steps."""
        if not self.live:
            return 0
        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(
                "this replica takes no part in the current quorum (a spare, or healing): "
                "sync inside the step of fsync.ft.Replica, after its quorum."
            )
        return int(rank)

    def all_reduce(self, x: torch.Tensor, op: str) -> _groups.Pending:
        """``x`` reduced across the quorum on the Manager's process group.

        What ``Manager.allreduce`` does, less the timer and the callbacks it chains on
        each ``Work`` (a wake-up of torchft's timer thread, Python callbacks on gloo's):
        the process group's own timeout bounds the collective, ``_Checked`` reports a
        failure to the Manager, and a replica outside the quorum (a spare) contributes
        zeros. What it costs: docs/fault-tolerance.md, "What a transaction costs".
        """
        if op not in _REDUCE_OPS:
            raise ValueError(
                f"the replicas reduce with one of {sorted(_REDUCE_OPS)}; got {op!r} (gloo has "
                "no average: fsync divides a mean itself, by the step's participants)."
            )
        names = _torchft.module("process_group")  # c10d's names, as torchft imports them
        options = names.AllreduceOptions()
        options.reduceOp = getattr(names.ReduceOp, _REDUCE_OPS[op])
        if self.live and not self.manager.is_participating():
            x.zero_()
        return _groups.Pending(x, (self._issue(lambda pg: pg.allreduce([x], options)),))

    def all_gather(self, x: torch.Tensor) -> _groups.Pending:
        """Every replica's ``x`` along dim 0, on the Manager's process group."""
        n = self.size()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        options = _torchft.module("process_group").AllgatherOptions()
        work = self._issue(lambda pg: pg.allgather([list(out.chunk(n))], [x], options))
        return _groups.Pending(out, (work,))

    def broadcast(self, x: torch.Tensor, src: int) -> _groups.Pending:
        """Replica ``src``'s ``x``, on the Manager's process group."""
        options = _torchft.module("process_group").BroadcastOptions()
        options.rootRank = src
        return _groups.Pending(x, (self._issue(lambda pg: pg.broadcast([x], options)),))

    def begin(self) -> None:
        """A step's quorum: torchft's ``start_quorum`` (a heal of this replica happens in
        it, through the state callbacks), then the group is live until the step ends.

        Raises:
            QuorumError: torchft gave no quorum (the lighthouse stayed away longer than
                its Manager retries, or a heal failed); fsync's own errors (a heal that
                does not fit) pass as they are.
        """
        started = time.monotonic()
        try:
            self.manager.start_quorum()
        except (ValueError, TypeError):  # fsync's checks of a state received (at a heal)
            raise
        except Exception as error:  # torchft's, of whatever kind: named in fsync's words
            waited = time.monotonic() - started
            raise QuorumError(lost_quorum(self.lighthouse, self._last, error, waited)) from error
        last, self._quorum = self._quorum, getattr(self.manager, "_quorum_id", None)
        self._silent = (last is None or last != self._quorum, self.issued)
        self._last = quorum_held(self.manager, self._quorum)
        self.live = True

    def meet_if_silent(self) -> None:
        """``meet`` where this step's quorum changed and the step issued no collective across
        replicas: a quorum's id is the same on every replica, so all of them meet."""
        changed, issued = self._silent
        if changed and self.issued == issued:
            self.meet()

    def meet(self) -> None:
        """One collective across the quorum, waited for: for a step that issued none.

        A peer that heals fetches this replica's committed state after the quorum, and
        ``should_commit`` withdraws it (torchft's checkpoint transport). A step with
        collectives cannot commit before every peer has joined them, so after its fetch;
        one without (DiLoCo's inner steps) could, and the fetch then timed out, step after
        step (see ``meet_if_silent``).
        """
        one = torch.ones(1, device=self.device)
        _comm.wait(self.all_reduce(one, "sum"), "the replicas' meeting before commit")

    def _issue(self, call: Any) -> _Checked:
        """``call(pg)`` on the Manager's process group, a failure reported to the Manager;
        nothing issued once the step has failed (its wait raises at once)."""
        self.manager.wait_quorum()
        self.issued += 1
        if self.manager.errored() is not None:
            return _Checked(None, self.manager)
        try:
            return _Checked(call(self.manager._pg), self.manager)
        except RuntimeError as error:
            self.manager.report_error(error)
            raise

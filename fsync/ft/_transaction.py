"""The step as a transaction: quorum, gradients, sync, then commit or keep the old state.

A functional step ``fn(state, *args) -> (new_state, value)`` computes a new
state and modifies nothing it was given; so discarding a step is returning the
old state. ``Replica.step(fn)`` wraps it:

1. ``Manager.start_quorum()``: the lighthouse's quorum for this step; the
   process group spans the live replicas; a replica that joins (or fell
   behind) receives the committed state from a peer (``_heal``), which
   replaces the state passed in;
2. ``fn`` runs, its fsync collectives across replicas over ``Replica.group``;
   a collective that fails (a peer died or hung) is reported to the Manager
   and ends ``fn`` with a ``CollectiveError``, which the step swallows;
3. ``Manager.should_commit()``: the new state if every participant of this
   replica group succeeded, else the old one. A step that issued no collective
   across replicas (DiLoCo's inner steps) in a quorum that changed meets the
   others once first (``ManagerGroup.meet``): a peer may still be fetching this replica's
   state, and ``should_commit`` withdraws it.

Nothing but ``fn``'s own errors leaves the step: a disagreement between live
replicas is still a ``ValueError`` everywhere, and a replica that joins with
another tree or other options gets a ``ValueError`` at its heal, alone.

Owns: the transaction. May import: ``_comm`` (with ``_comm._groups`` and ``_comm._failures``),
``fsync.ft._manager_group``, ``fsync.ft._mesh``, ``fsync.ft._connect``, ``fsync.ft._heal``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fsync import _comm
from fsync._comm import _failures, _groups
from fsync.ft import _connect, _heal, _manager_group, _mesh

_ASYNC_QUORUM = (
    "the Manager was made with use_async_quorum=True; a transaction needs its quorum (and a "
    "heal) before the step runs: make it with use_async_quorum=False."
)
_NOT_A_PAIR = (
    "the step function returned {got}; expected a pair (new_state, value): the new state "
    "(the whole state the transaction commits or discards) and anything else (the loss, "
    "say; None if nothing). End fn with `return state, loss`."
)


class Outcome(NamedTuple):
    """What became of one step of [fsync.ft.Replica.step][].

    Attributes:
        committed: Whether this step's new state was kept (else the state
            returned is the one the step started from, or the one healed).
        value: What ``fn`` returned beside the state (``None`` when it failed).
        step: The number of steps the job has committed, this one included
            (torchft's count: the same on every replica after a heal).
        participants: The number of replicas in this step's quorum (the
            divisor of a mean).
        healed: Whether this replica received the state from a peer this step.
        error: The collective failure that discarded this step, if any.
    """

    committed: bool
    value: Any
    step: int
    participants: int
    healed: bool
    error: str | None


class Replica:
    """This process's replica group in a torchft job: its group for fsync and its transactions.

    Settings and the torchft ``Manager`` only; the state is the caller's. The
    state served to a peer that heals is the one this replica last committed
    (kept between steps because torchft asks for it through a callback).

    Args:
        manager: A ``torchft.Manager`` made with ``use_async_quorum=False`` and
            no state callbacks (``Replica`` registers its own, under "fsync"),
            or use [connect][fsync.ft.Replica.connect].
        device: Where fsync's small control tensors live (``"cuda"`` with NCCL).
        within: For a replica group of several ranks, the c10d group of its ranks
            (``torch.distributed.group.WORLD`` under a torchrun of its own): ``group``
            is then two-level, a [fsync.ft.ReplicaMesh][].
        lighthouse: The lighthouse's address, for the words of [fsync.ft.QuorumError][]
            (``connect`` passes its own).

    Attributes:
        manager: The ``torchft.Manager``.
        group: The live replicas as an fsync group: pass it as ``group=`` to
            [fsync.GradSync][], [fsync.grad_and_value][], [fsync.diloco][] ...
            With ``within``, every rank of them, reduced hierarchically (within
            the replica group, then its shard across replicas).

    Example (not run here: it needs a lighthouse and peers):

        replica = fsync.ft.Replica.connect(lighthouse_addr, replica_id="0")
        sync = fsync.GradSync(group=replica.group)
        step = replica.step(train_step)  # train_step(state, batch) -> (state, loss)
        state, outcome = step(state, batch)
    """

    def __init__(
        self,
        manager: Any,
        *,
        device: torch.device | str = "cpu",
        within: Any = None,
        lighthouse: str | None = None,
    ) -> None:
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(_ASYNC_QUORUM)
        self.manager = manager
        self._replicas = _manager_group.ManagerGroup(manager, device=device, lighthouse=lighthouse)
        self.group: _groups.ReplicaGroup = self._replicas
        if within is not None:
            self.group = _mesh.ReplicaMesh(within, self._replicas)
        self._exchange = _heal.Exchange()  # what heals a peer, and what healed this one
        manager.register_state_dict_fn("fsync", self._exchange.load, self._exchange.save)

    @classmethod
    def connect(
        cls,
        lighthouse_addr: str,
        replica_id: str,
        *,
        min_replicas: int = 1,
        timeout: datetime.timedelta = datetime.timedelta(seconds=30),
        quorum_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        lighthouse_outage: datetime.timedelta = _connect.LIGHTHOUSE_OUTAGE,
        rank: int = 0,
        world_size: int = 1,
        store: tuple[str, int] | None = None,
        hostname: str = "localhost",
        within: Any = None,
    ) -> Replica:
        """A ``Replica`` over a new torchft ``Manager`` (gloo) joined to a lighthouse.

        Args:
            lighthouse_addr: The lighthouse's address (``http://host:port``).
            replica_id: This replica group's name, stable across its restarts.
            min_replicas: The fewest replicas a step may commit with.
            timeout: How long a collective, a commit or a heal may take: a hung
                peer costs the survivors this much once.
            quorum_timeout: How long a quorum may take to form.
            lighthouse_outage: How long the lighthouse may be away (down, or
                restarting at the same address) before a step gives up: meanwhile
                a replica asks it again every second or so, and goes on within
                about a second of its return. A step that gets no quorum within
                ``quorum_timeout`` plus this raises [fsync.ft.QuorumError][].
            rank: This process's rank within its replica group.
            world_size: The ranks of a replica group (each has its own Manager).
            store: The replica group's TCPStore ``(host, port)`` (torchrun's
                ``MASTER_ADDR``, ``MASTER_PORT``); a one-rank replica group starts
                its own.
            hostname: How peers reach this replica group's rank 0.
            within: The c10d group of this replica group's ranks (required with
                ``world_size`` > 1): ``group`` is two-level (see [fsync.ft.Replica][]).

        Raises:
            ValueError: A replica group of several ranks without ``store`` or
                ``within``.
            QuorumError: The lighthouse was out of reach for ``lighthouse_outage``.
        """
        made = _connect.manager(
            lighthouse_addr,
            replica_id,
            min_replicas=min_replicas,
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            lighthouse_outage=lighthouse_outage,
            rank=rank,
            world_size=world_size,
            store=store,
            hostname=hostname,
            within=within,
        )
        return cls(made, within=within, lighthouse=lighthouse_addr)

    def step(self, fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Outcome]]:
        """``fn(state, *args) -> (state, value)`` as a transaction across the replicas.

        Returns:
            ``step(state, *args, **kwargs) -> (state, Outcome)``: ``fn``'s new
            state when the step commits, else the state it started from (after
            a heal, the peer's). ``fn`` must not modify its arguments in place.

        Raises:
            ValueError: The state a peer sent does not fit this replica's (at a
                heal), or the live replicas disagree (``fn``'s sync).
            QuorumError: No quorum for the step (the lighthouse away longer than
                the replicas wait for it); raised before ``fn`` runs, so that no
                replica commits the step.
        """

        @functools.wraps(fn)
        def transaction(state: Any, /, *args: Any, **kwargs: Any) -> tuple[Any, Outcome]:
            return _transact(self, fn, state, args, kwargs)

        return transaction

    def close(self) -> None:
        """Shuts the Manager down (its server, its checkpoint transport).

        In a replica group of several ranks every rank calls it, and they meet first:
        rank 0's process serves torchft's ``ManagerServer`` for the group, and a rank
        whose last ``should_commit`` was still being answered as rank 0 exited failed
        with "transport error". A rank that is gone already ends the meeting early (the
        group's timeout at most); the Manager is shut down either way.
        """
        if isinstance(self.group, _mesh.ReplicaMesh):  # a rank gone has no answer to wait for
            with contextlib.suppress(_failures.CollectiveError):
                _mesh.meet_within(self.group.within, "the replica group's ranks meeting to close")
        self.manager.shutdown(wait=False)


def settle(group: _groups.ReplicaGroup) -> None:
    """Every result ``group`` returned in flight waited for, a failure ignored: at the end
    of a step, where one that failed left the buckets issued behind the failed one
    unwaited (c10d would keep their works, and their buckets, until the process ends)."""
    for result in group.unsettled:
        with contextlib.suppress(_failures.CollectiveError):  # the step's failure, reported
            _comm.wait(result)
    group.unsettled.clear()


def _transact(
    replica: Replica, fn: Callable[..., Any], state: Any, args: Any, kwargs: Any
) -> tuple[Any, Outcome]:
    """One step of [fsync.ft.Replica.step][]: the quorum (and a heal), ``fn`` with its
    collectives across the replicas, then ``should_commit``: ``fn``'s state or the old one."""
    manager, replicas, exchange = replica.manager, replica._replicas, replica._exchange
    exchange.committed = state  # served to a peer that heals in this quorum
    replicas.begin()
    state, healed = exchange.begin(state)
    error: _failures.CollectiveError | None = None
    try:
        result = fn(state, *args, **kwargs)
        replicas.meet_if_silent()
    except _failures.CollectiveError as failure:
        manager.report_error(failure)
        result, error = (state, None), failure
    finally:
        replicas.live = False
        settle(replicas)
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(_NOT_A_PAIR.format(got=type(result).__name__))
    new_state, value = result
    committed = bool(manager.should_commit())
    if committed:
        exchange.committed = new_state
    outcome = Outcome(
        committed=committed,
        value=value,
        step=int(manager.current_step()),
        participants=int(manager.num_participants()),
        healed=healed,
        error=None if error is None else str(error),
    )
    return (new_state if committed else state), outcome

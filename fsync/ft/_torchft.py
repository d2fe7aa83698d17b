"""fsync's link to torchft: the lazy import, the replica group, the Manager's wiring.

torchft (``pip install 'fsync[ft]'``) forms a quorum of replica groups at every
step (a lighthouse decides who is in), gives each replica group a ``Manager``
whose process group spans the live replicas, and heals a replica that joins
from a peer. ``ManagerGroup`` is that process group as an fsync group
(``_comm.ReplicaGroup``): its collectives go to the Manager's process group (an
all-reduce as a sum: fsync divides a mean itself, by the step's participant
count), after the Manager's quorum, and a failure of any of them is reported to
the Manager; the wait then raises, so that fsync's sync stops at the first
failed bucket with a ``CollectiveError`` and the step (``_transaction``) is
discarded. (``Manager.allreduce`` does the same with a timer and callbacks
around each collective, a few tenths of a millisecond more each; see
``ManagerGroup.all_reduce``.)

A replica group of several ranks is two-level (``ReplicaMesh``): within it, its own
c10d group; across, the ``ManagerGroup`` of each rank.

Owns: every name of torchft fsync uses, the replicas as fsync groups and a step's
quorum. May import: ``_comm`` (and torchft, lazily).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import math
import os
import time
from typing import Any

import torch

from fsync import _comm

EXTRA = "ft"
_MISSING = (
    "fsync.ft needs torchft, which is not installed: pip install 'fsync[{extra}]' (torchft "
    "0.2.0). {error}"
)
_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def _module(name: str = "") -> Any:
    """``torchft`` (or its submodule ``name``), imported on first use."""
    try:
        return importlib.import_module("torchft" + (f".{name}" if name else ""))
    except ImportError as error:
        raise ImportError(_MISSING.format(extra=EXTRA, error=error)) from error


def torchft() -> Any:
    """The ``torchft`` module, imported on first use; a clear ``ImportError`` without it."""
    return _module()


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


_LOST = (
    "no quorum for this step after {seconds:.1f} s: the lighthouse {where} did not form one "
    "({last}). It may be down or restarting for longer than the replicas wait for it, or "
    "another replica failed this quorum (a heal). Run the lighthouse so that it comes back "
    "at the same address (a restart loop or a service manager: docs/fault-tolerance.md), "
    "or give Replica.connect a longer lighthouse_outage. The state is the last committed "
    "step's. torchft's error: {kind}: {error}"
)


def lost_quorum(
    lighthouse: str, last: tuple[Any, int, int] | None, error: Exception, seconds: float
) -> str:
    """``_LOST``: the lighthouse, the last quorum (its id, replicas and committed step),
    torchft's ``error`` and how long it was waited for."""
    where = f"at {lighthouse}" if lighthouse else "(address unknown to fsync)"
    if last is None:
        had = "this replica had no quorum yet"
    else:
        had = f"the last quorum ({last[0]}) had {last[1]} replica(s), at committed step {last[2]}"
    return _LOST.format(
        where=where, seconds=seconds, last=had, kind=type(error).__name__, error=error
    )


def _quorum_held(manager: Any, number: Any) -> tuple[Any, int, int]:
    """The quorum ``manager`` holds, as a lost one names it: the lighthouse's own number
    (``_Renumbered``'s record; ``number`` where there is none), replicas, committed step."""
    number = getattr(getattr(manager, "_client", None), "lighthouse_id", number)
    return (number, int(manager.num_participants()), int(manager.current_step()))


class QuorumError(RuntimeError):
    """No quorum could be formed for a step of [fsync.ft.Replica.step][]: the lighthouse was
    away longer than ``Replica.connect``'s ``lighthouse_outage`` (or a heal failed). Raised
    on every replica that waited, before its step ran: nothing of the step is committed
    anywhere, and the state the replica holds is its last committed one."""


class ManagerGroup(_comm.ReplicaGroup):
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
        self._quorum: Any = None  # the number of the last step's quorum (_Renumbered's)
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

    def all_reduce(self, x: torch.Tensor, op: str) -> _comm.Pending:
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
        names = _module("process_group")  # c10d's names, as torchft imports them
        options = names.AllreduceOptions()
        options.reduceOp = getattr(names.ReduceOp, _REDUCE_OPS[op])
        if self.live and not self.manager.is_participating():
            x.zero_()
        return _comm.Pending(x, (self._issue(lambda pg: pg.allreduce([x], options)),))

    def all_gather(self, x: torch.Tensor) -> _comm.Pending:
        """Every replica's ``x`` along dim 0, on the Manager's process group."""
        n = self.size()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        options = _module("process_group").AllgatherOptions()
        work = self._issue(lambda pg: pg.allgather([list(out.chunk(n))], [x], options))
        return _comm.Pending(out, (work,))

    def broadcast(self, x: torch.Tensor, src: int) -> _comm.Pending:
        """Replica ``src``'s ``x``, on the Manager's process group."""
        options = _module("process_group").BroadcastOptions()
        options.rootRank = src
        return _comm.Pending(x, (self._issue(lambda pg: pg.broadcast([x], options)),))

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
        self._last = _quorum_held(self.manager, self._quorum)
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


_WITHIN = "the replica group's own collective, within it"


class _OverReplicas(_comm.ReplicaGroup):
    """A group made over the replicas' group ``across`` (``ReplicaMesh``, ``_InStep``): each
    crossing waited for as it is issued, control tensors where ``across`` keeps them, and
    what a failed crossing leaves for a wait ``across``'s to settle (``Replica.step``
    settles its ``ManagerGroup``)."""

    across: _comm.ReplicaGroup
    waits_at_once = True

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

    def all_reduce(self, x: torch.Tensor, op: str) -> _comm.Pending:
        """``x`` reduced within this replica group, then across the replicas."""
        x = _comm.wait(_comm.all_reduce(x, op, self.within, inplace=True), _WITHIN)
        return _pending(_comm.all_reduce(x, op, self._crossing, inplace=True))

    def all_gather(self, x: torch.Tensor) -> _comm.Pending:
        """Every rank's ``x`` along dim 0, replica by replica."""
        x = _comm.wait(_comm.all_gather(x, self.within), _WITHIN)
        return _pending(_comm.all_gather(x, self._crossing))

    def broadcast(self, x: torch.Tensor, src: int) -> _comm.Pending:
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

    def __init__(self, across: _comm.ReplicaGroup, within: Any) -> None:
        self.across, self.within = across, within

    def __repr__(self) -> str:
        return f"_InStep({self.across!r}, within={self.within!r})"

    def size(self) -> int:
        return self.across.size()

    def rank(self) -> int:
        return self.across.rank()

    def all_reduce(self, x: torch.Tensor, op: str) -> _comm.Pending:
        return self._agreed(self.across.all_reduce(x, op))

    def all_gather(self, x: torch.Tensor) -> _comm.Pending:
        return self._agreed(self.across.all_gather(x))

    def broadcast(self, x: torch.Tensor, src: int) -> _comm.Pending:
        return self._agreed(self.across.broadcast(x, src))

    def _agreed(self, crossing: _comm.Pending) -> _comm.Pending:
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
        return _comm.Pending(crossing.tensor, () if failure is None else (_comm.Failed(failure),))


def _pending(x: _comm.Issued) -> _comm.Pending:
    """``x`` as a ``Pending`` (``_comm`` returns a plain tensor where it issued nothing)."""
    return x if isinstance(x, _comm.Pending) else _comm.Pending(x, ())


def lighthouse(
    min_replicas: int = 1,
    *,
    port: int = 0,
    join_timeout_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
) -> Any:
    """An in-process torchft lighthouse (``.address()``, ``.shutdown()``) on ``port`` (0:
    a free one).

    For tests, examples and single-machine jobs; a cluster runs ``torchft_lighthouse``
    where it comes back at the same address if it stops (docs/fault-tolerance.md). A
    lighthouse made again on the port of one shut down is the same one to the replicas.
    ``join_timeout_ms`` is how long a quorum waits for replicas beyond ``min_replicas``.
    ``heartbeat_timeout_ms`` is how long a silent replica still counts as alive: a quorum
    needs more than half of the replicas heard from within it, so with two replicas the
    survivor of a death waits this long (torchft's default, 5 s) before it goes on alone.
    """
    return _module("coordination").LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


# While the lighthouse is away a replica tries it again this often: torchft's Manager sleeps
# (quorum deadline) / (retries + 1) between its quorum's attempts and reconnects for up to
# the connect timeout, whose backoff (0.1 s, growing 1.5x) stays under a second within it.
LIGHTHOUSE_RETRY = datetime.timedelta(seconds=1)
LIGHTHOUSE_CONNECT = datetime.timedelta(seconds=2)
LIGHTHOUSE_OUTAGE = datetime.timedelta(seconds=60)  # how long it may be away by default


def manager(
    lighthouse_addr: str,
    replica_id: str,
    *,
    min_replicas: int = 1,
    timeout: datetime.timedelta,
    quorum_timeout: datetime.timedelta,
    lighthouse_outage: datetime.timedelta = LIGHTHOUSE_OUTAGE,
    rank: int = 0,
    world_size: int = 1,
    store: tuple[str, int] | None = None,
    hostname: str = "localhost",
    within: Any = None,
) -> Any:
    """A torchft ``Manager`` over gloo with fsync's state callbacks left to register.

    ``store`` is the replica group's TCPStore ``(host, port)``; a one-rank replica
    group (``world_size=1``) starts its own. Quorums are synchronous, so that a
    replica that heals has its state before the step runs.

    A quorum may take ``quorum_timeout`` to form, and the lighthouse may be away for
    ``lighthouse_outage`` besides (a restart): torchft's quorum deadline is their sum,
    its attempts a ``LIGHTHOUSE_RETRY`` apart (``quorum_retries``), each reconnecting
    for ``LIGHTHOUSE_CONNECT``, so that a lighthouse back at its address is found
    within about a second; without retries a quorum asked while it was away never
    came (torchft's server does not answer a quorum that failed) and the step raised
    torchft's timeout. A Manager that cannot reach the lighthouse as it starts (a
    replica restarted during an outage) is made again until ``lighthouse_outage``. Its
    quorums are numbered by fsync (``_Renumbered``), as a restarted lighthouse reuses
    numbers.

    A replica group of several ranks also gives ``within``, its ranks' c10d group:
    torchft's rank 0 publishes its Manager's address in the store and the other ranks
    read it, but torchrun keeps its store across the restarts of a group, so after a
    restart they could read the dead Manager's (seen: "failed to connect to
    http://localhost:32837"). So rank 0 clears torchft's keys first, and the ranks meet
    over ``within`` before any of them reads.
    """
    ft = torchft()
    own_store = None
    if world_size != 1:
        if store is None or within is None:
            raise ValueError(
                f"a replica group of {world_size} ranks needs its TCPStore and its ranks' "
                "process group: pass store=(host, port) (torchrun's MASTER_ADDR and "
                "MASTER_PORT) and within=torch.distributed.group.WORLD (init_process_group "
                "first), the same on each of its ranks."
            )
        _clear_stale_keys(store, rank, within)
    elif store is None:
        own_store = _module("manager").TCPStore(
            "localhost", 0, is_master=True, wait_for_workers=False
        )
        store = ("localhost", own_store.port)
    deadline = quorum_timeout + lighthouse_outage
    settings = {
        "pg": ft.ProcessGroupGloo(timeout=timeout),
        "load_state_dict": None,
        "state_dict": None,
        "min_replica_size": min_replicas,
        "use_async_quorum": False,
        "timeout": timeout,
        "quorum_timeout": deadline,
        "connect_timeout": LIGHTHOUSE_CONNECT,
        "quorum_retries": max(1, math.ceil(deadline / LIGHTHOUSE_RETRY) - 1),
        "rank": rank,
        "world_size": world_size,
        "store_addr": store[0],
        "store_port": store[1],
        "lighthouse_addr": lighthouse_addr,
        "replica_id": replica_id,
        "hostname": hostname,
        "port": 0,
    }
    given_up = time.monotonic() + lighthouse_outage.total_seconds()
    started = time.monotonic()
    while True:
        try:
            made = ft.Manager(**settings)
            break
        except RuntimeError as error:  # rank 0's server found no lighthouse in time
            if rank != 0 or time.monotonic() >= given_up:
                waited = time.monotonic() - started
                raise QuorumError(lost_quorum(lighthouse_addr, None, error, waited)) from error
            time.sleep(LIGHTHOUSE_RETRY.total_seconds())
    made._fsync_store = own_store  # kept alive as long as the Manager
    made._client = _Renumbered(made._client)
    return made


class _Renumbered:
    """torchft's ``ManagerClient`` with each quorum given a number no other quorum of the
    job has, the same on every replica in it.

    torchft reconfigures a Manager's process group only where the quorum's number changes,
    and rendezvous it under ``torchft/<number>/`` in a replica's store. A restarted
    lighthouse numbers its quorums from 1 again: where its first had the survivor's last
    number, the survivor kept its old process group while the restarted replica waited in a
    new one's rendezvous until the process group's timeout; where it had the number of an
    older quorum, the rendezvous read that one's stale addresses. Here the number is a hash
    of the lighthouse's number, the replicas (each id carries its Manager's uuid, new with
    every restart) and the step at which that quorum formed, and it changes exactly where
    the lighthouse's number or the replicas do.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._formed: tuple[int, tuple[str, ...]] | None = None  # the lighthouse's id, replicas
        self._number = -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    @property
    def lighthouse_id(self) -> int | None:
        """The lighthouse's own number of the last quorum (its logs' ``quorum_id``)."""
        return None if self._formed is None else self._formed[0]

    def _quorum(self, **options: Any) -> Any:
        quorum = self._client._quorum(**options)
        formed = (int(quorum.quorum_id), tuple(sorted(quorum.replica_ids)))
        if formed != self._formed:
            self._formed = formed
            digest = hashlib.blake2b(repr((*formed, int(quorum.max_step))).encode(), digest_size=7)
            self._number = int.from_bytes(digest.digest(), "big")
        return _Numbered(quorum, self._number)


class _Numbered:
    """A torchft ``QuorumResult`` under another ``quorum_id`` (``_Renumbered``)."""

    def __init__(self, quorum: Any, number: int) -> None:
        self._quorum, self.quorum_id = quorum, number

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)


def _clear_stale_keys(store: Any, rank: int, within: Any) -> None:
    """torchft's keys gone from the replica group's ``store`` before its Managers start:
    rank 0 deletes what an earlier life of the group left, then every rank meets over
    ``within`` (an all-reduce), so that none reads before the new rank 0 has written."""
    names = _module("manager")
    if rank == 0:
        client = names.TCPStore(*store, is_master=False, wait_for_workers=False)
        for key in (names.MANAGER_ADDR_KEY, names.REPLICA_ID_KEY):
            client.delete_key(key)
    meet_within(within, "the replica group's ranks meeting before their Managers start")


def meet_within(within: Any, stage: str) -> None:
    """Every rank of a replica group (its c10d group ``within``) here before any goes on:
    one all-reduce, waited for (a ``CollectiveError`` naming ``stage`` if a rank is gone)."""
    one = torch.ones(1, device=_comm.default_device(within))  # on the GPU over NCCL
    _comm.wait(_comm.all_reduce(one, "sum", within), stage)

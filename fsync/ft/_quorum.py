"""A step's quorum as fsync sees it: a number of its own, and the error where none forms.

torchft's lighthouse forms a quorum of replica groups at every step and numbers it.
torchft rendezvous a Manager's process group under that number, and a restarted
lighthouse numbers from 1 again; so each quorum gets a number of fsync's
(``Renumbered``, around the Manager's client), unique in the job and the same on every
replica in it. Where no quorum forms (the lighthouse away longer than the replicas wait
for it, or a heal failed), every replica that waited raises ``QuorumError`` in fsync's
words (``lost_quorum``): where the lighthouse is, the last quorum this replica held,
what to do.

Owns: the quorums' numbers, ``QuorumError`` and its words. May import: nothing of fsync.
"""

from __future__ import annotations

import hashlib
from typing import Any

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


def quorum_held(manager: Any, number: Any) -> tuple[Any, int, int]:
    """The quorum ``manager`` holds, as a lost one names it: the lighthouse's own number
    (``Renumbered``'s record; ``number`` where there is none), replicas, committed step."""
    number = getattr(getattr(manager, "_client", None), "lighthouse_id", number)
    return (number, int(manager.num_participants()), int(manager.current_step()))


class QuorumError(RuntimeError):
    """No quorum could be formed for a step of [fsync.ft.Replica.step][]: the lighthouse was
    away longer than ``Replica.connect``'s ``lighthouse_outage`` (or a heal failed). Raised
    on every replica that waited, before its step ran: nothing of the step is committed
    anywhere, and the state the replica holds is its last committed one."""


class Renumbered:
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
    """A torchft ``QuorumResult`` under another ``quorum_id`` (``Renumbered``)."""

    def __init__(self, quorum: Any, number: int) -> None:
        self._quorum, self.quorum_id = quorum, number

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)

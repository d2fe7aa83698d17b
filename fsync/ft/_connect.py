"""Joining a job: a lighthouse, and a torchft ``Manager`` made to reach one.

``lighthouse`` starts torchft's lighthouse in this process (tests, examples,
single-machine jobs). ``manager`` makes the Manager of ``Replica.connect``: over gloo,
with synchronous quorums (a replica that heals has its state before its step runs),
retrying a lighthouse that is away (a restart) for up to ``lighthouse_outage``, its
quorums renumbered by fsync (``_quorum.Renumbered``), and, in a replica group of
several ranks, torchft's keys of an earlier life of the group cleared from its store
first.

Owns: the lighthouse's making, the Manager's settings and its retries. May import:
``fsync.ft._torchft``, ``fsync.ft._quorum``, ``fsync.ft._mesh``.
"""

from __future__ import annotations

import datetime
import math
import time
from typing import Any

from fsync.ft import _torchft
from fsync.ft._mesh import meet_within
from fsync.ft._quorum import QuorumError, Renumbered, lost_quorum


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
    return _torchft.module("coordination").LighthouseServer(
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
    quorums are numbered by fsync (``Renumbered``), as a restarted lighthouse reuses
    numbers.

    A replica group of several ranks also gives ``within``, its ranks' c10d group:
    torchft's rank 0 publishes its Manager's address in the store and the other ranks
    read it, but torchrun keeps its store across the restarts of a group, so after a
    restart they could read the dead Manager's (seen: "failed to connect to
    http://localhost:32837"). So rank 0 clears torchft's keys first, and the ranks meet
    over ``within`` before any of them reads.
    """
    ft = _torchft.torchft()
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
        own_store = _torchft.module("manager").TCPStore(
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
    made._client = Renumbered(made._client)
    return made


def _clear_stale_keys(store: Any, rank: int, within: Any) -> None:
    """torchft's keys gone from the replica group's ``store`` before its Managers start:
    rank 0 deletes what an earlier life of the group left, then every rank meets over
    ``within`` (an all-reduce), so that none reads before the new rank 0 has written."""
    names = _torchft.module("manager")
    if rank == 0:
        client = names.TCPStore(*store, is_master=False, wait_for_workers=False)
        for key in (names.MANAGER_ADDR_KEY, names.REPLICA_ID_KEY):
            client.delete_key(key)
    meet_within(within, "the replica group's ranks meeting before their Managers start")

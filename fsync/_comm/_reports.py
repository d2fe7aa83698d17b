"""Naming a failed collective: which sync it broke, at which stage, and which ranks did
not arrive, from each rank's report in the group's c10d store.

Entry points wrap their sync in ``naming``; a stage that knows more (the agreement, the
backward's buckets) calls ``named`` itself.

Owns: the reports and the words built from them. May import: torch, ``_comm`` and its
``_groups`` and ``_failures`` (above the package's boundary, ``_comm/__init__``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from fsync import _comm
from fsync._comm._failures import CAUSES, REPORT_PATIENCE_S, CollectiveError, ranks_in_words
from fsync._comm._groups import ReplicaGroup

_T = TypeVar("_T")


def named(
    failure: CollectiveError, group: _comm.Group, start: int, *, stage: str = "", step: Any = None
) -> CollectiveError:
    """``failure`` with the sync it broke, its stage, and which ranks did not arrive.

    This rank records its stage in the group's c10d store (torchrun's, or the one
    ``init_process_group`` made) under the sync's key, ``start`` (this group's c10d
    sequence number when the sync began, the same on ranks that keep step), and
    reads the other ranks' records for up to ``REPORT_PATIENCE_S`` seconds: a rank
    that wrote one saw the failure too; one that did not is missing (dead, hung,
    or not calling this sync). Nothing is written on syncs that succeed. Named
    once: the innermost caller that knows the stage names it.
    """
    if failure.reports is not None:
        return failure
    stage = failure.stage or stage or "a collective"
    if isinstance(group, ReplicaGroup):  # the runtime names and handles a replica's failure
        message = f"an fsync collective of a fault-tolerant step (fsync.ft) failed at {stage}."
        return CollectiveError(message, stage=stage, backend=failure.backend, reports={})
    steps = None if step is None else int(step)
    record = {"stage": stage, "step": steps}
    reports = _reports(group, start, record)
    sync = (
        f"step {steps} of its state"
        if steps is not None
        else f"the sync begun at c10d collective #{start} of its group"
    )
    message = f"an fsync collective failed at {stage}, in {sync}: {_who(reports, group)} {CAUSES}"
    cause = failure.backend or str(failure)
    return CollectiveError(message, stage=stage, backend=cause, reports=reports or {})


def naming(call: Callable[[], _T], group: _comm.Group, *, step: Any = None) -> _T:
    """``call()`` (an entry point's sync), a collective that fails in it ``named``.

    Eager only: under ``torch.compile`` the call is traced, and the agreement, a
    custom op, names its own failures at run time.
    """
    if torch.compiler.is_compiling():
        return call()
    start = _comm.sequence_number(group)
    try:
        return call()
    except CollectiveError as failure:
        raise named(failure, group, start, step=step) from failure


def _who(reports: dict[int, dict[str, Any]] | None, group: _comm.Group) -> str:
    """Words for which ranks reported the failure (and where), and which did not."""
    if reports is None:
        return (
            "the group's store could not be reached to learn which ranks did not arrive (the "
            "process that hosts it may be the one that died)."
        )
    stage = reports[_comm.rank(group)]["stage"]
    alike = [r for r in sorted(reports) if reports[r]["stage"] == stage]
    seen = f"{ranks_in_words(alike)} saw the failure there"
    elsewhere = [r for r in sorted(reports) if r not in alike]
    if elsewhere:
        seen += ", " + ", ".join(f"rank {r} at {reports[r]['stage']}" for r in elsewhere)
    missing = [r for r in range(_comm.size(group)) if r not in reports]
    if not missing:
        return (
            f"every rank arrived ({seen}): they issued different collectives, or the link failed."
        )
    return (
        f"{ranks_in_words(missing)} did not arrive (dead, hung, or not calling this sync: nothing "
        f"reported within {REPORT_PATIENCE_S:g} s); {seen}."
    )


def _reports(
    group: _comm.Group, start: int, record: dict[str, Any]
) -> dict[int, dict[str, Any]] | None:
    """Every rank's record of this failure found in the group's store, this rank's first."""
    try:
        store = _comm.store(group)
        prefix = f"fsync/failed/{_comm.group_name(group)}/{start}/"
        me, n = _comm.rank(group), _comm.size(group)
        store.set(prefix + str(me), json.dumps(record))
        reports = {me: record}
        deadline = time.monotonic() + REPORT_PATIENCE_S
        while len(reports) < n:
            for r in range(n):
                if r not in reports and store.check([prefix + str(r)]):
                    reports[r] = json.loads(store.get(prefix + str(r)))
            if len(reports) == n or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return reports
    except Exception:  # no store, or its host is gone: say so rather than fail again
        return None

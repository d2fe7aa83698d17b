"""The words for how ranks differ: each rank's description, and the first difference.

Each rank describes its sync as JSON (``describe``: the plan's leaves and buckets, the
hook's spec, the metadata of its state, ``find_unused``, ``divide_by``). The ranks
exchange the descriptions only when the agreement (``_agree``) found that they
disagree; ``first_difference`` then names the first way a rank's differs from rank 0's,
for the ``ValueError`` every rank raises.

On a disagreement, ``raise_disagreement`` gathers every rank's control vector and
description and raises the one error every rank raises: a skipped sync, what some ranks
found alone (``_agree.refuse``), or the first difference; ``check_fully_used`` names a
leaf some ranks have no gradient for.

Owns: the descriptions, the words for their differences and the errors raised on every
rank. May import: ``_comm`` (with ``_comm._failures``), ``_control``, ``_plan``,
``_trace`` (layer 3, above those).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from fsync import _comm
from fsync._comm import _failures
from fsync._control import FOUND, SEQ
from fsync._plan import PLAN_CACHE_SIZE
from fsync._trace import python_at_trace_time

_SKIPPED = (
    "ranks are at different syncs of this group: {who}. A rank skipped a sync (a sync "
    "written inside `if rank == 0:`, or a rank that ran out of data without active=False), "
    "so its collectives would pair with another step's. Every rank must call every sync; a "
    "rank without data passes active=False."
)
_OTHER_STATE_HERE = (
    "its state belongs to another plan (its fingerprint differs from the plan of the gradients)"
)
OTHER_STATE = (
    "state belongs to another plan (its fingerprint differs from the plan of the gradients) "
    "on {who}. Pass the state that this sync's init returned, or the previous step's."
)
_REFUSED = (
    "{who} cannot take part in this sync, so no rank sent its buckets (every rank raises this "
    "error): {details}"
)
_PARTLY_UNUSED = (
    "leaf {path!r} has a gradient on {have} but None on {lack}: a parameter unused on some "
    "ranks. Pass find_unused=True to GradSync (DDP's find_unused_parameters=True) to average "
    "it with zeros from the ranks that did not use it."
)

FIX = (
    "Every rank must pass the same tree (same structure, shapes, dtypes and layouts) with the "
    "same sync options, at every step. Build the plan from the parameter tree (GradSync.init("
    "params)) so that gradients unused on some ranks are still covered."
)
_OTHER_HOOK_STATE = (
    "the hook's state differs across ranks: {detail}. A state made for another plan or "
    "another hook (a stale or reloaded one) on some rank? Pass the state this sync's init "
    "returned for this plan, or the previous step's."
)


def first_difference(descriptions: list[dict[str, Any]]) -> str:
    """Words for the first way in which a rank's description differs from rank 0's."""
    ref = descriptions[0]
    what = ref["what"]
    for rank, other in enumerate(descriptions[1:], start=1):
        for key in ("hook", "state", "find_unused", "divide_by"):
            mine, theirs = ref["options"][key], other["options"][key]
            if key == "state" and mine != theirs:
                return _state_difference(mine, theirs, rank)
            if mine != theirs:
                if key != "hook":  # a hook's spec reads as code already
                    mine, theirs = repr(mine), repr(theirs)
                return (
                    f"the ranks' sync options differ: {key} is {mine} on rank 0 but {theirs} "
                    f"on rank {rank}."
                )
        words = _plan_difference(ref["plan"], other["plan"], rank)
        if words is not None:
            return f"{what} differ across ranks: {words}"
    return f"{what} differ across ranks in a way their descriptions do not show."


def _state_difference(mine: list[str], theirs: list[str], rank: int) -> str:
    for leaf, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return _OTHER_HOOK_STATE.format(
                detail=f"its leaf {leaf} is {a} on rank 0 but {b} on rank {rank}"
            )
    detail = f"it has {len(mine)} leaves on rank 0 but {len(theirs)} on rank {rank}"
    return _OTHER_HOOK_STATE.format(detail=detail)


def _plan_difference(ref: dict[str, Any], other: dict[str, Any], rank: int) -> str | None:
    for (path0, desc0), (path1, desc1) in zip(ref["leaves"], other["leaves"], strict=False):
        if path0 != path1:
            return f"the leaf at this position is {path0!r} on rank 0 but {path1!r} on rank {rank}."
        if desc0 != desc1:
            return f"leaf {path0!r} has {desc0} on rank 0 but {desc1} on rank {rank}."
    n0, n1 = len(ref["leaves"]), len(other["leaves"])
    if n0 != n1:
        longer, extra = (0, ref) if n0 > n1 else (rank, other)
        return (
            f"rank 0 has {n0} leaves and rank {rank} has {n1}; the first extra one is "
            f"{extra['leaves'][min(n0, n1)][0]!r} on rank {longer}."
        )
    if ref["structure"] != other["structure"]:
        return (
            f"the tree structure is {ref['structure']} on rank 0 but {other['structure']} on "
            f"rank {rank}."
        )
    if ref["reduce_dtype"] != other["reduce_dtype"]:
        return (
            f"reduce_dtype is {ref['reduce_dtype']} on rank 0 but {other['reduce_dtype']} on "
            f"rank {rank}."
        )
    if ref["buckets"] != other["buckets"]:
        return (
            f"the bucket plans differ (bucket_cap_mb, first_bucket_mb, order or buckets) "
            f"between rank 0 and rank {rank}: {ref['buckets']} on rank 0 but "
            f"{other['buckets']} on rank {rank}."
        )
    return None


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _described(
    plan_description: str,
    hook: str,
    find_unused: bool,
    divide_by: str,
    what: str,
    state: tuple[str, ...],
) -> str:
    options = {"hook": hook, "state": state, "find_unused": find_unused, "divide_by": divide_by}
    plan = json.loads(plan_description)
    return json.dumps({"plan": plan, "options": options, "what": what})


@python_at_trace_time
def describe(
    plan_description: str,
    hook: str,
    find_unused: bool,
    divide_by: str,
    what: str,
    state: tuple[str, ...] = (),
) -> str:
    """This rank's plan and options in words (JSON), exchanged only on a disagreement."""
    return _described(plan_description, hook, find_unused, divide_by, what, state)


def raise_disagreement(
    problem: str, control: torch.Tensor, description: str, group: _comm.Group
) -> None:
    mine = (control.tolist(), description)
    everyone = _comm.all_gather_object(mine, group, control.device)
    if problem == "found":
        raise _found(everyone)
    if problem == "seq":
        steps = [c[SEQ] for c, _ in everyone]
        where = ", ".join(f"rank {r} at sync {s}" for r, s in enumerate(steps))
        raise ValueError(_SKIPPED.format(who=where))
    descriptions = [json.loads(d) for _, d in everyone]
    raise ValueError(f"{first_difference(descriptions)} {FIX}")


def _found(everyone: list[tuple[list[int], str]]) -> Exception:
    """Every rank's error for what some ranks found alone (``refuse``, or a stale state).

    The error's type is the finders' own when they agree on it (a ``TypeError``
    for a wrong leaf type, say), else ``ValueError``; a finder that is no check
    of fsync's (``fn`` raised) makes it a ``RuntimeError``.
    """
    finders = [(r, _finding(d)) for r, (c, d) in enumerate(everyone) if c[FOUND]]
    if all(found is None for _, found in finders):  # states made for another plan
        return ValueError(OTHER_STATE.format(who=_failures.ranks_in_words([r for r, _ in finders])))
    kinds = {"ValueError" if found is None else found[0] for _, found in finders}
    details = "; ".join(
        f"rank {r}: {_OTHER_STATE_HERE if found is None else found[1]}" for r, found in finders
    )
    message = _REFUSED.format(
        who=_failures.ranks_in_words([r for r, _ in finders]), details=details
    )
    kind = kinds.pop() if len(kinds) == 1 else "ValueError"
    return {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)(message)


def _finding(description: str) -> tuple[str, str] | None:
    """``(kind, message)`` of a rank that refused (see ``refuse``), else ``None``."""
    found = json.loads(description).get("found")
    return None if found is None else (found[0], found[1])


def check_fully_used(
    counts: torch.Tensor, used: torch.Tensor, active: int, description: str, group: _comm.Group
) -> None:
    """Raises on every rank where some active ranks have a gradient for a leaf and others
    do not (``counts``, per tensor leaf, the ranks that have one)."""
    partial = ((counts > 0) & (counts < active)).nonzero()
    if partial.numel() == 0:
        return
    position = int(partial[0])
    has = _comm.all_gather_object(bool(used[position]), group, used.device)
    paths = [path for path, leaf in json.loads(description)["plan"]["leaves"] if leaf != "None"]
    have = _failures.ranks_in_words([r for r, h in enumerate(has) if h])
    lack = _failures.ranks_in_words([r for r, h in enumerate(has) if not h])
    raise ValueError(_PARTLY_UNUSED.format(path=paths[position], have=have, lack=lack))

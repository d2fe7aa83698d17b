"""Agreement between ranks: checked at every sync, before any bucket collective.

Every sync starts with one small all-reduce (``sum``, int64) of a fixed-size
control vector, the same size on every rank whatever the ranks hold, so that
ranks that disagree still meet in it:

* ``active``: 1 on a rank that contributes this step (the count divides a mean
  for ``divide_by="active"``);
* the 64-bit fingerprint ``h`` of the plan and the sync options (the hook's
  kind and settings, ``find_unused``, ``divide_by``), cut into four 16-bit
  chunks ``c``, each sent as ``(c, c**2)``;
* the sync's sequence number ``s`` (the state's step count modulo 2**16) as
  ``(s, s**2)``, which catches a rank that skipped a sync;
* a flag for what this rank found alone: a state made for another plan (read
  from the state's values), or a check that failed on this rank before the
  agreement (``refuse``: its message is what the ranks exchange), and the number
  of leaves this rank has no gradient for.

By Cauchy-Schwarz, ``(sum c)**2 == n * sum c**2`` holds exactly when all ``n``
values are equal, and every rank evaluates the same sums: every rank sees the
same verdict from ``O(1)`` bytes per rank, at any world size (int64 does not
overflow below 2**15 ranks). Only on a disagreement do the ranks exchange their
descriptions to name the first difference, in a ``ValueError`` raised on every
rank. The fingerprint covers the plan, the options and the metadata of the
hook's state (``state_words``). When some rank has no gradient for a leaf (or
with ``find_unused``) a second all-reduce counts, per tensor leaf, the ranks that
have one: a leaf no rank has comes back ``None`` (DDP's semantics); one some
ranks lack is averaged with zeros from them under ``find_unused``, and is an
error without it. A control all-reduce that fails is named (``_comm.named``):
the sync, the stage and the ranks that did not arrive.

Under ``torch.compile`` the same function runs as an opaque custom op
(``fsync::agree``), so the check, and its error, happen at run time in the
compiled step as they do eagerly; the packed buckets depend on its result, so no
bucket collective can be scheduled before it.

Owns: what ranks compare (the words for how they differ are ``_differences``). May
import: ``_comm``, ``_tree``, ``_trace``, ``_plan``, ``_differences``, ``_checks``
(layers 1 to 3).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import optree
import torch

from fsync import _checks, _comm, _failures, _tree
from fsync._differences import FIX, describe, first_difference
from fsync._plan import PLAN_CACHE_SIZE, BucketPlan
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
_OTHER_STATE = (
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

_T = TypeVar("_T")

# Control vector: [active, (c, c*c) for 4 chunks of h, s, s*s, found, nones].
_CHUNKS = 4
_CHUNK_BITS = 16
_ACTIVE, _H, _SEQ, _FOUND, _NONES = 0, 1, 1 + 2 * _CHUNKS, 3 + 2 * _CHUNKS, 4 + 2 * _CHUNKS
CONTROL_SIZE = 5 + 2 * _CHUNKS


class Agreed(NamedTuple):
    """What the ranks agreed on: the divisor of a mean and which leaves some rank has."""

    divisor: int | torch.Tensor
    used: list[bool] | None


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _digest(
    plan_fingerprint: int, hook: str, find_unused: bool, divide_by: str, state: tuple[str, ...]
) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps([plan_fingerprint, hook, find_unused, divide_by, state]).encode())
    return int.from_bytes(digest.digest(), "big")


@python_at_trace_time
def fingerprint(
    plan_fingerprint: int,
    hook: str,
    find_unused: bool,
    divide_by: str,
    state: tuple[str, ...] = (),
) -> int:
    """The 64-bit digest ranks compare: the plan's fingerprint, the sync options and the
    metadata of the hook's state (``state_words``)."""
    return _digest(plan_fingerprint, hook, find_unused, divide_by, state)


def state_words(state: Any) -> tuple[str, ...]:
    """The metadata of a hook's state, as the ranks compare it: each leaf's shape and dtype.

    A hook's state comes from ``init`` on the plan every rank shares, so it has the
    same structure and shapes on every rank; a state that differs on one rank (made
    for another plan, or another hook's) is a disagreement, found before any bucket
    collective, where the hook itself would find it only after, on that rank alone.
    """
    leaves = optree.tree_leaves(state, none_is_leaf=True, namespace=_tree.NAMESPACE)
    return tuple(
        f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        for x in leaves
    )


def _chunks(value: int) -> list[int]:
    mask = (1 << _CHUNK_BITS) - 1
    return [(value >> (_CHUNK_BITS * k)) & mask for k in range(_CHUNKS)]


def control_vector(
    h: int,
    *,
    plan_fingerprint: int,
    device: torch.device,
    active: bool = True,
    nones: int = 0,
    step: torch.Tensor | None = None,
    state_fingerprint: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's control vector (see the module's docstring)."""
    fixed = [int(active)]
    for c in _chunks(h):
        fixed += [c, c * c]
    if not torch.compiler.is_compiling():  # one small tensor from Python numbers
        seq = 0 if step is None else int(step) % (1 << _CHUNK_BITS)
        stale = state_fingerprint is not None and int(state_fingerprint) != plan_fingerprint
        values = [*fixed, seq, seq * seq, int(stale), nones]
        return torch.tensor(values, dtype=torch.int64, device=device)
    # Traced: the step and the state's fingerprint are tensors, read at run time.
    head = _int64_vector(fixed, device)
    tail = torch.tensor([0, 0, 0, nones], dtype=torch.int64, device=device)
    if step is not None:
        s = step.to(device=device, dtype=torch.int64).reshape(1) % (1 << _CHUNK_BITS)
        tail = tail + torch.cat([s, s * s, s.new_zeros(2)])
    if state_fingerprint is not None:
        other = (state_fingerprint.to(device).reshape(1) != plan_fingerprint).to(torch.int64)
        tail = tail + torch.cat([other.new_zeros(2), other, other.new_zeros(1)])
    return torch.cat([head, tail])


def _int64_vector(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64)``; traced, without a tensor constant.

    Inside a ``torch.cond`` branch (where [fsync.diloco][] syncs) inductor leaves a
    tensor constant of more than 8 elements unset and the compiled step fails at run
    time (pytorch/pytorch#185482, seen with torch 2.13), so a traced vector
    is filled run by run instead, which also keeps an all-ones vector one node.
    """
    if not torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.int64, device=device)
    runs = [
        torch.full((len(list(run)),), value, dtype=torch.int64, device=device)
        for value, run in itertools.groupby(values)
    ]
    return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.int64, device=device)


def _all_equal(total: int, squares: int, n: int) -> bool:
    return total * total == n * squares


def _verdict(summed: list[int], world_size: int) -> str | None:
    """Which kind of disagreement the summed control vector shows, if any."""
    if summed[_FOUND]:
        return "found"
    if not _all_equal(summed[_SEQ], summed[_SEQ + 1], world_size):
        return "seq"
    for k in range(_CHUNKS):
        if not _all_equal(summed[_H + 2 * k], summed[_H + 2 * k + 1], world_size):
            return "fingerprint"
    return None


def issue(control: torch.Tensor, group: _comm.Group) -> torch.Tensor:
    """Puts the control all-reduce on the wire (eager); ``conclude`` waits for it."""
    return _comm.all_reduce(control.clone(), "sum", group, inplace=True, control=True)


def conclude(
    pending: torch.Tensor,
    control: torch.Tensor,
    used: torch.Tensor,
    group: _comm.Group,
    description: str,
    find_unused: bool,
    *,
    start: int = -1,
    step: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed control vector and per-leaf use counts of an issued agreement.

    Raises the same ``ValueError`` on every rank when they disagree. A control
    all-reduce that fails (a rank died, hangs or stopped calling the sync) is
    named (``_comm.named``): the sync, begun at c10d collective ``start`` of
    the group, its ``step``, and the ranks that did not arrive.
    """
    try:
        return _concluded(pending, control, used, group, description, find_unused)
    except _failures.CollectiveError as failure:
        raise _comm.named(failure, group, start, stage=AGREEMENT, step=step) from failure


AGREEMENT = "the ranks' agreement (the sync's first collective)"


def _concluded(
    pending: torch.Tensor,
    control: torch.Tensor,
    used: torch.Tensor,
    group: _comm.Group,
    description: str,
    find_unused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = _comm.wait(pending)
    values = summed.tolist()
    world_size = _comm.size(group)
    problem = _verdict(values, world_size)
    if problem is not None:
        _raise(problem, control, description, group)
    counts = used
    if find_unused or values[_NONES]:  # some rank lacks a gradient: count who has each leaf
        counts = _comm.wait(
            _comm.all_reduce(used.clone(), "sum", group, inplace=True, control=True)
        )
        if not find_unused:
            _check_fully_used(counts, used, int(values[_ACTIVE]), description, group)
    return summed, counts


def agree(
    control: torch.Tensor,
    used: torch.Tensor,
    group: _comm.Group,
    description: str,
    find_unused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The agreement in one call (eager): ``issue``, then ``conclude``."""
    start = _comm.sequence_number(group)
    pending = issue(control, group)
    return conclude(pending, control, used, group, description, find_unused, start=start)


def _raise(problem: str, control: torch.Tensor, description: str, group: _comm.Group) -> None:
    mine = (control.tolist(), description)
    everyone = _comm.all_gather_object(mine, group, control.device)
    if problem == "found":
        raise _found(everyone)
    if problem == "seq":
        steps = [c[_SEQ] for c, _ in everyone]
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
    finders = [(r, _finding(d)) for r, (c, d) in enumerate(everyone) if c[_FOUND]]
    if all(found is None for _, found in finders):  # states made for another plan
        return ValueError(
            _OTHER_STATE.format(who=_failures.ranks_in_words([r for r, _ in finders]))
        )
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


def refuse(error: Exception, group: _comm.Group, like: Any = None) -> Any:
    """What this rank found alone, before the agreement, becomes every rank's error.

    A check that fails on one rank only (a gradient that does not fit the
    state's plan, a state of another kind, a shape made symbolic while tracing)
    must not raise there before the agreement: the other ranks would wait for
    this rank's collectives until the group's timeout. Instead this rank joins
    the sync's agreement with a vote that says it found something, and every
    rank raises the same error, naming this rank and what it found (``_found``),
    before any bucket collective, so the group works afterwards.

    Eagerly this raises. Under ``torch.compile`` it traces the agreement (the op
    raises at run time, on every rank) and returns ``like``, what the caller
    returns as far as it can tell, each tensor made to wait for the op, so that
    the rest of the step still traces and nothing of it runs first. With one
    rank eagerly, ``error`` itself is raised.
    """
    compiling = torch.compiler.is_compiling()
    if _comm.size(group) == 1 and not compiling:
        raise error
    device = _comm.default_device(group)
    control = _int64_vector([int(k == _FOUND) for k in range(CONTROL_SIZE)], device)
    used = torch.zeros(0, dtype=torch.int64, device=device)
    description = _refusal(type(error).__name__, str(error))
    if not compiling:
        agree(control, used, group, description, False)
        raise AssertionError("unreachable: the agreement raises for a rank that refuses")
    context = _op_context(_comm.group_name(group), description, False)
    summed, _ = torch.ops.fsync.agree(control, used, context)
    token = summed[_ACTIVE] >= 0
    return optree.tree_map(
        lambda x: x * token if isinstance(x, torch.Tensor) and not x.is_meta else x,
        like,
        none_is_leaf=True,
        namespace=_tree.NAMESPACE,
    )


def planned(make: Callable[[], _T], group: _comm.Group) -> _T:
    """``make()`` (an entry point's planning), its checks' errors every rank's (``refuse``).

    For entry points that take a tree once, eagerly (``init``, ``fsync.verify``):
    a check that fails on one rank only does not leave the others waiting in the
    ``verify_plan`` that follows.
    """
    try:
        return make()
    except (ValueError, TypeError) as error:
        refuse(error, group)
        raise


@python_at_trace_time
def _refusal(kind: str, message: str) -> str:
    """A refusing rank's description: what it found, in place of its plan."""
    return json.dumps({"found": [kind, message]})


def verify_plan(plan: BucketPlan, group: _comm.Group, what: str = "grads") -> None:
    """Raises the same ``ValueError`` on every rank unless all ranks hold the same plan.

    The per-step agreement with the plan's fingerprint alone (no options, no
    step), for entry points that take a tree once: ``GradSync.init``, the ZeRO
    step's ``init``, [fsync.broadcast][], [fsync.verify][].
    """
    if _comm.size(group) == 1:
        return
    device = _comm.default_device(group)
    control = control_vector(plan.fingerprint, plan_fingerprint=plan.fingerprint, device=device)
    description = describe(plan.description, "", False, "", what)
    agree(control, torch.zeros(0, dtype=torch.int64, device=device), group, description, False)


def _check_fully_used(
    counts: torch.Tensor, used: torch.Tensor, active: int, description: str, group: _comm.Group
) -> None:
    partial = ((counts > 0) & (counts < active)).nonzero()
    if partial.numel() == 0:
        return
    position = int(partial[0])
    has = _comm.all_gather_object(bool(used[position]), group, used.device)
    paths = [path for path, leaf in json.loads(description)["plan"]["leaves"] if leaf != "None"]
    have = _failures.ranks_in_words([r for r, h in enumerate(has) if h])
    lack = _failures.ranks_in_words([r for r, h in enumerate(has) if not h])
    raise ValueError(_PARTLY_UNUSED.format(path=paths[position], have=have, lack=lack))


@python_at_trace_time
def _op_context(group_name: str, description: str, find_unused: bool) -> str:
    """The agreement's settings as the one string argument of ``fsync::agree``."""
    return json.dumps([group_name, description, find_unused])


@torch.library.custom_op("fsync::agree", mutates_args=())
def _agree_op(
    control: torch.Tensor, used: torch.Tensor, context: str
) -> tuple[torch.Tensor, torch.Tensor]:
    group_name, description, find_unused = json.loads(context)
    summed, counts = agree(control, used, _comm.group_named(group_name), description, find_unused)
    return summed, counts.clone() if counts is used else counts


@_agree_op.register_fake
def _(control: torch.Tensor, used: torch.Tensor, context: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(control), torch.empty_like(used)


class Agreement:
    """An eager agreement on the wire: [begin][fsync._agree.begin] issued its control all-reduce.

    ``conclude`` waits for it and returns what the ranks agreed on, or raises the
    same ``ValueError`` on every rank. Between the two a sync does work that
    needs no agreement (packing, or the backward pass of [fsync.grad_and_value][]),
    and issues no bucket collective.
    """

    def __init__(
        self,
        check: _Check | None,
        plan: BucketPlan,
        has: list[bool],
        active: bool,
        step: torch.Tensor | None = None,
    ) -> None:
        self._check, self._plan, self._has, self._active = check, plan, has, active
        self._step = step
        # With one rank nothing is sent: there is no one to disagree with.
        self._start = -1 if check is None else _comm.sequence_number(check.group)
        self._pending = None if check is None else issue(check.control, check.group)

    def conclude(self) -> Agreed:
        """Waits for the control all-reduce: the divisor of a mean, the leaves that come back."""
        check = self._check
        if check is None or self._pending is None:
            return Agreed(1, _alone(self._plan, self._has, self._active))
        summed, counts = conclude(
            self._pending,
            check.control,
            check.used,
            check.group,
            check.description,
            check.find_unused,
            start=self._start,
            step=self._step,
        )
        return check.agreed(self._plan, summed, counts, self._has)


class _Check(NamedTuple):
    """One sync's side of the agreement: what it sends and how it reads the sums."""

    control: torch.Tensor
    used: torch.Tensor
    description: str
    group: _comm.Group
    find_unused: bool
    divide_by: str
    active: bool

    def agreed(
        self, plan: BucketPlan, summed: torch.Tensor, counts: torch.Tensor, has: list[bool]
    ) -> Agreed:
        divisor: int | torch.Tensor = _comm.size(self.group)
        if self.divide_by == "active":
            divisor = summed[_ACTIVE].clamp(min=1)
        present = None
        if self.find_unused or (self.active and not all(has)):
            present = _present(plan, counts, self.find_unused, has)
        return Agreed(divisor, present)


class Terms(NamedTuple):
    """What the ranks compare at one sync, besides the plan.

    Attributes:
        hook: The hook's spec, with where and at which stage it runs.
        find_unused: The option of that name.
        divide_by: The option of that name.
        active: Whether this rank contributes this step.
        step: The sync's sequence number (a state's step count), if it has one.
        state_fingerprint: The fingerprint of the plan a state was made for, if any.
        state: The metadata of the hook's state (``state_words``).
    """

    hook: str
    find_unused: bool = False
    divide_by: str = "world"
    active: bool = True
    step: torch.Tensor | None = None
    state_fingerprint: torch.Tensor | None = None
    state: tuple[str, ...] = ()


def _check_of(plan: BucketPlan, has: list[bool], group: _comm.Group, terms: Terms) -> _Check:
    device = plan.specs[0].device if plan.specs else _comm.default_device(group)
    options = (terms.hook, terms.find_unused, terms.divide_by)
    control = control_vector(
        fingerprint(plan.fingerprint, *options, terms.state),
        active=terms.active,
        nones=sum(1 for x in has if not x) if terms.active else 0,
        step=terms.step,
        state_fingerprint=terms.state_fingerprint,
        plan_fingerprint=plan.fingerprint,
        device=device,
    )
    used = _int64_vector([int(x) for x in has], device)
    description = describe(plan.description, *options, "grads", terms.state)
    return _Check(
        control, used, description, group, terms.find_unused, terms.divide_by, terms.active
    )


def begin(plan: BucketPlan, has: Sequence[bool], group: _comm.Group, terms: Terms) -> Agreement:
    """Issues one sync's agreement (eager only); ``Agreement.conclude`` finishes it.

    ``has`` tells, per tensor leaf of the plan (in flatten order), whether this
    rank has its gradient. The ranks compare the plan and the ``terms``: the
    options, the sync's sequence number, that the state was made for this plan,
    the hook state's metadata. With one rank nothing is sent, but a state for
    another plan is still refused.
    """
    has = [terms.active and x for x in has]
    if _comm.size(group) == 1:
        check_alone(plan, terms.state_fingerprint)
        return Agreement(None, plan, has, terms.active)
    return Agreement(_check_of(plan, has, group, terms), plan, has, terms.active, terms.step)


def check_alone(plan: BucketPlan, state_fingerprint: torch.Tensor | None) -> None:
    """With one rank there is no one to disagree with, but a state for another plan is
    still refused."""
    if state_fingerprint is not None and int(state_fingerprint) != plan.fingerprint:
        raise ValueError(_OTHER_STATE.format(who="rank 0"))


def agree_on(
    plan: BucketPlan,
    leaves: Sequence[Any],
    group: _comm.Group,
    terms: Terms,
    *,
    pack: Callable[[torch.Tensor | None], list[torch.Tensor]],
) -> tuple[Agreed, list[torch.Tensor]]:
    """The per-step agreement of one sync, and the sync's buckets packed by ``pack``.

    Eagerly ``pack(None)`` runs while the control all-reduce is on the wire, so a
    rank packs while its peers finish their step. Under ``torch.compile``
    ``pack(token)`` runs after the agreement with a 0-d tensor computed from its
    result and always true: buckets packed with it (see ``_pack.pack_leaves``)
    wait for the agreement, which is therefore neither scheduled after a bucket
    collective nor dropped as unused. With one rank nothing is sent (a state for
    another plan is still refused eagerly).
    """
    has = [leaves[i] is not None for i, spec in enumerate(plan.leaves) if spec is not None]
    if not torch.compiler.is_compiling():
        agreement = begin(plan, has, group, terms)
        buckets = pack(None)
        return agreement.conclude(), buckets
    has = [terms.active and x for x in has]
    if _comm.size(group) == 1:
        return Agreed(1, _alone(plan, has, terms.active)), pack(None)
    if terms.find_unused:
        raise ValueError(_checks.FIND_UNUSED_UNDER_COMPILE)
    check = _check_of(plan, has, group, terms)
    context = _op_context(_comm.group_name(group), check.description, terms.find_unused)
    summed, counts = torch.ops.fsync.agree(check.control, check.used, context)
    return check.agreed(plan, summed, counts, has), pack(summed[_ACTIVE] >= 0)


def _alone(plan: BucketPlan, has: list[bool], active: bool) -> list[bool] | None:
    """Which leaves come back with one rank: all, unless an active rank lacks some."""
    return _present(plan, None, False, has) if active and not all(has) else None


def _present(
    plan: BucketPlan, counts: torch.Tensor | None, find_unused: bool, has: list[bool]
) -> list[bool]:
    """Per leaf of the plan: does it come back as a tensor (some rank has a gradient)?"""
    # With find_unused (eager only: the tree's shape depends on the other ranks) the
    # counts; without, this rank's own leaves (agreed: every active rank lacks the same).
    where = counts.tolist() if find_unused and counts is not None else has
    tensor_leaves = [i for i, spec in enumerate(plan.leaves) if spec is not None]
    present = [False] * len(plan.leaves)
    for i, n in zip(tensor_leaves, where, strict=True):
        present[i] = bool(n)
    return present

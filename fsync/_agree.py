"""Agreement between ranks: checked at every sync, before any bucket collective.

Every sync starts with one small all-reduce (``sum``, int64) of each rank's control
vector (``_control``: its activity, the fingerprint of the plan, the options and the
hook state's metadata, the sync's sequence number, and what this rank found alone), so
that every rank sees the same verdict from ``O(1)`` bytes per rank. Only on a
disagreement do the ranks exchange their descriptions to name it, in an error raised on
every rank (``_differences``). When some rank has no gradient for a leaf (or with
``find_unused``) a second all-reduce counts, per tensor leaf, the ranks that have one: a
leaf no rank has comes back ``None`` (DDP's semantics); one some ranks lack is averaged
with zeros from them under ``find_unused``, and is an error without it. A check that
fails on one rank before the agreement joins it as a vote (``refuse``), so that every
rank raises. A control all-reduce that fails is named (``_reports.named``): the sync,
the stage and the ranks that did not arrive.

Under ``torch.compile`` the same function runs as an opaque custom op
(``fsync::agree``), so the check, and its error, happen at run time in the
compiled step as they do eagerly; the packed buckets depend on its result, so no
bucket collective can be scheduled before it.

Owns: the agreement's stages (issue, conclude, refuse) and its op. May import:
``_comm`` (with ``_comm._reports``), ``_tree``, ``_trace``, ``_plan``, ``_control``,
``_differences``, ``_checks`` (layers 1 to 3).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import optree
import torch

from fsync import _checks, _comm, _tree
from fsync._comm import _failures, _reports
from fsync._control import (
    ACTIVE,
    CONTROL_SIZE,
    FOUND,
    NONES,
    control_vector,
    fingerprint,
    int64_vector,
    verdict,
)
from fsync._differences import OTHER_STATE, check_fully_used, describe, raise_disagreement
from fsync._plan import BucketPlan
from fsync._trace import python_at_trace_time

_T = TypeVar("_T")


class Agreed(NamedTuple):
    """What the ranks agreed on: the divisor of a mean and which leaves some rank has."""

    divisor: int | torch.Tensor
    used: list[bool] | None


def issue(control: torch.Tensor, group: _comm.Group) -> torch.Tensor:
    """Puts the control all-reduce on the wire (eager); ``conclude`` waits for it."""
    return _comm.all_reduce(control.clone(), "sum", group, inplace=True, control=True)


def conclude(
    pending: torch.Tensor, check: _Check, *, start: int = -1, step: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed control vector and per-leaf use counts of ``check``'s issued agreement.

    Raises the same ``ValueError`` on every rank when they disagree. A control
    all-reduce that fails (a rank died, hangs or stopped calling the sync) is
    named (``_reports.named``): the sync, begun at c10d collective ``start`` of
    the group, its ``step``, and the ranks that did not arrive.
    """
    group = check.group
    try:
        summed = _comm.wait(pending)
        values = summed.tolist()
        problem = verdict(values, _comm.size(group))
        if problem is not None:
            raise_disagreement(problem, check.control, check.description, group)
        counts = check.used
        if check.find_unused or values[NONES]:  # some rank lacks a gradient: count who has each
            counts = _comm.wait(
                _comm.all_reduce(check.used.clone(), "sum", group, inplace=True, control=True)
            )
            if not check.find_unused:
                active = int(values[ACTIVE])
                check_fully_used(counts, check.used, active, check.description, group)
        return summed, counts
    except _failures.CollectiveError as failure:
        raise _reports.named(failure, group, start, stage=AGREEMENT, step=step) from failure


AGREEMENT = "the ranks' agreement (the sync's first collective)"


def agree(check: _Check) -> tuple[torch.Tensor, torch.Tensor]:
    """The agreement in one call (eager): ``issue``, then ``conclude``."""
    start = _comm.sequence_number(check.group)
    return conclude(issue(check.control, check.group), check, start=start)


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
    control = int64_vector([int(k == FOUND) for k in range(CONTROL_SIZE)], device)
    used = torch.zeros(0, dtype=torch.int64, device=device)
    description = _refusal(type(error).__name__, str(error))
    if not compiling:
        agree(_Check(control, used, description, group))
        raise AssertionError("unreachable: the agreement raises for a rank that refuses")
    context = _op_context(_comm.group_name(group), description, False)
    summed, _ = torch.ops.fsync.agree(control, used, context)
    token = summed[ACTIVE] >= 0
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
    agree(_Check(control, torch.zeros(0, dtype=torch.int64, device=device), description, group))


@python_at_trace_time
def _op_context(group_name: str, description: str, find_unused: bool) -> str:
    """The agreement's settings as the one string argument of ``fsync::agree``."""
    return json.dumps([group_name, description, find_unused])


@torch.library.custom_op("fsync::agree", mutates_args=())
def _agree_op(
    control: torch.Tensor, used: torch.Tensor, context: str
) -> tuple[torch.Tensor, torch.Tensor]:
    group_name, description, find_unused = json.loads(context)
    check = _Check(control, used, description, _comm.group_named(group_name), find_unused)
    summed, counts = agree(check)
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
        summed, counts = conclude(self._pending, check, start=self._start, step=self._step)
        return check.agreed(self._plan, summed, counts, self._has)


class _Check(NamedTuple):
    """One sync's side of the agreement: what it sends and how it reads the sums."""

    control: torch.Tensor
    used: torch.Tensor
    description: str
    group: _comm.Group
    find_unused: bool = False
    divide_by: str = "world"
    active: bool = True

    def agreed(
        self, plan: BucketPlan, summed: torch.Tensor, counts: torch.Tensor, has: list[bool]
    ) -> Agreed:
        divisor: int | torch.Tensor = _comm.size(self.group)
        if self.divide_by == "active":
            divisor = summed[ACTIVE].clamp(min=1)
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
    used = int64_vector([int(x) for x in has], device)
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
        raise ValueError(OTHER_STATE.format(who="rank 0"))


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
    return check.agreed(plan, summed, counts, has), pack(summed[ACTIVE] >= 0)


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

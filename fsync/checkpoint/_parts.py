"""The states one checkpoint holds: one step's, or several side by side, as a train step
holds them.

``step`` is what made the state: a [fsync.ops.ZeroStep][] (``"zero"``), an
[fsync.optim.Optimizer][] (``"optim"``), a [fsync.GradSync][] (``"sync"``: the hook's
state, PowerSGD's) or an [fsync.DiLoCo][] (``"diloco"``); or a tuple of them, with
``state`` the tuple of their states in the same order, as
``examples/compression.py`` holds ``(opt_state, sync_state)`` and
``examples/diloco.py`` ``(opt_state, diloco_state)``. A checkpoint holds at most one
state of each kind; a ZeRO step syncs and steps by itself, so it stands alone.

Owns: the kinds of step and how they combine. May import: ``_sync``, ``_diloco``,
``_zero``, ``fsync.optim``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from fsync._diloco import DiLoCo, DiLoCoState
from fsync._sync import GradSync, SyncState
from fsync._zero import ZeroState, ZeroStep
from fsync.optim._base import Optimizer

Step = ZeroStep | Optimizer | GradSync | DiLoCo | tuple[Any, ...]

_KINDS = (("zero", ZeroStep), ("optim", Optimizer), ("sync", GradSync), ("diloco", DiLoCo))
_STATES = {"zero": ZeroState, "sync": SyncState, "diloco": DiLoCoState}
_NAMES = {
    "zero": "fsync.ops.ZeroStep",
    "optim": "fsync.optim.Optimizer",
    "sync": "fsync.GradSync",
    "diloco": "fsync.DiLoCo",
}


class Part(NamedTuple):
    """One step of ``step`` and its kind."""

    kind: str
    step: Any


def is_composite(step: Any) -> bool:
    """Whether ``step`` is a tuple of steps (an Optimizer or a DiLoCo is a NamedTuple,
    not a composite)."""
    return type(step) in (tuple, list)


def _kind(step: Any) -> str:
    for kind, cls in _KINDS:
        if isinstance(step, cls):
            return kind
    raise TypeError(
        f"step is a {type(step).__name__}; expected what made the state: an "
        "fsync.ops.ZeroStep, an fsync.optim.Optimizer, an fsync.GradSync, an fsync.DiLoCo, "
        "or a tuple of them (with state the tuple of their states)."
    )


def parts_of(step: Any) -> tuple[Part, ...]:
    """The parts of ``step``, checked: one of each kind at most, a ZeRO step alone."""
    steps = tuple(step) if is_composite(step) else (step,)
    if not steps:
        raise ValueError(
            "step is an empty tuple; expected a step, or a tuple of the steps whose states "
            "the checkpoint holds, such as (opt, sync)."
        )
    parts = tuple(Part(_kind(s), s) for s in steps)
    kinds = [p.kind for p in parts]
    for kind in _NAMES:
        if kinds.count(kind) > 1:
            raise ValueError(
                f"step holds {kinds.count(kind)} {_NAMES[kind]}s; a checkpoint holds one "
                "state of each kind. Save the others in checkpoints of their own."
            )
    if "zero" in kinds and len(kinds) > 1:
        raise ValueError(
            f"step holds a ZeroStep beside {[k for k in kinds if k != 'zero']}; a ZeroStep "
            "syncs the gradients and steps the optimizer itself, its state holds the hook's: "
            "pass it alone."
        )
    return parts


def states_of(parts: tuple[Part, ...], state: Any, composite: bool) -> tuple[Any, ...]:
    """The state of each part, checked against its kind."""
    if not composite:
        states: tuple[Any, ...] = (state,)
    elif not is_composite(state) or len(state) != len(parts):
        got = f"a tuple of {len(state)}" if is_composite(state) else f"a {type(state).__name__}"
        raise TypeError(
            f"state is {got}; step is a tuple of {len(parts)} steps, so state must be the "
            f"tuple of their {len(parts)} states, in the same order."
        )
    else:
        states = tuple(state)
    for part, value in zip(parts, states, strict=True):
        want = _STATES.get(part.kind)
        wrong = (
            not isinstance(value, want)
            if want is not None
            else isinstance(value, tuple(_STATES.values()))
        )
        if wrong:
            expected = want.__name__ if want is not None else "the optimizer's state"
            raise TypeError(
                f"the state given for the {_NAMES[part.kind]} is a {type(value).__name__}; "
                f"expected {expected}. Pass the states in the order of step."
            )
    return states

"""What fsync tells dynamo about its own functions, without importing dynamo.

``import fsync`` must not cost what ``import torch._dynamo`` costs (seconds on a 2-core
machine: the CHANGELOG has the figures): a process
that never compiles (an eager rank, a launcher, a checkpoint reader) would pay it
for nothing. ``torch.compiler.assume_constant_result`` imports dynamo to set one
attribute on the function it marks; ``constant_result`` sets the same
attribute itself while dynamo is not imported yet, and calls torch's once it is.
``tests/test_compile.py`` checks that both mark a function alike, so a torch
release that marks differently fails there rather than at a user's first compile.

``python_at_trace_time`` builds on it: a function whose checks may fail, called as
Python at trace time, its errors raised again by the traced caller as fsync's.

Owns: marks that dynamo reads. May import: torch only (layer 0, under ``_comm``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import torch

_F = TypeVar("_F", bound=Callable[..., Any])

# What torch.compiler.assume_constant_result sets (torch._dynamo.decorators, torch 2.13).
MARK = "_dynamo_marked_constant"


def constant_result(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result(fn)``, without importing dynamo.

    Dynamo calls ``fn`` as Python while it traces and puts its result into the graph
    as a constant; eagerly ``fn`` is a plain function.
    """
    if "torch._dynamo" in sys.modules:
        return cast(Callable[[_F], _F], torch.compiler.assume_constant_result)(fn)
    setattr(fn, MARK, True)
    return fn


class Found(NamedTuple):
    """A check's error, handed back as a value by a function dynamo calls as Python."""

    kind: str
    """``"ValueError"`` or ``"TypeError"``."""
    message: str


def python_at_trace_time(fn: _F) -> _F:
    """Marks ``fn`` for dynamo to call as Python, its result a constant of the graph.

    ``torch.compiler.assume_constant_result`` (``_trace.constant_result``), typed;
    eagerly a plain call. The arguments must be constants (metadata, keys, options,
    plans). A ``ValueError`` or ``TypeError`` that ``fn`` raises (a check that failed)
    is handed out of it as a value and raised again by the caller: inside the
    constant function dynamo would wrap it in an error of its own, while raised by
    traced code it is fsync's error, which an entry point can catch and turn into
    every rank's (``_agree.refuse``).
    """

    def checked(*args: Any) -> Any:
        try:
            return fn(*args)
        except (ValueError, TypeError) as error:
            return Found(type(error).__name__, str(error))

    constant = constant_result(checked)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        result = constant(*args)
        if isinstance(result, Found):
            raise (TypeError if result.kind == "TypeError" else ValueError)(result.message)
        return result

    return cast(_F, call)

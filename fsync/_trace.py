"""What fsync tells dynamo about its own functions, without importing dynamo.

``import fsync`` must not cost what ``import torch._dynamo`` costs (seconds on a 2-core
machine: the CHANGELOG has the figures): a process
that never compiles (an eager rank, a launcher, a checkpoint reader) would pay it
for nothing. ``torch.compiler.assume_constant_result`` imports dynamo to set one
attribute on the function it marks; ``constant_result`` sets the same
attribute itself while dynamo is not imported yet, and calls torch's once it is.
``tests/test_compile.py`` checks that both mark a function alike, so a torch
release that marks differently fails there rather than at a user's first compile.

Owns: marks that dynamo reads. May import: torch only (layer 0, under ``_comm``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

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

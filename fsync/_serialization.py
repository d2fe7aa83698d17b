"""State types that ``torch.load`` may rebuild with ``weights_only=True`` (its default)."""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T", bound=type)


def register_state(cls: T) -> T:
    """Class decorator: lets ``torch.load`` rebuild this state NamedTuple of tensors.

    fsync's states hold only tensors and nested tuples, so allowing their
    classes in the weights-only unpickler is safe; without it every user would
    have to pass ``weights_only=False`` to load a checkpoint.
    """
    torch.serialization.add_safe_globals([cls])
    return cls

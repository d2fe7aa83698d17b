"""``fsync.compile``: ``torch.compile`` with the inductor settings that let a sync overlap."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_F = TypeVar("_F", bound=Callable[..., Any])

# Inductor's scheduler passes that move collectives earlier and their waits later, so
# that a bucket's all-reduce runs while later gradients are computed (the ordering the
# inductor config recommends for reorder_for_compute_comm_overlap_passes).
OVERLAP_OPTIONS: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}


def compile(fn: _F, /, *, overlap: bool = True, fullgraph: bool = True, **kwargs: Any) -> _F:
    """``torch.compile(fn, fullgraph=True)`` with fsync's recommended inductor settings.

    With ``overlap=True`` inductor reorders the compiled step so that each
    bucket's collective is issued as soon as its gradients exist and waited for
    only where its result is used, which lets communication run during the rest
    of the backward pass (the overlap DDP gets from autograd hooks, here from
    the compiler). Everything else is ``torch.compile``; ``options=`` given here
    are applied on top.

    Args:
        fn: The train step (or any function calling fsync).
        overlap: Apply the overlap settings (:data:`OVERLAP_OPTIONS`).
        fullgraph: As for ``torch.compile``; fsync traces without graph breaks.
        **kwargs: Passed to ``torch.compile`` (``mode``, ``dynamic``, ``options`` ...).

    Returns:
        The compiled function.

    Example:
        >>> import torch, fsync
        >>> def train_step(params, grads):
        ...     grads = fsync.sync_grads(grads)
        ...     return {k: p - 0.1 * grads[k] for k, p in params.items()}
        >>> train_step = fsync.compile(train_step)  # compiled on its first call
    """
    options = {**(OVERLAP_OPTIONS if overlap else {}), **kwargs.pop("options", {})}
    compiled = torch.compile(fn, fullgraph=fullgraph, options=options or None, **kwargs)
    return cast(_F, compiled)

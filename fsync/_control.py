"""The control vector each rank sends at a sync, and the verdict its sum gives.

The vector has a fixed size, the same on every rank whatever the ranks hold, so that
ranks that disagree still meet in its all-reduce (``sum``, int64, ``_agree``):

* ``active``: 1 on a rank that contributes this step (the count divides a mean
  for ``divide_by="active"``);
* the 64-bit fingerprint ``h`` of the plan and the sync options (the hook's
  kind and settings, ``find_unused``, ``divide_by``) and the metadata of the hook's
  state (``state_words``), cut into four 16-bit chunks ``c``, each sent as
  ``(c, c**2)``;
* the sync's sequence number ``s`` (the state's step count modulo 2**16) as
  ``(s, s**2)``, which catches a rank that skipped a sync;
* a flag for what this rank found alone: a state made for another plan (read
  from the state's values), or a check that failed on this rank before the
  agreement (``_agree.refuse``), and the number of leaves this rank has no gradient for.

By Cauchy-Schwarz, ``(sum c)**2 == n * sum c**2`` holds exactly when all ``n``
values are equal, and every rank evaluates the same sums: every rank sees the
same verdict from ``O(1)`` bytes per rank, at any world size (int64 does not
overflow below 2**15 ranks).

Owns: the vector's layout, the fingerprint and the verdict. May import: ``_tree``,
``_trace``, ``_plan`` (layer 3, above those).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fsync import _tree
from fsync._plan import PLAN_CACHE_SIZE
from fsync._trace import python_at_trace_time

# Control vector: [active, (c, c*c) for 4 chunks of h, s, s*s, found, nones].
_CHUNKS = 4
_CHUNK_BITS = 16
ACTIVE, _H, SEQ, FOUND, NONES = 0, 1, 1 + 2 * _CHUNKS, 3 + 2 * _CHUNKS, 4 + 2 * _CHUNKS
CONTROL_SIZE = 5 + 2 * _CHUNKS


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
    head = int64_vector(fixed, device)
    tail = torch.tensor([0, 0, 0, nones], dtype=torch.int64, device=device)
    if step is not None:
        s = step.to(device=device, dtype=torch.int64).reshape(1) % (1 << _CHUNK_BITS)
        tail = tail + torch.cat([s, s * s, s.new_zeros(2)])
    if state_fingerprint is not None:
        other = (state_fingerprint.to(device).reshape(1) != plan_fingerprint).to(torch.int64)
        tail = tail + torch.cat([other.new_zeros(2), other, other.new_zeros(1)])
    return torch.cat([head, tail])


def int64_vector(values: Sequence[int], device: torch.device) -> torch.Tensor:
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


def verdict(summed: list[int], world_size: int) -> str | None:
    """Which kind of disagreement the summed control vector shows, if any."""
    if summed[FOUND]:
        return "found"
    if not _all_equal(summed[SEQ], summed[SEQ + 1], world_size):
        return "seq"
    for k in range(_CHUNKS):
        if not _all_equal(summed[_H + 2 * k], summed[_H + 2 * k + 1], world_size):
            return "fingerprint"
    return None

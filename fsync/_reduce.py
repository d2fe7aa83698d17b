"""The one reduce: checked leaves and their plan in, reduced buffers (or leaves) out.

Every entry point ([fsync.sync_grads][], [fsync.GradSync][], the ZeRO step and
[fsync.sync_stats][]) ends here, so they all issue the same collectives in the
same order: the control collective (if the options need one), then pack, the
hook, the wait, and unpack.

Owns: the order of a sync's steps and the hook's calling convention. May
import: everything below it (layers 1 to 6), ``fsync.ops`` for the default hook.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fsync import _checks, _comm, _pack, _sparse
from fsync._agree import agree_on
from fsync._hook import Hook, SyncContext, hook_spec
from fsync._options import SyncOptions
from fsync._plan import BucketPlan
from fsync.ops._allreduce import allreduce

DEFAULT_HOOK = allreduce("mean")

_HOOK_RESULT = (
    "hook.apply returned {got}; expected a pair (buckets, state): a list with one tensor per "
    "bucket and the hook's new state. End a custom apply with `return buckets, state`."
)


class Reduced(NamedTuple):
    """What one reduce returns.

    Attributes:
        buffers: One reduced buffer per bucket of the plan (with ``scatter``,
            a dense bucket's buffer may be this rank's shard of it).
        used: Per leaf, whether any rank had a gradient for it (``None``
            unless ``find_unused``).
        hook_state: The hook's new state.
    """

    buffers: list[torch.Tensor]
    used: list[bool] | None
    hook_state: Any


def _apply_hook(
    buffers: list[torch.Tensor], plan: BucketPlan, hook: Hook, state: Any, ctx: Any
) -> tuple[list[torch.Tensor], Any]:
    dense = [b for b, spec in zip(buffers, plan.specs, strict=True) if not spec.sparse]
    result = hook.apply(dense, state, ctx)
    if not isinstance(result, tuple) or len(result) != 2:
        got = f"a {type(result).__name__}"
        if isinstance(result, tuple):
            got = f"a tuple of {len(result)}"
        raise TypeError(_HOOK_RESULT.format(got=got))
    out, state = result
    if not isinstance(out, list | tuple):
        raise TypeError(
            f"hook output: got a {type(out).__name__}; expected a list with one buffer per "
            "bucket, in the plan's order."
        )
    out = [_comm.wait(b) for b in out]
    _checks.check_buffers(
        out, ctx.buckets, plan, "hook output", shards=ctx.world_size if ctx.scatter else 0
    )
    return out, state


def reduce_buckets(
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    options: SyncOptions,
    hook_state: Any,
    group: _comm.Group,
    *,
    active: bool = True,
    scatter: bool = False,
    step: torch.Tensor | None = None,
    state_fingerprint: torch.Tensor | None = None,
) -> Reduced:
    """Agreement, pack, hook, wait: the reduced buffer of every bucket.

    ``leaves`` must already fit ``plan`` (see ``fit_tree``). The ranks first
    agree (``_agree.agree_on``) on the plan, the options, the sync's sequence
    number ``step`` (a state's step count) and that ``state_fingerprint`` (the
    fingerprint of the plan a state was made for) is the plan's. With
    ``scatter`` the hook may return this rank's shard of a bucket instead of all
    of it (the ZeRO step needs only that).
    """
    sparse = [spec for spec in plan.specs if spec.sparse]
    if sparse and torch.compiler.is_compiling():
        leaf = plan.leaves[sparse[0].leaves[0]]
        assert leaf is not None
        raise TypeError(_checks.SPARSE_UNDER_COMPILE.format(path=leaf.path))
    if not active:
        leaves = [None] * len(leaves)
    hook = hook_of(options)
    (divisor, used), buffers = agree_on(
        plan,
        leaves,
        group,
        hook=hook_spec(hook),
        find_unused=options.find_unused,
        divide_by=options.divide_by,
        active=active,
        step=step,
        state_fingerprint=state_fingerprint,
        pack=functools.partial(_pack_after, leaves, plan),
    )
    if sparse and hook_spec(hook) != DEFAULT_HOOK.spec:
        leaf = plan.leaves[sparse[0].leaves[0]]
        assert leaf is not None
        raise ValueError(_checks.SPARSE_NEEDS_DEFAULT_HOOK.format(path=leaf.path, hook=hook.spec))
    dense_specs = tuple(spec for spec in plan.specs if not spec.sparse)
    size = _comm.size(group)
    ctx = SyncContext(
        plan, dense_specs, group, _comm.rank(group), size, divisor, scatter=scatter, owned=True
    )
    dense, hook_state = _apply_hook(buffers, plan, hook, hook_state, ctx)
    reduced = iter(dense)
    out = [
        _sparse.sparse_mean(b, ctx) if spec.sparse else next(reduced)
        for b, spec in zip(buffers, plan.specs, strict=True)
    ]
    return Reduced(out, used, hook_state)


def _pack_after(
    leaves: Sequence[torch.Tensor | None], plan: BucketPlan, token: torch.Tensor | None
) -> list[torch.Tensor]:
    return _pack.pack_leaves(leaves, plan, after=token)


def unpack_reduced(reduced: Reduced, plan: BucketPlan) -> list[torch.Tensor | None]:
    """The leaves of reduced buffers; ``None`` where no rank had a gradient (``find_unused``)."""
    out = _pack.unpack_leaves(reduced.buffers, plan)
    if reduced.used is not None:
        out = [leaf if keep else None for leaf, keep in zip(out, reduced.used, strict=True)]
    return out


def hook_of(options: SyncOptions) -> Hook:
    """The options' hook, the default (all-reduce mean) filled in."""
    return DEFAULT_HOOK if options.hook is None else options.hook


def init_hook(options: SyncOptions, plan: BucketPlan) -> Any:
    """The initial state of the options' hook for ``plan``."""
    return hook_of(options).init(plan)

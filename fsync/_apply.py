"""A hook applied to dense buckets: its calling convention, its results waited for and checked.

``start_hook`` calls ``hook.apply`` (its collectives issued, its results maybe in
flight), ``finish_hook`` waits for them and checks them against the context's
buckets; ``start_bucket`` / ``finish_bucket`` do it for one bucket of a bucketwise
hook, naming a failed wait by the bucket (``stage``). ``context`` is the hook's
[fsync.SyncContext][] for every dense bucket of a plan.

Owns: the hook's calling convention. May import: ``_comm``, ``_checks``, ``_hook``,
``_agree`` (for ``refuse``), ``_plan`` (layers 1 to 6, below the reduce).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fsync import _checks, _comm
from fsync._agree import refuse
from fsync._comm import _failures
from fsync._hook import Hook, SyncContext
from fsync._plan import BucketPlan

_HOOK_RESULT = (
    "hook.apply returned {got}; expected a pair (buckets, state): a list with one tensor per "
    "bucket and the hook's new state. End a custom apply with `return buckets, state`."
)


def context(
    plan: BucketPlan, group: _comm.Group, divisor: int | torch.Tensor, *, scatter: bool = False
) -> SyncContext:
    """The hook's [fsync.SyncContext][] for every dense bucket of ``plan``, buffers owned."""
    dense = tuple(spec for spec in plan.specs if not spec.sparse)
    return SyncContext(
        plan,
        dense,
        group,
        _comm.rank(group),
        _comm.size(group),
        divisor,
        scatter=scatter,
        owned=True,
    )


def start_hook(
    buffers: list[torch.Tensor], hook: Hook, state: Any, ctx: SyncContext
) -> tuple[list[torch.Tensor], Any]:
    """``hook.apply`` on dense buffers: its collectives issued, its results maybe in flight.

    A check of the hook's that fails while tracing (a state that does not fit)
    is refused (``_agree.refuse``) rather than raised inside dynamo: at run time
    the ranks' agreement, earlier in the graph, has compared the hook states'
    metadata and raises first if they differ; where every rank's hook found the
    same, the refusal raises it on every rank.
    """
    try:
        result = hook.apply(buffers, state, ctx)
    except (ValueError, TypeError) as error:
        if not torch.compiler.is_compiling():
            raise
        refused: tuple[list[torch.Tensor], Any] = refuse(error, ctx.group, (buffers, state))
        return refused
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
    return list(out), state


def finish_hook(out: list[torch.Tensor], ctx: SyncContext, where: str = "") -> list[torch.Tensor]:
    """A started hook's buffers, waited for and checked against ``ctx.buckets``.

    ``where`` follows the bucket in the words of a failed wait (``" across nodes"``).
    """
    out = [
        _comm.wait(b, functools.partial(bucket_stage, ctx, k, f"the hook's result{where}"))
        for k, b in enumerate(out)
    ]
    shards = ctx.world_size if ctx.scatter else 0
    _checks.check_buffers(out, ctx.buckets, ctx.plan, "hook output", shards=shards)
    return out


def apply_hook(
    buffers: list[torch.Tensor], hook: Hook, state: Any, ctx: SyncContext, where: str = ""
) -> tuple[list[torch.Tensor], Any]:
    """The hook on dense buffers over ``ctx.group``: started, then waited for."""
    out, state = start_hook(buffers, hook, state, ctx)
    return finish_hook(out, ctx, where), state


def bucket_stage(ctx: SyncContext, k: int, what: str) -> str:
    """``"bucket 3 of 8 (what)"``: which of the plan's dense buckets ``ctx.buckets[k]`` is."""
    dense = [spec for spec in ctx.plan.specs if not spec.sparse]
    spec = ctx.buckets[k]
    number = next((i for i, s in enumerate(dense) if s is spec or s == spec), k)
    return f"bucket {number + 1} of {len(dense)} ({what})"


def alone(ctx: SyncContext, k: int) -> SyncContext:
    """``ctx`` for dense bucket ``k`` on its own."""
    return ctx._replace(buckets=(ctx.buckets[k],))


def start_bucket(buffer: torch.Tensor, hook: Hook, state: Any, ctx: SyncContext) -> torch.Tensor:
    """One complete dense bucket through a bucketwise hook over a flat group: issued, its
    result maybe in flight (``finish_bucket`` waits for it).

    ``ctx.buckets`` names the bucket alone (``alone(ctx, k)``); ``state`` is the
    hook's (which holds no tensors: it is the same for every bucket). On a 2-D
    mesh buckets go through a ``Pipeline`` instead. A collective that the hook
    waits for itself (a reduce-scatter on gloo, a compressing hook's cast back)
    and that fails is named as the bucket's.
    """
    if torch.compiler.is_compiling():
        return start_hook([buffer], hook, state, ctx)[0][0]
    try:
        out, _ = start_hook([buffer], hook, state, ctx)
    except _failures.CollectiveError as failure:
        if failure.stage:
            raise
        stage = bucket_stage(ctx, 0, "the hook's collectives")
        raise _failures.CollectiveError(
            _failures.COLLECTIVE_FAILED, stage=stage, backend=failure.backend
        ) from failure
    return out[0]


def finish_bucket(pending: torch.Tensor, ctx: SyncContext) -> torch.Tensor:
    """The reduced buffer of a bucket that ``start_bucket`` started, waited for and checked."""
    return finish_hook([pending], ctx)[0]

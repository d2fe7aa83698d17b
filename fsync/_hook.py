"""Hooks: what happens to the buckets between pack and unpack.

A [Hook][fsync.Hook] is a pair of pure functions, like an optax
``GradientTransformation``. Settings go to the factory that builds it
(``fsync.ops.allreduce("sum")``), tensors go to its state, and the state is
threaded through explicitly, so it can be checkpointed and traced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch

from fsync._comm import Group
from fsync._plan import BucketPlan, BucketSpec


class SyncContext(NamedTuple):
    """What a hook may know besides its buckets and state.

    Attributes:
        plan: The bucket plan of the tree being synced.
        buckets: One [BucketSpec][fsync.BucketSpec] per dense buffer the hook receives, in
            the same order (sparse buckets are reduced by fsync itself and never
            reach a hook).
        group: The group to communicate over; pass it to the collectives.
            On a 2-D mesh the hook runs on the cross-node hop: ``group`` is the
            mesh's dim 0, the buffers are this rank's shards of the node's sums
            and ``plan`` is their plan (see the guide "Many nodes").
        rank: This process's rank within ``group``.
        world_size: Number of ranks in ``group``.
        divisor: What a mean divides by: ``world_size`` (an int), or, when
            ranks without data join a sync, the number of contributing ranks
            (a 0-d tensor); across nodes, all the mesh's ranks (times the
            micro-batches of a [fsync.DeferredSync][]). Use ``divide`` rather
            than reading it.
        scatter: ``True`` when the caller (the ZeRO step) needs only this rank's
            shard of each reduced bucket. A hook may then return, per bucket,
            either the whole reduced bucket or this rank's shard of it: the
            bucket zero-padded to ``world_size * shard_numel(numel, world_size)``
            elements and cut into ``world_size`` equal pieces, piece ``rank``
            (what ``ops.allreduce`` returns, by a reduce-scatter).
        owned: ``True`` when the buffers passed to ``apply`` are new tensors that
            nothing else holds, so ``apply`` may write its result into them (the
            first hook of a sync gets the packed buckets; [chain][fsync.chain] passes
            ``False`` to the hooks after the first). Eagerly this saves a copy per
            bucket; under ``torch.compile`` the compiler reuses buffers anyway.
    """

    plan: BucketPlan
    buckets: tuple[BucketSpec, ...]
    group: Group
    rank: int
    world_size: int
    divisor: int | torch.Tensor
    scatter: bool = False
    owned: bool = False

    def divide(self, x: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """``x / divisor``, computed as DDP does: ``x * (1 / divisor)``.

        With an int divisor the factor is a Python float, which torch applies
        in the computation type of ``x`` and rounds once, exactly as DDP's
        ``mul_out(grad, 1 / world_size)``; a tensor divisor gives the same bits.
        ``inplace=True`` writes into ``x`` (only for a tensor the hook owns).
        """
        if isinstance(self.divisor, torch.Tensor):
            # The factor in at least float32, as torch's kernels hold a Python scalar.
            compute = torch.promote_types(x.dtype, torch.float32)
            factor: float | torch.Tensor = (1.0 / self.divisor.to(torch.float64)).to(compute)
        elif self.divisor == 1:
            return x
        else:
            factor = 1.0 / self.divisor
        return x.mul_(factor) if inplace else torch.mul(x, factor)


Buckets = Sequence[torch.Tensor]
InitFn = Callable[[BucketPlan], Any]
ApplyFn = Callable[[Buckets, Any, SyncContext], tuple[Buckets, Any]]


class Hook(NamedTuple):
    """A bucket transformation: ``init(plan) -> state`` and ``apply(buckets, state, ctx)``.

    Both are pure functions, like the two halves of an optax
    ``GradientTransformation``; [chain][fsync.chain] composes hooks.

    Attributes:
        init: ``init(plan) -> state``: the initial state for a
            [BucketPlan][fsync.BucketPlan], a pytree of tensors, ``()`` when the hook keeps
            none.
        apply: ``apply(buckets, state, ctx) -> (buckets, state)``: receives one
            flat 1-D tensor per dense bucket (see [SyncContext.buckets][fsync.SyncContext.buckets]),
            the state and a [SyncContext][fsync.SyncContext], and returns as many tensors of
            the same sizes and dtypes, plus its new state. It must not modify
            its inputs in place (unless ``ctx.owned`` allows it).
        spec: The hook's kind and settings in words, such as
            ``"powersgd(rank=2, ...)"``: part of what ranks compare at every
            sync, so that ranks running different hooks or settings get an
            error instead of wrong numbers. fsync's hooks fill it in; for a
            hook of your own, name its settings here (left empty, the module
            and name of ``apply`` stand in).
        bucketwise: ``True`` for a hook that keeps no state and treats each
            bucket on its own, so that ``apply`` called on one bucket at a time
            (``ctx.buckets`` naming that bucket) issues the same collectives, in
            the same order, and gives the same buffers as called on all of them.
            [fsync.grad_and_value][] then starts a bucket's hook as soon as
            backward completes the bucket; any other hook runs once every bucket
            is ready. fsync's all-reduce, quantisation and ``noop`` are
            bucketwise, so are fp16/bf16 compression around a bucketwise hook
            and a [chain][fsync.chain] of bucketwise hooks; PowerSGD is not (its
            state spans the buckets). Default ``False``: always correct.

    Example:
        >>> import fsync
        >>> def clip_apply(buckets, state, ctx):
        ...     return [b.clamp(-1.0, 1.0) for b in buckets], state
        >>> clip = fsync.Hook(init=lambda plan: (), apply=clip_apply)
        >>> hook = fsync.chain(clip, fsync.ops.allreduce())
    """

    init: InitFn
    apply: ApplyFn
    spec: str = ""
    bucketwise: bool = False


def hook_spec(hook: Hook, /) -> str:
    """What identifies ``hook`` across ranks: its ``spec``, or where its ``apply`` is defined."""
    if hook.spec:
        return hook.spec
    return f"{getattr(hook.apply, '__module__', '?')}.{getattr(hook.apply, '__qualname__', '?')}"


def spec_of(name: str, /, *args: Any, **settings: Any) -> str:
    """``name(arg, key=value, ...)``: a hook's spec from its factory's name and settings.

    Positional ``args`` are written as they are (an inner hook's spec, a number),
    keyword ``settings`` as ``key=repr(value)``.
    """
    words = [str(a) for a in args] + [f"{k}={v!r}" for k, v in settings.items()]
    return f"{name}({', '.join(words)})"


def check_hook(hook: Any, /) -> Hook:
    """Returns ``hook`` if it looks like a [Hook][fsync.Hook], else raises ``TypeError``."""
    if not (callable(getattr(hook, "init", None)) and callable(getattr(hook, "apply", None))):
        raise TypeError(
            f"hook is a {type(hook).__name__}; expected an fsync.Hook(init, apply), such as "
            "fsync.ops.allreduce()."
        )
    return cast(Hook, hook)


def chain(*hooks: Hook) -> Hook:
    """Composes hooks: the buckets go through each in turn, each with its own state.

    The state of the chain is a tuple with one entry per hook.

    Args:
        *hooks: The hooks, applied first to last.

    Returns:
        A [Hook][fsync.Hook].

    Example:
        >>> import fsync
        >>> hook = fsync.chain(fsync.ops.allreduce("sum"), fsync.ops.allreduce("sum"))
        >>> hook.init(None)
        ((), ())
    """
    for hook in hooks:
        check_hook(hook)

    def init(plan: BucketPlan) -> tuple[Any, ...]:
        return tuple(hook.init(plan) for hook in hooks)

    def apply(
        buckets: Buckets, state: tuple[Any, ...], ctx: SyncContext
    ) -> tuple[Buckets, tuple[Any, ...]]:
        if not isinstance(state, tuple) or len(state) != len(hooks):
            raise ValueError(
                f"chain of {len(hooks)} hooks got a state of {type(state).__name__}; expected "
                "the tuple its init returned."
            )
        new_state = []
        for k, (hook, hook_state) in enumerate(zip(hooks, state, strict=True)):
            # A hook's output may be held by the hook (in its state, say): only the
            # first hook may own its input.
            buckets, hook_state = hook.apply(
                buckets, hook_state, ctx if k == 0 else ctx._replace(owned=False)
            )
            new_state.append(hook_state)
        return buckets, tuple(new_state)

    spec = spec_of("chain", *(hook_spec(h) for h in hooks))
    return Hook(init, apply, spec, bucketwise=all(h.bucketwise for h in hooks))

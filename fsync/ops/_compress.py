"""Half-precision compression: cast the buckets down, run an inner hook, cast back.

``fp16_compress()`` is DDP's ``fp16_compress_hook``: with the default inner hook
each bucket is cast to float16, scaled by ``1 / world_size`` and summed across
ranks, then cast back to its own dtype. ``fp16_compress(inner)`` is DDP's
``fp16_compress_wrapper(inner)``, except that the inner hook's state is a value
too: it is made for, and kept in, the compressed dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fsync import _comm
from fsync._allreduce import allreduce
from fsync._checks import check_floating
from fsync._hook import Buckets, Hook, SyncContext, check_hook, hook_spec, spec_of
from fsync._plan import BucketPlan, BucketSpec


@functools.lru_cache(maxsize=32)
def _cast_plan(plan: BucketPlan, dtype: torch.dtype) -> BucketPlan:
    leaves = tuple(
        leaf if leaf is None or leaf.sparse else leaf._replace(dtype=dtype) for leaf in plan.leaves
    )
    return BucketPlan(plan.treespec, leaves, plan.buckets)


def cast_plan(plan: BucketPlan, dtype: torch.dtype) -> BucketPlan:
    """``plan`` with every dense leaf (and so every dense bucket) in ``dtype``.

    The buckets keep their leaves, order and offsets; only the dtype changes, so
    a hook running inside a cast sees a plan that describes the buffers it gets.
    Eagerly the cast plan is cached (and so its fingerprint, which stateful inner
    hooks compare). Inside ``torch.compile`` no plan can be built (its tree
    structure is no constant there) and the plan is handed on as it is: what a
    hook reads of it in a trace (leaf shapes, paths, layouts) does not depend on
    the dtype, and the buffers' dtypes are in ``ctx.buckets``.
    """
    if torch.compiler.is_compiling():
        return plan
    return _cast_plan(plan, dtype)


def _compress(name: str, dtype: torch.dtype, inner: Hook | None) -> Hook:
    inner = check_hook(allreduce("mean") if inner is None else inner)

    def init(plan: BucketPlan) -> Any:
        check_floating(name, plan, [s for s in plan.specs if not s.sparse])
        return inner.init(cast_plan(plan, dtype))

    def apply(buckets: Buckets, state: Any, ctx: SyncContext) -> tuple[Buckets, Any]:
        check_floating(name, ctx.plan, ctx.buckets)
        inner_ctx = ctx._replace(
            plan=cast_plan(ctx.plan, dtype),
            # Built field by field: dynamo cannot trace NamedTuple._replace on a constant.
            buckets=tuple(
                BucketSpec(
                    s.leaves, s.offsets, s.sizes, s.numel, dtype, s.device, s.sparse, s.layouts
                )
                for s in ctx.buckets
            ),
            # The cast makes new tensors, which the inner hook may overwrite.
            owned=ctx.owned or all(spec.dtype != dtype for spec in ctx.buckets),
        )
        out, state = inner.apply([b.to(dtype) for b in buckets], state, inner_ctx)
        # Element-wise, so a shard (ctx.scatter) is cast back as well as a whole bucket; the
        # wait first, so that a failed collective is fsync's error (see _comm.wait).
        cast = [_comm.wait(o).to(spec.dtype) for o, spec in zip(out, ctx.buckets, strict=True)]
        return cast, state

    return Hook(init, apply, spec_of(name, hook_spec(inner)), bucketwise=inner.bucketwise)


def fp16_compress(inner: Hook | None = None) -> Hook:
    """Communicates in float16: casts each bucket down, runs ``inner``, casts back.

    With the default ``inner`` this is DDP's ``fp16_compress_hook``: the
    float16 bucket is scaled by ``1 / world_size`` (before the sum, so it does
    not overflow) and all-reduced, and the result is cast back to the bucket's
    dtype; on two ranks the result equals DDP's bit for bit. Wrapping another
    hook is DDP's ``fp16_compress_wrapper``: ``inner`` sees float16 buckets, a
    float16 plan, and keeps its state (PowerSGD's error and Q) in float16.
    Bytes on the wire: half of a float32 all-reduce (a quarter of float64), or
    half of what ``inner`` sends in float32.

    Args:
        inner: The hook to run on the float16 buckets. Default:
            ``fsync.ops.allreduce("mean")``.

    Returns:
        A [fsync.Hook][] whose state is ``inner``'s.

    Raises:
        TypeError: ``inner`` is not a hook; at ``init``/``apply``: a bucket is
            not floating point.

    Example:
        >>> import torch, fsync
        >>> grads = {"w": torch.tensor([2049.0, 1e-8])}  # float16 has 11 significant bits
        >>> fsync.sync_grads(grads, hook=fsync.ops.fp16_compress())["w"]
        tensor([2048.,    0.])
    """
    return _compress("fp16_compress", torch.float16, inner)


def bf16_compress(inner: Hook | None = None) -> Hook:
    """Communicates in bfloat16: casts each bucket down, runs ``inner``, casts back.

    The bfloat16 form of [fp16_compress][fsync.ops.fp16_compress] (DDP's ``bf16_compress_hook``
    and ``bf16_compress_wrapper``): the range of float32 with 8 bits of
    mantissa, so large gradients do not overflow. Unlike DDP's, it runs on any
    backend that all-reduces bfloat16 (gloo included). Bytes on the wire: half
    of a float32 all-reduce, or half of what ``inner`` sends in float32.

    The hook returned has ``inner``'s state and raises what fp16_compress's raises.

    Args:
        inner: The hook to run on the bfloat16 buckets. Default:
            ``fsync.ops.allreduce("mean")``.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
        >>> sync = fsync.GradSync(hook=fsync.ops.bf16_compress(fsync.ops.powersgd(2)))
        >>> state = sync.init(params)
        >>> state.hook.q[0].dtype
        torch.bfloat16
    """
    return _compress("bf16_compress", torch.bfloat16, inner)

"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al., 2019).

The semantics are those of DDP's ``powerSGD_hook`` and ``batched_powerSGD_hook``;
what differs is where things live. Settings go to the factory, and every
tensor the algorithm carries from one step to the next (the step counter, the
error-feedback buffers, the warm-start Q matrices) is in [PowerSGDState][fsync.ops.PowerSGDState],
a NamedTuple that can be checkpointed, loaded with ``torch.load`` and traced.

Per dense bucket and step, once ``step >= start_step``:

1. the elements to compress (whole leaves viewed as matrices, or, batched, the
   bucket zero-padded to a square) get the error left over from the last step;
2. each matrix ``M`` (n x m) is multiplied by its orthonormalised Q (m x r):
   ``P = M Q``; one all-reduce sums the Ps together with the mean of the leaves
   left uncompressed;
3. each P is orthonormalised, ``Q = M^T P`` is averaged by a second all-reduce,
   and ``P Q^T`` is the synced matrix, equal on every rank;
4. the new error is what the compression lost on this rank (``M - P Q^T``); Q
   is kept for the next step (warm start).

Before ``start_step`` the buckets are all-reduced plainly. The switch reads a
tensor counter through ``torch.cond``, so a compiled step traces once.

This module is the hook: its state, its settings and their checks, and ``init`` /
``apply``, which compose what the modules beside it do: ``_powersgd_layout`` (which
elements are compressed, as which matrices), ``_powersgd_bucket`` (one bucket's power
iteration and error feedback) and ``_powersgd_random`` (the random Q).

Owns: [fsync.ops.powersgd][], [fsync.ops.batched_powersgd][] and
[fsync.ops.PowerSGDState][] (pickled under this module's name: checkpoints saved with
``torch.save`` name it so). May import: ``_comm``, ``_checks``, ``_hook``, ``_plan``,
``_state`` and the ``_powersgd_*`` modules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from fsync import _comm
from fsync._checks import check_floating
from fsync._hook import Buckets, Hook, SyncContext, spec_of
from fsync._plan import BucketPlan, BucketSpec
from fsync._state import register_state
from fsync.ops._powersgd_bucket import compress
from fsync.ops._powersgd_layout import Layout, LayoutFn, batched_layout, per_leaf_layout
from fsync.ops._powersgd_random import gaussian, key


@register_state
class PowerSGDState(NamedTuple):
    """What PowerSGD carries from one step to the next: tensors only.

    Attributes:
        step: 0-d int64 CPU tensor, the number of syncs done. Compression
            starts once it reaches ``start_step``.
        error: Per dense bucket, this rank's error feedback: what compression
            has not yet delivered, over the bucket's compressed elements (empty
            without error feedback or where nothing in the bucket is compressed).
        q: Per dense bucket, the Q matrices of its compressed leaves, flat and
            one after the other, reused as the next step's starting point
            (empty without warm start).
        fingerprint: 0-d int64 CPU tensor, the fingerprint of the plan the state
            was made for, so that it is never used with another one.
    """

    step: torch.Tensor
    error: tuple[torch.Tensor, ...]
    q: tuple[torch.Tensor, ...]
    fingerprint: torch.Tensor


Carry = tuple[torch.Tensor, ...]

_OTHER_PLAN = (
    "{name}: the state does not fit this plan: {detail}. It was made for another plan or by a "
    "hook with other settings; pass the state that this hook's init returned for this plan."
)


def _check_settings(
    rank: int,
    start_step: int,
    min_compression_rate: float,
    orthogonalization_epsilon: float,
    seed: int,
) -> None:
    for name, value in (("rank", rank), ("start_step", start_step), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int; got {value!r}.")
    if rank < 1:
        raise ValueError(
            f"rank must be >= 1 (the number of columns of P and Q); got {rank}. Try 1, 2 or 4."
        )
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0; got {start_step}.")
    for what, number in (
        ("min_compression_rate", min_compression_rate),
        ("orthogonalization_epsilon", orthogonalization_epsilon),
    ):
        if (
            isinstance(number, bool)
            or not isinstance(number, int | float)
            or not math.isfinite(number)
            or number < 0
        ):
            raise ValueError(f"{what} must be a finite number >= 0; got {number!r}.")


def _dense(specs: Sequence[BucketSpec]) -> tuple[BucketSpec, ...]:
    return tuple(spec for spec in specs if not spec.sparse)


class _Settings(NamedTuple):
    """The settings [fsync.ops.powersgd][] and [fsync.ops.batched_powersgd][] share
    beyond the layout (which the rank and the minimum compression rate make)."""

    start_step: int
    error_feedback: bool
    warm_start: bool
    orthogonalization_epsilon: float
    seed: int

    def spec(self, name: str, rank: int, min_compression_rate: float) -> str:
        """The hook's spec: its factory's name and every setting, in the factory's order."""
        return spec_of(
            name,
            rank,
            start_step=self.start_step,
            min_compression_rate=min_compression_rate,
            error_feedback=self.error_feedback,
            warm_start=self.warm_start,
            seed=self.seed,
            orthogonalization_epsilon=self.orthogonalization_epsilon,
        )


def _check_state(
    name: str,
    settings: _Settings,
    state: PowerSGDState,
    ctx: SyncContext,
    plan_layouts: list[Layout],
) -> None:
    """Raises unless ``state`` is a PowerSGDState that the hook ``name`` with these settings
    made for ``ctx``'s plan."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"{name}: state is a {type(state).__name__}; expected the PowerSGDState that "
            "init returned (or the previous step's)."
        )
    n = len(ctx.buckets)
    if len(state.error) != n or len(state.q) != n:
        detail = f"it has {len(state.error)} buckets, the plan has {n}"
        raise ValueError(_OTHER_PLAN.format(name=name, detail=detail))
    for b, (spec, layout) in enumerate(zip(ctx.buckets, plan_layouts, strict=True)):
        for what, tensor, numel in (
            ("error", state.error[b], layout.compressed_numel if settings.error_feedback else 0),
            ("q", state.q[b], layout.q_numel if settings.warm_start else 0),
        ):
            if tuple(tensor.shape) != (numel,) or tensor.dtype != spec.dtype:
                detail = (
                    f"{what}[{b}] has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, "
                    f"expected ({numel},) and {spec.dtype}"
                )
                raise ValueError(_OTHER_PLAN.format(name=name, detail=detail))
    if not torch.compiler.is_compiling() and int(state.fingerprint) != ctx.plan.fingerprint:
        detail = "its fingerprint is not this plan's"
        raise ValueError(_OTHER_PLAN.format(name=name, detail=detail))


def _powersgd(
    name: str, layout_fn: LayoutFn, rank: int, min_compression_rate: float, settings: _Settings
) -> Hook:
    """The hook [fsync.ops.powersgd][] and [fsync.ops.batched_powersgd][] make, each with
    its construction of the buckets' layouts; raises for a setting out of range."""
    start_step, error_feedback, warm_start, epsilon, seed = settings
    _check_settings(rank, start_step, min_compression_rate, epsilon, seed)

    def layout_of(plan: BucketPlan, spec: BucketSpec) -> Layout:
        return layout_fn(plan, spec, rank, min_compression_rate)

    def init(plan: BucketPlan) -> PowerSGDState:
        specs = _dense(plan.specs)
        check_floating(name, plan, specs)
        error, q = [], []
        for b, (spec, layout) in enumerate(
            zip(specs, [layout_of(plan, s) for s in specs], strict=True)
        ):
            zeros = torch.zeros(
                layout.compressed_numel if error_feedback else 0,
                dtype=spec.dtype,
                device=spec.device,
            )
            error.append(zeros)
            # The Q a fresh draw would give at the first compressed step, so that the
            # first compressed step does not depend on warm_start.
            first = key(seed, b, torch.tensor(start_step))
            numel = layout.q_numel if warm_start else 0
            q.append(gaussian(numel, first, spec.dtype, spec.device))
        return PowerSGDState(
            step=torch.zeros((), dtype=torch.int64),
            error=tuple(error),
            q=tuple(q),
            # Hashing the plan does not trace; inside torch.compile init only runs for
            # sync_grads to find out that the hook keeps state (and refuse it).
            fingerprint=torch.tensor(
                -1 if torch.compiler.is_compiling() else plan.fingerprint, dtype=torch.int64
            ),
        )

    def apply(
        buckets: Buckets, state: PowerSGDState, ctx: SyncContext
    ) -> tuple[Buckets, PowerSGDState]:
        check_floating(name, ctx.plan, ctx.buckets)
        plan_layouts = [layout_of(ctx.plan, s) for s in ctx.buckets]
        _check_state(name, settings, state, ctx, plan_layouts)
        n = len(buckets)

        def compress_bucket(
            b: int,
            bucket: torch.Tensor,
            error: torch.Tensor | None,
            q: torch.Tensor | None,
            step: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """The synced bucket, this rank's new error and the new Q (empty when not kept)."""
            layout = plan_layouts[b]
            if not layout.groups:  # nothing worth compressing: DDP's plain mean
                out = _comm.all_reduce(ctx.divide(bucket), "sum", ctx.group)
                return out, bucket.new_zeros(0), bucket.new_zeros(0)
            if q is None:  # no warm start: a fresh draw for this bucket and step
                q = gaussian(layout.q_numel, key(seed, b, step), bucket.dtype, bucket.device)
            out, new_error, new_q = compress(bucket, layout, error, q, epsilon, ctx)
            return out, new_error, new_q if warm_start else q.new_zeros(0)

        def compress_all(
            buckets: list[torch.Tensor], error: Carry, q: Carry, step: torch.Tensor
        ) -> tuple[list[torch.Tensor], Carry, Carry]:
            results = [
                compress_bucket(
                    b,
                    buckets[b],
                    error[b] if error_feedback else None,
                    q[b] if warm_start else None,
                    step,
                )
                for b in range(n)
            ]
            out = [r[0] for r in results]
            new_error = tuple(r[1] for r in results) if error_feedback else ()
            new_q = tuple(r[2] for r in results) if warm_start else ()
            return out, new_error, new_q

        def allreduce_all(
            buckets: list[torch.Tensor], error: Carry, q: Carry, step: torch.Tensor
        ) -> tuple[list[torch.Tensor], Carry, Carry]:
            out = [_comm.all_reduce(ctx.divide(b), "sum", ctx.group) for b in buckets]
            # torch.cond's branches may not return their inputs: copy the unchanged state.
            return out, tuple(e.clone() for e in error), tuple(v.clone() for v in q)

        operands = (
            list(buckets),
            state.error if error_feedback else (),
            state.q if warm_start else (),
            state.step,
        )
        if start_step == 0:
            out, error, q = compress_all(*operands)
        elif torch.compiler.is_compiling():
            # One graph for both sides of start_step, chosen by the tensor counter.
            out, error, q = torch.cond(
                state.step >= start_step, compress_all, allreduce_all, operands
            )
        else:
            branch = compress_all if int(state.step) >= start_step else allreduce_all
            out, error, q = branch(*operands)
        new_state = state._replace(
            step=state.step + 1,
            error=tuple(error) if error_feedback else state.error,
            q=tuple(q) if warm_start else state.q,
        )
        return list(out), new_state

    return Hook(init, apply, settings.spec(name, rank, min_compression_rate))


def powersgd(
    rank: int = 1,
    *,
    start_step: int = 10,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    seed: int = 0,
) -> Hook:
    """PowerSGD, leaf by leaf: DDP's ``powerSGD_hook`` as a hook with explicit state.

    Each leaf is read as a matrix (its outermost dimension in memory by the
    rest, ``view(shape[0], -1)`` for a contiguous leaf) and compressed to rank
    ``r = min(rank, rows, cols)`` when that saves enough:
    ``(rows + cols) * r * min_compression_rate < rows * cols``. Vectors and
    small leaves fail that test and are averaged exactly, all of a bucket's in
    the same collective as its Ps. The first ``start_step`` syncs are plain
    all-reduces; unlike DDP, which rebuilds its buckets after the first step,
    fsync's plan is fixed, so ``start_step`` may be 0 or 1. Keep the state in a
    [fsync.GradSync][].

    Bytes on the wire per step, relative to all-reduce:
    ``(sum of (rows + cols) * r over compressed leaves + numel of the others) /
    total numel``, in two all-reduces per bucket instead of one. A 1024 x 1024
    matrix at rank 4 sends 8192 instead of 1048576 elements (1/128).

    Error feedback differs from DDP's in one detail: DDP also keeps an error
    term for the leaves it does not compress (each rank's deviation from the
    mean, which cancels out across ranks at the next step); fsync keeps none
    there, which gives the same mean without the memory and the rounding.

    Args:
        rank: Columns of P and Q (DDP's ``matrix_approximation_rank``); 1 to 4
            is typical. Higher is more accurate and sends more.
        start_step: Number of plain all-reduce steps before compression starts
            (DDP's ``start_powerSGD_iter``).
        min_compression_rate: A leaf is compressed only if that divides its
            elements on the wire by more than this.
        error_feedback: Add what compression lost on this rank to the next
            step's gradient (needed for convergence; costs one buffer the size
            of the compressed leaves).
        warm_start: Start each step's power iteration from the last step's Q
            rather than from a fresh random one.
        orthogonalization_epsilon: Added to each column norm when
            orthonormalising; 0 leaves all-zero columns at zero.
        seed: Seeds the random Q, identically on every rank.

    Returns:
        A [fsync.Hook][] whose state is a [PowerSGDState][fsync.ops.PowerSGDState].

    Raises:
        TypeError: An integer setting is not an int; at ``init``/``apply``: a
            bucket is not floating point, or the state is not a PowerSGDState.
        ValueError: ``rank < 1``, a negative ``start_step``, rate or epsilon;
            at ``apply``: the state was made for another plan or other settings.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.zeros(64, 32), "b": torch.zeros(64)}
        >>> sync = fsync.GradSync(hook=fsync.ops.powersgd(rank=2, start_step=0))
        >>> state = sync.init(params)
        >>> grads, state = sync({"w": torch.ones(64, 32), "b": torch.ones(64)}, state)
        >>> int(state.hook.step), [tuple(q.shape) for q in state.hook.q]
        (1, [(64,)])
    """
    settings = _Settings(start_step, error_feedback, warm_start, orthogonalization_epsilon, seed)
    return _powersgd("powersgd", per_leaf_layout, rank, min_compression_rate, settings)


def batched_powersgd(
    rank: int = 1,
    *,
    start_step: int = 10,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    seed: int = 0,
) -> Hook:
    """PowerSGD over whole buckets: DDP's ``batched_powerSGD_hook`` with explicit state.

    Each bucket, zero-padded to ``side * side`` elements with
    ``side = ceil(sqrt(numel))``, is compressed as one square matrix at rank
    ``r = min(rank, side)``. Faster than [powersgd][fsync.ops.powersgd] (one small matmul per
    bucket) but usually less accurate, since the square ignores the leaves'
    rows and columns; DDP advises it only where rank 1 is good enough. Unlike
    DDP, a bucket is left uncompressed when compression would not divide its
    size by ``min_compression_rate`` (``2 * side * r * rate >= numel``; DDP
    compresses every bucket, even one that grows): pass 0 to compress all.

    Bytes on the wire per step, relative to all-reduce: ``2 * side * r / numel``
    for each compressed bucket (a 4 MiB float32 bucket at rank 1: 2048 of
    1048576 elements), in two all-reduces.

    The settings are [powersgd][fsync.ops.powersgd]'s, each applied to a bucket where
    powersgd's applies to a leaf; so are the hook it returns (its state a
    [PowerSGDState][fsync.ops.PowerSGDState]) and the errors it raises.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.zeros(64, 32), "b": torch.zeros(64)}
        >>> sync = fsync.GradSync(hook=fsync.ops.batched_powersgd(rank=1))
        >>> state = sync.init(params)
        >>> [tuple(e.shape) for e in state.hook.error]  # 2112 elements padded to 46 * 46
        [(2116,)]
    """
    settings = _Settings(start_step, error_feedback, warm_start, orthogonalization_epsilon, seed)
    return _powersgd("batched_powersgd", batched_layout, rank, min_compression_rate, settings)

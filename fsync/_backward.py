"""Gradients that sync while backward runs: the eager half of [fsync.grad_and_value][].

``torch.func.grad`` returns every gradient at once, after the last backward
kernel, so a sync called afterwards can hide nothing. DDP's Reducer overlaps by
starting a bucket's all-reduce from an autograd hook the moment the bucket's
last gradient exists. Here the gradient call is fsync's own, and one call does
the same with no state kept afterwards:

1. the differentiated arguments' tensor leaves are detached and made to
   require grad (as ``torch.func`` wraps them), ``fn`` runs (the forward pass),
   and the ranks' agreement is issued (``_agree.begin``): only its control
   all-reduce, which is on the wire during backward;
2. one backward (``torch.autograd.grad`` over those leaves, nothing accumulated
   anywhere else); a hook on each leaf copies its gradient into its bucket, in
   the bucket's dtype and the leaf's memory order, and hands autograd the
   bucket's slice in place of the gradient, so no second copy is kept;
3. a starter thread takes complete buckets in the plan's order (a complete
   bucket waits for those before it, as in DDP's Reducer): the first waits for
   the agreement, each then goes through a bucketwise hook on its own
   (``_reduce.start_bucket``), or, for any other hook, waits for the rest (on a
   2-D mesh its within-node reduce-scatter is issued already);
4. after backward, a leaf that got no gradient (``fn`` does not use it) is
   zeros, the buckets left are started, a hook that is not bucketwise runs on
   all of them, the call waits and unpacks.

Why a thread: a hook may wait for its own collective before it returns (a
compressing hook casts the result back, ``quantize`` dequantises it); on
backward's thread that would stall backward for the whole transfer. The thread
is the only one that issues the call's bucket collectives, so they leave every
rank in the plan's order; collectives that ``fn``'s own backward issues on the
same group (SyncBatchNorm) are not ordered against them: give those a group of
their own. Starter threads are kept for the process and reused, one per call in
flight (``on_starter``): c10d's functional collectives keep about 100 KiB for
every thread that issues one and never give it back (torch 2.13), so a thread
made per call grew a training run's memory without bound (1 GB in 5,000 calls).

Owns: one gradient call's buckets, their filling by autograd and their start
in plan order. May import: layers 1 to 6 (it composes the reduce's stages with
autograd, beside ``_reduce``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import optree
import torch

from fsync import _checks, _comm, _tree
from fsync._agree import Agreed, Agreement, begin, refuse
from fsync._hook import Hook, SyncContext, hook_spec
from fsync._options import SyncOptions
from fsync._plan import BucketPlan, LeafLayout
from fsync._planner import PLAN_CACHE_SIZE
from fsync._reduce import (
    DEFAULT_HOOK,
    Pipeline,
    Reduced,
    alone,
    context,
    finish_bucket,
    hook_of,
    pipelined,
    reduce_started,
    start_bucket,
    start_within,
    terms,
)
from fsync.ops._allreduce import allreduce


class _Slot(NamedTuple):
    """Where one leaf's gradient goes: its bucket, its place there and how it is laid out."""

    bucket: int
    offset: int
    numel: int
    layout: LeafLayout


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _slots(plan: BucketPlan) -> tuple[_Slot | None, ...]:
    """Per leaf of ``plan`` (flatten order), its ``_Slot``; ``None`` for a ``None`` leaf."""
    slots: list[_Slot | None] = [None] * len(plan.leaves)
    for k, spec in enumerate(plan.specs):
        for i, offset, numel, layout in zip(
            spec.leaves, spec.offsets, spec.sizes, spec.layouts, strict=True
        ):
            slots[i] = _Slot(k, offset, numel, layout)
    return tuple(slots)


def _in_bucket(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """The leaf's place in its bucket, viewed in the leaf's memory order (not its dim order)."""
    piece = buffer.narrow(0, slot.offset, slot.numel)
    return piece if slot.layout.view is None else piece.view(slot.layout.view)


_Job = tuple[Callable[[], None], threading.Event]


@functools.lru_cache(maxsize=1)
def _idle_starters(pid: int) -> queue.SimpleQueue[queue.SimpleQueue[_Job]]:
    """The inboxes of this process's idle starter threads (``pid``: a forked child, whose
    copy of them has no threads, starts its own)."""
    return queue.SimpleQueue()


def _serve(
    inbox: queue.SimpleQueue[_Job], idle: queue.SimpleQueue[queue.SimpleQueue[_Job]]
) -> None:
    """A starter thread: runs the jobs put in its inbox, one at a time, for good. It is
    idle again before its job counts as done, so the next call finds it. It lets go of
    a job before it waits for the next one: an idle thread holding the last call's
    buckets would keep memory that the caller has let go of."""
    while True:
        job, done = inbox.get()
        try:
            job()
        finally:
            del job
            idle.put(inbox)
            done.set()


def on_starter(job: Callable[[], None]) -> threading.Event:
    """Runs ``job`` on an idle starter thread, or on a new one where none is idle (a call
    nested in another's ``fn``); the event is set once it has returned.

    Daemon threads, so that a starter still waiting on a failed peer's collective
    does not hold up the interpreter's exit.
    """
    idle = _idle_starters(os.getpid())
    try:
        inbox = idle.get_nowait()
    except queue.Empty:
        inbox = queue.SimpleQueue()
        thread = threading.Thread(
            target=_serve, args=(inbox, idle), name="fsync-buckets", daemon=True
        )
        thread.start()
    done = threading.Event()
    inbox.put((job, done))
    return done


class Buckets:
    """The buckets of one gradient call: filled by autograd's hooks, started in plan order.

    ``receive`` is each leaf's autograd hook; ``run`` has a starter thread hand
    complete buckets to ``start`` in the plan's order; ``close`` (after
    backward) makes the leaves that got no gradient zeros and so completes every
    bucket; ``join`` waits for the starter and raises what it raised.
    """

    def __init__(
        self,
        plan: BucketPlan,
        start: Callable[[int, torch.Tensor], None],
        scale: float | None = None,
    ) -> None:
        self._scale = scale
        self.buffers = [
            torch.empty(spec.numel, dtype=spec.dtype, device=spec.device) for spec in plan.specs
        ]
        self._slots = _slots(plan)
        self._missing = [len(spec.leaves) for spec in plan.specs]
        self._arrived = [slot is None for slot in self._slots]
        self._changed = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._order = _DeviceOrder(plan)
        self._start = start
        self._finished: threading.Event | None = None

    def receive(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Leaf ``i``'s gradient into its bucket; what autograd keeps instead (a view of it)."""
        slot = self._slots[i]
        assert slot is not None
        target = _in_bucket(self.buffers[slot.bucket], slot)
        dense = grad.to_dense() if grad.layout != torch.strided else grad
        source = dense if slot.layout.perm is None else dense.permute(slot.layout.perm)
        if self._scale is None:
            target.copy_(source)
        else:
            torch.mul(source, self._scale, out=target)
        self._arrive([i])
        if slot.layout.dtype is not None or grad.layout != torch.strided:
            return grad
        return target if slot.layout.inverse is None else target.permute(slot.layout.inverse)

    def skip(self, indices: Sequence[int]) -> None:
        """Leaves that will get no gradient: zeros in their buckets, which can start sooner."""
        for i in indices:
            slot = self._slots[i]
            assert slot is not None
            _in_bucket(self.buffers[slot.bucket], slot).zero_()
        self._arrive(indices)

    def close(self) -> None:
        """Backward is over: every leaf still missing is zeros, every bucket complete."""
        with self._changed:
            missing = [i for i, arrived in enumerate(self._arrived) if not arrived]
        self.skip(missing)

    def _arrive(self, indices: Sequence[int]) -> None:
        with self._changed:
            for i in indices:
                slot = self._slots[i]
                assert slot is not None and not self._arrived[i]
                self._arrived[i] = True
                self._missing[slot.bucket] -= 1
                self._order.note(slot.bucket)
                if self._missing[slot.bucket] == 0:
                    self._order.record(slot.bucket)
                    self._changed.notify_all()

    def run(self) -> None:
        """Has a starter thread start complete buckets from now on."""
        self._finished = on_starter(self._start_in_order)

    def stop(self) -> None:
        """No bucket is started from now on (the call failed)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def join(self, *, quiet: bool = False) -> None:
        """Waits for the starter; raises what it raised (unless ``quiet``)."""
        if self._finished is not None:
            self._finished.wait()
        if self._error is not None and not quiet:
            raise self._error

    def _ready(self, k: int) -> bool:
        return self._stopped or not self._missing[k]

    def _start_in_order(self) -> None:
        try:
            with self._order.stream():
                for k, buffer in enumerate(self.buffers):
                    with self._changed:
                        self._changed.wait_for(functools.partial(self._ready, k))
                        if self._stopped:
                            return
                    self._order.wait(k)
                    self._start(k, buffer)
        except BaseException as error:  # handed to the caller's thread by join
            self._error = error


class _DeviceOrder:
    """On an accelerator, a bucket's collectives wait for the kernels that filled it.

    Autograd fills buckets on its own streams (each gradient's copy runs on the stream
    its forward ran on); the starting thread issues on the stream that was current when
    the call began. A bucket's leaves may come from several streams (a forward that runs
    branches on streams of their own): each stream that copied into the bucket gets an
    event once the bucket is complete, and the issuing stream waits for all of them. On
    the CPU there is nothing to order.
    """

    def __init__(self, plan: BucketPlan) -> None:
        device = plan.specs[0].device if plan.specs else torch.device("cpu")
        self._cuda = device.type == "cuda"
        self._device = device
        self._stream = torch.cuda.current_stream(device) if self._cuda else None
        self._writers: dict[int, set[Any]] = {}
        self._events: dict[int, list[Any]] = {}

    def note(self, bucket: int) -> None:
        """A leaf of ``bucket`` was just copied in, on the current stream."""
        if self._cuda:
            self._writers.setdefault(bucket, set()).add(torch.cuda.current_stream(self._device))

    def record(self, bucket: int) -> None:
        """``bucket`` is complete: an event on every stream that wrote into it."""
        if self._cuda:
            streams = self._writers.pop(bucket, set())
            streams.add(torch.cuda.current_stream(self._device))
            events = []
            for stream in streams:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
            self._events[bucket] = events

    def wait(self, bucket: int) -> None:
        if self._cuda and self._stream is not None:
            for event in self._events.pop(bucket):
                self._stream.wait_event(event)

    def stream(self) -> Any:
        """The stream the starting thread issues on (nothing to enter on the CPU)."""
        if self._cuda and self._stream is not None:
            return torch.cuda.stream(self._stream)
        return contextlib.nullcontext()


class Reducer:
    """What happens to one gradient call's buckets: the reduce's stages, bucket by bucket.

    ``start(k, buffer)`` runs on the bucket thread for each complete bucket in
    plan order; ``finish()`` runs on the caller's thread after it. A bucketwise
    hook starts each bucket whole over a flat group, or pushes it into the
    hierarchical ``Pipeline`` on a 2-D mesh; another hook waits for every bucket
    (on a mesh, each reduce-scattered within the node as it completes).
    """

    def __init__(
        self,
        plan: BucketPlan,
        hook: Hook,
        hook_state: Any,
        group: _comm.Group,
        agreement: Agreement,
    ) -> None:
        self._plan, self._hook, self._state, self._group = plan, hook, hook_state, group
        self._agreement = agreement
        self._per_bucket = pipelined(hook, hook_state)
        self._agreed: Agreed | None = None
        self._ctx: SyncContext | None = None
        self._pipeline: Pipeline | None = None
        self._started: list[torch.Tensor] = []

    def _context(self) -> tuple[Agreed, SyncContext]:
        if self._agreed is None or self._ctx is None:
            self._agreed = self._agreement.conclude()
            self._ctx = context(self._plan, self._group, self._agreed.divisor)
            if self._per_bucket and _comm.hierarchy(self._group) is not None:
                self._pipeline = Pipeline(self._hook, self._state, self._ctx)
        return self._agreed, self._ctx

    def start(self, k: int, buffer: torch.Tensor) -> None:
        """Bucket ``k`` is complete: start what can start (the agreement first)."""
        _, ctx = self._context()
        if self._pipeline is not None:
            self._pipeline.push(start_within(buffer, self._group))
        elif self._per_bucket:
            self._started.append(start_bucket(buffer, self._hook, self._state, alone(ctx, k)))
        else:
            self._started.append(start_within(buffer, self._group))

    def finish(self) -> Reduced:
        """Every bucket reduced: waited for, or, for a hook that is not bucketwise, run now."""
        agreed, ctx = self._context()
        if self._pipeline is not None:
            return Reduced(self._pipeline.drain(), agreed.used, self._state)
        if self._per_bucket:
            out = [finish_bucket(p, alone(ctx, k)) for k, p in enumerate(self._started)]
            return Reduced(out, agreed.used, self._state)
        out, state = reduce_started(self._started, self._hook, self._state, ctx)
        return Reduced(out, agreed.used, state)


_SUM = allreduce("sum")


def _fused_mean(
    hook: Hook, options: SyncOptions, plan: BucketPlan, group: _comm.Group
) -> float | None:
    """``1 / world_size`` where the default mean can scale each gradient on its way in.

    DDP's Reducer, when no comm hook is set, multiplies each gradient by
    ``1 / world_size`` as it copies it into the bucket (``mul_out``), then sums.
    fsync's default hook takes the same product on the packed bucket; taking it
    in the copy gives the same bits in one pass over memory instead of two, and
    the bucket is then summed. Only where it is the same product: the default
    hook, a mean over the world (not ``divide_by="active"``, known only after
    the agreement), a flat group (a mesh scales the node's sum) and every bucket
    in its leaves' dtype.
    """
    flat = _comm.hierarchy(group) is None and _comm.size(group) > 1
    if hook_spec(hook) != DEFAULT_HOOK.spec or options.divide_by != "world" or not flat:
        return None
    return None if plan.reduce_dtype is not None else 1.0 / _comm.size(group)


def reachable(output: torch.Tensor, leaves: Sequence[torch.Tensor | None]) -> list[bool]:
    """Per leaf, whether ``output`` depends on it through the autograd graph (DDP's test).

    DDP with ``find_unused_parameters=True`` walks the graph from the outputs
    after forward; a leaf it cannot reach gets no gradient on this rank.
    """
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return [leaf is not None and id(leaf) in found for leaf in leaves]


class TorchFunc(NamedTuple):
    """``torch.func.grad_and_value``'s conventions: which arguments, which output, what back.

    Attributes:
        fn: The function differentiated.
        argnums: The positional argument (an int) or arguments (a tuple of ints)
            differentiated; negative numbers count from the end.
        has_aux: Whether ``fn`` returns ``(value, aux)`` rather than ``value``.
    """

    fn: Callable[..., Any]
    argnums: int | tuple[int, ...]
    has_aux: bool

    @classmethod
    def of(cls, fn: Any, argnums: Any, has_aux: Any) -> TorchFunc:
        """The settings, checked as ``torch.func`` checks them, in fsync's words."""
        if not callable(fn):
            raise TypeError(f"fn is a {type(fn).__name__}; expected a function to differentiate.")
        numbers = argnums if isinstance(argnums, tuple) else (argnums,)
        if not numbers or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            raise TypeError(
                f"argnums must be an int or a non-empty tuple of ints; got {argnums!r}."
            )
        if len(set(numbers)) != len(numbers):
            raise ValueError(f"argnums must not repeat an argument; got {argnums!r}.")
        _checks.check_flag("has_aux", has_aux)
        return cls(fn, argnums, has_aux)

    def _positions(self, args: Sequence[Any]) -> tuple[int, ...]:
        numbers = self.argnums if isinstance(self.argnums, tuple) else (self.argnums,)
        for n in numbers:
            if not -len(args) <= n < len(args):
                raise ValueError(
                    f"argnums names argument {n}, but fn was called with {len(args)} positional "
                    "arguments; pass the arguments to differentiate positionally."
                )
        return tuple(n % len(args) for n in numbers)

    def differentiated(self, args: Sequence[Any]) -> Any:
        """The tree the gradients are taken for: one argument, or a tuple of them."""
        positions = self._positions(args)
        if isinstance(self.argnums, tuple):
            return tuple(args[n] for n in positions)
        return args[positions[0]]

    def forward(
        self, args: Sequence[Any], kwargs: dict[str, Any], rebuild: Callable[[Sequence[Any]], Any]
    ) -> Callable[[Sequence[torch.Tensor | None]], Any]:
        """``fn`` as a function of the differentiated leaves (``rebuild`` makes their tree)."""
        positions = self._positions(args)

        def call(leaves: Sequence[torch.Tensor | None]) -> Any:
            tree = rebuild(leaves)
            trees = tree if isinstance(self.argnums, tuple) else (tree,)
            new = list(args)
            for n, t in zip(positions, trees, strict=True):
                new[n] = t
            return self.fn(*new, **kwargs)

        return call

    def value(self, output: Any) -> torch.Tensor:
        """The value differentiated: ``output`` or its first half, a scalar tensor."""
        if self.has_aux:
            if not isinstance(output, tuple) or len(output) != 2:
                raise ValueError(
                    f"fn returned a {type(output).__name__}; with has_aux=True it must return a "
                    "pair (value, aux)."
                )
            output = output[0]
        if not isinstance(output, torch.Tensor) or output.dim() != 0:
            got = (
                f"a tensor of shape {tuple(output.shape)}"
                if isinstance(output, torch.Tensor)
                else f"a {type(output).__name__}"
            )
            raise ValueError(
                f"fn returned {got}; expected a scalar tensor (a 0-d loss) to differentiate. "
                "Reduce it first (loss.mean() or loss.sum()); for other outputs use "
                "torch.func.vjp."
            )
        return output

    def result(self, grads: Any, output: Any) -> tuple[Any, Any]:
        """``(grads, value)`` or ``(grads, (value, aux))``, as ``torch.func.grad_and_value``."""
        detached = optree.tree_map(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, output
        )
        return grads, detached

    def grad(self, result: tuple[Any, Any]) -> Any:
        """``grads`` or ``(grads, aux)`` from ``result``: what ``torch.func.grad`` returns."""
        grads, output = result
        return (grads, output[1]) if self.has_aux else grads

    def compiled(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """``torch.func.grad_and_value(fn)(*args, **kwargs)``: what a compiled step traces.

        ``None`` leaves of the differentiated arguments, which ``torch.func``
        refuses, stay ``None``, and so do their gradients (as eagerly).
        """
        leaves, rebuild_tree = _tree.leaves_and_rebuild(self.differentiated(args))
        if all(leaf is not None for leaf in leaves):
            call = torch.func.grad_and_value(self.fn, self.argnums, self.has_aux)
            grads, output = call(*args, **kwargs)
            return grads, output

        def rebuild(tensors: Sequence[Any]) -> Any:
            given = iter(tensors)
            return rebuild_tree([None if x is None else next(given) for x in leaves])

        forward = self.forward(args, kwargs, rebuild)
        tensors = [leaf for leaf in leaves if leaf is not None]
        grads, output = torch.func.grad_and_value(forward, has_aux=self.has_aux)(tensors)
        return rebuild(grads), output


def _tell(error: Exception, group: _comm.Group) -> None:
    """``fn`` raised on this rank before the agreement: the others raise, naming it.

    This rank raises ``error`` itself, with its traceback; the others get a
    ``RuntimeError`` (or ``fn``'s ``ValueError`` / ``TypeError``) saying which
    rank's ``fn`` raised what, instead of waiting for the group's timeout.
    """
    kind = type(error) if isinstance(error, ValueError | TypeError) else RuntimeError
    told: Exception = kind(f"fn raised {type(error).__name__}: {error}")
    with contextlib.suppress(Exception):  # the agreement raises here too; error is the one
        refuse(told, group)


_R = TypeVar("_R", covariant=True)


class Stages(Protocol[_R]):
    """What happens to one gradient call's buckets (``Reducer`` is the sync's).

    Made by ``synced_backward`` once the ranks' agreement is issued, as
    ``stages(plan, hook, hook_state, group, agreement)``; ``start(k, buffer)``
    runs on the starter thread for each complete bucket in plan order (the first
    concludes the agreement), ``finish()`` on the caller's thread after backward.
    """

    def start(self, k: int, buffer: torch.Tensor) -> None: ...

    def finish(self) -> _R: ...


def synced_backward(
    fn: Callable[[Sequence[torch.Tensor | None]], Any],
    value_of: Callable[[Any], torch.Tensor],
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    options: SyncOptions,
    hook_state: Any,
    group: _comm.Group,
    *,
    step: torch.Tensor | None = None,
    state_fingerprint: torch.Tensor | None = None,
    stages: Callable[[BucketPlan, Hook, Any, _comm.Group, Agreement], Stages[_R]],
) -> tuple[_R, Any]:
    """``fn`` on differentiable copies of ``leaves``, one backward of ``value_of(output)``
    that syncs as it runs: what ``stages`` made of the plan's buckets, and ``fn``'s output.

    ``fn(differentiable_leaves)`` is the forward pass; ``leaves`` fit ``plan``
    (its tensor leaves, in flatten order). ``stages`` says what happens to the
    complete buckets: ``Reducer`` reduces them, as
    [fsync.grad_and_value][] does; the ZeRO step's gradient call updates and
    gathers them too. It receives the hook to run, which is the options' hook
    or, where DDP's mean is fused into the copy, a sum (``_fused_mean``).
    """
    try:
        _checks.check_differentiable(plan)
    except TypeError as error:
        refuse(error, group)
    hook = hook_of(options)
    inputs = [None if x is None else x.detach().requires_grad_() for x in leaves]
    try:
        with torch.enable_grad():
            output = fn(inputs)
    except Exception as error:
        _tell(error, group)
        raise
    try:
        value = value_of(output)
    except ValueError as error:
        refuse(error, group)
    tensors = [x for x in inputs if x is not None]
    has = reachable(value, tensors) if options.find_unused else [True] * len(tensors)
    terms_ = terms(options, group, hook_state, step=step, state_fingerprint=state_fingerprint)
    start = _comm.sequence_number(group)
    agreement = begin(plan, has, group, terms_)
    scale = _fused_mean(hook, options, plan, group)
    reducer = stages(plan, hook if scale is None else _SUM, hook_state, group, agreement)
    buckets = Buckets(plan, reducer.start, scale)
    indices = [i for i, x in enumerate(inputs) if x is not None]
    buckets.skip([i for i, used in zip(indices, has, strict=True) if not used])
    for i, x, used in zip(indices, tensors, has, strict=True):
        if used:
            x.register_hook(functools.partial(buckets.receive, i))  # type: ignore[no-untyped-call]
    buckets.run()
    try:
        if value.requires_grad and tensors:
            torch.autograd.grad(value, tensors, allow_unused=True)
    except BaseException:
        buckets.stop()
        buckets.join(quiet=True)  # backward's own error is the one to report
        raise
    try:
        buckets.close()
        buckets.join()
        return reducer.finish(), output
    except _comm.CollectiveError as failure:
        raise _comm.named(failure, group, start, step=step) from failure

"""Gradients that sync while backward runs: the eager half of [fsync.grad_and_value][].

``torch.func.grad`` returns every gradient at once, after the last backward
kernel, so a sync called afterwards can hide nothing. DDP's Reducer overlaps by
starting a bucket's all-reduce from an autograd hook the moment the bucket's
last gradient exists. Here the gradient call is fsync's own, and one call does
the same with no state kept afterwards:

1. each dense bucket's leaves pass into ``fn`` through one autograd node of
   the bucket (``_Filled``): views of them that require grad, as ``torch.func``
   wraps its arguments; ``fn`` runs (the forward pass), and the ranks' agreement
   is issued (``_agree.begin``): only its control all-reduce, which is on the
   wire during backward;
2. one backward (``torch.autograd.grad`` for a token all the nodes take, so
   that nothing is accumulated anywhere); autograd runs a bucket's node as soon as
   it holds all of the bucket's gradients (it has AccumulateGrad's sequence number,
   the one autograd runs first among ready nodes), and the node packs them into the
   bucket's buffer in one batched copy, in the bucket's dtype and each leaf's
   memory order (``_pack.pack_grads``): one Python call per bucket, not per leaf;
3. a starter thread takes complete buckets in the plan's order (a complete
   bucket waits for those before it, as in DDP's Reducer), all but the last: the
   first waits for the agreement, each then goes through a bucketwise hook on its
   own (``_reduce.start_bucket``), or, for any other hook, waits for the rest (on
   a 2-D mesh its within-node reduce-scatter is issued already);
4. after backward, a bucket that got no gradient (``fn`` uses none of its
   leaves) is zeros, the caller's thread starts the last bucket once the starter
   is through, a hook that is not bucketwise runs on all of them, the call waits
   and unpacks.

With one rank and the default mean there is nothing to sync: ``plain_backward``
is autograd's call alone, its gradients the result.

Why a thread: a hook may wait for its own collective before it returns (a
compressing hook casts the result back, ``quantize`` dequantises it); on
backward's thread that would stall backward for the whole transfer. The thread
is the only one that issues the call's bucket collectives, so they leave every
rank in the plan's order; collectives that ``fn``'s own backward issues on the
same group (SyncBatchNorm) are not ordered against them: give those a group of
their own. Starter threads are kept for the process and reused, one per call in
flight (``on_starter``): c10d's functional collectives keep about 100 KiB for
every thread that issues one and never give it back (torch 2.13), so a thread
made per call would grow a training run's memory without bound.

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
from typing import Any, Protocol, TypeVar

import torch

from fsync import _buffers, _checks, _comm, _pack
from fsync._agree import Agreed, Agreement, begin, refuse
from fsync._apply import alone, context, finish_bucket, start_bucket
from fsync._comm import _failures, _reports
from fsync._hierarchy import GatheringPipeline, pipelined, reduce_started, start_within
from fsync._hook import Hook, SyncContext
from fsync._plan import BucketPlan
from fsync._reduce import Reduced, SyncCall, hook_of, terms

_Job = tuple[Callable[[], None], threading.Event]

# The sequence number of autograd's AccumulateGrad nodes (UINT64_MAX): run once ready.
_AS_SOON_AS_READY = 2**64 - 1


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


class _Filled(torch.autograd.Function):
    """One bucket's leaves on their way into ``fn``: views of them that require grad.

    Autograd runs the node's backward once, when it holds every gradient of the
    bucket's leaves that backward will produce (DDP's "bucket ready"), and the
    backward hands them to ``fill`` together. It returns no gradient for the leaves,
    so autograd accumulates nothing anywhere: the call differentiates for a token
    that every bucket's node takes, not for the leaves.
    """

    @staticmethod
    def forward(
        ctx: Any, fill: Callable[[tuple[Any, ...]], None], token: torch.Tensor, *leaves: Any
    ) -> tuple[torch.Tensor, ...]:
        ctx.fill = fill
        ctx.set_materialize_grads(False)  # a leaf backward gives no gradient: None
        return tuple(leaf.view_as(leaf) for leaf in leaves)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[None, ...]:
        ctx.fill(grads)
        return (None,) * (len(grads) + 2)


class Buckets:
    """The buckets of one gradient call: filled from autograd, started in plan order.

    ``inputs`` gives ``fn`` the leaves through one autograd node per bucket
    (``_Filled``), whose backward packs the bucket's gradients into its buffer in
    one batched copy (``_pack.pack_grads``); ``run`` has a starter thread hand
    complete buckets but the last to ``start`` in the plan's order; ``close``
    (after backward) makes the buckets that got no gradient at all zeros and
    starts the last; ``join`` waits for the starter and raises what it raised.
    """

    def __init__(self, plan: BucketPlan) -> None:
        self._plan = plan
        self._kept = _buffers.kept(plan)
        self.buffers: list[torch.Tensor | None] = [None] * len(plan.specs)
        # id of a bucket's node -> the bucket; the node lives as long as its views, which
        # the caller holds until backward is over (holding the node here would make a
        # cycle: the node's backward holds this object).
        self._nodes: dict[int, int] = {}
        self._changed = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._issuing = _Issuing(plan)
        self._finished: threading.Event | None = None
        self._start: Callable[[int, torch.Tensor], None] | None = None

    def inputs(self, leaves: Sequence[torch.Tensor | None]) -> tuple[list[Any], torch.Tensor]:
        """``leaves`` as ``fn`` receives them, and the token to differentiate for."""
        device = self._plan.specs[0].device if self._plan.specs else torch.device("cpu")
        token = torch.empty(0, device=device, requires_grad=True)
        out = list(leaves)
        for k, spec in enumerate(self._plan.specs):
            views = _Filled.apply(  # type: ignore[no-untyped-call]
                functools.partial(self._fill, k), token, *[leaves[i] for i in spec.leaves]
            )
            for i, view in zip(spec.leaves, views, strict=True):
                out[i] = view
            node = views[0].grad_fn
            # Autograd runs the ready node of the highest sequence number first, and these
            # nodes, made before the forward pass, have the lowest: without this each
            # would wait for the whole backward. AccumulateGrad's number, which DDP's
            # hooks run at: the bucket is packed as soon as its last gradient exists.
            node._set_sequence_nr(_AS_SOON_AS_READY)
            self._nodes[id(node)] = k
        return out, token

    def reachable(self, output: torch.Tensor) -> list[bool]:
        """Per tensor leaf (flatten order), whether ``output`` depends on it (DDP's test).

        DDP with ``find_unused_parameters=True`` walks the graph from the outputs
        after forward; a leaf it cannot reach gets no gradient on this rank. The walk
        stops at the buckets' nodes: the edge into a node names the leaf it carries.
        """
        found: set[int] = set()
        seen: set[Any] = set()
        stack = [(output.grad_fn, 0)]
        while stack:
            node, position = stack.pop()
            if node is None:
                continue
            k = self._nodes.get(id(node))
            if k is not None:
                found.add(self._plan.specs[k].leaves[position])
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.extend(node.next_functions)
        return [i in found for i, leaf in enumerate(self._plan.leaves) if leaf is not None]

    def _fill(self, k: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Bucket ``k``'s gradients, all there is of them (on autograd's thread)."""
        spec = self._plan.specs[k]
        buffer = _pack.pack_grads(grads, spec, into=self._kept.buffer(k, spec))
        with self._changed:
            self.buffers[k] = buffer
            self._changed.notify_all()

    def skip(self, unused: Sequence[bool]) -> None:
        """Buckets of which no leaf will get a gradient (per tensor leaf, ``unused``):
        zeros, which can start before backward."""
        tensor_leaves = [i for i, leaf in enumerate(self._plan.leaves) if leaf is not None]
        none = {i for i, u in zip(tensor_leaves, unused, strict=True) if u}
        for k, spec in enumerate(self._plan.specs):
            if none.issuperset(spec.leaves):
                self._fill(k, (None,) * len(spec.leaves))

    def close(self) -> None:
        """Backward is over: a bucket that got no gradient is zeros, and once the starter
        has started the others, the last bucket starts on this thread; raises what the
        starter raised.

        The last bucket in plan order is the last that backward completes (the plan
        follows backward's order, as DDP's does), so at this point the caller's thread
        would only wait for the starter to take it: starting it here spares that
        hand-off and the two threads' turns at the GIL, and a plan of one bucket
        (a small model's) needs no starter at all.
        """
        for k, spec in enumerate(self._plan.specs):
            if self.buffers[k] is None:
                self._fill(k, (None,) * len(spec.leaves))
        self.join()
        if self.buffers and self._start is not None:
            last = len(self.buffers) - 1
            with self._issuing.stream():
                self._start(last, self.buffers[last])  # type: ignore[arg-type]

    def run(self, start: Callable[[int, torch.Tensor], None]) -> None:
        """Has a starter thread give complete buckets but the last to ``start`` from now
        on; ``close`` gives the last."""
        self._start = start
        if len(self.buffers) > 1:
            self._finished = on_starter(functools.partial(self._start_in_order, start))

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
        return self._stopped or self.buffers[k] is not None

    def _start_in_order(self, start: Callable[[int, torch.Tensor], None]) -> None:
        try:
            with self._issuing.stream():
                for k in range(len(self.buffers) - 1):  # the last: ``close``'s
                    with self._changed:
                        self._changed.wait_for(functools.partial(self._ready, k))
                        if self._stopped:
                            return
                        buffer = self.buffers[k]
                    assert buffer is not None
                    start(k, buffer)
        except BaseException as error:  # handed to the caller's thread by join
            self._error = error


class _Issuing:
    """On an accelerator, the stream a call's bucket collectives are issued on: the one
    current when the call began.

    No event is needed to order a bucket's collective after the copy that filled it:
    autograd runs a bucket's node on the stream its forward ran on, which is this one
    (``inputs`` applies the nodes before ``fn`` runs), having made it wait for every
    stream that produced one of its gradients; the node copies there, and the starting
    thread issues there. On the CPU there is nothing to order.
    """

    def __init__(self, plan: BucketPlan) -> None:
        device = plan.specs[0].device if plan.specs else torch.device("cpu")
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def stream(self) -> Any:
        """The stream to issue on, entered (nothing to enter on the CPU)."""
        if self._stream is not None:
            return torch.cuda.stream(self._stream)
        return contextlib.nullcontext()


class Reducer:
    """What happens to one gradient call's buckets: the reduce's stages, bucket by bucket.

    ``start(k, buffer)`` runs on the bucket thread for each complete bucket in
    plan order; ``finish()`` runs on the caller's thread after it. A bucketwise
    hook starts each bucket whole over a flat group, or pushes it into the
    hierarchical ``GatheringPipeline`` on a 2-D mesh; another hook waits for every bucket
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
        self._pipeline: GatheringPipeline | None = None
        self._started: list[torch.Tensor] = []

    def _context(self) -> tuple[Agreed, SyncContext]:
        if self._agreed is None or self._ctx is None:
            self._agreed = self._agreement.conclude()
            self._ctx = context(self._plan, self._group, self._agreed.divisor)
            if self._per_bucket and _comm.hierarchy(self._group) is not None:
                self._pipeline = GatheringPipeline(self._hook, self._state, self._ctx)
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
    call: SyncCall,
    *,
    stages: Callable[[BucketPlan, Hook, Any, _comm.Group, Agreement], Stages[_R]],
) -> tuple[_R, Any]:
    """``fn`` on ``leaves`` made differentiable, one backward of ``value_of(output)``
    that syncs as it runs: what ``stages`` made of the plan's buckets, and ``fn``'s output.

    ``fn(differentiable_leaves)`` is the forward pass; ``leaves`` fit ``plan``
    (its tensor leaves, in flatten order); ``call`` is the sync's options, group, hook
    state, step and fingerprint. ``stages`` says what happens to the
    complete buckets: ``Reducer`` reduces them, as
    [fsync.grad_and_value][] does; the ZeRO step's gradient call updates and
    gathers them too.
    """
    group = call.group
    try:
        _checks.check_differentiable(plan)
    except TypeError as error:
        refuse(error, group)
    buckets = Buckets(plan)
    inputs, token = buckets.inputs(leaves)
    output, value = _forward(fn, value_of, inputs, group)
    if call.options.find_unused:
        has = buckets.reachable(value)
    else:
        has = [True] * sum(map(len, plan.buckets))
    start = _comm.sequence_number(group)
    agreement = begin(plan, has, group, terms(call))
    reducer = stages(plan, hook_of(call.options), call.hook_state, group, agreement)
    buckets.skip([not used for used in has])
    buckets.run(reducer.start)
    try:
        if value.requires_grad and plan.specs:
            torch.autograd.grad(value, token, allow_unused=True)
    except BaseException:
        buckets.stop()
        buckets.join(quiet=True)  # backward's own error is the one to report
        raise
    try:
        buckets.close()
        return reducer.finish(), output
    except _failures.CollectiveError as failure:
        raise _reports.named(failure, group, start, step=call.step) from failure


def _forward(
    fn: Callable[[Sequence[torch.Tensor | None]], Any],
    value_of: Callable[[Any], torch.Tensor],
    inputs: Sequence[torch.Tensor | None],
    group: _comm.Group,
) -> tuple[Any, torch.Tensor]:
    """``fn(inputs)`` with autograd on, and the value to differentiate; what fails on this
    rank is every rank's error (``_tell``, ``refuse``)."""
    try:
        with torch.enable_grad():
            output = fn(inputs)
    except Exception as error:
        _tell(error, group)
        raise
    try:
        return output, value_of(output)
    except ValueError as error:
        refuse(error, group)
        raise


def plain_backward(
    fn: Callable[[Sequence[torch.Tensor | None]], Any],
    value_of: Callable[[Any], torch.Tensor],
    leaves: Sequence[torch.Tensor | None],
    plan: BucketPlan,
    group: _comm.Group,
) -> tuple[list[torch.Tensor | None], Any]:
    """``fn`` on ``leaves`` made differentiable, and autograd's gradients of
    ``value_of(output)``, each in its leaf's layout and memory of its own: the call with one
    rank, where the mean is the gradient itself (nothing packed, nothing sent).

    A leaf that ``fn`` does not use gets zeros (``torch.func``'s rule).
    """
    _checks.check_differentiable(plan)
    inputs = [None if x is None else x.detach().requires_grad_() for x in leaves]
    output, value = _forward(fn, value_of, inputs, group)
    tensors = [x for x in inputs if x is not None]
    if value.requires_grad and tensors:
        grads: Sequence[torch.Tensor] = torch.autograd.grad(value, tensors, materialize_grads=True)
    else:
        grads = [torch.zeros_like(x) for x in tensors]
    return _pack.own_grads(grads, plan), output

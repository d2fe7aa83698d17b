"""The ZeRO step: gradient sync and a sharded optimizer update as one pure function.

DDP with ``ZeroRedundancyOptimizer`` keeps a full copy of the parameters on
every rank but only a part of the optimizer state: each rank updates the
parameters it owns and hands the result to the others. Here that is a function
of ``(params, grads, state)`` over the same bucket plan as [fsync.sync_grads][],
calling the same reduce:

* ``shard_buckets=True`` (ZeRO-2 style): each bucket is cut into ``world_size``
  equal shards (zero-padded). Its gradients are reduce-scattered, every rank
  updates its shard of every bucket with its shard of the optimizer state, and
  the updated shards are all-gathered.
* ``shard_buckets=False`` (torch's ``hook_with_zero_step``): each bucket is
  owned whole by one rank, chosen by size so that ranks hold similar amounts.
  Gradients are all-reduced, the owner updates the bucket and broadcasts it.

Which rank updates which elements is a pure value, ``ZeroLayout``
(``_layout``), computed from the plan, the world size, the rank and the
mode. The step object holds settings only; the state holds tensors, the
parameter tree's metadata included, so the first call already updates the
parameters and there are no warm-up iterations.

Per bucket the step is three stages, reduce, update, gather (``_stages``).
The step after the gradients exist issues every bucket's reduce, then updates
and gathers bucket after bucket. The ZeRO step's own gradient call
(``ZeroStep.value_and_step``, eager) runs them during backward instead, as
torch's ``hook_with_zero_step`` does with DDP's buckets: one backward in which
each bucket's autograd node packs it (``_backward``), and as each bucket
completes, in plan order on every rank and after the ranks' agreement, its
reduce is issued and the bucket before it is updated and gathered.

``replicated`` is the same pipeline with nothing split: its ``shard_group`` is this
rank alone (``_groups.ALONE``), so the layout is a world of one that owns every bucket
whole, the reduce an all-reduce over ``group``, and the gather the identity.

Owns: ``ZeroStep`` (its calls, eager and overlapped) and ``zero_state_dict``; the
factories that build it are ``_factories``. May import: every layer below (1 to 6)
and ``fsync.optim``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from fsync import _checks, _comm, _pack, _planner, _state, _tree
from fsync._agree import planned, refuse, verify_plan
from fsync._apply import context
from fsync._backward import synced_backward
from fsync._comm import _reports
from fsync._hook import Hook
from fsync._options import SyncOptions
from fsync._plan import BucketPlan
from fsync._reduce import SyncCall, agree_and_pack, dense, hook_of, init_hook
from fsync._torch_func import TorchFunc
from fsync._zero._layout import (
    ZeroLayout,
    ZeroState,
    check_state,
    gather,
    pack_range,
    shard_full,
    zero_layout,
)
from fsync._zero._stages import OverlappedStages, ZeroPipeline, ZeroUpdate
from fsync.optim._base import Optimizer

_META = torch.device("meta")


def _layout_of(step: ZeroStep, plan: BucketPlan) -> ZeroLayout:
    group = step.shard_group
    return zero_layout(plan, _comm.size(group), _comm.rank(group), step.shard_buckets)


def _fit(step: ZeroStep, params: Any, state: Any, what: str) -> tuple[_planner.Planned, ZeroLayout]:
    """``params`` (or ``grads``) fitted to the plan of ``state``, and the state's layout."""
    if not isinstance(state, ZeroState):
        raise TypeError(
            f"state is a {type(state).__name__}; expected the ZeroState returned by "
            "ZeroStep.init, ZeroStep.load or the previous step."
        )
    planned = _planner.fit_like(
        params,
        state.like,
        step.options.plan,
        what=what,
        default_device=lambda: _comm.default_device(step.group),
    )
    layout = _layout_of(step, planned.plan)
    check_state(layout, state)
    return planned, layout


def _plan_params(step: ZeroStep, params: Any) -> tuple[list[Any], ZeroLayout]:
    """The leaves of a parameter tree and its layout, agreed on by every rank."""
    _comm.check_group(step.group)
    leaves, plan, _ = planned(
        lambda: _planner.plan_tree(params, step.options.plan, what="params"), step.group
    )
    # First the collective check, so that every rank raises the same error.
    verify_plan(plan, step.group, what="parameter trees passed to ZeroStep.init")
    for spec in plan.leaves:
        if spec is not None and (spec.sparse or not spec.dtype.is_floating_point):
            kind = "is sparse" if spec.sparse else f"has dtype {spec.dtype}"
            raise TypeError(
                f"params leaf {spec.path!r} {kind}; the ZeRO step updates dense floating "
                "point parameters. Keep buffers and integer tensors out of the tree (pass "
                "them beside it) and use dense embeddings."
            )
    return leaves, _layout_of(step, plan)


@dataclasses.dataclass(eq=False)
class ZeroStep:
    """A ZeRO optimizer step over buckets; build it with [fsync.ops.zero][] (or, nothing
    split, [fsync.ops.replicated][]).

    The object holds settings only; ``init(params)`` makes this rank's
    [fsync.ops.ZeroState][]. ``value_and_step(loss_fn)`` is the gradient call
    that steps during backward, calling the object steps after it; both return
    the full new parameters on every rank and the new state.

    Attributes:
        optimizer: The [fsync.optim.Optimizer][] applied to the pieces.
        options: The sync options (hook and bucket sizes).
        shard_group: The ranks the update and the optimizer state are split over:
            ``group``, a replica group's own ranks (``fsync.ft.ReplicaMesh``), or
            this rank alone ([fsync.ops.replicated][]: nothing split).
        shard_buckets: Whether buckets are sharded (``True``) or owned whole.
        group: The process group the gradients are reduced over.
        update_in_backward: Where ``value_and_step`` updates (``None``: by device).
        hook: The hook the gradient buckets go through (the default filled in).
    """

    optimizer: Optimizer
    _: dataclasses.KW_ONLY
    options: SyncOptions
    shard_group: _comm.Group
    shard_buckets: bool = True
    group: _comm.Group = None
    update_in_backward: bool | None = None
    hook: Hook = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        _checks.check_optimizer(self.optimizer)
        _check_update_in_backward(self.update_in_backward)
        self.shard_buckets = bool(self.shard_buckets)
        self.hook = hook_of(self.options)

    def layout(self, state: ZeroState, /) -> ZeroLayout:
        """The ``ZeroLayout`` of ``state``: its plan, owners and pieces."""
        return _fit(self, None, state, "params")[1]

    def init(self, params: Any, /) -> ZeroState:
        """Plans the buckets for ``params``, checks them across ranks, returns the state.

        Args:
            params: The parameter tree (floating point tensors; ``None``
                leaves stay ``None``). Its values seed the optimizer state.

        Returns:
            This rank's [fsync.ops.ZeroState][].

        Raises:
            TypeError: A leaf is not a floating point dense tensor.
            ValueError: The ranks' parameter trees differ (raised on every rank).
        """
        leaves, layout = _plan_params(self, params)
        plan = layout.plan
        pieces = [pack_range(leaves, plan, p, plan.specs[p.bucket].dtype) for p in layout.pieces]
        return _fresh(self, params, layout, self.optimizer.init(pieces))

    def load(self, params: Any, full_state: Any, /) -> ZeroState:
        """This rank's state for ``params``, sharded from a full optimizer state.

        ``full_state`` is the optimizer's state for the whole parameter tree,
        as [fsync.ops.zero_state_dict][] gathers it (from any world size and
        mode) or as ``optimizer.init(params)`` and its updates produce without
        ZeRO. Every rank passes the same full state. The hook's state starts
        afresh.

        Args:
            params: The parameter tree, as for [init][fsync.ops.ZeroStep.init].
            full_state: The optimizer's state over the parameter tree.

        Returns:
            This rank's [fsync.ops.ZeroState][], on the parameters' devices.

        Raises:
            ValueError: ``full_state`` does not have the structure, shapes and
                dtypes of this optimizer's state for these parameters, or the
                ranks' parameter trees differ.
        """
        _, layout = _plan_params(self, params)
        return _fresh(self, params, layout, shard_full(layout, self.optimizer, full_state))

    def __call__(self, params: Any, grads: Any, state: ZeroState, /) -> tuple[Any, ZeroState]:
        """One optimizer step: sync ``grads``, update the parameters, gather them.

        Args:
            params: The parameter tree, as given to [init][fsync.ops.ZeroStep.init].
            grads: The local gradients, shaped like ``params``; ``None`` leaves
                count as zeros.
            state: This rank's [fsync.ops.ZeroState][].

        Returns:
            ``(params, state)``: the updated parameters (the same on every rank,
            with the input's layouts) and the new state.

        Raises:
            TypeError: A gradient is not floating point, or ``state`` is no ZeroState.
            ValueError: ``params`` or ``grads`` do not fit the plan, a gradient
                requires grad, or ``state`` was made for another plan, world or rank.
        """
        return _call(self, params, grads, state)

    def value_and_step(
        self, fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
    ) -> Callable[..., tuple[tuple[Any, Any], ZeroState]]:
        """The ZeRO step's own gradient call: one backward that steps as it runs.

        ``(params, loss), state = step.value_and_step(loss_fn)(state, params, batch)``
        is ``step(params, torch.func.grad(loss_fn)(params, batch), state)`` (the same
        bits where ``torch.func``'s gradients are autograd's) in one backward pass
        that reduces each bucket as backward completes it and, as torch's
        ``hook_with_zero_step`` does, updates and gathers it as its reduce is over
        (after backward on the CPU: ``update_in_backward`` of [fsync.ops.zero][]; the
        guide "ZeRO" says how). Under ``torch.compile`` it is
        ``torch.func.grad_and_value`` and the step.

        Args:
            fn: The loss: returns a scalar tensor (or ``(value, aux)`` with
                ``has_aux``); argument ``argnums`` is the parameter tree given to
                [init][fsync.ops.ZeroStep.init].
            argnums: The positional argument of ``fn`` holding the parameters (or
                a tuple of them, their tuple being the tree).
            has_aux: ``fn`` returns ``(value, aux)``; ``aux`` is passed through.

        Returns:
            A function ``(state, *args, **kwargs) -> ((params, value), state)``
            (``(params, (value, aux))`` with ``has_aux``): the updated parameters
            (the same on every rank) and ``fn``'s value, detached.

        Raises:
            TypeError: ``argnums`` is not an int or a tuple of ints, or (at call
                time) ``state`` is no ZeroState or a parameter not floating point.
            ValueError: (at call time) the parameters do not fit the state's plan,
                ``fn`` returns no scalar, or the ranks differ (on every rank).

        Example:
            >>> import torch, fsync
            >>> step = fsync.ops.zero(fsync.optim.sgd(0.5))
            >>> state = step.init({"w": torch.ones(2)})
            >>> call = step.value_and_step(lambda p, x: (p["w"] * x).sum())
            >>> (params, loss), state = call(state, {"w": torch.ones(2)}, torch.ones(2))
            >>> params["w"], loss
            (tensor([0.5000, 0.5000]), tensor(2.))
        """
        return _overlapped_call(self, TorchFunc.of(fn, argnums, has_aux))


def _call(step: ZeroStep, params: Any, grads: Any, state: ZeroState) -> tuple[Any, ZeroState]:
    """``ZeroStep.__call__``: the step once the gradients exist."""
    try:
        (p_leaves, plan, rebuild), layout = _fit_params(step, params, state)
        g_leaves = _fit(step, grads, state, "grads")[0].leaves
    except (ValueError, TypeError) as error:
        return refuse(error, step.group, like=(params, state))  # type: ignore[no-any-return]
    buffers, opt_state, hook_state = _reports.naming(
        lambda: _stepped(step, p_leaves, g_leaves, layout, state), step.group, step=state.step
    )
    new_state = state._replace(hook=hook_state, opt=opt_state, step=state.step + 1)
    return rebuild(_pack.unpack_leaves(buffers, plan)), new_state


def _overlapped_call(
    step: ZeroStep, settings: TorchFunc
) -> Callable[..., tuple[tuple[Any, Any], ZeroState]]:
    """The function ``ZeroStep.value_and_step`` returns."""

    @functools.wraps(settings.fn)
    def call(state: ZeroState, /, *args: Any, **kwargs: Any) -> tuple[tuple[Any, Any], ZeroState]:
        params = settings.differentiated(args)
        if torch.compiler.is_compiling():
            grads, output = settings.compiled(args, kwargs)
            params, state = step(params, grads, state)
            return (params, output), state
        try:
            (p_leaves, plan, rebuild), layout = _fit_params(step, params, state)
        except (ValueError, TypeError) as error:
            refuse(error, step.group)  # every rank raises it
        in_backward = step.update_in_backward
        if in_backward is None:  # the CPU's cores are backward's: update after it there
            in_backward = any(t.device.type != "cpu" for t in p_leaves if t is not None)
        update = ZeroUpdate(layout, step.optimizer, p_leaves, state.opt, step.shard_group)
        (buffers, opt_state, hook_state), output = synced_backward(
            settings.forward(args, kwargs, rebuild),
            settings.value,
            p_leaves,
            plan,
            _sync_call(step, state),
            stages=functools.partial(OverlappedStages, update, in_backward=in_backward),
        )
        new_state = state._replace(hook=hook_state, opt=opt_state, step=state.step + 1)
        params = rebuild(_pack.unpack_leaves(buffers, plan))
        return settings.result(params, output), new_state

    return call


def _sync_call(step: ZeroStep, state: ZeroState) -> SyncCall:
    """The sync of ``state``'s step, as the reduce's stages take it (the fingerprint is its
    layout's plan's)."""
    return SyncCall(step.options, step.group, state.hook, state.step, state.layout[0])


def _fresh(step: ZeroStep, params: Any, layout: ZeroLayout, opt_state: Any) -> ZeroState:
    """A state at step 0 for ``params``: this optimizer state, the hook's afresh."""
    return ZeroState(
        layout.tensor(),
        init_hook(step.options, layout.plan, step.group),
        opt_state,
        _state.like(params),
        torch.zeros((), dtype=torch.int64),
    )


def _fit_params(step: ZeroStep, params: Any, state: Any) -> tuple[_planner.Planned, ZeroLayout]:
    """``params`` fitted to the plan of ``state``, every parameter of the plan present."""
    planned_, layout = _fit(step, params, state, "params")
    for leaf, spec in zip(planned_.leaves, planned_.plan.leaves, strict=True):
        if leaf is None and spec is not None:
            raise ValueError(
                f"params leaf {spec.path!r} is None, but the plan holds a parameter "
                "there; pass the parameter tree given to init."
            )
    return planned_, layout


def _stepped(
    step: ZeroStep,
    params: list[Any],
    grads: list[Any],
    layout: ZeroLayout,
    state: ZeroState,
) -> tuple[list[torch.Tensor], Any, Any]:
    """The step's stages after the gradients exist: agree and pack, every reduce issued (one
    hook call over all buckets), then bucket after bucket updated and gathered."""
    agreed, buckets = agree_and_pack(grads, layout.plan, _sync_call(step, state))
    # Each rank needs only its shard of a bucket: the hook may reduce-scatter it.
    ctx = context(layout.plan, step.group, agreed.divisor, scatter=step.shard_buckets)
    update = ZeroUpdate(layout, step.optimizer, params, state.opt, step.shard_group)
    pipeline = ZeroPipeline(update, step.hook, state.hook, ctx)
    pipeline.push_all(dense(buckets, layout.plan))
    return pipeline.drain()


def _check_update_in_backward(update_in_backward: Any) -> None:
    if update_in_backward is not None and not isinstance(update_in_backward, bool):
        raise TypeError(
            f"update_in_backward is {update_in_backward!r}; expected True, False or None "
            "(None: during backward on an accelerator, after it on the CPU)."
        )


def zero_state_dict(state: ZeroState, step: ZeroStep, /, *, to: int = 0) -> Any:
    """Gathers the full optimizer state of a ZeRO step on rank ``to``.

    The result is the optimizer's state for the whole parameter tree, shaped
    as ``step.optimizer.init(params)`` would make it (each per-parameter entry
    a tree like the parameters), so it can be saved with ``torch.save`` and
    resharded for any world size with [ZeroStep.load][fsync.ops.ZeroStep.load], or used without
    ZeRO. It is the functional form of ``ZeroRedundancyOptimizer``'s
    ``consolidate_state_dict``. Every rank must call it; the hook's state is
    not included.

    Args:
        state: This rank's [fsync.ops.ZeroState][].
        step: The [fsync.ops.ZeroStep][] the state belongs to.
        to: The rank (within the step's ``shard_group``) that receives the full state.

    Returns:
        The full optimizer state on rank ``to``; ``None`` on the other ranks. A
        replicated step's state is whole on every rank, and every rank gets it.

    Raises:
        TypeError: ``step`` is not a [fsync.ops.ZeroStep][] or ``state`` not a
            [fsync.ops.ZeroState][].
        ValueError: ``to`` is not a rank of that group, or ``state`` belongs to
            another plan, world size or rank.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.ones(3)}
        >>> step = fsync.ops.zero(fsync.optim.adam(0.1))
        >>> state = step.init(params)
        >>> params, state = step(params, {"w": torch.ones(3)}, state)
        >>> full = fsync.ops.zero_state_dict(state, step)
        >>> full.exp_avg["w"], int(full.step)
        (tensor([0.1000, 0.1000, 0.1000]), 1)
        >>> state = step.load(params, full)  # on any world size, in either layout
    """
    if not isinstance(step, ZeroStep):
        raise TypeError(f"step is a {type(step).__name__}; expected the ZeroStep of the state.")
    layout = step.layout(state)
    _checks.check_rank("to", to, layout.world_size)
    plan = layout.plan
    slots, slot_spec = _tree.flatten(state.opt, is_leaf=layout.is_pieces)
    # The dtype of every bucket's state, for the ranks that do not own it.
    full_pieces = [torch.empty(spec.numel, dtype=spec.dtype, device=_META) for spec in plan.specs]
    templates, _ = _tree.flatten(
        step.optimizer.init(full_pieces),
        is_leaf=lambda x: type(x) is list and len(x) == len(full_pieces),
    )
    out = []
    for slot, template in zip(slots, templates, strict=True):
        if not layout.is_pieces(slot):
            out.append(slot)
            continue
        buffers = gather(layout, slot, step.shard_group, [t.dtype for t in template])
        out.append(_tree.unflatten(plan.treespec, _pack.unpack_leaves(buffers, plan)))
    if layout.rank != to:
        return None
    return _tree.unflatten(slot_spec, out)

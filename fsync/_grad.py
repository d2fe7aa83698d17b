"""[fsync.grad_and_value][] and [fsync.grad][]: ``torch.func``'s gradient calls, synced.

They take ``torch.func``'s arguments and return what it returns, except that the
gradients are already averaged across ranks, as [fsync.sync_grads][] would
average them. Eagerly the call is fsync's own backward pass, which starts each
bucket's collective as soon as autograd completes the bucket (``_backward``), so
communication hides behind the rest of backward as with DDP; under
``torch.compile`` it is ``torch.func.grad_and_value`` followed by
[fsync.sync_grads][], whose collectives the compiler schedules. The stateful
form, for hooks with state, is [fsync.GradSync.grad_and_value][].

Owns: the gradient calls, stateless and (for [fsync.GradSync][]) stateful. May
import: every layer below (1 to 6).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import optree
import torch
from typing_extensions import Unpack

from fsync import _checks, _comm, _planner, _tree
from fsync._agree import check_alone, refuse
from fsync._backward import Reducer, plain_backward, synced_backward
from fsync._options import OptionKeywords, SyncOptions
from fsync._planner import Planned
from fsync._reduce import SyncCall, gives_back, init_hook, sync_tree, unpack_reduced
from fsync._torch_func import TorchFunc


def grad_and_value(
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    group: _comm.Group = None,
    **options: Unpack[OptionKeywords],
) -> Callable[..., tuple[Any, Any]]:
    """``torch.func.grad_and_value`` whose gradients come back synced across ranks.

    ``fsync.grad_and_value(loss_fn)(params, batch)`` returns ``(grads, loss)``
    like ``torch.func.grad_and_value``, with ``grads`` averaged over the ranks
    exactly as ``fsync.sync_grads(grads, **options)`` averages them. Eagerly it
    runs one backward pass in which each bucket is packed (one copy, by an
    autograd node of the bucket) as soon as backward has computed its gradients
    and its hook and collectives start, in the plan's order on every rank, after
    the ranks' agreement; communication then hides behind the rest of backward,
    as with DDP, and the result equals DDP's synced ``.grad`` bit for bit. With
    one rank and the default mean it is autograd's call alone. Nothing is kept
    between calls but the plan cache and, on the CPU, the memory of the plan's
    buckets, packed into again only once the caller holds nothing of the
    results it backed (see the guide "Concepts"). Under ``torch.compile`` it is
    ``torch.func.grad_and_value`` then [fsync.sync_grads][], which the compiler
    schedules (see the guide "Compiling").

    A parameter that ``fn`` does not use gets a zero gradient (``torch.func``'s
    rule), averaged with the other ranks'. A hook that treats each bucket on its
    own ([fsync.Hook][]'s ``bucketwise``) starts bucket by bucket; another runs
    once backward is over. The value and ``aux`` come back detached. Hooks with
    state and ``find_unused`` need [fsync.GradSync.grad_and_value][]; a rank
    without data this step joins with ``fsync.sync_grads(zeros, active=False)``.

    Args:
        fn: The function to differentiate; it returns a scalar tensor (or a
            pair ``(value, aux)`` with ``has_aux``).
        argnums: The positional argument to differentiate (its tensor leaves
            are floating point), or a tuple of them.
        has_aux: ``fn`` returns ``(value, aux)``; ``aux`` is passed through.
        group: The group to average over, as for [fsync.sync_grads][].
        **options: The sync options, fields of [fsync.SyncOptions][], as for
            [fsync.sync_grads][].

    Returns:
        A function of ``fn``'s arguments returning ``(grads, value)``, or
        ``(grads, (value, aux))`` with ``has_aux``; ``grads`` has the structure of
        the differentiated argument (a tuple of them for a tuple ``argnums``).

    Raises:
        TypeError: An option is unknown, ``argnums`` is not an int or a tuple of
            ints, or (at call time) a differentiated leaf is not a floating
            point tensor.
        ValueError: The hook keeps state, ``find_unused`` was given, or (at call
            time) ``fn`` does not return a scalar or the ranks' trees differ
            (raised on every rank).

    Example:
        >>> import torch, fsync
        >>> def loss_fn(params, x):
        ...     return (params["w"] * x).sum()
        >>> grads, loss = fsync.grad_and_value(loss_fn)({"w": torch.ones(3)}, torch.arange(3.0))
        >>> grads["w"], loss  # one rank: the mean is this rank's gradient
        (tensor([0., 1., 2.]), tensor(3.))
    """
    settings = TorchFunc.of(fn, argnums, has_aux)
    sync_options = SyncOptions.of(
        options, where="grad_and_value", mesh=_comm.hierarchy(group) is not None
    )
    if sync_options.find_unused:
        raise ValueError(_checks.FIND_UNUSED_NEEDS_STATE)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if torch.compiler.is_compiling():
            grads, output = settings.compiled(args, kwargs)
            return sync_tree(grads, sync_options, group), output
        _comm.check_group(group)
        try:
            tree = settings.differentiated(args)
            leaves, plan, rebuild = _planner.plan_tree(tree, sync_options.plan, what="argument")
            state = init_hook(sync_options, plan, group)
            if optree.tree_leaves(state, namespace=_tree.NAMESPACE):
                raise ValueError(_checks.STATEFUL_HOOK)
        except (ValueError, TypeError) as error:
            refuse(error, group)  # every rank raises it
        forward = settings.forward(args, kwargs, rebuild)
        if gives_back(sync_options, plan, group):
            grads, output = plain_backward(forward, settings.value, leaves, plan, group)
            return settings.result(rebuild(grads), output)
        reduced, output = synced_backward(
            forward,
            settings.value,
            leaves,
            plan,
            SyncCall(sync_options, group, state),
            stages=Reducer,
        )
        return settings.result(rebuild(unpack_reduced(reduced, plan)), output)

    return call


def grad(
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    group: _comm.Group = None,
    **options: Unpack[OptionKeywords],
) -> Callable[..., Any]:
    """``torch.func.grad`` whose gradients come back synced: [fsync.grad_and_value][] without
    the value.

    Args:
        fn: The function to differentiate (see [fsync.grad_and_value][]).
        argnums: The argument or arguments to differentiate.
        has_aux: ``fn`` returns ``(value, aux)``; the call then returns ``(grads, aux)``.
        group: The group to average over, as for [fsync.sync_grads][].
        **options: The sync options, fields of [fsync.SyncOptions][].

    Returns:
        A function of ``fn``'s arguments returning the synced ``grads``, or
        ``(grads, aux)`` with ``has_aux``.

    Raises:
        TypeError: As [fsync.grad_and_value][].
        ValueError: As [fsync.grad_and_value][].

    Example:
        >>> import torch, fsync
        >>> fsync.grad(lambda w: (w * w).sum())(torch.tensor([1.0, 2.0]))
        tensor([2., 4.])
    """
    settings = TorchFunc.of(fn, argnums, has_aux)
    with_value = grad_and_value(fn, argnums, has_aux, group=group, **options)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return settings.grad(with_value(*args, **kwargs))

    return call


class _Sync(Protocol):
    """What the stateful gradient call needs of a [fsync.GradSync][]."""

    options: SyncOptions
    group: _comm.Group

    def __call__(self, grads: Any, state: Any, /) -> tuple[Any, Any]: ...


def stateful(
    sync: _Sync,
    fit: Callable[[Any, Any], Planned],
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...],
    has_aux: bool,
    *,
    value: bool = True,
) -> Callable[..., tuple[Any, Any]]:
    """The function [fsync.GradSync.grad_and_value][] (or, without ``value``, ``.grad``) returns.

    ``fit(tree, state)`` fits a differentiated argument to the plan of a state.
    """
    settings = TorchFunc.of(fn, argnums, has_aux)

    @functools.wraps(fn)
    def call(state: Any, /, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if torch.compiler.is_compiling():
            grads, output = settings.compiled(args, kwargs)
            grads, state = sync(grads, state)
            result = (grads, output)
        else:
            try:
                leaves, plan, rebuild = fit(settings.differentiated(args), state)
            except (ValueError, TypeError) as error:
                refuse(error, sync.group)  # every rank raises it
            forward = settings.forward(args, kwargs, rebuild)
            if gives_back(sync.options, plan, sync.group):
                check_alone(plan, state.fingerprint)
                grads, output = plain_backward(forward, settings.value, leaves, plan, sync.group)
                hook_state = state.hook
            else:
                reduced, output = synced_backward(
                    forward, settings.value, leaves, plan, SyncCall.at(sync, state), stages=Reducer
                )
                grads, hook_state = unpack_reduced(reduced, plan), reduced.hook_state
            state = state._replace(hook=hook_state, step=state.step + 1)
            result = settings.result(rebuild(grads), output)
        return (result if value else settings.grad(result)), state

    return call

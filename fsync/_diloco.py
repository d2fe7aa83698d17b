"""DiLoCo and local SGD: sync a pseudo-gradient every ``inner_steps`` steps, then an outer step.

Each rank trains on its own for ``H = inner_steps`` steps (any inner optimizer,
no communication); on every ``H``-th call the ranks average the
*pseudo-gradient* ``anchor - params`` (how far each rank moved from the
parameters of the last sync, the anchor) through the one reduce, with any hook,
and an outer optimizer steps the anchor with it. The new anchor is every rank's
new parameters (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"). With ``outer=fsync.optim.sgd(1.0)`` the new
anchor is the mean of the ranks' parameters: local SGD, torch's
``PeriodicModelAverager``.

The sync is [fsync.GradSync][]'s (the hook's state, PowerSGD's error feedback
included, lives in the [fsync.DiLoCoState][]), with the transform's call count
as the sequence number the ranks agree on, so ranks that would average after a
different number of calls (another ``inner_steps``, a state from another step)
get a ``ValueError`` instead of a silent average. Under ``torch.compile`` the
every-``H``-th-call branch is a ``torch.cond`` on the call count: one graph,
whose collectives run only when the predicate holds.

Owns: [fsync.diloco][], [fsync.DiLoCo][] and [fsync.DiLoCoState][]. May import:
every layer below (1 to 6), the sync entry point (``_sync``) and ``fsync.optim``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from typing_extensions import Unpack

from fsync import _checks, _comm, _tree
from fsync._options import OptionKeywords
from fsync._state import register_state
from fsync._sync import GradSync, SyncState
from fsync.optim._base import Optimizer, check_params, spec_paths
from fsync.optim._sgd import sgd

_OUTER_LR, _OUTER_MOMENTUM = 0.7, 0.9


@register_state
class DiLoCoState(NamedTuple):
    """The state [fsync.diloco][] threads from one call to the next: tensors only.

    Attributes:
        anchor: The parameters of the last sync (at first, those given to
            ``init``), a tree like them: what the pseudo-gradient is measured
            from and what the outer optimizer updates.
        outer: The outer optimizer's state over the anchor.
        sync: The [fsync.SyncState][] of the pseudo-gradient's sync: its plan's
            fingerprint and metadata and the hook's state (PowerSGD's error
            feedback); its ``step`` is the call count at the last sync.
        step: 0-d int64 CPU tensor, the number of calls so far (inner steps).
    """

    anchor: Any
    outer: Any
    sync: SyncState
    step: torch.Tensor


class DiLoCo(NamedTuple):
    """DiLoCo as a pair of pure functions, made by [fsync.diloco][].

    Attributes:
        init: ``init(params) -> state``: the [fsync.DiLoCoState][] for the
            parameters every rank starts from (copied into the anchor; give every
            rank the same ones, with [fsync.broadcast][]). Collective: it checks
            that every rank has the same tree, as [fsync.GradSync][]'s ``init``.
        update: ``update(params, state) -> (params, state)``, called after every
            inner optimizer step: on every ``inner_steps``-th call the synced,
            outer-stepped anchor (new tensors), otherwise ``params`` as given.
    """

    init: Callable[[Any], DiLoCoState]
    update: Callable[[Any, DiLoCoState], tuple[Any, DiLoCoState]]


def diloco(
    inner_steps: int,
    outer: Optimizer | None = None,
    *,
    group: _comm.Group = None,
    **options: Unpack[OptionKeywords],
) -> DiLoCo:
    """DiLoCo / local SGD: average a pseudo-gradient every ``inner_steps`` calls, step the anchor.

    ``update(params, state)`` is called after every inner optimizer step. On
    every ``inner_steps``-th call it computes the pseudo-gradient
    ``anchor - params``, syncs it across ranks as a gradient (bucketed, through
    ``hook``: compression, quantisation, PowerSGD with error feedback), applies
    the outer optimizer to the anchor with it and returns the new anchor as the
    parameters of every rank. On the other calls it returns ``params`` as given
    and communicates nothing. Nothing passed in is modified; the parameters
    returned never share memory with the state. Works eagerly and inside
    ``torch.compile(fullgraph=True)`` (best through [fsync.compile][], whose
    ``dynamic=False`` keeps Python floats out of the graph's inputs): the
    branch is a ``torch.cond`` on the call count, one graph for every call,
    whose other branch copies the parameters and the state (a ``torch.cond``
    branch may not return its inputs).

    With ``outer=fsync.optim.sgd(1.0)`` this is local SGD: the new parameters
    are the mean of the ranks' parameters, as torch's
    ``PeriodicModelAverager(period=inner_steps, warmup_steps=inner_steps - 1)``
    makes them (within rounding: the mean is taken of ``anchor - params``).

    Args:
        inner_steps: ``H``, the number of calls (inner steps) between syncs, >= 1.
        outer: The outer optimizer, an [fsync.optim.Optimizer][] stepping the
            anchor with the averaged pseudo-gradient. Default: DiLoCo's, SGD
            with ``lr=0.7``, ``momentum=0.9``, Nesterov.
        group: ``None`` for the default process group, a ``ProcessGroup``, a
            1-D ``DeviceMesh`` or a ``(DeviceMesh, dim)`` pair: the ranks whose
            parameters are averaged.
        **options: The options of the pseudo-gradient's sync, fields of
            [fsync.SyncOptions][]: ``hook`` (any [fsync.Hook][], stateful ones
            included; ``fsync.ops.bf16_compress()`` halves the bytes),
            ``bucket_cap_mb``, ``first_bucket_mb``, ``reduce_dtype``,
            ``order``, ``buckets``. Not ``find_unused``: every parameter has a
            pseudo-gradient.

    Returns:
        A [fsync.DiLoCo][] pair ``(init, update)``.

    Raises:
        TypeError: ``outer`` is not an [fsync.optim.Optimizer][] or updates in
            place, or an option is unknown; at ``init``/``update``: a leaf is not a floating point
            tensor, or the state is not a [fsync.DiLoCoState][].
        ValueError: ``inner_steps`` is not a positive integer, an option is
            invalid; at ``update``: ``params`` do not match the anchor, or the
            ranks disagree (another tree, options or call count; raised on every
            rank).

    Example:
        >>> import torch, fsync
        >>> local_sgd = fsync.diloco(2, fsync.optim.sgd(1.0))
        >>> state = local_sgd.init({"w": torch.zeros(2)})
        >>> params, state = local_sgd.update({"w": torch.ones(2)}, state)  # call 1: nothing
        >>> params["w"], int(state.step)
        (tensor([1., 1.]), 1)
        >>> params, state = local_sgd.update({"w": torch.full((2,), 3.0)}, state)  # call 2: sync
        >>> params["w"]  # one rank: the mean of the parameters is the parameters
        tensor([3., 3.])
    """
    if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
        raise ValueError(
            f"inner_steps must be a positive int (the number of inner steps between syncs); "
            f"got {inner_steps!r}."
        )
    if outer is None:
        outer = sgd(_OUTER_LR, momentum=_OUTER_MOMENTUM, nesterov=True)
    if not isinstance(outer, Optimizer):
        raise TypeError(
            f"outer is a {type(outer).__name__}; expected an fsync.optim.Optimizer such as "
            "fsync.optim.sgd(0.7, momentum=0.9, nesterov=True) (DiLoCo's, the default)."
        )
    _checks.refuse_in_place(outer, "outer", "diloco")
    sync = GradSync(group=group, **options)
    if sync.options.find_unused:
        raise ValueError(
            "diloco does not take find_unused=True: every parameter has a pseudo-gradient "
            "(anchor - params), so no leaf is ever unused."
        )
    return DiLoCo(*_transform(inner_steps, outer, sync))


def _transform(
    inner_steps: int, outer: Optimizer, sync: GradSync
) -> tuple[Callable[[Any], DiLoCoState], Callable[[Any, DiLoCoState], tuple[Any, DiLoCoState]]]:
    """The ``(init, update)`` pair of [fsync.diloco][], over a checked configuration."""

    def init(params: Any, /) -> DiLoCoState:
        leaves, treespec = _tree.flatten(params)
        check_params(leaves, spec_paths(treespec))
        anchor = _tree.unflatten(treespec, [_copy(p) for p in leaves])
        return DiLoCoState(
            anchor=anchor,
            outer=outer.init(anchor),
            sync=sync.init(anchor),
            step=torch.zeros((), dtype=torch.int64),
        )

    def outer_step(like: SyncState, *args: Any) -> tuple[Any, ...]:
        """The sync branch: pseudo-gradient, its sync, the outer step; new tensors only."""
        params, anchor, outer_state, hook_state, _, step = args
        pseudo = _pseudo_gradient(anchor, params)
        # The call count is the sequence number the ranks agree on: ranks that would
        # average after different numbers of calls are told so, not averaged.
        pseudo, synced = sync(pseudo, like._replace(hook=hook_state, step=step))
        anchor, outer_state = outer.update(anchor, pseudo, outer_state)
        return _copies(anchor), anchor, outer_state, synced.hook, synced.step, step.clone()

    def update(params: Any, state: DiLoCoState, /) -> tuple[Any, DiLoCoState]:
        _check_update(params, state)
        branch = functools.partial(outer_step, state.sync)
        args = (params, state.anchor, state.outer, state.sync.hook, state.sync.step, state.step)
        due = (state.step + 1) % inner_steps == 0
        if torch.compiler.is_compiling():
            # One graph for every call: the sync and its collectives are a branch that
            # runs only when due (a Python `if` on the count would recompile or break).
            out = _cond(due, branch, _unchanged, args)
        elif bool(due):
            out = branch(*args)
        else:
            return params, state._replace(step=state.step + 1)
        params, anchor, outer_state, hook_state, sync_step, _ = out
        sync_state = state.sync._replace(hook=hook_state, step=sync_step)
        return params, DiLoCoState(anchor, outer_state, sync_state, state.step + 1)

    return init, update


def _copy(leaf: Any) -> Any:
    return None if leaf is None else leaf.detach().clone()


def _copies(tree: Any) -> Any:
    """``tree`` with every tensor copied (``None`` stays ``None``)."""
    leaves, treespec = _tree.flatten(tree)
    return _tree.unflatten(treespec, [_copy(leaf) for leaf in leaves])


def _pseudo_gradient(anchor: Any, params: Any) -> Any:
    """``anchor - params`` leaf by leaf: how far this rank moved since the last sync."""
    anchors, treespec = _tree.flatten(anchor)
    leaves = _tree.flatten(params)[0]
    diffs = [None if a is None else torch.sub(a, p) for a, p in zip(anchors, leaves, strict=True)]
    return _tree.unflatten(treespec, diffs)


def _unchanged(*args: Any) -> tuple[Any, ...]:
    """The other branch under ``torch.cond``: everything as it was (copies: no aliasing)."""
    return tuple(_copies(x) for x in args)


def _fresh(x: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``x``, copied if it is one of ``inputs``."""
    return x.clone() if any(x is t for t in inputs) else x


def _cond(
    pred: torch.Tensor,
    true_fn: Callable[..., tuple[Any, ...]],
    false_fn: Callable[..., tuple[Any, ...]],
    args: tuple[Any, ...],
) -> tuple[Any, ...]:
    """``torch.cond`` over trees: both branches return trees shaped like ``args``.

    ``torch.cond`` takes and returns tensors only, so the trees go in flat, their
    ``None`` leaves (an optimizer without momentum) left out, and come back whole.
    """
    leaves, treespec = _tree.flatten(args)
    where = [i for i, leaf in enumerate(leaves) if leaf is not None]

    def flat(fn: Callable[..., tuple[Any, ...]]) -> Callable[..., list[torch.Tensor]]:
        def run(*tensors: torch.Tensor) -> list[torch.Tensor]:
            out = _tree.flatten(fn(*_rebuild(tensors)))[0]
            # A branch may not return an input as it is (a hook state's constant part).
            return [_fresh(out[i], tensors) for i in where]

        return run

    def _rebuild(tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        full: list[Any] = [None] * len(leaves)
        for i, t in zip(where, tensors, strict=True):
            full[i] = t
        return tuple(_tree.unflatten(treespec, full))

    return _rebuild(
        tuple(torch.cond(pred, flat(true_fn), flat(false_fn), [leaves[i] for i in where]))
    )


def _check_update(params: Any, state: DiLoCoState) -> None:
    """Raises unless ``state`` is a DiLoCo state and ``params`` are shaped like its anchor."""
    if not isinstance(state, DiLoCoState):
        raise TypeError(
            f"state is a {type(state).__name__}; expected the DiLoCoState returned by "
            "fsync.diloco(...).init or by the previous update."
        )
    leaves, treespec = _tree.flatten(params)
    check_params(leaves, spec_paths(treespec))
    anchors, anchor_spec = _tree.flatten(state.anchor)
    if treespec != anchor_spec:
        raise ValueError(
            f"diloco.update: params have structure {treespec} but the state's anchor has "
            f"{anchor_spec}; pass the parameters the state was made for (init(params))."
        )
    for path, p, a in zip(treespec.paths(), leaves, anchors, strict=True):
        differ = _checks.leaf_difference(p, a)
        if differ is not None:
            got, want = differ
            raise ValueError(
                f"diloco.update: params leaf {_tree.path_str(path)!r} is {got}; expected the "
                f"anchor's {want}. Pass the parameters the state was made for."
            )

"""The entry points of a sync: [fsync.sync_grads][] and [fsync.GradSync][].

Both take a tree and options, plan it (``plan_tree`` or, for a
state, ``fit_like``), check that the ranks agree, and call the one
reduce (``reduce``); neither keeps anything between calls but what
the caller holds (the state).

Owns: the public sync functions and [fsync.SyncState][]. May import: every
layer below (1 to 6).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from typing_extensions import Unpack

from fsync import _checks, _comm, _grad, _planner, _state, _tree
from fsync._agree import check_alone, planned, refuse, verify_plan
from fsync._comm import _reports
from fsync._hook import Hook
from fsync._options import OptionKeywords, SyncOptions
from fsync._plan import BucketPlan
from fsync._reduce import (
    SyncCall,
    check_sparse_traced,
    copied_back,
    hook_of,
    init_hook,
    reduce,
    sync_tree,
    unpack_reduced,
)
from fsync._state import register_state


@register_state
class SyncState(NamedTuple):
    """The state [fsync.GradSync][] threads from one step to the next: tensors only.

    Attributes:
        fingerprint: 0-d int64 CPU tensor, the fingerprint of the plan this state
            belongs to, so a state is never silently used with another plan.
        hook: The hook's own state (``()`` for stateless hooks).
        step: 0-d int64 CPU tensor, the number of syncs done: the sequence
            number the ranks compare at every sync, which catches a rank that
            skipped one.
        like: The tree given to ``init``, each tensor leaf replaced by a meta
            tensor of its shape, strides and dtype (no memory): what the plan
            is rebuilt from at every step.
    """

    fingerprint: torch.Tensor
    hook: Any
    like: Any
    step: torch.Tensor


def sync_grads(
    grads: Any,
    /,
    *,
    group: _comm.Group = None,
    active: bool = True,
    **options: Unpack[OptionKeywords],
) -> Any:
    """Synchronises a gradient tree across ranks: DDP's bucketed all-reduce as a function.

    The leaves are packed into DDP-sized buckets (see [fsync.plan_buckets][]),
    each bucket goes through ``hook`` (default: all-reduce mean) and the result
    is unpacked into a tree of the same structure, shapes, dtypes and memory
    layouts. The plan is cached by tree metadata, so repeated calls do no
    planning; every eager call checks with one small collective that every rank
    has the same plan. Works eagerly and inside ``torch.compile(fullgraph=True)``
    (sparse leaves eagerly only). Nothing passed in is modified.

    Args:
        grads: A pytree of floating point gradient tensors (``None`` leaves
            stay ``None``; sparse COO leaves are averaged by all-gather).
        group: ``None`` for the default process group, a ``ProcessGroup``, a
            1-D ``DeviceMesh``, a ``(DeviceMesh, dim)`` pair, or a 2-D
            ``DeviceMesh`` ``(nodes, local)`` with ``mesh_dim_names``: a
            hierarchical mean (reduce-scatter within the node, ``hook`` across
            nodes on the ``1/local`` shards, whose plan its state is made for,
            all-gather within; see the guide "Many nodes").
        active: ``False`` on a rank that has no data this step (uneven inputs,
            DDP's ``join``): it contributes zeros and receives the result.
        **options: The sync options, fields of [fsync.SyncOptions][]:
            ``hook`` (a stateless one; PowerSGD and other stateful hooks need
            [fsync.GradSync][]), ``bucket_cap_mb``, ``first_bucket_mb``,
            ``reduce_dtype`` (``torch.float32`` for bf16 gradients,
            ``torch.bfloat16`` to halve the traffic of fp32 ones), ``order``,
            ``buckets`` and ``divide_by`` (``"active"`` divides by the number of
            ranks with ``active=True``, at the cost of one small collective).

    Returns:
        The synchronised gradients, as a tree like ``grads``.

    Raises:
        TypeError: A leaf is not a tensor or not a floating point tensor, an
            option is unknown, or the hook is not a [fsync.Hook][].
        ValueError: A gradient requires grad, an option is invalid, the hook
            keeps state, the leaves are on several devices, or the ranks' trees
            differ (raised on every rank).

    Example:
        >>> import torch, fsync
        >>> grads = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> fsync.sync_grads(grads)["b"]  # one rank: the mean is the gradient itself
        tensor([1., 1.])
    """
    sync_options = SyncOptions.of(
        options, where="sync_grads", mesh=_comm.hierarchy(group) is not None
    )
    if sync_options.find_unused:
        raise ValueError(_checks.FIND_UNUSED_NEEDS_STATE)
    _checks.check_flag("active", active)
    _comm.check_group(group)
    return sync_tree(grads, sync_options, group, active=active)


class GradSync:
    """The stateful form of [fsync.sync_grads][], for hooks that keep state.

    Settings go to the constructor and nothing else is kept on the object:
    ``init(tree)`` plans the buckets for a tree with the gradients' structure
    (usually the parameters), checks across ranks that everyone has the same
    plan, and returns the initial [fsync.SyncState][]; calling the object syncs
    a gradient tree with the state's plan and returns the new state. The plan is
    fixed from the first step: no warm-up iterations, no rebuild.

    Args:
        group: The group to average over, as for [fsync.sync_grads][] (on a 2-D
            mesh the hook's state is made for the shards it sees across nodes).
        **options: The sync options, fields of [fsync.SyncOptions][]: ``hook``
            (any [fsync.Hook][], stateful ones included), the bucket options,
            ``reduce_dtype``, ``divide_by`` and ``find_unused`` (eager only):
            gradients may then be ``None`` for parameters some ranks did not
            use, as with DDP's ``find_unused_parameters=True``. Without it a
            ``None`` gradient counts as zeros.

    Attributes:
        options: The [fsync.SyncOptions][] given, validated.
        group: The ``group`` given.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> sync = fsync.GradSync()
        >>> state = sync.init(params)
        >>> grads, state = sync({"w": torch.ones(2, 2), "b": torch.ones(2)}, state)
        >>> sync.plan(state).buckets
        ((1, 0),)
    """

    def __init__(self, *, group: _comm.Group = None, **options: Unpack[OptionKeywords]) -> None:
        self.options = SyncOptions.of(
            options, where="GradSync", mesh=_comm.hierarchy(group) is not None
        )
        self.group = group

    @property
    def hook(self) -> Hook:
        """The hook in use (the default filled in when none was given)."""
        return hook_of(self.options)

    def plan(self, state: SyncState, /, *, device: torch.device | str | None = None) -> BucketPlan:
        """The bucket plan of ``state`` (made by [init][fsync.GradSync.init]), its buckets on
        ``device``. The state keeps the tree's metadata but not its device: by default the
        group's (CPU for gloo, the current GPU for NCCL); name the gradients' where they
        live elsewhere (CUDA tensors synced over gloo)."""
        where = None if device is None else torch.device(device)
        return _fit(self, None, state, device=where).plan

    def _fit_argument(self, tree: Any, state: SyncState) -> _planner.Planned:
        return _fit(self, tree, state, what="argument")

    def init(self, tree: Any, /) -> SyncState:
        """Plans the buckets for ``tree``, checks the plan across ranks, returns the state.

        Args:
            tree: A tree shaped like the gradients to come, usually the
                parameters (only metadata is read), or a ready
                [fsync.BucketPlan][] made with this object's options.

        Returns:
            The initial [fsync.SyncState][].

        Raises:
            ValueError: The ranks' trees differ (raised on every rank), the
                leaves are on several devices, or a plan given was made with
                other options than this object's.
        """
        _comm.check_group(self.group)
        tree, plan = planned(lambda: _init_plan(self.options, tree), self.group)
        verify_plan(plan, self.group, what="trees passed to GradSync.init")
        return SyncState(
            fingerprint=torch.tensor(plan.fingerprint, dtype=torch.int64),
            hook=init_hook(self.options, plan, self.group),
            like=_state.like(tree),
            step=torch.zeros((), dtype=torch.int64),
        )

    def __call__(
        self, grads: Any, state: SyncState, /, *, active: bool = True
    ) -> tuple[Any, SyncState]:
        """Syncs ``grads`` with the plan of ``state``.

        Args:
            grads: Gradients shaped like the tree given to [init][fsync.GradSync.init]
                (``None`` leaves allowed, see ``find_unused``); may be ``None``
                as a whole when ``active=False``.
            state: The [fsync.SyncState][] from ``init`` or the previous call.
            active: ``False`` on a rank with no data this step (uneven inputs):
                it contributes zeros and receives the result.

        Returns:
            ``(grads, state)``: the synchronised gradients and the new state.

        Raises:
            TypeError: A leaf is not a floating point tensor.
            ValueError: ``grads`` does not match the plan, a gradient requires
                grad, or ``state`` belongs to another plan.
        """
        _checks.check_flag("active", active)
        try:
            planned = _checked(self, grads, state, active)
        except (ValueError, TypeError) as error:
            like = (_expected(self, grads, state), state)
            return refuse(error, self.group, like)  # type: ignore[no-any-return]
        return _synced(self, planned, state, active)

    def grad_and_value(
        self, fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
    ) -> Callable[..., tuple[tuple[Any, Any], SyncState]]:
        """The stateful [fsync.grad_and_value][]: a gradient call that syncs with this object.

        Eagerly, buckets start as backward completes them when the hook is
        bucketwise; a hook with state (PowerSGD) runs once backward is over, on
        buckets packed while it ran. ``find_unused`` leaves a parameter that no
        rank's ``fn`` reaches ``None`` (DDP's rule, from the autograd graph).

        Returns:
            A function ``(state, *args, **kwargs) -> ((grads, value), state)``
            (``(grads, (value, aux))`` with ``has_aux``): ``fn``'s arguments
            after the [fsync.SyncState][], whose tree the differentiated
            arguments must fit.

        Example:
            >>> import torch, fsync
            >>> sync = fsync.GradSync()
            >>> state = sync.init({"w": torch.zeros(2)})
            >>> step = sync.grad_and_value(lambda p: (p["w"] ** 2).sum())
            >>> (grads, loss), state = step(state, {"w": torch.ones(2)})
            >>> grads["w"], int(state.step)
            (tensor([2., 2.]), 1)
        """
        return _grad.stateful(self, self._fit_argument, fn, argnums, has_aux)

    def grad(
        self, fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
    ) -> Callable[..., tuple[Any, SyncState]]:
        """[grad_and_value][fsync.GradSync.grad_and_value] without the value: ``torch.func.grad``'s
        results (``grads``, or ``(grads, aux)``) and the new state."""
        return _grad.stateful(self, self._fit_argument, fn, argnums, has_aux, value=False)


def _synced(
    sync: GradSync, planned: _planner.Planned, state: SyncState, active: bool
) -> tuple[Any, SyncState]:
    """The sync at the state's step and the state after it: with one rank and the default
    mean, copies of the gradients (nothing to send); else the one reduce, a collective that
    fails in it named."""
    leaves, plan, rebuild = planned
    copies = copied_back(leaves, plan, sync.options, sync.group, active=active)
    if copies is not None:
        check_alone(plan, state.fingerprint)
        return rebuild(copies), state._replace(step=state.step + 1)
    reduced = _reports.naming(
        lambda: reduce(leaves, plan, SyncCall.at(sync, state), active=active),
        sync.group,
        step=state.step,
    )
    new_state = state._replace(hook=reduced.hook_state, step=state.step + 1)
    return rebuild(unpack_reduced(reduced, plan)), new_state


def _checked(sync: GradSync, grads: Any, state: SyncState, active: bool) -> _planner.Planned:
    """``grads`` fitted to the plan of ``state``: every check a sync makes before the agreement."""
    planned = _fit(sync, _checks.given(grads) if active else grads, state)
    check_sparse_traced(planned.plan)
    return planned


def _expected(sync: GradSync, grads: Any, state: Any) -> Any:
    """What a refused sync returns under ``torch.compile`` (see ``_agree.refuse``): zeros
    shaped like the state's tree (``grads`` itself where ``state`` is no state), so that the
    rest of the step traces."""
    if not isinstance(state, SyncState):
        return grads
    return _state.zeros_of(state.like, _comm.default_device(sync.group))


def _fit(
    sync: GradSync,
    grads: Any,
    state: SyncState,
    what: str = "grads",
    device: torch.device | None = None,
) -> _planner.Planned:
    """``grads`` fitted to the plan of ``state`` (rebuilt from its ``like`` tree); without
    a tensor leaf in ``grads``, the plan is on ``device`` (the group's if ``None``)."""
    if not isinstance(state, SyncState):
        raise TypeError(
            f"state is a {type(state).__name__}; expected the SyncState returned by "
            "GradSync.init or by the previous call."
        )
    return _planner.fit_like(
        grads,
        state.like,
        sync.options.plan,
        what=what,
        default_device=lambda: device or _comm.default_device(sync.group),
    )


def _init_plan(options: SyncOptions, tree: Any) -> tuple[Any, BucketPlan]:
    """The tree ``GradSync.init`` keeps (as metadata) and its plan; a plan given is checked."""
    given = tree if isinstance(tree, BucketPlan) else None
    device = None
    if given is not None:
        tree = _tree.unflatten(given.treespec, [_state.like_of_spec(leaf) for leaf in given.leaves])
        device = given.specs[0].device if given.specs else None
    plan = _planner.plan_tree(tree, options.plan, what="tree", device=device).plan
    if given is not None and given != plan:
        raise ValueError(
            "the plan given to GradSync.init was made with other options than this "
            "GradSync's; pass its layout as an option, GradSync(buckets=plan.buckets, "
            "reduce_dtype=plan.reduce_dtype), and init it with the parameters."
        )
    return tree, plan

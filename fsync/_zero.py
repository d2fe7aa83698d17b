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

Which rank updates which elements is a pure value, ``ZeroLayout``,
computed from the plan, the world size, the rank and the mode. The step object
holds settings only; the state holds tensors, the parameter tree's metadata
included, so the first call already updates the parameters and there are no
warm-up iterations.

Owns: the sharded step, its layout and its checkpoints. May import: every layer
below (1 to 6) and ``fsync.optim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fsync import _checks, _comm, _pack, _planner, _tree
from fsync._agree import planned, refuse, verify_plan
from fsync._hook import Hook
from fsync._options import OptionKeywords, SyncOptions
from fsync._plan import BucketPlan
from fsync._reduce import agree_and_pack, context, hook_of, init_hook, reduce_dense
from fsync._serialization import register_state
from fsync.optim._base import Optimizer

_META = torch.device("meta")

_GATHER_FIX = (
    "Gather it with fsync.ops.zero_state_dict(state, step) on the world that made it and shard "
    "the result for this world with ZeroStep.load(params, full_state)."
)


@register_state
class ZeroState(NamedTuple):
    """This rank's state of a [fsync.ops.ZeroStep][].

    Attributes:
        layout: 1-D int64 CPU tensor ``[plan fingerprint, world size, rank,
            shard_buckets]``: what the state was sharded for, so that it is never
            used with another plan, world or rank.
        hook: The gradient hook's state (``()`` for stateless hooks).
        opt: The optimizer's state over this rank's pieces: a list with one
            flat tensor per bucket shard (``shard_buckets=True``) or per owned
            bucket (``shard_buckets=False``) wherever the optimizer keeps
            per-parameter state, and the optimizer's other entries (its step
            count) as they are.
        like: The parameter tree, each leaf a meta tensor of its shape, strides
            and dtype (no memory): what the plan is rebuilt from.
        step: 0-d int64 CPU tensor, the number of steps done: the sequence
            number the ranks compare at every step.
    """

    layout: torch.Tensor
    hook: Any
    opt: Any
    like: Any
    step: torch.Tensor


class Piece(NamedTuple):
    """The elements ``[lo, hi)`` of bucket ``bucket`` (``hi`` may pass its end: padding)."""

    bucket: int
    lo: int
    hi: int


class ZeroLayout(NamedTuple):
    """Which elements of which buckets this rank updates: a pure value.

    Attributes:
        plan: The bucket plan of the parameters.
        world_size: The number of ranks.
        rank: This rank.
        shard_buckets: Whether buckets are sharded (``True``) or owned whole.
        owners: The rank that owns each bucket with ``shard_buckets=False``
            (empty when sharded).
        pieces: This rank's pieces, in bucket order.
    """

    plan: BucketPlan
    world_size: int
    rank: int
    shard_buckets: bool
    owners: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def tensor(self) -> torch.Tensor:
        """``[plan fingerprint, world size, rank, shard_buckets]`` as a state keeps it."""
        values = [self.plan.fingerprint, self.world_size, self.rank, int(self.shard_buckets)]
        return torch.tensor(values, dtype=torch.int64)

    def is_pieces(self, x: Any) -> bool:
        """Whether ``x`` is a list of tensors shaped like this rank's pieces."""
        return (
            type(x) is list
            and len(x) == len(self.pieces)
            and all(
                isinstance(t, torch.Tensor) and tuple(t.shape) == (p.hi - p.lo,)
                for t, p in zip(x, self.pieces, strict=True)
            )
        )

    def meta_pieces(self) -> list[torch.Tensor]:
        """Memory-less tensors shaped like this rank's pieces (for optimizer templates)."""
        specs = self.plan.specs
        return [
            torch.empty(p.hi - p.lo, dtype=specs[p.bucket].dtype, device=_META) for p in self.pieces
        ]


def owners_by_size(nbytes: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The rank owning each bucket: largest bucket first, to the least loaded rank.

    Deterministic (ties go to the lower bucket index, then the lower rank), so
    every rank computes the same owners from the same plan.
    """
    load = [0] * world_size
    owners = [0] * len(nbytes)
    for b in sorted(range(len(nbytes)), key=lambda b: (-nbytes[b], b)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[b] = rank
        load[rank] += nbytes[b]
    return tuple(owners)


def zero_layout(plan: BucketPlan, world_size: int, rank: int, shard_buckets: bool) -> ZeroLayout:
    """The ``ZeroLayout`` of a plan for one rank of a world."""
    numels = tuple(spec.numel for spec in plan.specs)
    nbytes = tuple(spec.nbytes for spec in plan.specs)
    owners, pieces = _assign_pieces(numels, nbytes, world_size, rank, shard_buckets)
    return ZeroLayout(
        plan, world_size, rank, shard_buckets, owners, tuple(Piece(*p) for p in pieces)
    )


@_planner.python_at_trace_time
def _assign_pieces(
    numels: tuple[int, ...],
    nbytes: tuple[int, ...],
    world_size: int,
    rank: int,
    shard_buckets: bool,
) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
    """Bucket owners and this rank's ``(bucket, lo, hi)`` pieces, as Python at trace time."""
    if shard_buckets:
        shards = [_pack.shard_numel(n, world_size) for n in numels]
        return (), tuple((b, rank * n, (rank + 1) * n) for b, n in enumerate(shards))
    owners = owners_by_size(nbytes, world_size)
    return owners, tuple((b, 0, n) for b, n in enumerate(numels) if owners[b] == rank)


def pack_range(
    leaves: Sequence[Any], plan: BucketPlan, piece: Piece, dtype: torch.dtype
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a bucket packed from ``leaves`` in ``dtype``, zeros past its end.

    Only the leaves that overlap the range are read, so a rank never copies
    the whole bucket to get its shard; the result never shares memory with them.
    """
    spec = plan.specs[piece.bucket]
    parts = []
    for i, offset, size in zip(spec.leaves, spec.offsets, spec.sizes, strict=True):
        start, stop = max(piece.lo, offset), min(piece.hi, offset + size)
        if start < stop:
            leaf_spec = plan.leaves[i]
            assert leaf_spec is not None
            parts.append(_pack.flat(leaves[i], leaf_spec, dtype)[start - offset : stop - offset])
    padding = piece.hi - max(piece.lo, spec.numel)
    if padding > 0 or not parts:
        parts.append(torch.zeros(max(padding, 0), dtype=dtype, device=spec.device))
    return torch.cat(parts).to(spec.device)


def _gather(
    layout: ZeroLayout,
    pieces: Sequence[torch.Tensor],
    group: _comm.Group,
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """Every bucket whole on every rank, from each rank's pieces of it (eager or traced)."""
    specs = layout.plan.specs
    if layout.shard_buckets:
        # Issue every all-gather before waiting on the first.
        gathered = [_comm.all_gather(piece, group) for piece in pieces]
        return [_comm.wait(g)[: spec.numel] for g, spec in zip(gathered, specs, strict=True)]
    mine = iter(pieces)
    sent = [
        next(mine)
        if owner == layout.rank
        else torch.empty(spec.numel, dtype=dtype, device=spec.device)
        for owner, spec, dtype in zip(layout.owners, specs, dtypes, strict=True)
    ]
    return _comm.broadcasts(sent, list(layout.owners), group)


def _reduced_pieces(
    step: ZeroStep, grads: Sequence[torch.Tensor | None], layout: ZeroLayout, state: ZeroState
) -> tuple[list[torch.Tensor], Any]:
    """The gradients' mean over the ranks, this rank's pieces of it; the hook's new state."""
    agreed, buckets = agree_and_pack(
        grads,
        layout.plan,
        step.options,
        step.group,
        hook_state=state.hook,
        step=state.step,
        state_fingerprint=state.layout[0],
    )
    # Each rank needs only its shard of a bucket: the hook may reduce-scatter it.
    ctx = context(layout.plan, step.group, agreed.divisor, scatter=step.shard_buckets)
    reduced, hook_state = reduce_dense(buckets, step.hook, state.hook, ctx)
    return _grad_pieces(layout, reduced), hook_state


def _grad_pieces(layout: ZeroLayout, reduced: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    pieces = []
    for p in layout.pieces:
        buffer, spec = reduced[p.bucket], layout.plan.specs[p.bucket]
        if layout.shard_buckets and buffer.numel() == spec.numel:
            # A hook that returned the whole bucket (PowerSGD, ...): take our shard.
            # Were it a one-element shard instead, the two readings agree.
            buffer = _pack.shard_of(buffer, layout.rank, layout.world_size)
        pieces.append(buffer)
    return pieces


def _check_pieces(layout: ZeroLayout, new_pieces: Any) -> None:
    if not isinstance(new_pieces, list | tuple) or len(new_pieces) != len(layout.pieces):
        raise ValueError(
            "optimizer.update must return the parameters with the structure it was given "
            f"(a list of {len(layout.pieces)} flat tensors); got {type(new_pieces).__name__}."
        )
    for piece, p in zip(new_pieces, layout.pieces, strict=True):
        spec = layout.plan.specs[p.bucket]
        if tuple(piece.shape) != (p.hi - p.lo,) or piece.dtype != spec.dtype:
            raise ValueError(
                f"optimizer.update returned a piece of bucket {p.bucket} with shape "
                f"{tuple(piece.shape)} and dtype {piece.dtype}; expected "
                f"({p.hi - p.lo},) and {spec.dtype}."
            )


def _check_state(layout: ZeroLayout, state: Any) -> None:
    """Raises unless ``state`` was made for this layout's plan, world, mode and rank."""
    if torch.compiler.is_compiling():
        return
    fingerprint, world_size, rank, sharded = (int(v) for v in state.layout.tolist())
    if fingerprint != layout.plan.fingerprint:
        raise ValueError(
            "state belongs to another plan (its fingerprint differs): it was made for "
            "another parameter tree or other bucket sizes. Pass the state this ZeroStep's "
            "init or load returned."
        )
    if world_size != layout.world_size:
        raise ValueError(
            f"state was sharded for a world of {world_size} ranks, but this group has "
            f"{layout.world_size}. {_GATHER_FIX}"
        )
    if bool(sharded) != layout.shard_buckets:
        raise ValueError(
            f"state was made with shard_buckets={bool(sharded)} but this step has "
            f"shard_buckets={layout.shard_buckets}. {_GATHER_FIX}"
        )
    if rank != layout.rank:
        raise ValueError(
            f"state holds rank {rank}'s part, but this is rank {layout.rank}; every rank "
            "must pass its own state."
        )


def _shard_full(layout: ZeroLayout, optimizer: Optimizer, full_state: Any) -> Any:
    """This rank's pieces of a full optimizer state (every per-parameter slot cut up)."""
    plan = layout.plan
    meta_params = _tree.unflatten(
        plan.treespec,
        [
            None if leaf is None else torch.empty(leaf.shape, dtype=leaf.dtype, device=_META)
            for leaf in plan.leaves
        ],
    )
    _checks.check_full_state(full_state, optimizer.init(meta_params))
    template_slots, slot_spec = _tree.flatten(
        optimizer.init(layout.meta_pieces()), is_leaf=layout.is_pieces
    )
    local: list[Any] = []
    for slot, template in zip(slot_spec.flatten_up_to(full_state), template_slots, strict=True):
        if not layout.is_pieces(template):
            local.append(slot)
            continue
        leaves, _ = _tree.flatten(slot)
        local.append(
            [
                pack_range(leaves, plan, p, t.dtype)
                for p, t in zip(layout.pieces, template, strict=True)
            ]
        )
    return _tree.unflatten(slot_spec, local)


def _layout_of(step: ZeroStep, plan: BucketPlan) -> ZeroLayout:
    group = step.group
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
    _check_state(layout, state)
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


class ZeroStep:
    """A ZeRO optimizer step over buckets; build it with [fsync.ops.zero][].

    The object holds settings only. ``init(params)`` plans the buckets, checks
    across ranks that everyone has the same parameter tree, and returns this
    rank's [fsync.ops.ZeroState][]. Calling the object with ``(params, grads,
    state)`` syncs the gradients (through the same reduce as
    [fsync.sync_grads][]), updates this rank's part of the parameters and
    returns the full new parameters on every rank, with the new state. Nothing
    passed in is modified.

    Attributes:
        optimizer: The [fsync.optim.Optimizer][] applied to the pieces.
        options: The sync options (hook and bucket sizes).
        shard_buckets: Whether buckets are sharded (``True``) or owned whole.
        group: The process group.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        options: SyncOptions,
        shard_buckets: bool = True,
        group: _comm.Group = None,
    ) -> None:
        _checks.check_optimizer(optimizer)
        self.optimizer = optimizer
        self.options = options
        self.shard_buckets = bool(shard_buckets)
        self.group = group

    @property
    def hook(self) -> Hook:
        """The hook the gradient buckets go through (the default filled in)."""
        return hook_of(self.options)

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
        return ZeroState(
            layout.tensor(),
            init_hook(self.options, plan, self.group),
            self.optimizer.init(pieces),
            _planner.like(params),
            torch.zeros((), dtype=torch.int64),
        )

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

        Example:
            >>> import torch, fsync
            >>> params = {"w": torch.ones(3)}
            >>> step = fsync.ops.zero(fsync.optim.adam(0.1))
            >>> state = step.init(params)
            >>> full = fsync.ops.zero_state_dict(state, step)
            >>> state = step.load(params, full)
        """
        _, layout = _plan_params(self, params)
        return ZeroState(
            layout.tensor(),
            init_hook(self.options, layout.plan, self.group),
            _shard_full(layout, self.optimizer, full_state),
            _planner.like(params),
            torch.zeros((), dtype=torch.int64),
        )

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
        try:
            (p_leaves, plan, rebuild), layout = _fit(self, params, state, "params")
            for leaf, spec in zip(p_leaves, plan.leaves, strict=True):
                if leaf is None and spec is not None:
                    raise ValueError(
                        f"params leaf {spec.path!r} is None, but the plan holds a parameter "
                        "there; pass the parameter tree given to init."
                    )
            g_leaves = _fit(self, grads, state, "grads")[0].leaves
        except (ValueError, TypeError) as error:
            return refuse(error, self.group, like=(params, state))  # type: ignore[no-any-return]
        grad_pieces, hook_state = _comm.naming(
            lambda: _reduced_pieces(self, g_leaves, layout, state), self.group, step=state.step
        )
        specs = plan.specs
        param_pieces = [pack_range(p_leaves, plan, p, specs[p.bucket].dtype) for p in layout.pieces]
        new_pieces, opt_state = self.optimizer.update(param_pieces, grad_pieces, state.opt)
        _check_pieces(layout, new_pieces)
        buffers = _comm.naming(
            lambda: _gather(layout, new_pieces, self.group, [spec.dtype for spec in specs]),
            self.group,
            step=state.step,
        )
        out = _pack.unpack_leaves(buffers, plan)
        new_state = state._replace(hook=hook_state, opt=opt_state, step=state.step + 1)
        return rebuild(out), new_state


def zero(
    optimizer: Optimizer,
    *,
    hook: Hook | None = None,
    shard_buckets: bool = True,
    group: _comm.Group = None,
    bucket_cap_mb: float | None = None,
    first_bucket_mb: float = 1.0,
) -> ZeroStep:
    """A ZeRO step: synced gradients feed an optimizer update sharded across ranks.

    Every rank keeps the full parameters and only its part of the optimizer
    state. Per bucket of the plan ([fsync.plan_buckets][] with these
    sizes), with ``shard_buckets=True`` the gradients are reduce-scattered
    (through ``hook`` with ``ctx.scatter`` set), each rank updates its shard
    with ``optimizer`` and the shards are all-gathered; with
    ``shard_buckets=False`` each bucket is all-reduced and updated by one
    owning rank, which broadcasts it (the owners balance bucket bytes,
    largest first). Works with any world size, backend and parameter dtypes,
    eagerly and under ``torch.compile(fullgraph=True)``.

    Args:
        optimizer: An [fsync.optim.Optimizer][]; it is applied to a list
            of flat tensors (this rank's pieces).
        hook: The [fsync.Hook][] for the gradient buckets; default
            ``fsync.ops.allreduce("mean")``. It may return per bucket the
            whole reduced bucket or this rank's shard of it.
        shard_buckets: Shard every bucket across ranks (``True``) or give each
            bucket whole to one rank (``False``).
        group: ``None`` for the default group, a ``ProcessGroup``, a 1-D
            ``DeviceMesh``, ``(DeviceMesh, dim)``, or a 2-D ``DeviceMesh``
            ``(nodes, local)``: gradients are then reduced hierarchically (as
            [fsync.sync_grads][] does) and the ranks of the whole mesh share
            the update.
        bucket_cap_mb: Bucket size limit in MiB; ``None``: 25, or 4 on a 2-D mesh
            (see [fsync.SyncOptions][]).
        first_bucket_mb: Size limit of the first bucket in MiB.

    Returns:
        A [fsync.ops.ZeroStep][]: ``state = step.init(params)``, then
        ``params, state = step(params, grads, state)``.

    Raises:
        TypeError: ``optimizer`` or ``hook`` has the wrong type.
        ValueError: A bucket size is not a finite positive number.

    Example:
        >>> import torch, fsync
        >>> params = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
        >>> step = fsync.ops.zero(fsync.optim.sgd(0.5))
        >>> state = step.init(params)
        >>> params, state = step(params, {"w": torch.ones(2, 2), "b": torch.ones(2)}, state)
        >>> params["b"]
        tensor([-0.5000, -0.5000])
    """
    given = OptionKeywords(hook=hook, first_bucket_mb=first_bucket_mb)
    if bucket_cap_mb is not None:  # else the default for the group (SyncOptions.of)
        given["bucket_cap_mb"] = bucket_cap_mb
    mesh = _comm.hierarchy(group) is not None
    options = SyncOptions.of(given, where="fsync.ops.zero", mesh=mesh)
    return ZeroStep(optimizer, options=options, shard_buckets=shard_buckets, group=group)


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
        to: The rank (within the step's group) that receives the full state.

    Returns:
        The full optimizer state on rank ``to``; ``None`` on the other ranks.

    Raises:
        TypeError: ``step`` is not a [fsync.ops.ZeroStep][] or ``state`` not a
            [fsync.ops.ZeroState][].
        ValueError: ``to`` is not a rank of the group, or ``state`` belongs to
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
        buffers = _gather(layout, slot, step.group, [t.dtype for t in template])
        out.append(_tree.unflatten(plan.treespec, _pack.unpack_leaves(buffers, plan)))
    if layout.rank != to:
        return None
    return _tree.unflatten(slot_spec, out)

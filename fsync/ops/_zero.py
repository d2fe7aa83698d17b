"""The ZeRO step: gradient sync and a sharded optimizer update as one pure function.

DDP with ``ZeroRedundancyOptimizer`` keeps a full copy of the parameters on
every rank but only a part of the optimizer state: each rank updates the
parameters it owns and hands the result to the others. Here that is a function
of ``(params, grads, state)`` over the same bucket plan as :func:`fsync.sync_grads`:

* ``shard_buckets=True`` (ZeRO-2 style): each bucket is cut into ``world_size``
  equal shards (zero-padded). Its gradients are reduce-scattered, every rank
  updates its shard of every bucket with its shard of the optimizer state, and
  the updated shards are all-gathered.
* ``shard_buckets=False`` (torch's ``hook_with_zero_step``): each bucket is
  owned whole by one rank, chosen by size so that ranks hold similar amounts.
  Gradients are all-reduced, the owner updates the bucket and broadcasts it.

The plan is fixed by :meth:`ZeroStep.init`, so the first call already updates
the parameters; there are no warm-up iterations and any backend works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fsync import _comm, _pack, _tree, _verify
from fsync._hook import Hook, SyncContext, check_hook
from fsync._plan import BucketPlan, check_bucket_options, leaf_specs, plan_from_specs
from fsync._serialization import register_state
from fsync._sync import check_grad_types, check_grads
from fsync.ops._allreduce import allreduce
from fsync.optim._base import Optimizer

_DEFAULT_HOOK = allreduce("mean")
_META = torch.device("meta")

_GATHER_FIX = (
    "Gather it with fsync.ops.zero_state_dict(state, step) on the world that made it and shard "
    "the result for this world with ZeroStep.load(full_state)."
)


@register_state
class ZeroState(NamedTuple):
    """This rank's state of a :class:`ZeroStep`.

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
    """

    layout: torch.Tensor
    hook: Any
    opt: Any


class _Piece(NamedTuple):
    """The elements ``[lo, hi)`` of bucket ``bucket`` (``hi`` may pass its end: padding)."""

    bucket: int
    lo: int
    hi: int


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


def _pack_range(
    leaves: Sequence[Any],
    plan: BucketPlan,
    piece: _Piece,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a bucket packed from ``leaves``, zeros past its end.

    Only the leaves that overlap the range are read, so a rank never copies
    the whole bucket to get its shard.
    """
    spec = plan.specs[piece.bucket]
    parts = []
    for i, offset, size in zip(spec.leaves, spec.offsets, spec.sizes, strict=True):
        start, stop = max(piece.lo, offset), min(piece.hi, offset + size)
        if start < stop:
            leaf_spec = plan.leaves[i]
            assert leaf_spec is not None
            parts.append(
                _pack.flat(leaves[i], leaf_spec, spec.dtype)[start - offset : stop - offset]
            )
    padding = piece.hi - max(piece.lo, spec.numel)
    if padding > 0 or not parts:
        where = parts[0].device if parts else device
        parts.append(torch.zeros(max(padding, 0), dtype=dtype, device=where))
    # torch.cat always copies: the piece never shares memory with the caller's tensors.
    return torch.cat(parts).to(device)


class ZeroStep:
    """A ZeRO optimizer step over buckets; build it with :func:`zero`.

    ``init(params)`` fixes the bucket plan, checks across ranks that everyone
    has the same parameter tree, and returns this rank's :class:`ZeroState`.
    Calling the object with ``(params, grads, state)`` syncs the gradients,
    updates this rank's part of the parameters and returns the full new
    parameters on every rank, with the new state. Nothing passed in is modified.

    Attributes:
        optimizer: The :class:`fsync.optim.Optimizer` applied to the pieces.
        hook: The hook the gradient buckets go through.
        shard_buckets: Whether buckets are sharded (``True``) or owned whole.
        group: The process group.
        bucket_cap_mb: Bucket size limit in MiB of the plan.
        first_bucket_mb: Size limit of the plan's first bucket in MiB.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        hook: Hook | None = None,
        shard_buckets: bool = True,
        group: _comm.Group = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
    ) -> None:
        if not (
            callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))
        ):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}; expected an fsync.optim.Optimizer "
                "(init, update), such as fsync.optim.adamw(1e-3)."
            )
        check_bucket_options(bucket_cap_mb, first_bucket_mb)
        self.optimizer = optimizer
        self.hook = check_hook(_DEFAULT_HOOK if hook is None else hook)
        self.shard_buckets = bool(shard_buckets)
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self._plan: BucketPlan | None = None
        self._rank = 0
        self._world_size = 1
        self._owners: tuple[int, ...] = ()
        self._pieces: tuple[_Piece, ...] = ()

    # --- the layout -----------------------------------------------------------------------

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan fixed by :meth:`init`."""
        if self._plan is None:
            raise RuntimeError("ZeroStep has no plan yet; call .init(params) first.")
        return self._plan

    @property
    def owners(self) -> tuple[int, ...]:
        """The rank that owns each bucket with ``shard_buckets=False`` (empty when sharded)."""
        self.plan  # noqa: B018 (raises before init)
        return self._owners

    def _layout(self) -> torch.Tensor:
        values = [self.plan.fingerprint, self._world_size, self._rank, int(self.shard_buckets)]
        return torch.tensor(values, dtype=torch.int64)

    def _set_plan(self, plan: BucketPlan) -> None:
        self._world_size = world_size = _comm.size(self.group)
        self._rank = rank = _comm.rank(self.group)
        if self.shard_buckets:
            self._owners = ()
            pieces = []
            for b, spec in enumerate(plan.specs):
                n = _pack.shard_numel(spec.numel, world_size)
                pieces.append(_Piece(b, rank * n, (rank + 1) * n))
            self._pieces = tuple(pieces)
        else:
            self._owners = owners_by_size(plan.nbytes, world_size)
            self._pieces = tuple(
                _Piece(b, 0, spec.numel)
                for b, spec in enumerate(plan.specs)
                if self._owners[b] == rank
            )
        self._plan = plan

    def _is_pieces(self, x: Any) -> bool:
        """Whether ``x`` is a list of tensors shaped like this rank's pieces."""
        return (
            type(x) is list
            and len(x) == len(self._pieces)
            and all(
                isinstance(t, torch.Tensor) and tuple(t.shape) == (p.hi - p.lo,)
                for t, p in zip(x, self._pieces, strict=True)
            )
        )

    def _meta_pieces(self) -> list[torch.Tensor]:
        specs = self.plan.specs
        return [
            torch.empty(p.hi - p.lo, dtype=specs[p.bucket].dtype, device=_META)
            for p in self._pieces
        ]

    # --- init and load --------------------------------------------------------------------

    def init(self, params: Any, /) -> ZeroState:
        """Plans the buckets for ``params``, checks them across ranks, returns the state.

        Args:
            params: The parameter tree (floating point tensors; ``None``
                leaves stay ``None``). Its values seed the optimizer state.

        Returns:
            This rank's :class:`ZeroState`.

        Raises:
            TypeError: A leaf is not a floating point dense tensor.
            ValueError: The ranks' parameter trees differ (raised on every
                rank), or this object was initialised for another tree.
        """
        _comm.check_group(self.group)
        treespec, leaves, specs = leaf_specs(params, what="params")
        plan = plan_from_specs(
            treespec,
            specs,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
        )
        if self._plan is not None and plan != self._plan:
            raise ValueError(
                "this ZeroStep was initialised for another parameter tree; make one ZeroStep "
                "per tree."
            )
        # First the collective check, so that every rank raises the same error.
        _verify.verify_plan(plan, self.group, what="parameter trees passed to ZeroStep.init")
        for spec in specs:
            if spec is None:
                continue
            if spec.sparse or not spec.dtype.is_floating_point:
                kind = "is sparse" if spec.sparse else f"has dtype {spec.dtype}"
                raise TypeError(
                    f"params leaf {spec.path!r} {kind}; the ZeRO step updates dense floating "
                    "point parameters. Keep buffers and integer tensors out of the tree (pass "
                    "them beside it) and use dense embeddings."
                )
        self._set_plan(plan)
        pieces = [
            _pack_range(leaves, plan, p, plan.specs[p.bucket].dtype, plan.specs[p.bucket].device)
            for p in self._pieces
        ]
        return ZeroState(self._layout(), self.hook.init(plan), self.optimizer.init(pieces))

    def load(self, full_state: Any, /) -> ZeroState:
        """Shards a full optimizer state for this rank, world size and mode.

        ``full_state`` is the optimizer's state for the whole parameter tree,
        as :func:`zero_state_dict` gathers it (from any world size and mode)
        or as ``optimizer.init(params)`` and its updates produce without ZeRO.
        Every rank passes the same full state; no collective is issued. The
        hook's state starts afresh.

        Args:
            full_state: The optimizer's state over the parameter tree.

        Returns:
            This rank's :class:`ZeroState`, on the parameters' devices.

        Raises:
            RuntimeError: :meth:`init` was not called first.
            ValueError: ``full_state`` does not have the structure, shapes and
                dtypes of this optimizer's state for these parameters.

        Example:
            >>> import torch, fsync
            >>> params = {"w": torch.ones(3)}
            >>> step = fsync.ops.zero(fsync.optim.adam(0.1))
            >>> state = step.init(params)
            >>> full = fsync.ops.zero_state_dict(state, step)
            >>> state = step.load(full)
        """
        plan = self.plan
        param_like = _tree.unflatten(
            plan.treespec,
            [
                None if leaf is None else torch.empty(leaf.shape, dtype=leaf.dtype, device=_META)
                for leaf in plan.leaves
            ],
        )
        self._check_full(full_state, self.optimizer.init(param_like))
        template_slots, slot_spec = _tree.flatten(
            self.optimizer.init(self._meta_pieces()), is_leaf=self._is_pieces
        )
        local: list[Any] = []
        for slot, template in zip(slot_spec.flatten_up_to(full_state), template_slots, strict=True):
            if not self._is_pieces(template):
                local.append(slot)
                continue
            leaves, _ = _tree.flatten(slot)
            local.append(
                [
                    _pack_range(leaves, plan, p, t.dtype, plan.specs[p.bucket].device)
                    for p, t in zip(self._pieces, template, strict=True)
                ]
            )
        return ZeroState(self._layout(), self.hook.init(plan), _tree.unflatten(slot_spec, local))

    def _check_full(self, full_state: Any, template: Any) -> None:
        expected, t_spec = _tree.flatten(template)
        got, spec = _tree.flatten(full_state)
        if spec != t_spec:
            raise ValueError(
                f"full_state has structure {spec}, but this optimizer's state for these "
                f"parameters has {t_spec}. Pass what fsync.ops.zero_state_dict returned for the "
                "same optimizer and parameter tree."
            )
        for accessor, want, have in zip(t_spec.accessors(), expected, got, strict=True):
            where = accessor.codify("full_state")
            if want is None or have is None:
                if (want is None) != (have is None):
                    raise ValueError(
                        f"{where} is {'None' if have is None else 'a tensor'}; expected "
                        f"{'None' if want is None else 'a tensor'}."
                    )
                continue
            if not isinstance(have, torch.Tensor):
                raise ValueError(f"{where} is a {type(have).__name__}; expected a tensor.")
            if have.shape != want.shape or have.dtype != want.dtype:
                raise ValueError(
                    f"{where} has shape {tuple(have.shape)} and dtype {have.dtype}; expected "
                    f"shape {tuple(want.shape)} and dtype {want.dtype}. Was it saved for another "
                    "model or optimizer?"
                )

    # --- the step -------------------------------------------------------------------------

    def _check_state(self, state: Any, /) -> None:
        """Raises unless ``state`` was made by this step for this plan, world and rank."""
        plan = self.plan
        if not isinstance(state, ZeroState):
            raise TypeError(
                f"state is a {type(state).__name__}; expected the ZeroState returned by "
                "ZeroStep.init, ZeroStep.load or the previous step."
            )
        if torch.compiler.is_compiling():
            return
        fingerprint, world_size, rank, sharded = (int(v) for v in state.layout.tolist())
        if fingerprint != plan.fingerprint:
            raise ValueError(
                "state belongs to another plan (its fingerprint differs): it was made for "
                "another parameter tree or other bucket sizes. Pass the state this ZeroStep's "
                "init or load returned."
            )
        if world_size != self._world_size:
            raise ValueError(
                f"state was sharded for a world of {world_size} ranks, but this group has "
                f"{self._world_size}. {_GATHER_FIX}"
            )
        if bool(sharded) != self.shard_buckets:
            raise ValueError(
                f"state was made with shard_buckets={bool(sharded)} but this step has "
                f"shard_buckets={self.shard_buckets}. {_GATHER_FIX}"
            )
        if rank != self._rank:
            raise ValueError(
                f"state holds rank {rank}'s part, but this is rank {self._rank}; every rank "
                "must pass its own state."
            )

    def __call__(self, params: Any, grads: Any, state: ZeroState, /) -> tuple[Any, ZeroState]:
        """One optimizer step: sync ``grads``, update the parameters, gather them.

        Args:
            params: The parameter tree given to :meth:`init` (same structure,
                shapes and dtypes; the values of the previous step).
            grads: The local gradients, shaped like ``params``; ``None`` leaves
                count as zeros.
            state: This rank's :class:`ZeroState`.

        Returns:
            ``(params, state)``: the updated parameters (the same on every rank,
            with the input's layouts) and the new state.

        Raises:
            TypeError: A gradient is not a floating point tensor, or ``state``
                is not a :class:`ZeroState`.
            ValueError: ``params`` or ``grads`` do not match the plan, a
                gradient requires grad, or ``state`` was made for another plan,
                world size, mode or rank.
        """
        plan = self.plan
        self._check_state(state)
        p_leaves, p_spec = _tree.flatten(params)
        _pack.check_leaves(p_leaves, p_spec, plan, "params")
        for leaf, spec in zip(p_leaves, plan.leaves, strict=True):
            if leaf is None and spec is not None:
                raise ValueError(
                    f"params leaf {spec.path!r} is None, but the plan holds a parameter there; "
                    "pass the parameter tree given to init."
                )
        g_leaves, g_spec = _tree.flatten(grads)
        check_grad_types(g_leaves, g_spec)
        _pack.check_leaves(g_leaves, g_spec, plan, "grads")
        check_grads(g_leaves, plan)

        ctx = SyncContext(
            plan,
            plan.specs,
            self.group,
            self._rank,
            self._world_size,
            self._world_size,
            scatter=self.shard_buckets,
        )
        reduced, hook_state = self.hook.apply(_pack.pack_leaves(g_leaves, plan), state.hook, ctx)
        reduced = [_comm.wait(b) for b in reduced]
        grad_pieces = self._grad_pieces(reduced)
        param_pieces = [
            _pack_range(p_leaves, plan, p, plan.specs[p.bucket].dtype, plan.specs[p.bucket].device)
            for p in self._pieces
        ]
        new_pieces, opt_state = self.optimizer.update(param_pieces, grad_pieces, state.opt)
        self._check_pieces(new_pieces)
        buffers = self._gather_params(new_pieces)
        out = _pack.unpack_leaves(buffers, plan)
        return _tree.unflatten(p_spec, out), ZeroState(state.layout, hook_state, opt_state)

    def _grad_pieces(self, reduced: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        specs = self.plan.specs
        if len(reduced) != len(specs):
            raise ValueError(
                f"hook output: got {len(reduced)} buffers for {len(specs)} buckets; expected "
                "one per bucket, in the plan's order."
            )
        for b, (buffer, spec) in enumerate(zip(reduced, specs, strict=True)):
            expected = f"the whole bucket, a 1-D {spec.dtype} tensor of {spec.numel} elements"
            sizes = {spec.numel}
            if self.shard_buckets:
                n = _pack.shard_numel(spec.numel, self._world_size)
                expected += f", or this rank's shard of it ({n} elements)"
                sizes.add(n)
            if not isinstance(buffer, torch.Tensor):
                raise TypeError(
                    f"hook output: buffer {b} is a {type(buffer).__name__}; expected {expected}."
                )
            if buffer.dim() != 1 or buffer.numel() not in sizes or buffer.dtype != spec.dtype:
                raise ValueError(
                    f"hook output: buffer {b} has shape {tuple(buffer.shape)} and dtype "
                    f"{buffer.dtype}; expected {expected}."
                )
        pieces = []
        for p in self._pieces:
            buffer, spec = reduced[p.bucket], specs[p.bucket]
            if self.shard_buckets and buffer.numel() == spec.numel:
                # A hook that returned the whole bucket (PowerSGD, ...): take our shard.
                # Were it a one-element shard instead, the two readings agree.
                buffer = _pack.shard_of(buffer, self._rank, self._world_size)
            pieces.append(buffer)
        return pieces

    def _check_pieces(self, new_pieces: Any) -> None:
        if not isinstance(new_pieces, list | tuple) or len(new_pieces) != len(self._pieces):
            raise ValueError(
                "optimizer.update must return the parameters with the structure it was given "
                f"(a list of {len(self._pieces)} flat tensors); got {type(new_pieces).__name__}."
            )
        for piece, p in zip(new_pieces, self._pieces, strict=True):
            spec = self.plan.specs[p.bucket]
            if tuple(piece.shape) != (p.hi - p.lo,) or piece.dtype != spec.dtype:
                raise ValueError(
                    f"optimizer.update returned a piece of bucket {p.bucket} with shape "
                    f"{tuple(piece.shape)} and dtype {piece.dtype}; expected "
                    f"({p.hi - p.lo},) and {spec.dtype}."
                )

    def _gather_params(self, new_pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        specs = self.plan.specs
        if self.shard_buckets:
            # Issue every all-gather before waiting on the first.
            gathered = [_comm.all_gather(piece, self.group) for piece in new_pieces]
            return [_comm.wait(g)[: spec.numel] for g, spec in zip(gathered, specs, strict=True)]
        mine = iter(new_pieces)
        sent = []
        for owner, spec in zip(self._owners, specs, strict=True):
            if owner == self._rank:
                tensor = next(mine)
            else:
                tensor = torch.empty(spec.numel, dtype=spec.dtype, device=spec.device)
            sent.append(_comm.broadcast(tensor, owner, self.group))
        return [_comm.wait(t) for t in sent]

    # --- gathering a full state -----------------------------------------------------------

    def _gather_slot(
        self, pieces: Sequence[torch.Tensor], template: Sequence[torch.Tensor], to: int
    ) -> Any:
        """A per-parameter state slot, gathered into a tree like the parameters on rank ``to``."""
        plan = self.plan
        if self.shard_buckets:
            gathered = [_comm.all_gather(piece, self.group) for piece in pieces]
            buffers = [
                _comm.wait(g)[: spec.numel] for g, spec in zip(gathered, plan.specs, strict=True)
            ]
        else:
            mine = iter(pieces)
            sent = []
            for b, (owner, spec) in enumerate(zip(self._owners, plan.specs, strict=True)):
                if owner == self._rank:
                    tensor = next(mine)
                else:
                    tensor = torch.empty(spec.numel, dtype=template[b].dtype, device=spec.device)
                sent.append(_comm.broadcast(tensor, owner, self.group))
            buffers = [_comm.wait(t) for t in sent]
        if self._rank != to:
            return None
        return _tree.unflatten(plan.treespec, _pack.unpack_leaves(buffers, plan))


def zero(
    optimizer: Optimizer,
    *,
    hook: Hook | None = None,
    shard_buckets: bool = True,
    group: _comm.Group = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> ZeroStep:
    """A ZeRO step: synced gradients feed an optimizer update sharded across ranks.

    Every rank keeps the full parameters and only its part of the optimizer
    state. Per bucket of the plan (:func:`fsync.plan_buckets` with these
    sizes), with ``shard_buckets=True`` the gradients are reduce-scattered
    (through ``hook`` with ``ctx.scatter`` set), each rank updates its shard
    with ``optimizer`` and the shards are all-gathered; with
    ``shard_buckets=False`` each bucket is all-reduced and updated by one
    owning rank, which broadcasts it (the owners balance bucket bytes,
    largest first). Works with any world size, backend and parameter dtypes,
    eagerly and under ``torch.compile(fullgraph=True)``.

    Args:
        optimizer: An :class:`fsync.optim.Optimizer`; it is applied to a list
            of flat tensors (this rank's pieces).
        hook: The :class:`fsync.Hook` for the gradient buckets; default
            ``fsync.ops.allreduce("mean")``. It may return per bucket the
            whole reduced bucket or this rank's shard of it.
        shard_buckets: Shard every bucket across ranks (``True``) or give each
            bucket whole to one rank (``False``).
        group: ``None`` for the default group, a ``ProcessGroup``, a 1-D
            ``DeviceMesh`` or ``(DeviceMesh, dim)``.
        bucket_cap_mb: Bucket size limit in MiB.
        first_bucket_mb: Size limit of the first bucket in MiB.

    Returns:
        A :class:`ZeroStep`: ``state = step.init(params)``, then
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
    return ZeroStep(
        optimizer,
        hook=hook,
        shard_buckets=shard_buckets,
        group=group,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_mb=first_bucket_mb,
    )


def zero_state_dict(state: ZeroState, step: ZeroStep, /, *, to: int = 0) -> Any:
    """Gathers the full optimizer state of a ZeRO step on rank ``to``.

    The result is the optimizer's state for the whole parameter tree, shaped
    as ``step.optimizer.init(params)`` would make it (each per-parameter entry
    a tree like the parameters), so it can be saved with ``torch.save`` and
    resharded for any world size with :meth:`ZeroStep.load`, or used without
    ZeRO. It is the functional form of ``ZeroRedundancyOptimizer``'s
    ``consolidate_state_dict``. Every rank must call it; the hook's state is
    not included.

    Args:
        state: This rank's :class:`ZeroState`.
        step: The :class:`ZeroStep` the state belongs to.
        to: The rank (within the step's group) that receives the full state.

    Returns:
        The full optimizer state on rank ``to``; ``None`` on the other ranks.

    Raises:
        TypeError: ``step`` is not a :class:`ZeroStep` or ``state`` not a
            :class:`ZeroState`.
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
    step._check_state(state)
    world_size = step._world_size
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world_size:
        raise ValueError(f"to must be a rank of the group, 0 to {world_size - 1}; got {to!r}.")
    slots, slot_spec = _tree.flatten(state.opt, is_leaf=step._is_pieces)
    # The dtype of every bucket's state, for the ranks that do not own it.
    full_pieces = [
        torch.empty(spec.numel, dtype=spec.dtype, device=_META) for spec in step.plan.specs
    ]
    templates, _ = _tree.flatten(
        step.optimizer.init(full_pieces),
        is_leaf=lambda x: type(x) is list and len(x) == len(full_pieces),
    )
    out = []
    for slot, template in zip(slots, templates, strict=True):
        if step._is_pieces(slot):
            out.append(step._gather_slot(slot, template, to))
        else:
            out.append(slot)
    if step._rank != to:
        return None
    return _tree.unflatten(slot_spec, out)

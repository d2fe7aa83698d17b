"""fsync's states as DCP state dicts: each rank writes what it owns.

``state_dict(params, state, step=...)`` is a dict for ``torch.distributed.checkpoint``
(DCP): ``dcp.save(sd, checkpoint_id=path)`` (or ``dcp.async_save``) writes it, every
rank its own part. ``step`` is what made ``state``, or a tuple of such steps with the
tuple of their states (``_parts``). Its entries, as DCP names them:

* ``params.<path>``: the parameters, whole (the same on every rank: DCP writes each
  once, spreading them over the ranks);
* ``optim.state.<path>.<entry>``: the optimizer's per-parameter entries, each with
  its parameter's shape. A ZeRO rank holds of each only the elements of its pieces:
  ``_chunks.Chunks`` describes them to DCP as rectangles of that tensor, so a
  checkpoint written by N ranks in one sharding mode is read by M ranks in either,
  every rank reading only what its own pieces need;
* ``optim.<entry>``: the optimizer's other entries (its step count);
* ``step``: the ZeRO state's step count;
* ``hook.rank<r>.<i>``: rank ``r``'s ZeRO hook state (PowerSGD's error feedback and
  Q), leaf ``i`` of its tree, one entry per rank;
* ``sync.*`` and ``diloco.*``: a GradSync's and a DiLoCo's states (``_sync_states``);
  with a DiLoCo, whose ranks train apart, ``params`` and ``optim`` are each rank's own
  and stored as ``local.rank<r>.params`` and ``local.rank<r>.optim``;
* ``fsync``: the description ``load`` compares first (``_describe``).

Owns: the checkpoint's layout (``state_dict``, ``compose``) and the entries of an
optimizer or ZeRO state. May import: every layer below the entry points, ``_zero``,
``_sync``, ``_diloco``, ``fsync.optim``, and this package's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsync import _comm, _tree
from fsync._zero import ZeroLayout, ZeroState, ZeroStep
from fsync.checkpoint import _describe
from fsync.checkpoint._chunks import Chunks, range_chunks
from fsync.checkpoint._describe import Description
from fsync.checkpoint._entries import (
    Named,
    described,
    hook_entry,
    named,
    optim_entries,
    params_entry,
    process,
    slots,
    tensor,
)
from fsync.checkpoint._parts import Part, Step, is_composite, parts_of, states_of
from fsync.checkpoint._sync_states import diloco_part, sync_part
from fsync.optim._base import Optimizer

_META = torch.device("meta")

Made = tuple[dict[str, Any], dict[str, Any]]
"""A part's entries and its description's fields."""

# The description's fields where no part sets them.
_NO_FIELDS: dict[str, Any] = {
    "optimizer": None,
    "per_parameter": (),
    "shared": (),
    "none": (),
    "sharding": None,
    "hook": None,
    "sync": None,
    "outer": None,
    "diloco": None,
    "local": None,
}


# --- the state dict ------------------------------------------------------------------------


def state_dict(params: Any, state: Any, /, *, step: Step) -> dict[str, Any]:
    """A DCP state dict of the parameters and the states of ``step``: each rank's own part.

    Save it with ``torch.distributed.checkpoint.save(sd, checkpoint_id=path)`` (or
    ``async_save``) on every rank; resume with [fsync.checkpoint.load][] at any world
    size and, for a ZeRO step, in either sharding mode. The dict references the
    tensors of ``params`` and ``state`` (no copy): save it before the next step
    replaces them, or let ``dcp.async_save`` stage it.

    Args:
        params: The parameter tree (every rank the same values, as a ZeRO step or
            [fsync.sync_grads][] leaves them; with a DiLoCo, each rank's own).
        state: The state of ``step``: a [fsync.ops.ZeroState][] (this rank's
            part), an optimizer's state over ``params`` (an [fsync.optim.AdamState][]
            or [fsync.optim.SGDState][]), a [fsync.SyncState][] or a
            [fsync.DiLoCoState][]; or, for a tuple of steps, the tuple of their
            states, as the train step holds them: ``(opt_state, sync_state)``.
        step: What made ``state``: the [fsync.ops.ZeroStep][], the
            [fsync.optim.Optimizer][], the [fsync.GradSync][] or the
            [fsync.DiLoCo][]; or a tuple of them, at most one of each kind (a
            ZeroStep alone): ``(opt, sync)``, ``(opt, diloco)``.

    Returns:
        A dict of the entries the guide "Checkpoints" lists: ``params``, ``optim``
        (per-parameter entries in the parameters' shapes; a ZeRO rank's only its
        elements), ``step`` and ``hook`` (a ZeRO state's), ``sync`` and ``diloco``,
        ``local`` (with a DiLoCo: each rank's parameters and optimizer state) and
        ``fsync`` (what [fsync.checkpoint.load][] checks first).

    Raises:
        TypeError: ``step`` is none of these, or ``state`` is not its state (or
            not the tuple of its states, in order).
        ValueError: ``step`` holds two steps of a kind or a ZeroStep beside
            another, ``state`` belongs to another plan, world, rank or tree, or two
            parameters share a path.

    Example:
        >>> import torch, fsync
        >>> opt, sync = fsync.optim.adam(0.1), fsync.GradSync()
        >>> params = {"w": torch.ones(3)}
        >>> opt_state, sync_state = opt.init(params), sync.init(params)
        >>> grads, sync_state = sync({"w": torch.ones(3)}, sync_state)
        >>> params, opt_state = opt.update(params, grads, opt_state)
        >>> sd = fsync.checkpoint.state_dict(
        ...     params, (opt_state, sync_state), step=(opt, sync))
        >>> sorted(sd["optim"]["state"]["w"]), sd["optim"]["step"], sd["sync"]["step"]
        (['exp_avg', 'exp_avg_sq'], tensor(1), tensor(1))
    """
    parts = parts_of(step)
    return compose(params, parts, states_of(parts, state, is_composite(step)))


def compose(params: Any, parts: tuple[Part, ...], states: tuple[Any, ...]) -> dict[str, Any]:
    """The state dict of ``params`` and the checked ``states`` of ``parts``."""
    tree = named(params)
    entries: dict[str, Any] = {"params": params_entry(tree)}
    fields = dict(_NO_FIELDS, parts=tuple(p.kind for p in parts))
    for part, value in zip(parts, states, strict=True):
        made, more = _PARTS[part.kind](tree, value, part.step)
        entries.update(made)
        fields.update(more)
    if fields["local"] is not None:  # DiLoCo: every rank's parameters and optimizer its own
        own = {k: entries.pop(k) for k in ("params", "optim") if k in entries}
        entries["local"] = {f"rank{process()[0]}": own}
    leaves = tuple(
        _describe.leaf(p, x) for p, x in zip(tree.paths, tree.leaves, strict=True) if x is not None
    )
    description = Description(format=_describe.FORMAT, params=leaves, **fields)
    entries[_describe.KEY] = description.as_entry()
    return entries


def _optim_fields(
    optim: tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]],
) -> dict[str, Any]:
    name, per_parameter, shared, none = optim
    return {"optimizer": name, "per_parameter": per_parameter, "shared": shared, "none": none}


def _optim_part(tree: Named, opt_state: Any, _: Optimizer) -> Made:
    optim, optim_described = optim_entries(tree, opt_state)
    return {"optim": optim}, _optim_fields(optim_described)


def _zero_part(tree: Named, state: ZeroState, step: ZeroStep) -> Made:
    layout = step.layout(state)  # raises for a state of another plan, world or rank
    _check_params(tree.paths, tree.leaves, layout)
    found = slots(state.opt, layout.is_pieces)
    dtypes = iter(_bucket_dtypes(layout, step.optimizer))
    optim: dict[str, Any] = {"state": {}}
    for name, value in found:
        if layout.is_pieces(value):
            for path, chunks in _leaf_chunks(layout, value, next(dtypes)).items():
                optim["state"].setdefault(path, {})[name] = chunks
        elif value is not None:
            optim[name] = tensor(value, f"optimizer state entry {name!r}")
    entries = {
        "optim": optim,
        "step": state.step,
        "hook": {f"rank{_comm.rank(step.group)}": hook_entry(state.hook)},
    }
    fields = _optim_fields(described(state.opt, found, layout.is_pieces))
    fields.update(sharding=(layout.world_size, layout.shard_buckets), hook=_hook_key(layout, step))
    return entries, fields


_PARTS: dict[str, Callable[[Named, Any, Any], Made]] = {
    "zero": _zero_part,
    "optim": _optim_part,
    "sync": sync_part,
    "diloco": diloco_part,
}


def _check_params(paths: list[str], leaves: list[Any], layout: ZeroLayout) -> None:
    """Raises unless the parameter tree is the one of the state's plan."""
    specs = layout.plan.leaves
    if len(specs) != len(leaves):
        raise ValueError(
            f"params has {len(leaves)} leaves, but the state's plan {len(specs)}; pass the "
            "parameter tree the step was given."
        )
    for path, x, spec in zip(paths, leaves, specs, strict=True):
        if (spec is None) != (x is None) or (
            spec is not None and (tuple(x.shape) != spec.shape or x.dtype != spec.dtype)
        ):
            raise ValueError(
                f"params leaf {path!r} does not match the state's plan (shape "
                f"{None if spec is None else spec.shape}); pass the parameter tree the step "
                "was given."
            )


def _hook_key(layout: ZeroLayout, step: ZeroStep) -> tuple[int, int]:
    """What a hook state is valid for: the plan and the world of the reduce."""
    return layout.plan.fingerprint, _comm.size(step.group)


def _bucket_dtypes(layout: ZeroLayout, optimizer: Optimizer) -> list[list[torch.dtype]]:
    """Per per-parameter entry of the optimizer state, the dtype it has in each bucket (what
    ``optimizer.init`` makes of the whole buckets: also where this rank holds none)."""
    specs = layout.plan.specs
    whole = [torch.empty(s.numel, dtype=s.dtype, device=_META) for s in specs]
    template = optimizer.init(whole)
    slots, _ = _tree.flatten(template, is_leaf=lambda x: type(x) is list and len(x) == len(whole))
    return [[t.dtype for t in s] for s in slots if type(s) is list and len(s) == len(whole)]


def _leaf_chunks(
    layout: ZeroLayout, pieces: list[torch.Tensor], dtypes: list[torch.dtype]
) -> dict[str, Chunks]:
    """Per parameter (by path), this rank's elements of it in ``pieces`` as ``Chunks``
    (``dtypes``: the entry's dtype per bucket)."""
    plan = layout.plan
    bucket_of = {i: b for b, spec in enumerate(plan.specs) for i in spec.leaves}
    held: dict[int, tuple[list[tuple[int, ...]], list[torch.Tensor]]] = {
        i: ([], []) for i, leaf in enumerate(plan.leaves) if leaf is not None and leaf.numel
    }
    for piece, flat_piece in zip(layout.pieces, pieces, strict=True):
        spec = plan.specs[piece.bucket]
        for i, offset, size in zip(spec.leaves, spec.offsets, spec.sizes, strict=True):
            start, stop = max(piece.lo, offset), min(piece.hi, offset + size)
            leaf = plan.leaves[i]
            if start < stop and leaf is not None:
                flat = flat_piece[start - piece.lo : stop - piece.lo]
                rects, views = range_chunks(flat, leaf.shape, leaf.perm, start - offset)
                held[i][0].extend(o for o, _ in rects)
                held[i][1].extend(views)
    out = {}
    for i, (offsets, parts) in held.items():
        leaf = plan.leaves[i]
        assert leaf is not None
        out[leaf.path] = Chunks(parts, offsets, leaf.shape, dtypes[bucket_of[i]], leaf.device)
    return out

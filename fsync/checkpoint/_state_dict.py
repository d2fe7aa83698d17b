"""fsync's states as DCP state dicts, and back: each rank writes and reads what it owns.

``state_dict(params, state, step=...)`` is a dict for ``torch.distributed.checkpoint``
(DCP): ``dcp.save(sd, checkpoint_id=path)`` (or ``dcp.async_save``) writes it, every
rank its own part. Its entries, as DCP names them:

* ``params.<path>``: the parameters, whole (the same on every rank: DCP writes each
  once, spreading them over the ranks);
* ``optim.state.<path>.<entry>``: the optimizer's per-parameter entries, each with
  its parameter's shape. A ZeRO rank holds of each only the elements of its pieces:
  ``_chunks.Chunks`` describes them to DCP as rectangles of that tensor, so a
  checkpoint written by N ranks in one sharding mode is read by M ranks in either,
  every rank reading only what its own pieces need;
* ``optim.<entry>``: the optimizer's other entries (its step count);
* ``step``: the ZeRO state's step count;
* ``hook.rank<r>.<i>``: rank ``r``'s hook state (PowerSGD's error feedback and Q),
  leaf ``i`` of its tree, one entry per rank;
* ``fsync``: the description ``load`` compares first (``_describe``).

``load(path, params, step=...)`` reads the description and DCP's metadata, checks
them against the caller's tree and step (the first difference a ``ValueError`` on
every rank, before any tensor is read), then one ``dcp.load`` into fresh tensors
shaped for this world: nothing the caller passed is written to.

Owns: the checkpoint's layout (``state_dict``, ``load``). May import: every layer
below the entry points, ``_zero``, ``fsync.optim``, and this package's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsync import _comm, _tree
from fsync._zero_layout import ZeroLayout
from fsync.checkpoint import _describe
from fsync.checkpoint._chunks import Chunks, range_chunks
from fsync.checkpoint._describe import Description

# Through fsync.ops, which imports the ZeRO step's modules in the order they need.
from fsync.ops import ZeroState, ZeroStep
from fsync.optim._base import Optimizer

Step = ZeroStep | Optimizer

_META = torch.device("meta")


def check_step(step: Any) -> None:
    if not isinstance(step, ZeroStep | Optimizer):
        raise TypeError(
            f"step is a {type(step).__name__}; expected the fsync.ops.ZeroStep the state "
            "belongs to, or the fsync.optim.Optimizer whose state it is."
        )


def _named_params(params: Any) -> tuple[list[str], list[Any], Any]:
    """The paths, leaves and structure of a parameter tree (paths unique)."""
    leaves, treespec = _tree.flatten(params)
    paths = [_tree.path_str(p) for p in treespec.paths()]
    if len(set(paths)) != len(paths):
        seen = next(p for p in paths if paths.count(p) > 1)
        raise ValueError(
            f"two parameters have the path {seen!r}; a checkpoint names each parameter by "
            "its path, so the paths must differ (do not mix a key 'a.b' with a nested 'a': "
            "{'b': ...})."
        )
    for path, x in zip(paths, leaves, strict=True):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"params leaf {path!r} is a {type(x).__name__}; expected a tensor.")
    return paths, leaves, treespec


def _slots(opt_state: Any, is_per_parameter: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """The optimizer state's entries, ``(name, value)``: per-parameter ones whole."""
    slots, spec = _tree.flatten(opt_state, is_leaf=is_per_parameter)
    # Named as code reads them (a NamedTuple's fields by name): ".exp_avg" -> "exp_avg".
    names = [a.codify("").lstrip(".") or "<root>" for a in spec.accessors()]
    return list(zip(names, slots, strict=True))


def _description(
    params: Any, slots: list[tuple[str, Any]], per: Callable[[Any], bool], opt_state: Any, **kw: Any
) -> Description:
    paths, leaves, _ = _named_params(params)
    return Description(
        format=_describe.FORMAT,
        params=tuple(
            _describe.leaf(p, x) for p, x in zip(paths, leaves, strict=True) if x is not None
        ),
        optimizer=type(opt_state).__name__,
        per_parameter=tuple(n for n, s in slots if per(s)),
        shared=tuple(n for n, s in slots if not per(s) and s is not None),
        none=tuple(n for n, s in slots if s is None),
        **kw,
    )


# --- the state dict ------------------------------------------------------------------------


def state_dict(params: Any, state: Any, /, *, step: Step) -> dict[str, Any]:
    """A DCP state dict of the parameters and the optimizer state: each rank's own part.

    Save it with ``torch.distributed.checkpoint.save(sd, checkpoint_id=path)`` (or
    ``async_save``) on every rank; resume with [fsync.checkpoint.load][] at any world
    size and, for a ZeRO step, in either sharding mode. The dict references the
    tensors of ``params`` and ``state`` (no copy): save it before the next step
    replaces them, or let ``dcp.async_save`` stage it.

    Args:
        params: The parameter tree (every rank the same values, as a ZeRO step or
            [fsync.sync_grads][] leaves them).
        state: A [fsync.ops.ZeroState][] of ``step`` (this rank's part), or the
            state of the optimizer ``step`` (an [fsync.optim.AdamState][] or
            [fsync.optim.SGDState][] over ``params``, the same on every rank).
        step: The [fsync.ops.ZeroStep][] the state belongs to, or the
            [fsync.optim.Optimizer][].

    Returns:
        A dict of the entries the module ``fsync.checkpoint`` lists: ``params``,
        ``optim`` (per-parameter entries in the parameters' shapes; a ZeRO rank's
        only its elements), ``step``, ``hook`` (this rank's hook state) and ``fsync``
        (what [fsync.checkpoint.load][] checks first).

    Raises:
        TypeError: ``step`` is neither, or ``state`` is not its state.
        ValueError: ``state`` belongs to another plan, world or rank, or two
            parameters share a path.

    Example:
        >>> import torch, fsync
        >>> opt = fsync.optim.adam(0.1)
        >>> params = {"w": torch.ones(3)}
        >>> params, state = opt.update(params, {"w": torch.ones(3)}, opt.init(params))
        >>> sd = fsync.checkpoint.state_dict(params, state, step=opt)
        >>> sorted(sd["optim"]["state"]["w"]), sd["optim"]["step"]
        (['exp_avg', 'exp_avg_sq'], tensor(1))
    """
    check_step(step)
    if isinstance(step, ZeroStep):
        if not isinstance(state, ZeroState):
            raise TypeError(
                f"state is a {type(state).__name__}; expected the fsync.ops.ZeroState of step."
            )
        return zero_state_dict(params, state, step)
    if isinstance(state, ZeroState):
        raise TypeError(
            "state is a ZeroState but step is an fsync.optim.Optimizer; pass the ZeroStep "
            "the state belongs to as step."
        )
    return optim_state_dict(params, state, step)


def optim_state_dict(params: Any, opt_state: Any, optimizer: Optimizer) -> dict[str, Any]:
    paths, leaves, treespec = _named_params(params)

    def per(x: Any) -> bool:
        return x is not None and _tree.structure(x) == treespec

    slots = _slots(opt_state, per)
    optim: dict[str, Any] = {"state": {}}
    for name, value in slots:
        if per(value):
            for path, x in zip(paths, _tree.flatten(value)[0], strict=True):
                if x is not None:
                    optim["state"].setdefault(path, {})[name] = x
        elif value is not None:
            optim[name] = _tensor(value, f"optimizer state entry {name!r}")
    description = _description(params, slots, per, opt_state, sharding=None, hook=None)
    return {
        "params": _params_entry(paths, leaves),
        "optim": optim,
        _describe.KEY: description.as_entry(),
    }


def _tensor(x: Any, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} is a {type(x).__name__}; a checkpoint holds tensors only.")
    return x


def _params_entry(paths: list[str], leaves: list[Any]) -> dict[str, torch.Tensor]:
    return {p: x.detach() for p, x in zip(paths, leaves, strict=True) if x is not None}


def zero_state_dict(params: Any, state: ZeroState, step: ZeroStep) -> dict[str, Any]:
    layout = step.layout(state)  # raises for a state of another plan, world or rank
    paths, leaves, _ = _named_params(params)
    _check_params(paths, leaves, layout)
    slots = _slots(state.opt, layout.is_pieces)
    dtypes = iter(_bucket_dtypes(layout, step.optimizer))
    optim: dict[str, Any] = {"state": {}}
    for name, value in slots:
        if layout.is_pieces(value):
            for path, chunks in _leaf_chunks(layout, value, next(dtypes)).items():
                optim["state"].setdefault(path, {})[name] = chunks
        elif value is not None:
            optim[name] = _tensor(value, f"optimizer state entry {name!r}")
    description = _description(
        params,
        slots,
        layout.is_pieces,
        state.opt,
        sharding=(layout.world_size, layout.shard_buckets),
        hook=_hook_key(layout, step),
    )
    return {
        "params": _params_entry(paths, leaves),
        "optim": optim,
        "step": state.step,
        "hook": {f"rank{_comm.rank(step.group)}": _hook_entry(state.hook)},
        _describe.KEY: description.as_entry(),
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


def _hook_entry(hook_state: Any) -> dict[str, torch.Tensor]:
    leaves, _ = _tree.flatten(hook_state)
    return {str(i): _tensor(x, "a hook state leaf") for i, x in enumerate(leaves)}


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
    for piece, tensor in zip(layout.pieces, pieces, strict=True):
        spec = plan.specs[piece.bucket]
        for i, offset, size in zip(spec.leaves, spec.offsets, spec.sizes, strict=True):
            start, stop = max(piece.lo, offset), min(piece.hi, offset + size)
            leaf = plan.leaves[i]
            if start < stop and leaf is not None:
                flat = tensor[start - piece.lo : stop - piece.lo]
                rects, views = range_chunks(flat, leaf.shape, leaf.perm, start - offset)
                held[i][0].extend(o for o, _ in rects)
                held[i][1].extend(views)
    out = {}
    for i, (offsets, parts) in held.items():
        leaf = plan.leaves[i]
        assert leaf is not None
        out[leaf.path] = Chunks(parts, offsets, leaf.shape, dtypes[bucket_of[i]], leaf.device)
    return out

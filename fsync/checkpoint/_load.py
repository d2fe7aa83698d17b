"""A checkpoint read back: checked first, then read into fresh states for this world.

``load`` is the inverse of ``_state_dict.state_dict``. Before any tensor is read it
checks, on every rank, that the directory is a complete DCP checkpoint (its
``.metadata``, written last, and every data file it names, long enough), that it was
written by ``fsync.checkpoint.state_dict`` (the ``"fsync"`` entry), and that its
parameters and optimizer are the caller's (``_describe.first_difference``) with the
shapes and dtypes this state needs (DCP's metadata); the ranks then agree (one small
exchange of what each found), so that every rank raises the same ``ValueError``. Only
then does one ``dcp.load`` read, into tensors made here: the states the steps make
for this world (each step's ``init``), whose tensors the load fills in place, and new
parameters; what is each rank's own and was saved for another world or plan is left
out of that read and stays as ``init`` made it. Nothing the caller passed is written to.

Owns: the resume. May import: what ``_state_dict`` may, and it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from fsync import _comm, _tree
from fsync.checkpoint import _describe
from fsync.checkpoint._describe import Description
from fsync.checkpoint._parts import Part, Step, is_composite, parts_of
from fsync.checkpoint._state_dict import compose


def load(
    checkpoint_id: str | os.PathLike[str],
    params: Any,
    /,
    *,
    step: Step,
    storage_reader: Any = None,
) -> tuple[Any, Any]:
    """The parameters and the states of ``step`` from a checkpoint, for this world.

    The checkpoint is what ``dcp.save(fsync.checkpoint.state_dict(...))`` wrote, by
    any number of ranks and, for a ZeRO step, in either sharding mode: each rank
    reads only the elements its own pieces hold. Every rank calls it. What is each
    rank's own is restored where the world size and the bucket plan are those it
    was saved with, and starts afresh otherwise: a hook's state (PowerSGD's error
    feedback and Q, of a ZeRO step, a [fsync.GradSync][] or a DiLoCo) as ``init``
    makes it, since a rank's error feedback is what that rank's compression has not
    yet delivered and has no meaning for another split of the ranks or the buckets;
    with a DiLoCo, whose ranks train apart between syncs, each rank's parameters
    start from the anchor (the last sync's) and its inner optimizer's state as the
    optimizer's ``init`` makes it. The step counts are restored everywhere.

    Args:
        checkpoint_id: The checkpoint's directory (``dcp.save``'s ``checkpoint_id``).
        params: A parameter tree of the checkpoint's structure, shapes, dtypes and
            devices (its values are not read: a freshly built model's will do).
        step: The step the state was saved with: a [fsync.ops.ZeroStep][] (any
            world size, either ``shard_buckets``), an [fsync.optim.Optimizer][], a
            [fsync.GradSync][] or a [fsync.DiLoCo][]; or the tuple of steps given
            to [fsync.checkpoint.state_dict][], in the same order.
        storage_reader: A DCP ``StorageReader`` for storage other than a file
            system (then the file checks are DCP's own).

    Returns:
        ``(params, state)``: new parameters (the checkpoint's values, with the
        layouts and devices of ``params``) and this rank's new state, as ``step``'s
        ``init`` makes it for this world, filled from the checkpoint (a
        [fsync.ops.ZeroState][], an optimizer's state, a [fsync.SyncState][], a
        [fsync.DiLoCoState][]); for a tuple of steps, the tuple of their states.

    Raises:
        FileNotFoundError: ``checkpoint_id`` is no directory (on every rank).
        ValueError: The checkpoint is incomplete (no ``.metadata``, a data file
            missing or short), was not written by ``fsync.checkpoint.state_dict``,
            or holds another model (its first differing parameter named), other
            states than ``step`` makes or another optimizer's state; on every
            rank, before anything is read.
        TypeError: ``step`` is none of these steps.

    Example:
        >>> import tempfile, warnings, torch, fsync
        >>> import torch.distributed.checkpoint as dcp
        >>> opt = fsync.optim.adam(0.1)
        >>> params = {"w": torch.ones(3)}
        >>> params, state = opt.update(params, {"w": torch.ones(3)}, opt.init(params))
        >>> path = tempfile.mkdtemp()
        >>> with warnings.catch_warnings():  # DCP warns that one process saves alone
        ...     warnings.simplefilter("ignore")
        ...     sd = fsync.checkpoint.state_dict(params, state, step=opt)
        ...     _ = dcp.save(sd, checkpoint_id=path)
        >>> loaded, state = fsync.checkpoint.load(path, {"w": torch.zeros(3)}, step=opt)
        >>> loaded["w"], int(state.step)
        (tensor([0.9000, 0.9000, 0.9000]), 1)
    """
    parts = parts_of(step)
    dcp = _comm.checkpointing()
    group = parts[0].step.group if parts[0].kind == "zero" else None
    where = repr(os.fspath(checkpoint_id))
    metadata, reader = _agreed(lambda: _read_metadata(checkpoint_id, storage_reader), group)
    saved = _agreed(lambda: _read_description(checkpoint_id, reader, metadata, where), group)
    fresh_params = _tree.unflatten(
        _tree.structure(params),
        [None if x is None else torch.zeros_like(x) for x in _tree.flatten(params)[0]],
    )
    # The states the steps make for this world (collectives: the ranks' trees agree),
    # whose tensors the load fills in place.
    states = tuple(part.step.init(fresh_params) for part in parts)
    template = compose(fresh_params, parts, states)
    mine = Description.of_entry(template.pop(_describe.KEY), where)
    apart = _without_what_starts_afresh(template, saved, mine)

    def check() -> None:
        problem = _describe.first_difference(saved, mine, where)
        problem = problem or _describe.check_tensors(template, metadata, where)
        if problem:
            raise ValueError(problem)

    _agreed(check, group)
    with _alone_quietly():
        dcp.load(
            template,
            checkpoint_id=checkpoint_id,
            storage_reader=_fresh_reader(reader),
            no_dist=not _comm.initialized(),
        )
    if apart:  # DiLoCo at another world: every rank from the anchor, its optimizer afresh
        fresh_params, states = _from_anchor(parts, states)
    return fresh_params, (states if is_composite(step) else states[0])


def _without_what_starts_afresh(template: dict[str, Any], saved: Any, mine: Any) -> bool:
    """Drops from ``template`` each rank's own entries that the checkpoint holds for another
    world or plan (a hook state, DiLoCo's parameters and optimizer state): those start
    afresh. Whether the local parameters did."""
    if saved.hook is None or saved.hook != mine.hook:
        template.pop("hook", None)  # another world or plan: the hook starts afresh
    if "sync" in template and saved.sync != mine.sync:
        template["sync"].pop("hook")
    if "diloco" in template and saved.diloco != mine.diloco:
        template["diloco"]["sync"].pop("hook")
    if "local" in template and saved.local != mine.local:
        template.pop("local")
        return True
    return False


def _from_anchor(parts: tuple[Part, ...], states: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The parameters (copies of DiLoCo's loaded anchor) and the states, the inner
    optimizer's made afresh for them."""
    anchor = next(s for p, s in zip(parts, states, strict=True) if p.kind == "diloco").anchor
    leaves, treespec = _tree.flatten(anchor)
    params = _tree.unflatten(treespec, [None if x is None else x.clone() for x in leaves])
    fresh = tuple(
        p.step.init(params) if p.kind == "optim" else s for p, s in zip(parts, states, strict=True)
    )
    return params, fresh


def _read_metadata(checkpoint_id: Any, storage_reader: Any) -> tuple[Any, Any]:
    """DCP's metadata of the checkpoint and its reader; raises for an incomplete one."""
    dcp = _comm.checkpointing()
    if storage_reader is None:
        if not os.path.isdir(os.fspath(checkpoint_id)):
            raise FileNotFoundError(_describe.check_directory(checkpoint_id))
        problem = _describe.check_directory(checkpoint_id)
        if problem:
            raise ValueError(problem)
    reader = storage_reader or dcp.FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    if storage_reader is None:
        problem = _describe.check_files(checkpoint_id, metadata)
        if problem:
            raise ValueError(problem)
    return metadata, reader


def _read_description(checkpoint_id: Any, reader: Any, metadata: Any, where: str) -> Description:
    """The checkpoint's ``"fsync"`` entry, read alone (each rank by itself)."""
    dcp = _comm.checkpointing()
    if _describe.KEY not in metadata.state_dict_metadata:
        raise ValueError(
            f"the checkpoint at {where} has no 'fsync' entry: it was not written from "
            "fsync.checkpoint.state_dict. Load it with torch.distributed.checkpoint directly."
        )
    entry: dict[str, Any] = {_describe.KEY: ""}
    with _alone_quietly(always=True):
        dcp.load(
            entry, checkpoint_id=checkpoint_id, storage_reader=_fresh_reader(reader), no_dist=True
        )
    return Description.of_entry(entry[_describe.KEY], where)


@contextlib.contextmanager
def _alone_quietly(*, always: bool = False) -> Iterator[None]:
    """Without DCP's warning that it loads in a single process, where that is meant (no
    process group, or ``always``: the description each rank reads by itself)."""
    with warnings.catch_warnings():
        if always or not _comm.initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fresh_reader(reader: Any) -> Any:
    """``reader`` if the caller gave one, else ``None`` (DCP makes its own from the path)."""
    dcp = _comm.checkpointing()
    return None if type(reader) is dcp.FileSystemReader else reader


def _agreed(find: Any, group: _comm.Group) -> Any:
    """``find()``, its error (``FileNotFoundError``, ``ValueError``) raised on every rank.

    Every rank calls it; each tells the others whether it failed and how, in one small
    exchange, and every rank raises the first failing rank's error, so that a rank
    that cannot see the checkpoint does not leave the others waiting in ``dcp.load``.
    """
    problem: tuple[str, str] | None = None
    try:
        value = find()
    except (FileNotFoundError, ValueError) as error:
        problem, value = (type(error).__name__, str(error)), None
    if _comm.initialized() and _comm.size(group) > 1:
        found = _comm.all_gather_object(problem, group, _comm.default_device(group))
        failed = [(r, p) for r, p in enumerate(found) if p is not None]
        if failed:
            rank, (kind, message) = failed[0]
            if any(p != failed[0][1] for _, p in failed) or len(failed) < len(found):
                message = f"rank {rank}: {message}"
            raise (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(message)
    elif problem is not None:
        raise (FileNotFoundError if problem[0] == "FileNotFoundError" else ValueError)(problem[1])
    return value

"""What a checkpoint holds, in words small enough to compare before a tensor is read.

``fsync.checkpoint.state_dict`` stores beside the tensors one small entry, ``"fsync"``:
a description of the parameter tree (every leaf's path, shape and dtype), which
states it holds (``parts``), the optimizer's state (its type and which of its entries
are per parameter), how the ZeRO state was split (world size, mode), the world and
plan of each hook state, DiLoCo's outer optimizer, and the world whose ranks each
stored their own parameters. ``load`` reads that entry and DCP's own metadata first, and compares
them with what the caller's tree and step would make; the first difference is a
``ValueError`` naming it, on every rank, before anything else is read. This module
also checks that a checkpoint directory is complete (DCP writes its ``.metadata``
last, after every rank's data).

Owns: the description and its comparison. May import: ``_comm``, ``_tree``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fsync import _comm

FORMAT = 1
KEY = "fsync"

Optim = tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]
"""An optimizer state described: its type, per-parameter, shared and ``None`` entries."""


class Leaf(NamedTuple):
    """A parameter as a checkpoint describes it."""

    path: str
    shape: tuple[int, ...]
    dtype: str


class Description(NamedTuple):
    """The ``"fsync"`` entry of a checkpoint: plain Python values only.

    Attributes:
        format: The layout of the state dict (``FORMAT``).
        params: Every tensor leaf of the parameter tree, in flatten order.
        optimizer: The optimizer state's type name (``"AdamState"``), ``None``
            where no optimizer state is stored.
        per_parameter: The optimizer state's entries that are trees like the
            parameters (``"exp_avg"``), stored per parameter.
        shared: Its other entries (``"step"``), stored once; ``None`` entries
            are listed with ``none``.
        none: Its entries that are ``None`` (SGD's momentum without momentum).
        sharding: ``(world size, shard_buckets)`` of a ZeRO state, ``None`` for an
            optimizer state kept whole.
        hook: ``(plan fingerprint, world size)`` the ZeRO hook's state was made
            for, or ``None`` when none is stored.
        parts: The kinds of the states stored, in the order of ``step``:
            ``"zero"``, ``"optim"``, ``"sync"`` (a [fsync.GradSync][]'s),
            ``"diloco"``.
        sync: ``(plan fingerprint, world size)`` of the GradSync's hook state.
        outer: DiLoCo's outer optimizer state, described as ``Optim``.
        diloco: ``(plan fingerprint, world size)`` of DiLoCo's hook state.
        local: The world size whose ranks each stored their own parameters and
            optimizer state (with DiLoCo, whose ranks train apart), else ``None``.
    """

    format: int
    params: tuple[Leaf, ...]
    optimizer: str
    per_parameter: tuple[str, ...]
    shared: tuple[str, ...]
    none: tuple[str, ...]
    sharding: tuple[int, bool] | None
    hook: tuple[int, int] | None
    parts: tuple[str, ...] = ()
    sync: tuple[int, int] | None = None
    outer: Optim | None = None
    diloco: tuple[int, int] | None = None
    local: int | None = None

    def as_entry(self) -> str:
        """The value stored under ``"fsync"``: JSON, one string (a dict would be flattened
        into one entry per key by DCP), readable without fsync."""
        entry = self._asdict()
        entry["params"] = [list(leaf) for leaf in self.params]
        return json.dumps(entry)

    @classmethod
    def of_entry(cls, text: Any, where: str) -> Description:
        """The description stored as ``text``, or a ``ValueError`` saying it is none."""
        try:
            entry = json.loads(text)
        except (TypeError, ValueError):
            entry = None
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            got = entry.get("format") if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(
                f"the checkpoint at {where} has an 'fsync' entry of format {got!r}; expected "
                f"format {FORMAT}, as fsync.checkpoint.state_dict writes it. Load it with the "
                "fsync version that wrote it."
            )
        values = dict(entry)
        values["params"] = tuple(Leaf(p, tuple(s), d) for p, s, d in entry["params"])
        for name in ("per_parameter", "shared", "none", "parts"):
            values[name] = tuple(entry.get(name, ()))
        for name in ("sharding", "hook", "sync", "diloco"):
            values[name] = None if entry.get(name) is None else tuple(entry[name])
        outer = entry.get("outer")
        values["outer"] = None if outer is None else (outer[0], *map(tuple, outer[1:]))
        return cls(**values)


def leaf(path: str, tensor: torch.Tensor) -> Leaf:
    return Leaf(path, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def first_difference(saved: Description, mine: Description, where: str) -> str | None:
    """Words for the first way the checkpoint (``saved``) differs from what this tree and step
    would load (``mine``), in the order a reader cares: the model, then the optimizer."""
    fix = (
        "Load a checkpoint of this model and optimizer, or build the parameters and step "
        "the checkpoint was written with."
    )
    saved_paths = {p.path: p for p in saved.params}
    for have in mine.params:
        want = saved_paths.get(have.path)
        if want is None:
            return (
                f"the checkpoint at {where} holds no parameter {have.path!r} (it holds "
                f"{len(saved.params)} parameters, the first {_names(saved.params)}); it was "
                f"written for another model. {fix}"
            )
        if want != have:
            return (
                f"the checkpoint at {where} holds parameter {have.path!r} with shape "
                f"{want.shape} and dtype {want.dtype}; this tree's has shape {have.shape} and "
                f"dtype {have.dtype}. {fix}"
            )
    extra = [p.path for p in saved.params if p.path not in {h.path for h in mine.params}]
    if extra:
        return (
            f"the checkpoint at {where} holds parameter {extra[0]!r}, which this tree lacks "
            f"({len(extra)} of its {len(saved.params)} parameters are not here). {fix}"
        )
    if saved.parts != mine.parts:
        return (
            f"the checkpoint at {where} holds the states {list(saved.parts)}, in that order; "
            f"step makes {list(mine.parts)}. Pass as step the steps the checkpoint was saved "
            "with (a tuple, such as (opt, sync), for several states)."
        )
    theirs = (saved.optimizer, saved.per_parameter, saved.shared, saved.none)
    ours = (mine.optimizer, mine.per_parameter, mine.shared, mine.none)
    return _other_optimizer(where, "", theirs, ours) or (
        None
        if saved.outer is None or mine.outer is None
        else _other_optimizer(where, "DiLoCo's outer ", saved.outer, mine.outer)
    )


def _other_optimizer(where: str, which: str, saved: Any, mine: Any) -> str | None:
    if tuple(saved) == tuple(mine):
        return None
    return (
        f"the checkpoint at {where} holds the state of another {which}optimizer: a "
        f"{saved[0]} with per-parameter entries {list(saved[1])} and shared entries "
        f"{list(saved[2])}; this step's {which}optimizer makes a {mine[0]} with "
        f"{list(mine[1])} and {list(mine[2])}. Build the {which}optimizer the checkpoint "
        "was written with."
    )


def _names(leaves: Sequence[Leaf]) -> str:
    shown = ", ".join(repr(p.path) for p in leaves[:3])
    return shown + (", ..." if len(leaves) > 3 else "")


def check_directory(path: str | os.PathLike[str]) -> str | None:
    """Words for what keeps ``path`` from being a complete DCP checkpoint, or ``None``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return (
            f"no checkpoint at {path!r}: it is not a directory. Pass the checkpoint_id that "
            "dcp.save wrote to."
        )
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return (
            f"the checkpoint at {path!r} is incomplete: it has no .metadata, which "
            "torch.distributed.checkpoint writes last, once every rank's data is written (a "
            "save that was interrupted, or still running). Resume from an earlier checkpoint."
        )
    return None


def check_files(path: str | os.PathLike[str], metadata: Any) -> str | None:
    """Words for a data file that ``metadata`` names and that is missing or short."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    for name, end in sorted(sizes.items()):
        file = os.path.join(os.fspath(path), name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < end:
            state = "is missing" if have is None else f"has {have} bytes of the {end} it needs"
            return (
                f"the checkpoint at {os.fspath(path)!r} is incomplete: its data file {name!r} "
                f"{state}. Resume from an earlier checkpoint."
            )
    return None


def check_tensors(template: dict[str, Any], metadata: Any, where: str) -> str | None:
    """Words for the first tensor of ``template`` (flattened as DCP flattens it) that the
    checkpoint's metadata lacks or holds with another shape or dtype."""
    dcp = _comm.checkpointing()
    flat, _ = dcp._nested_dict.flatten_state_dict(template)
    stored = metadata.state_dict_metadata
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        md = stored.get(key)
        if not isinstance(md, dcp.metadata.TensorStorageMetadata):
            return (
                f"the checkpoint at {where} holds no tensor {key!r}: it was not written for "
                "this state."
            )
        if tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
            return (
                f"the checkpoint at {where} holds {key!r} with shape {tuple(md.size)} and dtype "
                f"{md.properties.dtype}; expected shape {tuple(value.shape)} and dtype "
                f"{value.dtype}."
            )
    return None

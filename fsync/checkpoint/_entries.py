"""A tree and an optimizer state as DCP entries: by parameter path, tensors only.

What every part of a checkpoint shares (``_state_dict``'s ZeRO and optimizer parts,
``_sync_states``' GradSync and DiLoCo parts): a parameter tree's paths and leaves,
checked (``Named``); the optimizer state's entries, the per-parameter ones stored per
parameter path (``optim_entries``) and described for ``_describe``; a hook state as
one entry per leaf; and which process of the checkpoint's world this is.

Owns: the naming of entries. May import: ``_comm``, ``_tree`` and ``_describe``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fsync import _checks, _comm, _tree
from fsync.checkpoint._describe import Optim


class Named(NamedTuple):
    """A parameter tree's paths (unique), leaves and structure."""

    paths: list[str]
    leaves: list[Any]
    treespec: Any


def named(params: Any) -> Named:
    """The paths, leaves and structure of a parameter tree, checked."""
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
    return Named(paths, leaves, treespec)


def check_like(tree: Named, like: Any, what: str) -> None:
    """Raises unless ``like`` (a state's tree, values or meta tensors) has the structure,
    shapes and dtypes of the parameter tree."""
    leaves, treespec = _tree.flatten(like)
    if treespec != tree.treespec:
        raise ValueError(
            f"params has structure {tree.treespec} but {what} was made for {treespec}; pass "
            "the parameter tree the state was made for."
        )
    for path, x, y in zip(tree.paths, tree.leaves, leaves, strict=True):
        differ = _checks.leaf_difference(x, y)
        if differ is not None:
            got, want = differ
            raise ValueError(
                f"params leaf {path!r} is {got}; {what} was made for {want}. Pass the parameter "
                "tree the state was made for."
            )


def tensor(x: Any, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} is a {type(x).__name__}; a checkpoint holds tensors only.")
    return x


def params_entry(tree: Named, leaves: list[Any] | None = None) -> dict[str, torch.Tensor]:
    """The tree's tensors (or ``leaves``, of the same paths) by path."""
    leaves = tree.leaves if leaves is None else leaves
    return {p: x.detach() for p, x in zip(tree.paths, leaves, strict=True) if x is not None}


def hook_entry(hook_state: Any) -> dict[str, torch.Tensor]:
    """A hook state's leaves, entry ``str(i)`` for leaf ``i``."""
    leaves, _ = _tree.flatten(hook_state)
    return {str(i): tensor(x, "a hook state leaf") for i, x in enumerate(leaves)}


def slots(opt_state: Any, is_per_parameter: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """The optimizer state's entries, ``(name, value)``: per-parameter ones whole."""
    found, spec = _tree.flatten(opt_state, is_leaf=is_per_parameter)
    # Named as code reads them (a NamedTuple's fields by name): ".exp_avg" -> "exp_avg".
    names = [a.codify("").lstrip(".") or "<root>" for a in spec.accessors()]
    return list(zip(names, found, strict=True))


def described(opt_state: Any, found: list[tuple[str, Any]], per: Callable[[Any], bool]) -> Optim:
    """The optimizer state as ``_describe`` compares it."""
    return (
        type(opt_state).__name__,
        tuple(n for n, s in found if per(s)),
        tuple(n for n, s in found if not per(s) and s is not None),
        tuple(n for n, s in found if s is None),
    )


def optim_entries(tree: Named, opt_state: Any) -> tuple[dict[str, Any], Optim]:
    """An optimizer state over ``tree`` (kept whole): ``{"state": {path: {entry: tensor}},
    entry: tensor}``, and its description."""

    def per(x: Any) -> bool:
        return x is not None and _tree.structure(x) == tree.treespec

    found = slots(opt_state, per)
    optim: dict[str, Any] = {"state": {}}
    for name, value in found:
        if per(value):
            for path, x in zip(tree.paths, _tree.flatten(value)[0], strict=True):
                if x is not None:
                    optim["state"].setdefault(path, {})[name] = x
        elif value is not None:
            optim[name] = tensor(value, f"optimizer state entry {name!r}")
    return optim, described(opt_state, found, per)


def process() -> tuple[int, int]:
    """This process's rank and the number of processes (the default group's: those that
    write the checkpoint together), ``(0, 1)`` without a process group."""
    if not _comm.initialized():
        return 0, 1
    return _comm.rank(None), _comm.size(None)

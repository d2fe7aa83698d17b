"""How fsync flattens pytrees.

Every function in fsync flattens trees the same way, so that a plan built from
the parameters fits the gradients:

* dict keys keep their insertion order (the order ``named_parameters()`` yields),
  not optree's default sorted order. This is a per-namespace optree setting,
  switched on once for fsync's own namespace; unlike the
  ``optree.dict_insertion_ordered`` context manager inside a function, a
  namespace flag is something dynamo can trace through.
* ``None`` is a leaf, so a gradient tree with unused (``None``) entries has the
  same structure as the parameter tree it came from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch.torch_version import TorchVersion

NAMESPACE = "fsync"

# Entered once and never left: the setting belongs to fsync's own namespace, so it
# changes nothing for other users of optree. The context manager is kept alive in
# this module, since collecting it would run its exit and restore sorted order.
_INSERTION_ORDERED = optree.dict_insertion_ordered(True, namespace=NAMESPACE)
_INSERTION_ORDERED.__enter__()


def compile_problem(
    torch_version: str = torch.__version__, optree_version: str = optree.__version__
) -> str | None:
    """Why ``torch.compile`` cannot trace ``flatten`` with these versions, else ``None``.

    optree 0.20 looks a type up in a namespace whose dicts keep insertion order (fsync's)
    through ``sys.version_info >= (3, 15)``, a comparison torch 2.11's dynamo cannot trace
    (``'<' not supported between instances of 'tuple' and 'version_info'``): every compiled
    flatten fails. Seen on torch 2.11.0+cu130 with optree 0.20.0; optree 0.14 to 0.19 have no
    such lookup, and torch 2.13's dynamo traces it. torch 2.12 was not checked, so it is
    refused too. The dependency ``optree>=0.13,!=0.20.0`` keeps a fresh install clear of it.
    """
    if TorchVersion(torch_version) >= "2.13" or TorchVersion(optree_version) < "0.20":
        return None
    return (
        f"fsync under torch.compile needs optree < 0.20 with torch < 2.13; got torch "
        f"{torch_version} and optree {optree_version}, whose registry lookup this torch's "
        f"dynamo cannot trace. Install optree 0.19 (pip install 'optree>=0.13,<0.20') or "
        f"torch >= 2.13."
    )


def flatten(
    tree: Any, /, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flattens ``tree`` into leaves (``None`` included) and its structure.

    ``is_leaf`` stops the flattening at the subtrees it returns ``True`` for.
    """
    return optree.tree_flatten(tree, is_leaf, none_is_leaf=True, namespace=NAMESPACE)


class Alike(NamedTuple):
    """Trees of one plain container of leaves, read directly (``alike`` makes them)."""

    leaves: list[list[Any]]  # per tree
    rebuild: Callable[[Sequence[Any]], Any]  # leaves -> a tree like these: what unflatten gives
    keys: tuple[Any, ...] | None  # the dicts' keys; None for the sequences

    def path(self, i: int, /) -> str:
        """Leaf ``i``'s path, as ``path_str`` writes it."""
        return str(i if self.keys is None else self.keys[i])


def alike(trees: Sequence[Any], /) -> Alike | None:
    """The leaves of ``trees`` where every one is the same plain container of leaves, else
    ``None`` (flatten them).

    Plain: dicts with the same keys in the same order, or lists, tuples or namedtuples of
    one type and length (``_plain_node``), whose values are tensors or ``None``; their
    leaves are what ``flatten`` gives, in its order. ``dict(model.named_parameters())`` is
    the tree most code syncs, and an optimizer's update reads its parameters, gradients and
    state this way (the ZeRO step's are one-tensor lists): under ``torch.compile``, dynamo
    traces ``flatten`` through its optree polyfill, which makes a ``PyTreeSpec`` object per
    node, milliseconds each to trace, where reading a container directly costs a fraction
    of that.
    """
    first = trees[0]
    node = _plain_node(first)
    if node is None:
        return None
    keys = tuple(first) if type(first) is dict else None
    if not all(
        type(tree) is type(first)
        and len(tree) == len(first)
        and (keys is None or tuple(tree) == keys)
        for tree in trees
    ):
        return None
    leaves = [node[0], *(_children(tree) for tree in trees[1:])]
    if all(leaf is None or isinstance(leaf, torch.Tensor) for tree in leaves for leaf in tree):
        return Alike(leaves, node[1], keys)
    return None


def leaves_and_rebuild(
    tree: Any, /, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """``flatten(tree, is_leaf=is_leaf)``'s leaves and a function that makes a tree of its
    structure from leaves.

    A dict, list, tuple or namedtuple whose children are all leaves (tensors, ``None``, or
    what ``is_leaf`` says is one) is read directly, as ``alike`` reads its trees; anything
    else is flattened. The ZeRO step reads its optimizer state this way once per piece (a
    NamedTuple of a step count and per-piece lists).
    """
    node = None if is_leaf is not None and is_leaf(tree) else _plain_node(tree)
    if node is not None:
        children, rebuild = node
        if all(
            child is None
            or isinstance(child, torch.Tensor)
            or (is_leaf is not None and is_leaf(child))
            for child in children
        ):
            return children, rebuild
    leaves, spec = flatten(tree, is_leaf=is_leaf)
    return leaves, functools.partial(unflatten, spec)


def _plain_node(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]] | None:
    """``tree``'s children and how to build it again, for a dict, list, tuple or namedtuple
    that optree flattens as its builtin kind in fsync's namespace; else ``None``."""
    kind = type(tree)
    if kind is dict:
        keys = tuple(tree)
        return _children(tree), lambda children: dict(zip(keys, children, strict=True))
    if kind is list or kind is tuple:
        return _children(tree), kind
    if isinstance(tree, tuple) and _builtin_namedtuple(kind):
        return _children(tree), lambda children: kind(*children)
    return None


def _children(node: Any) -> list[Any]:
    """A plain node's children (a dict's values)."""
    return list(node.values()) if type(node) is dict else list(node)


def _builtin_namedtuple(kind: type) -> bool:
    """Whether optree flattens ``kind`` as a namedtuple in fsync's namespace: one can register
    a namedtuple class of one's own as a custom node (optree warns and allows it)."""
    registry = getattr(optree.register_pytree_node, "get", None)  # not in every optree
    if registry is None or not hasattr(kind, "_fields"):
        return False
    entry = registry(kind, namespace=NAMESPACE)
    return entry is not None and entry.kind == optree.PyTreeKind.NAMEDTUPLE


def structure(tree: Any, /) -> optree.PyTreeSpec:
    """The structure ``flatten`` would give ``tree``."""
    return optree.tree_structure(tree, none_is_leaf=True, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, leaves: Any, /) -> Any:
    """Inverse of ``flatten``."""
    return optree.tree_unflatten(spec, leaves)


def path_str(path: tuple[Any, ...], /) -> str:
    """``('layer', 0, 'weight')`` -> ``'layer.0.weight'``; the root leaf is ``'<root>'``."""
    return ".".join(str(key) for key in path) if path else "<root>"

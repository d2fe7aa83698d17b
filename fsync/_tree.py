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

from collections.abc import Callable
from typing import Any

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


def flat_dict(tree: Any, /) -> tuple[tuple[Any, ...], list[Any]] | None:
    """``(keys, values)`` of a plain dict of tensors and ``None``, else ``None``.

    ``dict(model.named_parameters())`` is the tree most code syncs. Under
    ``torch.compile`` reading it directly costs a fraction of tracing optree's
    generic flatten (about 25 ms per leaf on our CPU machines), and gives the
    same leaves in the same (insertion) order.
    """
    if type(tree) is not dict:
        return None
    values = list(tree.values())
    if all(value is None or isinstance(value, torch.Tensor) for value in values):
        return tuple(tree), values
    return None


def structure(tree: Any, /) -> optree.PyTreeSpec:
    """The structure ``flatten`` would give ``tree``."""
    return optree.tree_structure(tree, none_is_leaf=True, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, leaves: Any, /) -> Any:
    """Inverse of ``flatten``."""
    return optree.tree_unflatten(spec, leaves)


def path_str(path: tuple[Any, ...], /) -> str:
    """``('layer', 0, 'weight')`` -> ``'layer.0.weight'``; the root leaf is ``'<root>'``."""
    return ".".join(str(key) for key in path) if path else "<root>"

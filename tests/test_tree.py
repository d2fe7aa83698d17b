"""fsync._tree: what reading a plain container directly gives, against optree's flatten."""

from __future__ import annotations

import collections

import optree
import pytest
import torch

from fsync import _tree

_Pair = collections.namedtuple("_Pair", "a b")
_A, _B = torch.ones(2), torch.zeros(3)

PLAIN = {
    "dict": {"w": _A, "none": None, "b": _B},
    "dict in insertion order": {"z": _A, "a": _B},
    "empty dict": {},
    "list": [_A, None, _B],
    "tuple": (_B,),
    "a namedtuple": _Pair(_A, None),
}
NOT_PLAIN = {
    "nested dict": {"layer": {"w": _A}},
    "a float leaf": {"w": _A, "lr": 0.1},
    "an OrderedDict": collections.OrderedDict(w=_A),
    "a namedtuple holding a list": _Pair(_A, [_B]),
    "a tensor": _A,
}
_Custom = collections.namedtuple("_Custom", "a b")


def _same_tree(x, y):
    """Same types, keys in the same order and the very same leaves."""
    if isinstance(x, dict):
        return type(x) is type(y) and list(x) == list(y) and all(x[k] is y[k] for k in x)
    return (
        type(x) is type(y) and len(x) == len(y) and all(a is b for a, b in zip(x, y, strict=True))
    )


@pytest.mark.parametrize("name", list(PLAIN))
def test_a_plain_container_reads_as_flatten_gives(name):
    tree = PLAIN[name]
    leaves, spec = _tree.flatten(tree)
    same = _tree.alike([tree, tree])
    assert same is not None
    for got in same.leaves:
        assert all(a is b for a, b in zip(got, leaves, strict=True))
    assert _same_tree(same.rebuild(leaves), _tree.unflatten(spec, leaves))
    assert [same.path(i) for i in range(len(leaves))] == [_tree.path_str(p) for p in spec.paths()]
    read, rebuild = _tree.leaves_and_rebuild(tree)
    assert all(a is b for a, b in zip(read, leaves, strict=True))
    assert _same_tree(rebuild(leaves), tree)


@pytest.mark.parametrize("name", list(NOT_PLAIN))
def test_any_other_tree_is_flattened(name):
    tree = NOT_PLAIN[name]
    assert _tree.alike([tree]) is None
    leaves, spec = _tree.flatten(tree)
    read, rebuild = _tree.leaves_and_rebuild(tree)
    assert all(a is b for a, b in zip(read, leaves, strict=True))
    assert _tree.structure(rebuild(leaves)) == spec


@pytest.mark.parametrize(
    "trees",
    [
        [{"a": _A, "b": _B}, {"b": _B, "a": _A}],  # the same keys in another order
        [{"a": _A}, {"a": _A, "b": _B}],
        [[_A], [_A, _B]],
        [[_A], (_A,)],
        [{"a": _A}, [_A]],
        [(_A, _B), _Pair(_A, _B)],  # a tuple and a namedtuple
        [[_A], [{"x": _A}]],  # a container inside the second
    ],
)
def test_trees_of_other_structures_are_not_alike(trees):
    assert _tree.alike(trees) is None


def _pieces(x):
    return type(x) is list and len(x) == 2


@pytest.mark.parametrize(
    "tree",
    [
        _Pair(_A, [_A, _B]),  # a namedtuple of a leaf and a list is_leaf says is one
        {"n": None, "p": [_B, _A]},
        (_Pair(_A, None),),  # a namedtuple inside: flattened
        [_A, [_B]],  # a list is_leaf does not take: flattened
    ],
)
def test_leaves_and_rebuild_with_is_leaf_gives_what_flatten_gives(tree):
    leaves, spec = _tree.flatten(tree, is_leaf=_pieces)
    read, rebuild = _tree.leaves_and_rebuild(tree, is_leaf=_pieces)
    assert len(read) == len(leaves) and all(a is b for a, b in zip(read, leaves, strict=True))
    again = rebuild(leaves)
    assert type(again) is type(tree)
    assert _tree.flatten(again, is_leaf=_pieces)[1] == spec


def test_a_namedtuple_registered_as_a_node_of_its_own_is_flattened_as_registered():
    """optree lets one register a namedtuple class as a custom node in fsync's namespace;
    then its flatten is the registered one, and so is what leaves_and_rebuild gives."""
    with pytest.warns(UserWarning, match="namedtuple"):
        optree.register_pytree_node(
            _Custom,
            lambda c: ((c.b,), c.a, None),  # only b is a child; a goes in the metadata
            lambda a, children: _Custom(a, *children),
            namespace=_tree.NAMESPACE,
        )
    try:
        tree = _Custom(_A, _B)
        assert _tree.alike([tree]) is None
        read, rebuild = _tree.leaves_and_rebuild(tree)
        assert len(read) == 1 and read[0] is _B
        assert rebuild([_A]).a is _A and rebuild([_A]).b is _A
    finally:
        optree.unregister_pytree_node(_Custom, namespace=_tree.NAMESPACE)

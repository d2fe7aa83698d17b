"""Leaf metadata (``fsync._metas``): what the memo hands back is what reading the leaves
gives, whatever changed about them since, and leaves seen before are not read again."""

from __future__ import annotations

import pytest
import torch

import fsync
from fsync import _metas


def _leaves():
    return [torch.zeros(3, 4), torch.zeros(5), torch.nn.Parameter(torch.zeros(2, 2))]


def _changed(what: str) -> list:
    """The leaves of ``_leaves`` with one thing about the first one changed."""
    leaves = _leaves()
    first = {
        "shape": torch.zeros(4, 3),
        "numel": torch.zeros(3, 5),
        "stride": torch.zeros(4, 3).t(),
        "dtype": torch.zeros(3, 4, dtype=torch.float64),
        "device": torch.zeros(3, 4, device="meta"),
        "requires_grad": torch.zeros(3, 4, requires_grad=True),
        "a parameter": torch.nn.Parameter(torch.zeros(3, 4)),
        "None": None,
        "sparse": torch.zeros(3, 4).to_sparse(),
        "conjugate": torch.zeros(3, 4, dtype=torch.complex64).conj(),
    }[what]
    leaves[0] = first
    return leaves


CHANGES = [
    "shape",
    "numel",
    "stride",
    "dtype",
    "device",
    "requires_grad",
    "a parameter",
    "None",
    "sparse",
    "conjugate",
]


@pytest.mark.parametrize("what", CHANGES)
def test_the_memo_gives_what_reading_gives_after_any_change(what):
    structure = ("test", what)
    _metas._seen.cache_clear()
    for leaves in (_leaves(), _changed(what), _leaves(), _changed(what), _changed(what)):
        assert _metas.of(structure, leaves) == _metas.read(leaves), what


def test_a_tensor_changed_in_place_is_read_again():
    structure = ("test", "in place")
    leaves = _leaves()
    assert _metas.of(structure, leaves) == _metas.read(leaves)
    leaves[1].resize_(6)  # the same tensor, another shape
    assert _metas.of(structure, leaves)[1][0] == (6,)
    leaves[2].requires_grad_(False)
    assert _metas.of(structure, leaves)[2][6] is False


def test_leaves_seen_before_are_not_read_again(monkeypatch):
    structure = ("test", "counted")
    _metas._seen.cache_clear()
    read = _metas.read
    calls = []
    monkeypatch.setattr(_metas, "read", lambda leaves: calls.append(1) or read(leaves))
    grads, params = _leaves(), [torch.zeros(3, 4, requires_grad=True), *_leaves()[1:]]
    for _ in range(3):  # two sets of leaves in turns: both kept
        assert _metas.of(structure, grads) == read(grads)
        assert _metas.of(structure, params) == read(params)
    assert len(calls) == 2
    with_none = [None, *grads[1:]]
    for _ in range(2):  # a None leaf: read every call
        assert _metas.of(structure, with_none) == read(with_none)
    assert len(calls) == 4


def test_a_plan_follows_a_parameter_resized_in_place():
    tree = {"w": torch.zeros(8), "b": torch.zeros(2)}
    assert fsync.plan_buckets(tree).leaves[0].shape == (8,)
    tree["w"].resize_(3, 3)
    assert fsync.plan_buckets(tree).leaves[0].shape == (3, 3)


def test_under_transforms_and_inference_mode_the_memo_gives_what_reading_gives():
    structure = ("test", "transforms")

    def metas_agree(x):
        leaves = [x, torch.zeros(2)]
        first, again = _metas.of(structure, leaves), _metas.of(structure, leaves)
        return torch.tensor(first == again == _metas.read(leaves))

    assert torch.func.vmap(metas_agree)(torch.zeros(4, 3)).all()
    assert metas_agree(torch.zeros(3))
    with torch.inference_mode():
        assert metas_agree(torch.zeros(3))

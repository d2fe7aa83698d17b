"""verify: the same tree (and values) on every rank, or one ValueError on all of them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsync
from tests._world import World


def _on_rank_verify():
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    tree = {"a": torch.arange(6.0).view(2, 3), "b": [torch.ones(2, dtype=torch.int64), None]}
    fsync.verify(tree, values=True)  # all equal: nothing raised
    nan = {"x": torch.tensor([float("nan"), 1.0])}
    fsync.verify(nan, values=True)  # NaN equals NaN bitwise

    changed = {"a": tree["a"].clone(), "b": tree["b"]}
    if rank == last:
        changed["a"][1, 2] = -1.0
    fsync.verify(changed)  # same shapes: only values differ
    with pytest.raises(
        ValueError,
        match=rf"values differ across ranks: leaf 'a' at index \(1, 2\) is 5\.0 on rank 0 "
        rf"but -1\.0 on rank {last}\. Start every rank from the same values",
    ):
        fsync.verify(changed, values=True)

    shaped = {"a": torch.zeros(2, 3 + (rank == last))}
    with pytest.raises(
        ValueError,
        match=rf"trees passed to fsync\.verify differ across ranks: leaf 'a' has shape \(2, 3\).*"
        rf"on rank 0 but shape \(2, 4\).* on rank {last}",
    ):
        fsync.verify(shaped)
    layout = torch.zeros(2, 3, 4, 4)
    if rank == last:
        layout = layout.to(memory_format=torch.channels_last)
    with pytest.raises(
        ValueError, match=rf"contiguous on rank 0 but .*channels_last on rank {last}"
    ):
        fsync.verify({"conv": layout})


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_verify(world: World):
    world.run(_on_rank_verify)


def test_verify_single_rank(single_rank):
    fsync.verify({"w": torch.ones(2)}, values=True)
    with pytest.raises(TypeError, match=r"verify leaf 'w' is a str"):
        fsync.verify({"w": "weights"})

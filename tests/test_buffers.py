"""Kept bucket memory (``fsync._buffers``): an eager call packs into memory a plan keeps,
reused only once nothing of what it last held is alive, with the bits of a fresh buffer.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsync
from fsync import _buffers, _pack
from tests._world import World

# Buckets of 0.25 MiB: a leaf each, every one over the 256 KiB worth keeping.
CAP = {"bucket_cap_mb": 0.25, "first_bucket_mb": 0.25}


def _tree(seed: int):
    """Leaves of every layout a bucket packs, each bucket over ``_buffers.SMALLEST``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "conv": torch.randn(128, 64, 3, 3, generator=g).to(memory_format=torch.channels_last),
        "t": torch.randn(300, 400, generator=g).t(),
        "w": torch.randn(70_000, generator=g),
        "bf16": torch.randn(200_000, generator=g).to(torch.bfloat16),
        "none": None,
    }


def _storages(buffers):
    return [b.untyped_storage().data_ptr() for b in buffers]


def _assert_equal(tree, expected):
    for name, leaf in expected.items():
        if leaf is None:
            assert tree[name] is None, name
        else:
            assert tree[name].stride() == leaf.stride() and torch.equal(tree[name], leaf), name


def test_a_kept_buffer_is_packed_again_only_once_nothing_of_it_is_alive():
    _buffers.kept.cache_clear()
    trees = [_tree(seed) for seed in range(5)]
    plan = fsync.plan_buckets(trees[0], **CAP)
    assert len(plan.specs) >= 3
    sizes = [spec.numel * spec.dtype.itemsize for spec in plan.specs]
    assert min(sizes) >= _buffers.SMALLEST, sizes

    def synced(tree):
        return fsync.unpack(fsync.pack(tree, plan), plan)

    first = synced(trees[0])
    kept_first = _storages(fsync.pack(trees[0], plan))  # second kept buffers: first is alive
    second = synced(trees[1])  # the second kept buffers again: the pack above is gone
    assert set(_storages(fsync.pack(trees[1], plan))).isdisjoint(kept_first)  # all in use
    third = synced(trees[2])  # every kept buffer in use: new memory, not kept
    _assert_equal(first, trees[0])  # nothing packed since wrote into what a result holds
    _assert_equal(second, trees[1])
    view = first["w"][10:20]  # a view keeps its bucket in use
    del first, second
    fourth = fsync.pack(trees[3], plan)
    leaves, _ = fsync._tree.flatten(trees[0])
    w = next(i for i, leaf in enumerate(leaves) if leaf is trees[0]["w"])  # in flatten order
    w_bucket = next(k for k, spec in enumerate(plan.specs) if w in spec.leaves)
    assert torch.equal(view, trees[0]["w"][10:20])
    assert _storages(fourth)[w_bucket] in kept_first  # the second's, free again
    del view, fourth
    fifth = synced(trees[4])
    _assert_equal(fifth, trees[4])
    _assert_equal(third, trees[2])


def test_kept_buffers_hold_the_bits_of_new_ones():
    """The pack into kept memory (one batched copy into views of it) against the pack into
    a new buffer, for every bucket of the tree and a tree with a None where the plan has
    a tensor (zeros, over whatever the memory held)."""
    _buffers.kept.cache_clear()
    tree = _tree(0)
    plan = fsync.plan_buckets(tree, **CAP)
    leaves, _ = fsync._tree.flatten(tree)
    holes = dict(tree, w=None)
    hole_leaves, _ = fsync._tree.flatten(holes)
    for step in range(3):  # new memory, then kept memory written before
        for source in (leaves, hole_leaves):
            for k, spec in enumerate(plan.specs):
                grads = [source[i] for i in spec.leaves]
                into = _buffers.kept(plan).buffer(k, spec)
                packed = _pack.pack_grads(grads, spec, into=into)
                assert packed is into, step
                assert torch.equal(packed, _pack.pack_grads(grads, spec)), (step, k)


def test_small_buckets_are_not_kept():
    """Under 256 KiB a bucket's buffer is new at every call (glibc's free lists reuse it)."""
    _buffers.kept.cache_clear()
    plan = fsync.plan_buckets({"w": torch.ones(100)})
    (spec,) = plan.specs
    a = _buffers.kept(plan).buffer(0, spec)
    b = _buffers.kept(plan).buffer(0, spec)
    assert (
        a.numel() == spec.numel and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    )


def _on_rank_steps_keep_their_gradients():
    """``fsync.grad_and_value`` in a loop that keeps every step's gradients: each step's
    equal the exact mean of the two ranks' ``torch.func`` gradients (``a + b`` rounds once,
    and halving is exact), still after the later steps packed into kept memory."""
    rank = dist.get_rank()
    params = {k: v for k, v in _tree(0).items() if v is not None and v.dtype == torch.float32}

    def loss(p, x):
        return sum((leaf.reshape(-1)[:1000] * x).square().sum() for leaf in p.values())

    call = fsync.grad_and_value(loss, **CAP)
    kept, expected = [], []
    for step in range(4):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(10 * step + rank))
        grads, _ = call(params, x)
        local = torch.func.grad(loss)(params, x)
        mean = {}
        for name, g in local.items():
            total = g.clone()
            dist.all_reduce(total)
            mean[name] = total / 2
        kept.append(grads)
        expected.append(mean)
        for earlier, want in zip(kept, expected, strict=True):
            assert all(torch.equal(earlier[k], want[k]) for k in want), step
    return True


@pytest.mark.parametrize("world", [2], indirect=True)
def test_gradients_kept_across_steps_stay_theirs(world: World):
    assert all(world.run(_on_rank_steps_keep_their_gradients))

"""Bucket assignment and plans, checked against DDP's own functions and buckets."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsync
from tests._world import World

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8]


@st.composite
def tensors_and_limits(draw, sparse: bool = False):
    n = draw(st.integers(1, 24))
    tensors = [
        torch.empty(draw(st.integers(0, 600)), dtype=draw(st.sampled_from(DTYPES)))
        for _ in range(n)
    ]
    limits = draw(st.lists(st.integers(0, 3000), min_size=1, max_size=4))
    expect_sparse = draw(st.lists(st.booleans(), min_size=n, max_size=n)) if sparse else [False] * n
    return tensors, limits, expect_sparse


@settings(max_examples=300, deadline=None)
@given(tensors_and_limits())
def test_assignment_equals_ddp(case):
    tensors, limits, _ = case
    expected = dist._compute_bucket_assignment_by_size(tensors, limits)[0]
    assert fsync.compute_bucket_assignment_by_size(tensors, limits) == expected


@settings(max_examples=150, deadline=None)
@given(tensors_and_limits(sparse=True))
def test_sparse_tensors_get_their_own_bucket_as_in_ddp(case):
    # DDP takes sparse-ness as a flag beside dense stand-ins; fsync reads it off the tensor.
    tensors, limits, expect_sparse = case
    expected = dist._compute_bucket_assignment_by_size(tensors, limits, expect_sparse)[0]
    as_sparse = [
        torch.zeros(t.numel(), dtype=t.dtype).to_sparse() if flag else t
        for t, flag in zip(tensors, expect_sparse, strict=True)
    ]
    assert fsync.compute_bucket_assignment_by_size(as_sparse, limits) == expected


def test_assignment_edge_cases():
    assert fsync.compute_bucket_assignment_by_size([], [10]) == []
    # A bucket closes once its bytes *reach* the limit; the last limit repeats.
    ts = [torch.empty(10), torch.empty(10), torch.empty(10), torch.empty(10)]
    assert fsync.compute_bucket_assignment_by_size(ts, [40, 80]) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="size_limits is empty"):
        fsync.compute_bucket_assignment_by_size(ts, [])
    with pytest.raises(ValueError, match="non-negative integers"):
        fsync.compute_bucket_assignment_by_size(ts, [-1])
    with pytest.raises(ValueError, match="non-negative integers"):
        fsync.compute_bucket_assignment_by_size(ts, [1.5])
    with pytest.raises(TypeError, match=r"tensors\[1\] is a list"):
        fsync.compute_bucket_assignment_by_size([ts[0], [1.0]], [10])


def _tree():
    return {
        "b": torch.zeros(300, 300),  # 351.6 KiB
        "a": {"w": torch.zeros(64, 3, 3, 3).to(memory_format=torch.channels_last), "n": None},
        "c": [torch.zeros(1000, dtype=torch.float16), torch.zeros(10)],
    }


def test_leaves_follow_insertion_order_and_none_is_kept():
    plan = fsync.plan_buckets(_tree())
    paths = [None if leaf is None else leaf.path for leaf in plan.leaves]
    assert paths == ["b", "a.w", None, "c.0", "c.1"]
    assert plan.leaves[1].layout == "channels_last"
    assert plan.leaves[1].perm == (0, 2, 3, 1)
    assert all(2 not in bucket for bucket in plan.buckets)


def test_reverse_order_with_limits_first_then_cap():
    # Reverse order: c.1, c.0 (fp16: own key), a.w, b. float32 limits [4 KiB, 400 KiB].
    plan = fsync.plan_buckets(_tree(), bucket_cap_mb=400 / 1024, first_bucket_mb=4 / 1024)
    # c.1 (40 B) + a.w (6912 B) reach 4 KiB: first bucket; b (360000 B) alone does not
    # reach 400 KiB and is the leftover float32 bucket; fp16 c.0 has its own.
    assert plan.buckets == ((4, 1), (3,), (0,))
    assert plan.nbytes == (40 + 6912, 2000, 360000)
    assert [s.dtype for s in plan.specs] == [torch.float32, torch.float16, torch.float32]


def test_forward_and_explicit_order():
    forward = fsync.plan_buckets(_tree(), order="forward", bucket_cap_mb=1e-3, first_bucket_mb=1e-3)
    assert forward.buckets == ((0,), (1,), (3,), (4,))
    explicit = fsync.plan_buckets(_tree(), order=[1, 0, 4, 3])
    assert explicit.buckets == ((1, 0, 4), (3,))
    assert explicit.specs[0].offsets == (0, 64 * 27, 64 * 27 + 90000)


@pytest.mark.parametrize(
    ("order", "match"),
    [
        ("backward", "order must be 'reverse', 'forward'"),
        ([0, 1, 3], "exactly once"),
        ([0, 1, 2, 3, 4], "exactly once"),  # 2 is the None leaf
        ([0, 0, 1, 3, 4], "exactly once"),
    ],
)
def test_bad_order(order, match):
    with pytest.raises(ValueError, match=match):
        fsync.plan_buckets(_tree(), order=order)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a finite positive"),
        ({"bucket_cap_mb": float("inf")}, "bucket_cap_mb must be a finite positive"),
        ({"first_bucket_mb": -1.0}, "first_bucket_mb must be a finite non-negative"),
        ({"bucket_cap_mb": "25"}, "bucket_cap_mb must be"),
    ],
)
def test_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fsync.plan_buckets(_tree(), **kwargs)


def test_non_tensor_leaf_is_named():
    with pytest.raises(
        TypeError, match=r"leaf 'x\.lr' is a float; expected a torch.Tensor or None"
    ):
        fsync.plan_buckets({"w": torch.zeros(2), "x": {"lr": 0.1}})


def test_sparse_leaf_alone_and_in_table():
    tree = {"emb": torch.zeros(10, 4).to_sparse(), "w": torch.zeros(4), "v": torch.zeros(4)}
    plan = fsync.plan_buckets(tree)
    assert plan.buckets == ((2, 1), (0,))
    assert plan.specs[1].sparse and plan.leaves[0].layout == "sparse (2 sparse dims)"
    assert "(sparse)" in str(plan)


def test_plan_is_a_frozen_hashable_value():
    a, b = fsync.plan_buckets(_tree()), fsync.plan_buckets(_tree())
    assert a == b and hash(a) == hash(b) and a.fingerprint == b.fingerprint
    c = fsync.plan_buckets(_tree(), bucket_cap_mb=1e-3, first_bucket_mb=1e-3)
    assert a != c and a.fingerprint != c.fingerprint
    assert len({a, b, c}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.buckets = ()  # type: ignore[misc]


def test_fingerprint_covers_layout_not_device_index():
    contiguous = fsync.plan_buckets({"w": torch.zeros(4, 3, 2, 2)})
    channels_last = fsync.plan_buckets(
        {"w": torch.zeros(4, 3, 2, 2).to(memory_format=torch.channels_last)}
    )
    assert contiguous.fingerprint != channels_last.fingerprint
    on_meta = fsync.plan_buckets({"w": torch.zeros(4, 3, 2, 2, device="meta")})
    assert on_meta.fingerprint != contiguous.fingerprint  # device type counts


def test_table_lists_every_bucket():
    plan = fsync.plan_buckets(_tree(), bucket_cap_mb=400 / 1024, first_bucket_mb=4 / 1024)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == "BucketPlan: 4 tensor leaves in 3 buckets, 0.352 MiB"
    assert lines[1].split() == [
        "bucket",
        "leaves",
        "dtype",
        "device",
        "MiB",
        "first",
        "leaf",
        "..",
        "last",
        "leaf",
    ]
    assert lines[2].split() == ["0", "2", "float32", "cpu", "0.007", "c.1", "..", "a.w"]
    assert lines[3].split() == ["1", "1", "float16", "cpu", "0.002", "c.0"]
    assert lines[4].split() == ["2", "1", "float32", "cpu", "0.343", "b"]
    assert repr(plan).startswith("BucketPlan(5 leaves, 3 buckets, 0.35 MiB, fingerprint=0x")


def test_plan_validates_itself():
    plan = fsync.plan_buckets(_tree())
    with pytest.raises(ValueError, match="in more than one bucket"):
        fsync.BucketPlan(plan.treespec, plan.leaves, ((0, 1), (1, 3, 4)))
    with pytest.raises(ValueError, match=r"leaves \[4\] are in no bucket"):
        fsync.BucketPlan(plan.treespec, plan.leaves, ((0, 1), (3,)))
    with pytest.raises(ValueError, match="not a tensor leaf"):
        fsync.BucketPlan(plan.treespec, plan.leaves, ((0, 1, 2), (3,), (4,)))
    with pytest.raises(ValueError, match=r"mixes torch\.float32"):
        fsync.BucketPlan(plan.treespec, plan.leaves, ((0, 1, 3, 4),))


# --- DDP's own rebuilt buckets ----------------------------------------------------------


def _ddp_rebuilt_buckets(bucket_cap_mb):
    """DDP's buckets after its rebuild, for a sequential model on this (1-rank) world."""
    torch.manual_seed(0)
    widths = (512, 512, 256, 512, 64, 300, 128)  # 3.2 MiB of parameters
    layers = []
    for n_in, n_out in itertools.pairwise(widths):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    model = nn.Sequential(*layers)
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    for _ in range(10):  # DDP reports its rebuilt buckets from the 10th iteration on
        ddp.zero_grad()
        ddp(torch.randn(4, widths[0])).sum().backward()
    data = ddp._get_ddp_logging_data()
    sizes = [int(s) for s in data["rebuilt_bucket_sizes"].split(", ")]
    indices = [
        tuple(int(i) for i in b.split())
        for b in data["rebuilt_per_bucket_param_indices"].split(", ")
    ]
    kwargs = (
        {}
        if bucket_cap_mb is None
        else {"bucket_cap_mb": bucket_cap_mb, "first_bucket_mb": bucket_cap_mb}
    )
    plan = fsync.plan_buckets(dict(model.named_parameters()), **kwargs)
    return sizes, indices, list(plan.nbytes), list(plan.buckets)


@pytest.mark.parametrize("world", [1], indirect=True)
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.5, 0.25])
def test_plan_equals_ddp_rebuilt_buckets(world: World, bucket_cap_mb):
    ((sizes, indices, nbytes, buckets),) = world.run(_ddp_rebuilt_buckets, bucket_cap_mb)
    assert len(sizes) > 1
    assert nbytes == sizes
    assert buckets == indices


def test_order_default_matches_named_parameters():
    model = nn.Sequential(collections.OrderedDict(z=nn.Linear(2, 2), a=nn.Linear(2, 2)))
    plan = fsync.plan_buckets(dict(model.named_parameters()))
    assert [leaf.path for leaf in plan.leaves] == ["z.weight", "z.bias", "a.weight", "a.bias"]
    assert plan.buckets == ((3, 2, 1, 0),)

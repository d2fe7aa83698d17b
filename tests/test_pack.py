"""pack/unpack: flat buffers in each leaf's memory order and back, eagerly and compiled."""

from __future__ import annotations

import warnings

import pytest
import torch

import fsync


def _tree():
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "conv": randn(8, 3, 3, 3).to(memory_format=torch.channels_last),
        "conv3d": randn(4, 2, 3, 3, 3).to(memory_format=torch.channels_last_3d),
        "t": randn(5, 7).t(),  # transposed: dim order (1, 0)
        "scalar": randn(()),
        "empty": randn(0, 4),
        "none": None,
        "half": [randn(6, dtype=torch.float16), randn(3, 2, dtype=torch.bfloat16)],
        "w": randn(16, 4),
    }


def _assert_same_tree(a, b):
    la, sa = fsync._tree.flatten(a)
    lb, sb = fsync._tree.flatten(b)
    assert sa == sb
    for x, y in zip(la, lb, strict=True):
        if x is None:
            assert y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        assert _layout(x) == _layout(y)
        assert torch.equal(x, y)


def _layout(x):
    """Strides where they mean something: dimensions of size > 1 of a non-empty tensor."""
    if x.numel() == 0:
        return ()
    return tuple(st for st, n in zip(x.stride(), x.shape, strict=True) if n > 1)


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-4])
def test_round_trip_keeps_values_dtypes_and_layouts(bucket_cap_mb):
    tree = _tree()
    plan = fsync.plan_buckets(tree, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=bucket_cap_mb)
    buffers = fsync.pack(tree, plan)
    assert [b.numel() for b in buffers] == [s.numel for s in plan.specs]
    assert all(
        b.dim() == 1 and b.dtype == s.dtype for b, s in zip(buffers, plan.specs, strict=True)
    )
    out = fsync.unpack(buffers, plan)
    _assert_same_tree(out, tree)
    assert out["conv"].is_contiguous(memory_format=torch.channels_last)
    assert out["conv3d"].is_contiguous(memory_format=torch.channels_last_3d)


def test_buffer_holds_leaves_in_memory_order():
    tree = _tree()
    plan = fsync.plan_buckets(tree, order="forward")
    (float_buffer, *_) = fsync.pack(tree, plan)
    spec = plan.specs[0]
    expected = torch.cat(
        [
            tree["conv"].permute(0, 2, 3, 1).reshape(-1),  # NHWC, as it sits in memory
            tree["conv3d"].permute(0, 2, 3, 4, 1).reshape(-1),
            tree["t"].t().reshape(-1),
            tree["scalar"].reshape(-1),
            tree["empty"].reshape(-1),
            tree["w"].reshape(-1),
        ]
    )
    assert spec.leaves == (0, 1, 2, 3, 4, 8)
    assert torch.equal(float_buffer, expected)


def test_pack_copies_and_unpack_views():
    tree = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    before = {k: v.clone() for k, v in tree.items()}
    plan = fsync.plan_buckets(tree)
    buffers = fsync.pack(tree, plan)
    buffers[0].mul_(5)  # the caller's tensors must not see this
    _assert_same_tree(tree, before)
    out = fsync.unpack(buffers, plan)
    assert out["a"].untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr()


def test_inputs_in_other_layouts_come_back_in_the_plan_layout():
    plan = fsync.plan_buckets({"w": torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)})
    x = torch.randn(2, 3, 4, 4)  # contiguous, not channels_last
    out = fsync.unpack(fsync.pack({"w": x}, plan), plan)["w"]
    assert torch.equal(out, x) and out.is_contiguous(memory_format=torch.channels_last)
    expanded = torch.randn(3, 1, 1).expand(2, 3, 4, 4)  # stride-0 dimensions
    out = fsync.unpack(fsync.pack({"w": expanded}, plan), plan)["w"]
    assert torch.equal(out, expanded)
    strided = torch.randn(2, 3, 8, 4)[:, :, ::2]  # a non-contiguous slice
    assert torch.equal(fsync.unpack(fsync.pack({"w": strided}, plan), plan)["w"], strided)


def test_none_where_plan_has_tensor_packs_zeros():
    plan = fsync.plan_buckets({"a": torch.ones(2), "b": torch.ones(3)})
    (buffer,) = fsync.pack({"a": None, "b": torch.ones(3)}, plan)
    assert torch.equal(buffer, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    ("tree", "error", "match"),
    [
        ({"a": torch.ones(2)}, ValueError, "tree does not match the plan: its structure is"),
        ({"a": torch.ones(2), "b": torch.ones(4)}, ValueError, r"leaf 'b' has shape \(4,\)"),
        (
            {"a": torch.ones(2), "b": torch.ones(3, dtype=torch.float64)},
            ValueError,
            "dtype torch.float64",
        ),
        ({"b": torch.ones(3), "a": torch.ones(2)}, ValueError, "its structure is"),
        ({"a": torch.ones(2), "b": 1.0}, TypeError, r"tree leaf 'b' is a float"),
    ],
)
def test_pack_rejects_trees_that_do_not_match(tree, error, match):
    plan = fsync.plan_buckets({"a": torch.ones(2), "b": torch.ones(3)})
    with pytest.raises(error, match=match):
        fsync.pack(tree, plan)


def test_pack_rejects_tensor_where_plan_has_none():
    plan = fsync.plan_buckets({"a": torch.ones(2), "b": None})
    with pytest.raises(ValueError, match="holds a tensor where the plan's tree holds None"):
        fsync.pack({"a": torch.ones(2), "b": torch.ones(1)}, plan)


def test_unpack_checks_buffers():
    plan = fsync.plan_buckets({"a": torch.ones(2), "b": torch.ones(3)})
    (buffer,) = fsync.pack({"a": torch.ones(2), "b": torch.ones(3)}, plan)
    with pytest.raises(ValueError, match="got 2 buffers for 1 bucket;"):
        fsync.unpack([buffer, buffer], plan)
    with pytest.raises(ValueError, match="expected a dense 1-D tensor of 5 elements"):
        fsync.unpack([buffer[:4]], plan)
    with pytest.raises(ValueError, match=r"is torch\.float64 on cpu; expected torch\.float32"):
        fsync.unpack([buffer.double()], plan)
    with pytest.raises(TypeError, match="buffer 0 is a list"):
        fsync.unpack([[1.0] * 5], plan)


def test_sparse_bucket_is_the_coalesced_tensor():
    dense = torch.zeros(5, 2)
    dense[1, 0], dense[3, 1] = 1.0, 2.0
    tree = {"emb": dense.to_sparse(), "w": torch.ones(2)}
    plan = fsync.plan_buckets(tree)
    buffers = fsync.pack(tree, plan)
    sparse = buffers[[s.sparse for s in plan.specs].index(True)]
    assert sparse.is_sparse and sparse.is_coalesced()
    assert torch.equal(fsync.unpack(buffers, plan)["emb"].to_dense(), dense)


def test_compiled_pack_unpack_equals_eager():
    tree = _tree()
    plan = fsync.plan_buckets(tree, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)

    def round_trip(t):
        return fsync.unpack([b * 2 for b in fsync.pack(t, plan)], plan)

    compiled = torch.compile(round_trip, fullgraph=True)
    _assert_same_tree(compiled(tree), round_trip(tree))


def test_compiled_pack_of_a_plain_dict_traces_no_cache():
    """A plain dict of tensors (the tree most code syncs) is fitted to its plan by Python at
    trace time: dynamo meets none of the eager call's caches, and says nothing."""
    tree = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    plan = fsync.plan_buckets(tree)

    def round_trip(t):
        return fsync.unpack([b * 2 for b in fsync.pack(t, plan)], plan)

    torch._dynamo.utils.warn_once_cache.clear()  # dynamo warns once a process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(round_trip, fullgraph=True)(tree)
    assert not [w for w in caught if "lru_cache" in str(w.message)], caught
    _assert_same_tree(got, round_trip(tree))

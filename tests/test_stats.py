"""sync_stats: bytes and collectives per step, measured on the real code path."""

from __future__ import annotations

import logging

import pytest
import torch

import fsync
from fsync import _planner
from fsync._comm._recorder import Collective


def _tree():
    return {
        "w": torch.zeros(256, 64),
        "b": torch.zeros(64),
        "h": torch.zeros(10, dtype=torch.bfloat16),
    }


def test_allreduce_puts_the_buckets_on_the_wire():
    stats = fsync.sync_stats(_tree(), world_size=4)
    assert stats.buckets == 2 and stats.num_collectives == 2
    assert stats.bytes_reduced == stats.bytes_on_wire == (256 * 64 + 64) * 4 + 10 * 2
    assert stats.compression == 1.0
    assert [c.op for c in stats.collectives] == ["all_reduce", "all_reduce"]
    text = str(stats)
    assert "2 buckets" in text and "1 x all_reduce bfloat16" in text and "compression 1.00x" in text


def test_one_rank_communicates_nothing():
    stats = fsync.sync_stats(_tree(), world_size=1)
    assert stats.num_collectives == 0 and stats.bytes_on_wire == 0


def test_counts_what_a_custom_hook_sends():
    def apply(buckets, state, ctx):
        # An all-gather of every bucket in bf16, then a local mean.
        out = []
        for b in buckets:
            gathered = fsync._comm.all_gather(b.to(torch.bfloat16), ctx.group)
            out.append(gathered.view(ctx.world_size, -1).float().mean(0).to(b.dtype))
        return out, state

    hook = fsync.Hook(lambda plan: (), apply)
    stats = fsync.sync_stats({"w": torch.zeros(1000)}, hook=hook, world_size=3)
    assert [(c.op, c.dtype, c.numel) for c in stats.collectives] == [
        ("all_gather", torch.bfloat16, 1000)
    ]
    assert stats.compression == 2.0


def test_plan_and_options():
    plan = fsync.plan_buckets(_tree(), reduce_dtype=torch.bfloat16)
    stats = fsync.sync_stats(plan, world_size=2)
    assert stats.buckets == 1 and stats.bytes_on_wire == (256 * 64 + 64 + 10) * 2
    small = fsync.sync_stats(_tree(), bucket_cap_mb=0.01, first_bucket_mb=1e-4)
    assert small.num_collectives == 3
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        fsync.sync_stats(_tree(), world_size=0)


def test_reduce_dtype_option():
    # fp32 and bf16 leaves reduced in bf16: one bucket, two bytes per element on the wire.
    stats = fsync.sync_stats(_tree(), reduce_dtype=torch.bfloat16)
    assert stats.bytes_on_wire == (256 * 64 + 64 + 10) * 2
    assert stats == fsync.sync_stats(fsync.plan_buckets(_tree(), reduce_dtype=torch.bfloat16))
    up = fsync.sync_stats({"h": torch.zeros(10, dtype=torch.bfloat16)}, reduce_dtype=torch.float32)
    assert up.collectives == (Collective("all_reduce", torch.float32, 10),)
    with pytest.raises(TypeError, match="reduce_dtype must be None or a floating point"):
        fsync.sync_stats(_tree(), reduce_dtype=torch.int32)


# The ranks' agreement: one all-reduce of 13 int64 at every step (active, four 16-bit
# chunks of the fingerprint and their squares, the step and its square, two flags).
AGREEMENT = Collective("all_reduce", torch.int64, 13, control=True)


@pytest.mark.parametrize(
    ("options", "control"),
    [
        ({}, (AGREEMENT,)),
        ({"divide_by": "active"}, (AGREEMENT,)),
        # One count per tensor leaf (None leaves send none), after the agreement.
        ({"find_unused": True}, (AGREEMENT, Collective("all_reduce", torch.int64, 3, True))),
    ],
    ids=["world", "active", "find_unused"],
)
def test_counts_the_control_collectives(options, control):
    tree = {**_tree(), "frozen": None}  # three tensor leaves
    plain = fsync.sync_stats(tree, world_size=4)
    stats = fsync.sync_stats(tree, world_size=4, **options)
    # The control collectives come first and apart; the buckets are unchanged.
    assert stats.control == control
    assert stats.collectives == plain.collectives
    assert stats.bytes_on_wire == plain.bytes_on_wire and stats.compression == 1.0
    assert stats.control_bytes == sum(c.numel for c in control) * 8
    assert f"agreement adds {len(control)} all-reduce" in str(stats)
    one = fsync.sync_stats(tree, world_size=1, **options)
    assert one.num_collectives == 0 and one.control == ()


@pytest.mark.parametrize(
    "options", [{}, {"find_unused": True}, {"divide_by": "active"}, {"reduce_dtype": torch.float32}]
)
def test_stats_match_a_recorded_gradsync_step(single_rank, options):
    """sync_stats counts what GradSync really issues (its control collective included)."""
    params = {**_tree(), "frozen": None}
    # Unused on this rank where find_unused allows it (without it, a None gradient costs
    # the step a count of ranks per leaf, which sync_stats, given no gradients, cannot see).
    grads = {**params, "b": None} if options.get("find_unused") else params
    recorder = fsync._comm._recorder.Recorder(3)
    sync = fsync.GradSync(group=recorder, **options)
    state = sync.init(params)
    start = len(recorder.calls)  # after init's plan check
    sync(grads, state)
    stats = fsync.sync_stats(params, world_size=3, **options)
    assert (*stats.control, *stats.collectives) == tuple(recorder.calls[start:])


def test_option_errors():
    with pytest.raises(TypeError, match="find_unused must be a bool"):
        fsync.sync_stats(_tree(), find_unused=1)
    with pytest.raises(ValueError, match="divide_by must be 'world' or 'active'"):
        fsync.sync_stats(_tree(), divide_by="initial")


def test_plan_is_logged_at_debug(single_rank, caplog):
    # A plan is logged when it is made, not when the cache gives it back (another test may
    # have planned this tree already).
    _planner._cached_plan.cache_clear()
    with caplog.at_level(logging.DEBUG, logger="fsync"):
        fsync.GradSync().init({"w": torch.zeros(4)})
    assert "fsync planned 1 bucket for tree:" in caplog.text
    assert "BucketPlan: 1 tensor leaf in 1 bucket" in caplog.text

"""Faults and awkward input: no hang, no garbage, no mutation, clear errors."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import fsync
from fsync._agree import AGREEMENT
from fsync._comm._failures import REPORT_PATIENCE_S
from tests._numerics import gathered, summation_bound
from tests._world import World, started_early

PG_TIMEOUT = 4.0


def _on_rank_one_skips_sync(mode):
    rank = dist.get_rank()
    if rank == 1:
        if mode == "dies":
            os._exit(3)
        return "skipped"  # never calls the sync
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="an fsync collective failed") as error:
        fsync.sync_grads({"w": torch.ones(3)})
    return time.monotonic() - started, str(error.value)


def _missing_rank_1(message, world_size, stage, step):
    """The words a live rank's error must hold when rank 1 is gone: where, when, who."""
    assert f"an fsync collective failed at {stage}" in message, message
    assert step in message, message
    assert "rank 1 did not arrive (dead, hung, or not calling this sync" in message, message
    live = [r for r in range(world_size) if r != 1]  # each saw the failure at the same stage
    who = ("rank " if len(live) == 1 else "ranks ") + ", ".join(map(str, live))
    assert f"{who} saw the failure there." in message, message
    assert "Backend error:" in message


# Each fault test's cases at once, each on a fresh world with the short group timeout,
# started as this module's first test starts: their waits for the timeout (~9 s) overlap
# each other and the module's other tests.
never_synced = started_early(
    "never_synced",
    "test_peer_that_never_syncs_fails_within_the_timeout",
    {mode: (2, _on_rank_one_skips_sync, mode) for mode in ("skips", "dies")},
    pg_timeout=PG_TIMEOUT,
)


def test_peer_that_never_syncs_fails_within_the_timeout(never_synced):
    for mode, (live, other) in never_synced.results().items():
        kind, value = live
        assert kind == "ok", (mode, value)
        elapsed, message = value
        # gloo gives up after the group's timeout (or at once when the peer's socket
        # closes); then the live rank waits up to REPORT_PATIENCE_S for the others'
        # reports; the slack covers process scheduling on a loaded machine.
        assert elapsed < PG_TIMEOUT + REPORT_PATIENCE_S + 20, (mode, elapsed)
        assert "process group's timeout" in message
        # sync_grads keeps no step count: the sync is named by c10d's count of the group.
        _missing_rank_1(message, 2, AGREEMENT, "in the sync begun at c10d collective #")
        assert other == (("died", 3) if mode == "dies" else ("ok", "skipped"))


def _on_rank_one_stops_after_steps(mode):
    rank = dist.get_rank()
    sync = fsync.GradSync(bucket_cap_mb=1e-4, first_bucket_mb=1e-4)  # two buckets
    grads = {"w": torch.ones(64), "b": torch.ones(32)}
    state = sync.init(grads)
    assert len(sync.plan(state).buckets) == 2
    for _ in range(3):  # the steady state: bucket all-reduces only, no check
        out, state = sync(grads, state)
        assert torch.equal(out["w"], grads["w"])
    if rank == 1:
        if mode == "dies":
            # Dies while computing its next step, once the others surely read the last one.
            time.sleep(0.5)
            os._exit(3)
        return "stopped"  # never calls the sync again
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="an fsync collective failed") as error:
        sync(grads, state)
    return time.monotonic() - started, str(error.value)


# Started with never_synced's, as the module's first test starts.
stopped_syncing = started_early(
    "stopped_syncing",
    "test_peer_that_stops_in_the_steady_state_fails_within_the_timeout",
    {
        (mode, size): (size, _on_rank_one_stops_after_steps, mode)
        for size in (2, 3)
        for mode in ("skips", "dies")
    },
    pg_timeout=PG_TIMEOUT,
)


def test_peer_that_stops_in_the_steady_state_fails_within_the_timeout(stopped_syncing):
    for (mode, size), results in stopped_syncing.results().items():
        for rank in (r for r in range(size) if r != 1):
            kind, value = results[rank]
            assert kind == "ok", (mode, size, value)
            elapsed, message = value
            assert "process group's timeout" in message
            _missing_rank_1(message, size, AGREEMENT, "in step 3 of its state")
            if mode == "skips":
                # A live peer that never answers: gloo waits out the group's timeout
                # (measured: 4.00-4.01 s), then the rank waits REPORT_PATIENCE_S for rank
                # 1's report, which never comes. The 3 s above cover the rank's scheduling
                # on two loaded cores.
                low = PG_TIMEOUT + REPORT_PATIENCE_S - 0.5
                assert low < elapsed < PG_TIMEOUT + REPORT_PATIENCE_S + 3, (mode, size, elapsed)
            else:
                # A dead peer's sockets close: gloo fails as soon as rank 1 exits (its
                # 0.5 s sleep), well before the timeout; then the wait for rank 1's report.
                assert elapsed < PG_TIMEOUT / 2 + REPORT_PATIENCE_S, (mode, size, elapsed)
        assert results[1] == (("died", 3) if mode == "dies" else ("ok", "stopped"))


def _on_rank_awkward_input():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    grads = {
        "expanded": torch.randn(3, 1, generator=g).expand(3, 4),  # stride 0
        "strided": torch.randn(4, 6, generator=g)[:, ::2],  # a slice with gaps
        "transposed": torch.randn(5, 3, generator=g).t(),
        "empty": torch.randn(0, 3, generator=g),
        "scalar": torch.randn((), generator=g),
    }
    dense = {k: v.contiguous() for k, v in grads.items()}
    out = fsync.sync_grads(grads)
    for name, parts in gathered(dense).items():
        expected = torch.stack([p * (1.0 / world_size) for p in parts]).sum(0)
        # The same terms; only the order of the sum may differ.
        bound = summation_bound(parts, world_size)
        assert torch.all((out[name] - expected).abs() <= bound), name
    assert out["transposed"].stride() == grads["transposed"].stride()

    # Empty trees and trees of None are fine and communicate nothing but the check.
    assert fsync.sync_grads({}) == {}
    assert fsync.sync_grads({"a": None, "b": [None]}) == {"a": None, "b": [None]}
    sync = fsync.GradSync()
    assert sync(({}), sync.init({}))[0] == {}

    with pytest.raises(ValueError, match=r"leaves are on several devices: cpu \('a'\), meta"):
        fsync.sync_grads({"a": torch.ones(1), "b": torch.ones(1, device="meta")})
    with pytest.raises(ValueError, match=r"leaves are on several devices"):
        fsync.GradSync().init({"a": torch.ones(1), "b": torch.ones(1, device="meta")})


@pytest.mark.parametrize("world", [3], indirect=True)
def test_awkward_but_valid_input(world: World):
    world.run(_on_rank_awkward_input)


def _checksums(tree):
    leaves, _ = fsync._tree.flatten(tree)
    return [
        None if x is None else (x.clone(), x.stride(), x.data_ptr(), x._version) for x in leaves
    ]


def _assert_untouched(tree, sums):
    for x, saved in zip(fsync._tree.flatten(tree)[0], sums, strict=True):
        if x is None:
            assert saved is None
            continue
        value, stride, ptr, version = saved
        same = x.shape == value.shape if x.is_meta else torch.equal(x, value)
        assert same and x.stride() == stride and x.data_ptr() == ptr
        assert x._version == version  # not even written with the same values


def _on_rank_no_mutation():
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    grads = {
        "w": torch.randn(4, 3, generator=g),
        "c": torch.randn(2, 3, 2, 2, generator=g).to(memory_format=torch.channels_last),
        "h": torch.randn(5, generator=g).to(torch.bfloat16),
    }
    params = {k: v.clone() for k, v in grads.items()}
    buffers = {"mean": torch.randn(3, generator=g), "count": torch.tensor(rank)}
    # Compiled below: a GradSync step whose plan casts (the fp32 leaves to bf16 and back).
    sync = fsync.GradSync(reduce_dtype=torch.bfloat16)
    state = sync.init(params)
    inputs = (grads, params, buffers, state)
    sums = [_checksums(t) for t in inputs]

    fsync.sync_grads(grads)
    fsync.sync_grads(grads, reduce_dtype=torch.float32, active=rank == 0, divide_by="active")
    unused = fsync.GradSync(find_unused=True)
    unused(grads, unused.init(params))
    sync(grads, state)
    fsync.broadcast(params)
    fsync.sync_buffers(buffers, mode="mean")
    fsync.verify(params)
    fsync.accumulate(grads, grads)
    plan = fsync.plan_buckets(params)
    fsync.unpack(fsync.pack(grads, plan), plan)
    torch.compile(fsync.sync_grads, fullgraph=True)(grads)
    torch.compile(lambda g, s: sync(g, s), fullgraph=True)(grads, state)
    for tree, saved in zip(inputs, sums, strict=True):
        _assert_untouched(tree, saved)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_no_input_is_modified(world: World):
    world.run(_on_rank_no_mutation, timeout=300)

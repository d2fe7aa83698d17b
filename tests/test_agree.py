"""Every rank agrees at every step: a disagreement is the same ValueError on every rank.

Each case lets the ranks sync correctly first (so that plans are cached and, before
fsync checked at every step, would not have been checked again), then makes the
last rank differ in one thing, and checks that every rank raises an error naming
the difference with both ranks' values, within seconds, eagerly and under
``torch.compile(fullgraph=True)``, and that the group still works afterwards (no
bucket collective was issued).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

import fsync
from fsync._agree import AGREEMENT
from fsync._comm._failures import REPORT_PATIENCE_S
from tests._world import World, started_early

# An error must come from the control collective, long before any timeout.
FAST = 10.0


def _tree(rank: int) -> dict[str, torch.Tensor]:
    return {
        "enc.w": torch.full((4, 3), float(rank + 1)),
        "enc.b": torch.ones(4),
        "head.w": torch.ones(2, 4),
    }


def _differs(odd: bool, base: dict[str, torch.Tensor]):
    """Per case: the tree and options of this rank, and the error every rank must raise."""
    last = dist.get_world_size() - 1
    ops = fsync.ops
    return {
        "key order": (
            dict(reversed(base.items())) if odd else base,
            {},
            rf"the leaf at this position is 'enc.w' on rank 0 but 'head.w' on rank {last}",
        ),
        "shape": (
            {**base, "enc.b": torch.ones(5)} if odd else base,
            {},
            rf"leaf 'enc.b' has shape \(4,\).* on rank 0 but shape \(5,\).* on rank {last}",
        ),
        "dtype": (
            {**base, "enc.b": torch.ones(4, dtype=torch.float64)} if odd else base,
            {},
            rf"leaf 'enc.b' has .*float32.* on rank 0 but .*float64.* on rank {last}",
        ),
        "layout": (
            {**base, "enc.w": torch.ones(3, 4).t()} if odd else base,
            {},
            rf"leaf 'enc.w' has .*contiguous on rank 0 but .*dim order \(1, 0\) on rank {last}",
        ),
        "hook": (
            base,
            {"hook": ops.fp16_compress()} if odd else {},
            rf"hook is allreduce\(op='mean'\) on rank 0 but fp16_compress\(allreduce\("
            rf"op='mean'\)\) on rank {last}",
        ),
        "op": (
            base,
            {"hook": ops.allreduce("sum")} if odd else {},
            rf"hook is allreduce\(op='mean'\) on rank 0 but allreduce\(op='sum'\) on rank {last}",
        ),
        "quantize bits": (
            base,
            {"hook": ops.quantize(4 if odd else 8)},
            rf"hook is quantize\(bits=8, .*\) on rank 0 but quantize\(bits=4, .*\) on "
            rf"rank {last}",
        ),
        "divide_by": (
            base,
            {"divide_by": "active"} if odd else {},
            rf"divide_by is 'world' on rank 0 but 'active' on rank {last}",
        ),
        "reduce_dtype": (
            base,
            {"reduce_dtype": torch.float64} if odd else {},
            rf"reduce_dtype is None on rank 0 but torch.float64 on rank {last}",
        ),
        "bucket sizes": (
            base,
            {"bucket_cap_mb": 1e-5, "first_bucket_mb": 1e-5} if odd else {},
            r"the bucket plans differ \(bucket_cap_mb, first_bucket_mb, order or buckets\)",
        ),
    }


_COMPILED_CASES = ("key order", "shape", "hook", "divide_by")


def _raises_everywhere(call, match):
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        call()
    assert time.monotonic() - started < FAST


def _on_rank_sync_grads_disagree(compiled_cases):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    odd = rank == world_size - 1
    base = _tree(rank)
    expected = sum(float(r + 1) for r in range(world_size)) / world_size
    for _ in range(2):  # plans seen and cached on every rank
        fsync.sync_grads(base)
        fsync.sync_grads(dict(reversed(base.items())))
    for name, (tree, options, match) in _differs(odd, base).items():
        _raises_everywhere(lambda t=tree, o=options: fsync.sync_grads(t, **o), match)
        if name in compiled_cases:
            # Static shapes (fsync.compile's default): a tree whose shapes changed between
            # calls recompiles with its own plan, which the ranks then compare.
            step = torch.compile(
                lambda t, o=options: fsync.sync_grads(t, **o), fullgraph=True, dynamic=False
            )
            # The first call compiles (untimed: minutes on a loaded 2-core machine); the
            # claim is that the error comes from the agreement, long before any timeout.
            with pytest.raises(ValueError, match=match):
                step(tree)
            _raises_everywhere(lambda t=tree, s=step: s(t), match)
        # Nothing was sent but the control collective: the group works as before.
        assert torch.equal(fsync.sync_grads(base)["enc.w"], torch.full((4, 3), expected))


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_sync_grads_disagreement_is_the_same_error_on_every_rank(world: World):
    compiled = _COMPILED_CASES if world.size == 2 else ()
    world.run(_on_rank_sync_grads_disagree, compiled, timeout=400)


def _on_rank_gradsync_disagree():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    odd = rank == world_size - 1
    last = world_size - 1
    params = _tree(0)
    grads = _tree(rank)
    # A stateless hook: a state from another plan then traces, and the ranks' agreement
    # refuses it at run time. (A stateful hook's own state check fails earlier, while
    # tracing, on the rank whose state does not fit: see docs/concepts.md.)
    sync = fsync.GradSync()
    compiled = torch.compile(lambda g, s: sync(g, s), fullgraph=True)
    for run in (sync, compiled):
        state = sync.init(params)
        _, state = run(grads, state)
        _, later = run(grads, state)
        # A state from another plan (other bucket sizes) on one rank only.
        other = fsync.GradSync(bucket_cap_mb=1e-5, first_bucket_mb=1e-5).init(params)
        _raises_everywhere(
            lambda r=run, o=other, s=later: r(grads, o if odd else s),
            rf"state belongs to another plan .* on rank {last}\.",
        )
        # A stale state (the step before) on one rank: it skipped a sync.
        _raises_everywhere(
            lambda r=run, s=state, t=later: r(grads, s if odd else t),
            rf"ranks are at different syncs of this group: rank 0 at sync 2, .*rank {last} at "
            r"sync 1.* A rank skipped a sync",
        )
        # Settings of the hook that differ: PowerSGD's rank.
        hook = fsync.ops.powersgd(3 if odd else 2, start_step=0)
        differs = fsync.GradSync(hook=hook)
        _raises_everywhere(
            lambda d=differs: d(grads, d.init(params)),
            rf"hook is powersgd\(2, .*\) on rank 0 but powersgd\(3, .*\) on rank {last}",
        )
        _, later = run(grads, later)  # and the good state goes on


@pytest.mark.parametrize("world", [2], indirect=True)
def test_gradsync_state_and_settings_disagreement(world: World):
    world.run(_on_rank_gradsync_disagree, timeout=400)


def _on_rank_none_leaves():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    last = world_size - 1
    params = _tree(0)
    grads = _tree(rank)
    sync = fsync.GradSync()
    compiled = torch.compile(lambda g, s: sync(g, s), fullgraph=True)
    for run in (sync, compiled):
        state = sync.init(params)
        # Unused on every rank: None comes back None (DDP's semantics), as in sync_grads.
        out, state = run({**grads, "head.w": None}, state)
        assert out["head.w"] is None
        assert fsync.sync_grads({**grads, "head.w": None})["head.w"] is None
        # Unused on some ranks without find_unused: the same error everywhere.
        partial = {**grads, "head.w": None} if rank == last else grads
        _raises_everywhere(
            lambda r=run, s=state, p=partial: r(p, s),
            rf"leaf 'head.w' has a gradient on ranks? 0.* but None on rank {last}: a parameter "
            r"unused on some ranks. Pass find_unused=True",
        )
        out, state = run(grads, state)  # the group goes on
    # With find_unused (eager) it is averaged with zeros from the ranks without it.
    unused = fsync.GradSync(find_unused=True)
    out, _ = unused(partial, unused.init(params))
    assert torch.equal(out["head.w"], torch.full((2, 4), (world_size - 1) / world_size))


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_none_leaves_have_ddp_semantics_or_raise_everywhere(world: World):
    world.run(_on_rank_none_leaves, timeout=400)


def _on_rank_compiled_peer_stops(mode):
    rank = dist.get_rank()
    sync = fsync.GradSync()
    grads = {"w": torch.ones(64), "b": torch.ones(32)}
    state = sync.init(grads)
    step = fsync.compile(lambda g, s: sync(g, s))
    for _ in range(2):
        _, state = step(grads, state)
    # Compiled on both ranks: from here on the steady state's timeout (see below).
    dist.barrier()
    _set_pg_timeout(datetime.timedelta(seconds=STEADY_PG_TIMEOUT))
    if rank == 1:
        if mode == "dies":
            time.sleep(0.5)
            os._exit(3)
        return "stopped"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="an fsync collective failed") as error:
        step(grads, state)
    return time.monotonic() - started, str(error.value)


# The first compiled step's agreement waits for the slower rank's compilation, which on a
# loaded two-core machine can finish many seconds after the other's: the group's timeout
# must cover that skew, or the warm-up itself times out. Once both ranks have compiled,
# the group's timeout drops to the steady state's, which the failure then waits for.
COMPILED_PG_TIMEOUT = 30.0
STEADY_PG_TIMEOUT = 4.0


# Both ways a peer stops, each on a world of its own, started as this module's first test
# starts: their waits for the timeout overlap each other and the module's tests.
compiled_peer_stopped = started_early(
    "compiled_peer_stopped",
    "test_compiled_step_fails_within_the_timeout_when_a_peer_stops",
    {mode: (2, _on_rank_compiled_peer_stops, mode) for mode in ("skips", "dies")},
    pg_timeout=COMPILED_PG_TIMEOUT,
    timeout=240,
)


def test_compiled_step_fails_within_the_timeout_when_a_peer_stops(compiled_peer_stopped):
    for mode, results in compiled_peer_stopped.results().items():
        kind, value = results[0]
        assert kind == "ok", (mode, value)
        elapsed, message = value
        # fsync's own words, from the agreement that the compiled step runs first, with the
        # step (the state's), the stage and the missing rank; gloo gives up after the group's
        # timeout, then the rank waits REPORT_PATIENCE_S for the others' reports (the slack
        # covers scheduling on two loaded cores).
        assert "process group's timeout" in message
        assert f"an fsync collective failed at {AGREEMENT}" in message, message
        assert "rank 1 did not arrive" in message and "rank 0 saw the failure there" in message
        assert elapsed < STEADY_PG_TIMEOUT + REPORT_PATIENCE_S + 20, (mode, elapsed)
        assert results[1] == (("died", 3) if mode == "dies" else ("ok", "stopped"))


# --- misuse that used to end in an abort, garbage or another library's words ------------------


def _on_rank_misuse():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grads = _tree(rank)
    expected = sum(float(r + 1) for r in range(world_size)) / world_size
    # Compiled sync_grads of a plain dict with the compression hooks (and in a chain).
    for hook in (
        fsync.ops.fp16_compress(),
        fsync.ops.bf16_compress(),
        fsync.chain(fsync.ops.noop(), fsync.ops.fp16_compress()),
    ):
        step = torch.compile(lambda g, h=hook: fsync.sync_grads(g, hook=h), fullgraph=True)
        eager = fsync.sync_grads(grads, hook=hook)
        assert torch.equal(step(grads)["enc.w"], eager["enc.w"])
        assert torch.equal(eager["enc.w"], torch.full((4, 3), expected))
    # A hook that returns something else than (buckets, state).
    no_state = fsync.Hook(lambda plan: (), lambda b, s, c: b)
    with pytest.raises(TypeError, match=r"hook.apply returned a list; expected a pair"):
        fsync.sync_grads(grads, hook=no_state)
    not_a_list = fsync.Hook(lambda plan: (), lambda b, s, c: (3, s))
    with pytest.raises(TypeError, match=r"hook output: got a int; expected a list with one"):
        fsync.sync_grads(grads, hook=not_a_list)
    # A group this rank is not in.
    solo = dist.new_group([0])
    if rank != 0:
        with pytest.raises(ValueError, match=r"is not a member of the group it was given"):
            fsync.sync_grads(grads, group=solo)
    # grads=None without active=False.
    sync = fsync.GradSync()
    state = sync.init(grads)
    with pytest.raises(ValueError, match=r"grads is None on an active rank; .* active=False"):
        sync(None, state)
    # Sparse gradients are averaged by fsync itself: a hook that would not apply is refused.
    sparse = {"emb": torch.zeros(6, 2).to_sparse(1), "w": torch.ones(3)}
    for hook in (fsync.ops.allreduce("sum"), fsync.ops.noop()):
        with pytest.raises(ValueError, match=r"sparse gradient 'emb' is averaged by fsync"):
            fsync.sync_grads(sparse, hook=hook)
    assert fsync.sync_grads(sparse, hook=fsync.ops.allreduce("mean"))["emb"].is_sparse
    assert torch.equal(fsync.sync_grads(grads)["enc.w"], torch.full((4, 3), expected))


@pytest.mark.parametrize("world", [2], indirect=True)
def test_misuse_gets_fsync_errors_and_compression_compiles_on_plain_dicts(world: World):
    world.run(_on_rank_misuse, timeout=400)


# --- what one rank finds alone ------------------------------------------------------------------


def _refused(call, match, error=ValueError, *, compile_first=False):
    """``call()`` raises ``error`` matching ``match``, fast; the group works afterwards.

    With ``compile_first``, a first call compiles (it may raise the same error) before the
    clock starts: on a slow machine a compile alone took over ``FAST`` (CI, 19 s).
    """
    if compile_first:
        with contextlib.suppress(ValueError, TypeError):
            call()
    started = time.monotonic()
    with pytest.raises(error, match=match):
        call()
    assert time.monotonic() - started < FAST
    expected = sum(float(r + 1) for r in range(dist.get_world_size())) / dist.get_world_size()
    assert torch.equal(
        fsync.sync_grads(_tree(dist.get_rank()))["enc.w"], torch.full((4, 3), expected)
    )


def _on_rank_local_findings(compiled):
    """Each check that fails on the last rank alone is the same error on every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    last = world_size - 1
    odd = rank == last
    base = _tree(rank)
    refused = rf"rank {last} cannot take part in this sync, so no rank sent its buckets"

    def run(fn):
        """Eagerly, or compiled (``_refused`` compiles it with a first, untimed call)."""
        return torch.compile(fn, fullgraph=True) if compiled else fn

    sync = fsync.GradSync()
    state = sync.init(base)
    step = run(lambda g, s: sync(g, s))
    wider = {**base, "enc.w": torch.ones(5, 3)}
    _refused(
        lambda: step(wider if odd else base, state),
        rf"{refused} \(every rank raises this error\): rank {last}: grads does not match the "
        r"plan: leaf 'enc.w' has shape \(5, 3\)",
        compile_first=compiled,
    )
    foreign = sync.init({**base, "enc.b": torch.ones(7)})  # a state made for another tree
    _refused(
        lambda: step(base, foreign if odd else state),
        rf"{refused}.*rank {last}: grads does not match the plan: leaf 'enc.b' has shape \(4,\)",
        compile_first=compiled,
    )
    powersgd = fsync.GradSync(hook=fsync.ops.powersgd(1, start_step=0, min_compression_rate=0))
    hooked = powersgd.init(base)
    stale = powersgd.init({**base, "enc.w": torch.ones(6, 3)}).hook  # another plan's hook state
    step_powersgd = run(lambda g, s: powersgd(g, s))
    _refused(
        lambda: step_powersgd(base, hooked._replace(hook=stale) if odd else hooked),
        r"the hook's state differs across ranks: its leaf 1 is \(\d+,\) torch.float32 on rank 0 "
        rf"but \(\d+,\) torch.float32 on rank {last}",
        compile_first=compiled,
    )
    # A wrong leaf type on one rank: every rank raises the TypeError it found.
    ints = {**base, "enc.b": torch.ones(4, dtype=torch.int64)}
    stateless = run(lambda g: fsync.sync_grads(g))
    _refused(
        lambda: stateless(ints if odd else base),
        rf"{refused}.*rank {last}: grads leaf 'enc.b' has dtype torch.int64",
        TypeError,
        compile_first=compiled,
    )
    if compiled:
        # A shape changed on one rank only, under plain torch.compile: dynamo makes it
        # symbolic (automatic dynamic shapes), fsync specializes it (a plan needs static
        # shapes), and the ranks' plans then differ: fsync's error, not dynamo's.
        dynamic = torch.compile(lambda g: fsync.sync_grads(g), fullgraph=True)
        dynamic(base)
        changed = {**base, "enc.w": torch.ones(5, 3)} if odd else base
        with contextlib.suppress(ValueError):  # compiles the odd rank's new graph
            dynamic(changed)
        _refused(
            lambda: dynamic(changed),
            rf"grads differ across ranks: leaf 'enc.w' has shape \(4, 3\).* on rank 0 but "
            rf"shape \(5, 3\).* on rank {last}",
        )
        return
    # A state of another kind, and a tree that is no tree of tensors, at init.
    _refused(
        lambda: sync(base, (state.hook,) if odd else state),
        rf"{refused}.*rank {last}: state is a tuple; expected the SyncState",
        TypeError,
    )
    _refused(
        lambda: fsync.GradSync().init({**base, "lr": 0.1} if odd else base),
        rf"{refused}.*rank {last}: tree leaf 'lr' is a float",
        TypeError,
    )

    # fn itself raises on one rank: that rank raises its own error, the others name it.
    def loss(params):
        if odd:
            raise ZeroDivisionError("this rank's batch was empty")
        return sum(p.sum() for p in params.values())

    if odd:
        _refused(lambda: fsync.grad(loss)(base), "this rank's batch was empty", ZeroDivisionError)
    else:
        _refused(
            lambda: fsync.grad(loss)(base),
            rf"{refused}.*rank {last}: fn raised ZeroDivisionError: this rank's batch was empty",
            RuntimeError,
        )


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_what_one_rank_finds_alone_is_every_ranks_error(world: World, compiled):
    world.run(_on_rank_local_findings, compiled, timeout=600)

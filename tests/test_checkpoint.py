"""fsync.checkpoint on real gloo worlds: written by 2 ranks, resumed on 1, 3 and 4 and back.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`. The training is
``tests/test_zero.py``'s exact one: AdamW over the parity model with the hook
``allreduce("sum")`` and only rank 0's gradient nonzero, so the reduced gradient is
rank 0's exactly at any world size (``x + 0 + ... + 0 == x``), and AdamW's operations
are elementwise: a run resumed at another world size or in the other sharding mode
must match the uninterrupted one bit for bit, and so does ``torch.optim.AdamW``
loaded from the plain-file export.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fsync
from tests._models import func_loss, params_of, ref_batch, ref_model
from tests.conftest import get_world
from tests.test_zero import ADAMW, SMALL, _exact_grads

BEFORE, AFTER = 3, 3  # steps before the checkpoint, steps after it
# Each multi-rank test's bound: a hang fails the test, not the suite (the World kills
# its ranks past its own timeout, shorter still).
TIMEOUT = 150
RUN_TIMEOUT = 100


def _step(shard_buckets, group=None, optimizer=None):
    return fsync.ops.zero(
        optimizer or fsync.optim.adamw(**ADAMW),
        hook=fsync.ops.allreduce("sum"),
        shard_buckets=shard_buckets,
        group=group,
        **SMALL,
    )


def _mesh_2x2():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))


def _train(step, params, state, steps):
    rank = dist.get_rank()
    for s in steps:
        params, state = step(params, _exact_grads(params, s, rank), state)
    return params, state


def _clone(tree):
    return {k: v.clone() for k, v in tree.items()}


def _on_rank_write(path):
    """Trains BEFORE steps sharded, saves, goes on AFTER steps: the uninterrupted run."""
    step = _step(True)
    params = params_of(ref_model())
    params, state = _train(step, params, step.init(params), range(BEFORE))
    dcp.save(fsync.checkpoint.state_dict(params, state, step=step), checkpoint_id=path)
    params, state = _train(step, params, state, range(BEFORE, BEFORE + AFTER))
    return params, fsync.ops.zero_state_dict(state, step)


def _on_rank_resume(path, cases):
    """Per case ``(shard_buckets, on a 2 x 2 mesh, path to save again or None)``: loaded from
    ``path`` into freshly built parameters, trained AFTER steps; what the rank ends with."""
    out = []
    for shard_buckets, mesh, again in cases:
        step = _step(shard_buckets, group=_mesh_2x2() if mesh else None)
        fresh = params_of(ref_model())  # the model's initial values, not the checkpoint's
        untouched = _clone(fresh)
        params, state = fsync.checkpoint.load(path, fresh, step=step)
        assert all(torch.equal(fresh[k], untouched[k]) for k in fresh)  # nothing written to
        assert int(state.step) == BEFORE and int(state.opt.step) == BEFORE
        if again is not None:
            dcp.save(fsync.checkpoint.state_dict(params, state, step=step), checkpoint_id=again)
        params, state = _train(step, params, state, range(BEFORE, BEFORE + AFTER))
        out.append((params, fsync.ops.zero_state_dict(state, step)))
    return out


def _assert_same_run(results, expected, what):
    params, full = expected
    for rank, (p, f) in enumerate(results):
        assert all(torch.equal(p[k], params[k]) for k in params), (what, rank)
        if f is not None:  # zero_state_dict's full state, on rank 0
            assert int(f.step) == int(full.step) == BEFORE + AFTER
            for slot in ("exp_avg", "exp_avg_sq"):
                mine, want = getattr(f, slot), getattr(full, slot)
                assert all(torch.equal(mine[k], want[k]) for k in want), (what, slot)


@pytest.mark.timeout(2 * TIMEOUT)
def test_written_by_2_ranks_resumes_on_1_3_and_4_in_either_mode_and_back(tmp_path):
    path, again = str(tmp_path / "by2"), str(tmp_path / "by3")
    written = get_world(2).run(_on_rank_write, path, timeout=RUN_TIMEOUT)
    expected = written[0]
    _assert_same_run(written[1:], expected, "the other rank of the writing world")
    # Every world size and mode reads the two ranks' shards; the world of 3 that owns
    # buckets whole saves again, and 2 sharded ranks read that back.
    runs = {
        1: [(True, False, None), (False, False, None)],
        3: [(True, False, None), (False, False, again)],
        4: [(True, True, None), (False, True, None)],
    }
    for size, cases in runs.items():
        results = get_world(size).run(_on_rank_resume, path, cases, timeout=RUN_TIMEOUT)
        for k, case in enumerate(cases):
            _assert_same_run([r[k] for r in results], expected, (size, case))
    back = get_world(2).run(_on_rank_resume, again, [(True, False, None)], timeout=RUN_TIMEOUT)
    _assert_same_run([r[0] for r in back], expected, "back on 2 ranks")


# --- bad input ---------------------------------------------------------------------------


def _error(call):
    """The type and message of what ``call()`` raised (it must raise)."""
    try:
        call()
    except (ValueError, FileNotFoundError, TypeError) as error:
        return type(error).__name__, str(error)
    raise AssertionError("no error")


def _on_rank_bad_input(root):
    rank = dist.get_rank()
    path = os.path.join(root, "good")
    step = _step(True)
    params = params_of(ref_model())
    params, state = _train(step, params, step.init(params), range(1))
    dcp.save(fsync.checkpoint.state_dict(params, state, step=step), checkpoint_id=path)
    dist.barrier()
    if rank == 0:  # a half-written copy (no .metadata) and one with a short data file
        shutil.copytree(path, os.path.join(root, "half"))
        os.remove(os.path.join(root, "half", ".metadata"))
        shutil.copytree(path, os.path.join(root, "short"))
        data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
        with open(os.path.join(root, "short", data), "r+b") as f:
            f.truncate(10)
    dist.barrier()

    fresh = params_of(ref_model())
    untouched = _clone(fresh)
    other_model = {**_clone(fresh), "extra": torch.zeros(3)}
    wider = {k: torch.zeros(25, 24) if k == "fc.weight" else v for k, v in _clone(fresh).items()}
    found = {
        "another model": _error(lambda: fsync.checkpoint.load(path, other_model, step=step)),
        "another shape": _error(lambda: fsync.checkpoint.load(path, wider, step=step)),
        "another optimizer": _error(
            lambda: fsync.checkpoint.load(
                path, fresh, step=_step(True, optimizer=fsync.optim.sgd(0.1, momentum=0.9))
            )
        ),
        "missing": _error(
            lambda: fsync.checkpoint.load(os.path.join(root, "none"), fresh, step=step)
        ),
        "half-written": _error(
            lambda: fsync.checkpoint.load(os.path.join(root, "half"), fresh, step=step)
        ),
        "short file": _error(
            lambda: fsync.checkpoint.load(os.path.join(root, "short"), fresh, step=step)
        ),
        # Only rank 1 is given a wrong path: both ranks raise, naming rank 1.
        "one rank": _error(
            lambda: fsync.checkpoint.load(
                path if rank == 0 else os.path.join(root, "none"), fresh, step=step
            )
        ),
    }
    assert all(torch.equal(fresh[k], untouched[k]) for k in fresh)
    # After all that, the group works and the good checkpoint loads.
    loaded, _ = fsync.checkpoint.load(path, fresh, step=step)
    assert all(torch.equal(loaded[k], params[k]) for k in params)
    return found


@pytest.mark.timeout(TIMEOUT)
def test_bad_checkpoints_are_every_ranks_error_before_anything_is_read(tmp_path):
    found = get_world(2).run(_on_rank_bad_input, str(tmp_path), timeout=RUN_TIMEOUT)
    assert found[0] == found[1]  # the same error on every rank
    errors = found[0]
    expected = {
        "another model": ("ValueError", r"holds no parameter 'extra' \(it holds \d+ parameters"),
        "another shape": ("ValueError", r"parameter 'fc.weight' with shape \(24, 24\)"),
        "another optimizer": ("ValueError", r"another optimizer.*'exp_avg'.*'momentum'"),
        "missing": ("FileNotFoundError", r"no checkpoint at .*none.*not a directory"),
        "half-written": ("ValueError", r"incomplete: it has no \.metadata"),
        "short file": ("ValueError", r"incomplete: its data file .* has 10 bytes"),
        "one rank": ("FileNotFoundError", r"^rank 1: no checkpoint at"),
    }
    for case, (kind, pattern) in expected.items():
        assert errors[case][0] == kind and re.search(pattern, errors[case][1]), (case, errors[case])


# --- async save, and the plain-file export into torch.optim.AdamW -----------------------


def _on_rank_async(path):
    """Saved with dcp.async_save at step BEFORE while the next steps run; loaded back."""
    step = _step(True)
    params = params_of(ref_model())
    params, state = _train(step, params, step.init(params), range(BEFORE))
    saved_params, saved = _clone(params), fsync.ops.zero_state_dict(state, step)
    # The save's collectives run in a thread of their own, beside the step's: on a group
    # of their own (one group in two threads would interleave their collectives).
    saving = dist.new_group(backend="gloo")
    sd = fsync.checkpoint.state_dict(params, state, step=step)
    future = dcp.async_save(sd, checkpoint_id=path, process_group=saving)
    later, _ = _train(step, params, state, range(BEFORE, BEFORE + AFTER))
    future.result()
    dist.destroy_process_group(saving)
    loaded, loaded_state = fsync.checkpoint.load(path, params_of(ref_model()), step=step)
    assert all(torch.equal(loaded[k], saved_params[k]) for k in saved_params)
    full = fsync.ops.zero_state_dict(loaded_state, step)
    if full is not None:
        assert int(full.step) == BEFORE
        for slot in ("exp_avg", "exp_avg_sq"):
            mine, want = getattr(full, slot), getattr(saved, slot)
            assert all(torch.equal(mine[k], want[k]) for k in want), slot
    return later


def _adamw_from_export(file):
    """torch.optim.AdamW over the exported parameters, its state from the export, fed the
    gradients the ZeRO ranks reduced (rank 0's): the parameters after AFTER steps."""
    exported = torch.load(file)  # weights-only: nested dicts of tensors and a JSON string
    model = ref_model()
    model.load_state_dict(exported["params"])
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    opt.load_state_dict(fsync.checkpoint.torch_optimizer_state_dict(exported, opt, names))
    loss = func_loss(model)
    for s in range(BEFORE, BEFORE + AFTER):
        params = {n: p.detach() for n, p in model.named_parameters()}
        grads = torch.func.grad(loss)(params, ref_batch(0, s, batch=12))
        for n, p in model.named_parameters():
            p.grad = grads[n]
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(TIMEOUT)
def test_async_save_and_the_export_continue_in_torch_adamw_bit_for_bit(tmp_path):
    path, file = str(tmp_path / "async"), str(tmp_path / "plain.pt")
    expected = get_world(2).run(_on_rank_async, path, timeout=RUN_TIMEOUT)[0]
    dcp_to_torch_save(path, file)
    # In a rank's process: its one thread computes the gradients as the ranks did (the
    # test process's threads may sum the embedding's gradient in another order).
    continued = get_world(1).run(_adamw_from_export, file, timeout=RUN_TIMEOUT)[0]
    assert continued.keys() == expected.keys()
    for n in expected:
        assert torch.equal(continued[n], expected[n]), n


# --- the hook's state ---------------------------------------------------------------------


def _powersgd_step(shard_buckets=True):
    hook = fsync.ops.powersgd(rank=1, start_step=0, min_compression_rate=1.0)
    return fsync.ops.zero(fsync.optim.adamw(**ADAMW), hook=hook, shard_buckets=shard_buckets)


def _leaves_equal(a, b):
    x, y = fsync._tree.flatten(a)[0], fsync._tree.flatten(b)[0]
    return len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))


def _on_rank_powersgd_save(path):
    """PowerSGD's state after BEFORE steps (each rank its own error feedback), saved."""
    rank = dist.get_rank()
    step = _powersgd_step()
    params = params_of(ref_model())
    state = step.init(params)
    for s in range(BEFORE):  # every rank its own gradient: error feedback differs by rank
        grads = torch.func.grad(func_loss(ref_model()))(params, ref_batch(rank, s))
        params, state = step(params, grads, state)
    dcp.save(fsync.checkpoint.state_dict(params, state, step=step), checkpoint_id=path)
    assert any(e.abs().sum() > 0 for e in state.hook.error)  # something to restore
    return state.hook


def _on_rank_powersgd_load(path, saved):
    """Restored at the world and plan it was saved with, afresh at another."""
    step = _powersgd_step()
    _, state = fsync.checkpoint.load(path, params_of(ref_model()), step=step)
    fresh = step.init(params_of(ref_model())).hook
    if dist.get_world_size() == len(saved):
        return _leaves_equal(state.hook, saved[dist.get_rank()])
    return _leaves_equal(state.hook, fresh)


@pytest.mark.timeout(TIMEOUT)
def test_powersgd_state_is_restored_at_the_same_world_and_afresh_at_another(tmp_path):
    path = str(tmp_path / "powersgd")
    saved = get_world(2).run(_on_rank_powersgd_save, path, timeout=RUN_TIMEOUT)
    assert not _leaves_equal(saved[0].error, saved[1].error)  # each rank's own
    assert get_world(2).run(_on_rank_powersgd_load, path, saved, timeout=RUN_TIMEOUT) == [True] * 2
    assert get_world(1).run(_on_rank_powersgd_load, path, saved, timeout=RUN_TIMEOUT) == [True]


# --- GradSync's and DiLoCo's states, with the optimizer's: (opt, sync), (opt, diloco) ------
#
# Every rank its own gradients (ref_batch(rank, s)), PowerSGD with error feedback: each
# rank's hook state is its own. Resumed at the world of 2 that wrote it, the run goes on
# bit for bit; at another world size what is each rank's own starts afresh, and the run
# must equal a reference put together by hand from the writing world's values (the same
# arithmetic on the same tensors: bit for bit).


def _powersgd():
    return fsync.ops.powersgd(rank=1, start_step=0, min_compression_rate=1.0)


def _sync_run(opt, sync, params, opt_state, sync_state, steps):
    """An optimizer after a GradSync, as examples/compression.py trains."""
    rank, loss = dist.get_rank(), func_loss(ref_model())
    for s in steps:
        grads, sync_state = sync(torch.func.grad(loss)(params, ref_batch(rank, s)), sync_state)
        params, opt_state = opt.update(params, grads, opt_state)
    return params, opt_state, sync_state


def _on_rank_sync_write(path):
    """BEFORE steps, saved as (opt, sync), AFTER more: what was saved and the final params."""
    opt, sync = fsync.optim.adamw(**ADAMW), fsync.GradSync(hook=_powersgd())
    params = params_of(ref_model())
    params, opt_state, sync_state = _sync_run(
        opt, sync, params, opt.init(params), sync.init(params), range(BEFORE)
    )
    sd = fsync.checkpoint.state_dict(params, (opt_state, sync_state), step=(opt, sync))
    dcp.save(sd, checkpoint_id=path)
    saved = _clone(params), opt_state, sync_state.hook
    final, _, _ = _sync_run(opt, sync, params, opt_state, sync_state, range(BEFORE, BEFORE + AFTER))
    return saved, final


def _on_rank_sync_resume(path, saved):
    """Loaded as (opt, sync): restored (each rank its own hook state) at the world of
    ``saved``, else the hook afresh; AFTER steps on, against the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, sync = fsync.optim.adamw(**ADAMW), fsync.GradSync(hook=_powersgd())
    fresh = params_of(ref_model())
    untouched = _clone(fresh)
    params, (opt_state, sync_state) = fsync.checkpoint.load(path, fresh, step=(opt, sync))
    assert all(torch.equal(fresh[k], untouched[k]) for k in fresh)  # nothing written to
    want_params, want_opt, want_hook = saved[rank] if world == len(saved) else saved[0]
    if world != len(saved):  # another world: the hook state as init makes it
        want_hook = sync.init(want_params).hook
    assert _leaves_equal(params, want_params) and _leaves_equal(opt_state, want_opt)
    assert _leaves_equal(sync_state.hook, want_hook) and int(sync_state.step) == BEFORE
    by_hand = sync.init(want_params)._replace(hook=want_hook, step=torch.tensor(BEFORE))
    steps = range(BEFORE, BEFORE + AFTER)
    continued, _, _ = _sync_run(opt, sync, params, opt_state, sync_state, steps)
    reference, _, _ = _sync_run(opt, sync, _clone(want_params), want_opt, by_hand, steps)
    assert _leaves_equal(continued, reference)
    # A checkpoint of (opt, sync) is no checkpoint of opt alone, on every rank.
    other = _error(lambda: fsync.checkpoint.load(path, fresh, step=opt))
    unpaired = _error(lambda: fsync.checkpoint.state_dict(params, opt_state, step=(opt, sync)))
    return continued, other, unpaired


@pytest.mark.timeout(2 * TIMEOUT)
def test_sync_state_resumes_on_2_bit_for_bit_and_afresh_on_1_and_3(tmp_path):
    path = str(tmp_path / "sync")
    written = get_world(2).run(_on_rank_sync_write, path, timeout=RUN_TIMEOUT)
    saved = [s for s, _ in written]
    assert not _leaves_equal(saved[0][2].error, saved[1][2].error)  # each rank's own
    resumed = get_world(2).run(_on_rank_sync_resume, path, saved, timeout=RUN_TIMEOUT)
    for (_, final), (continued, _, _) in zip(written, resumed, strict=True):
        assert _leaves_equal(continued, final)  # the uninterrupted run, bit for bit
    for size in (1, 3):
        get_world(size).run(_on_rank_sync_resume, path, saved, timeout=RUN_TIMEOUT)
    other, unpaired = resumed[0][1:]
    assert other[0] == "ValueError" and re.search(r"holds the states \['optim', 'sync'\]", other[1])
    assert unpaired[0] == "TypeError" and re.search(r"tuple of their 2 states", unpaired[1])


def _diloco_run(opt, outer, params, opt_state, diloco_state, steps):
    """An inner optimizer on each rank's own gradients, then DiLoCo: examples/diloco.py."""
    rank, loss = dist.get_rank(), func_loss(ref_model())
    for s in steps:
        grads = torch.func.grad(loss)(params, ref_batch(rank, s))
        params, opt_state = opt.update(params, grads, opt_state)
        params, diloco_state = outer.update(params, diloco_state)
    return params, opt_state, diloco_state


def _diloco_steps():
    # H = 2 and BEFORE = 3: saved one inner step after a sync, the ranks' parameters apart.
    return fsync.optim.adamw(**ADAMW), fsync.diloco(2, hook=_powersgd())


def _diloco_values(state):
    """A DiLoCoState's tensors (its SyncState's plan metadata left out)."""
    return state.anchor, state.outer, state.sync.hook, state.sync.step, state.step


def _on_rank_diloco_write(path):
    opt, outer = _diloco_steps()
    params = params_of(ref_model())
    params, opt_state, state = _diloco_run(
        opt, outer, params, opt.init(params), outer.init(params), range(BEFORE)
    )
    sd = fsync.checkpoint.state_dict(params, (opt_state, state), step=(opt, outer))
    dcp.save(sd, checkpoint_id=path)
    saved = _clone(params), opt_state, _diloco_values(state)
    final, _, _ = _diloco_run(opt, outer, params, opt_state, state, range(BEFORE, BEFORE + AFTER))
    return saved, final


def _on_rank_diloco_resume(path, saved):
    """Loaded as (opt, diloco): at the world of ``saved`` every rank's own parameters,
    optimizer and hook state; at another, each rank from the anchor, its optimizer and
    hook afresh. Anchor, outer state and step counts everywhere bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, outer = _diloco_steps()
    params, (opt_state, state) = fsync.checkpoint.load(
        path, params_of(ref_model()), step=(opt, outer)
    )
    want_params, want_opt, (anchor, outer_state, hook, sync_step, step) = (
        saved[rank] if world == len(saved) else saved[0]
    )
    if world != len(saved):
        want_params, want_opt = _clone(anchor), opt.init(anchor)
        hook = outer.init(anchor).sync.hook
    assert _leaves_equal(params, want_params) and _leaves_equal(opt_state, want_opt)
    assert _leaves_equal(_diloco_values(state), (anchor, outer_state, hook, sync_step, step))
    assert int(state.step) == BEFORE and int(state.sync.step) == 2
    made = outer.init(anchor)
    by_hand = made._replace(
        outer=outer_state, sync=made.sync._replace(hook=hook, step=sync_step), step=step
    )
    steps = range(BEFORE, BEFORE + AFTER)
    continued, _, _ = _diloco_run(opt, outer, params, opt_state, state, steps)
    reference, _, _ = _diloco_run(opt, outer, _clone(want_params), want_opt, by_hand, steps)
    assert _leaves_equal(continued, reference)
    return continued


@pytest.mark.timeout(2 * TIMEOUT)
def test_diloco_state_resumes_on_2_bit_for_bit_and_from_the_anchor_on_3(tmp_path):
    path = str(tmp_path / "diloco")
    written = get_world(2).run(_on_rank_diloco_write, path, timeout=RUN_TIMEOUT)
    saved = [s for s, _ in written]
    assert not _leaves_equal(saved[0][0], saved[1][0])  # each rank's own parameters
    assert not _leaves_equal(saved[0][2][2], saved[1][2][2])  # and error feedback
    resumed = get_world(2).run(_on_rank_diloco_resume, path, saved, timeout=RUN_TIMEOUT)
    for (_, final), continued in zip(written, resumed, strict=True):
        assert _leaves_equal(continued, final)  # the uninterrupted run, bit for bit
    get_world(3).run(_on_rank_diloco_resume, path, saved, timeout=RUN_TIMEOUT)

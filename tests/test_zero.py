"""The ZeRO step on real gloo worlds, against torch.optim, DDP + ZeroRedundancyOptimizer.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`; they make
their own assertions and return what the test process needs to see.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import re
import sys
import time
import types
from unittest import mock

import optree
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from fsync import _comm, _tree
from fsync._comm import _groups
from fsync._comm._failures import REPORT_PATIENCE_S
from fsync._pack import shard_numel
from tests._models import (
    Backwards,
    Boom,
    backwards_loss,
    func_loss,
    params_of,
    ref_batch,
    ref_loss,
    ref_model,
)
from tests._numerics import AGREEMENT, linear_loss
from tests._world import World, started_early

STEPS = 10
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
# Small buckets, so the parity model's 2,000 parameters make three of them.
SMALL = {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001}


def _gathered(tree):
    """Every rank's copy of a dict of tensors: {name: [rank0, rank1, ...]}."""
    out = {}
    for name, t in tree.items():
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        out[name] = parts
    return out


def _nbytes(tree):
    leaves, _ = _tree.flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _assert_same(ours, ref, world_size):
    for k, r in ref.items():
        if world_size <= 2:
            # With one or two ranks the mean a * 0.5 + b * 0.5 is the exact mean
            # rounded once, whatever the summation order, and the optimizer runs
            # torch.optim's operations: the runs agree bit for bit.
            assert torch.equal(ours[k], r), (k, (ours[k] - r).abs().max())
        else:
            # Three or four ranks: the reduction adds W rounded terms (W - 1 more
            # roundings than the exactly rounded mean, or than DDP's bucketed
            # all-reduce in another order). AdamW's step m / (sqrt(v) + eps) does
            # not depend on the gradients' scale, so a gradient off by a few ulps
            # moves the step by a few ulps of lr, and the parameter may round the
            # other way: about one ulp of the parameters per step (measured: at
            # most 2 ulps after 10 steps).
            bound = STEPS * torch.finfo(r.dtype).eps * r.abs().max()
            assert (ours[k] - r).abs().max() <= bound, (k, (ours[k] - r).abs().max(), bound)


# --- 1 and 2: parity with torch.optim and ZeroRedundancyOptimizer; state per rank --------


def _assert_bitwise(ours, expected, what):
    """Every tensor of two trees equal bit for bit, layouts included."""
    a, spec_a = _tree.flatten(ours)
    b, spec_b = _tree.flatten(expected)
    assert spec_a == spec_b, (what, spec_a, spec_b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.stride() == y.stride(), (
                what,
                i,
                x.stride(),
                y.stride(),
            )
            assert x.is_meta == y.is_meta and x.shape == y.shape, (what, i)
            if not x.is_meta:  # the state's tree, metadata only
                assert torch.equal(x, y), (what, i, (x.double() - y.double()).abs().max())
        else:
            assert x == y, (what, i)


def _assert_elementwise(ours, expected, name, steps, what):
    """Equal bit for bit, but for bfloat16 under SGD: torch's CPU kernel for a bfloat16
    ``add(x, y, alpha=a)`` (SGD's ``p - lr * g``, its momentum and weight decay) fuses the
    multiply-add in its vectorised loop and rounds ``a * y`` first in its scalar tail, so an
    element's bits depend on where it falls in its tensor (float32/64 and Adam's kernels do
    not), and a flat shard or bucket and the parameter cut from it may disagree by an ulp of
    the parameter's scale per such add and step: two per step (the parameter and the
    momentum buffer). The same holds for every dtype under a fused optimizer (``fused=True``):
    torch's fused kernels round differently in their scalar tail too (an ulp at a few
    elements of 100k, measured), two per step as bound."""
    a, b = _tree.flatten(ours)[0], _tree.flatten(expected)[0]
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not isinstance(x, torch.Tensor):
            assert x == y, (what, i)
        elif (x.dtype == torch.bfloat16 and name == "sgd") or name.endswith("fused"):
            ulp = torch.finfo(torch.bfloat16).eps * y.abs().max().float()
            assert (x.float() - y.float()).abs().max() <= 2 * steps * ulp, (what, i)
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), (what, i)


def _on_rank_parity(shard_buckets):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = ref_model()
    loss_fn = func_loss(model)
    params = params_of(model)
    step = fsync.ops.zero(fsync.optim.adamw(**ADAMW), shard_buckets=shard_buckets, **SMALL)
    state = step.init(params)
    assert len(step.layout(state).plan.buckets) == 3
    # The overlapped call, beside the step after backward: the same bits at every step.
    overlapped, o_params, o_state = step.value_and_step(loss_fn), params, step.init(params)

    # Reference 1: torch.optim.AdamW fed the exact mean of every rank's gradients.
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), **ADAMW)
    # Reference 2: DDP with ZeroRedundancyOptimizer(AdamW), torch's own ZeRO.
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=SMALL["bucket_cap_mb"])
    zero_ref = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    for s in range(STEPS):
        batch = ref_batch(rank, s)
        grads = torch.func.grad(loss_fn)(params, batch)
        ref_grads = torch.func.grad(loss_fn)({k: v.detach() for k, v in ref.items()}, batch)
        for k, parts in _gathered(ref_grads).items():
            ref[k].grad = (torch.stack([p.double() for p in parts]).sum(0) / world_size).float()
        ref_opt.step()
        zero_ref.zero_grad()
        ref_loss(ddp, batch).backward()
        zero_ref.step()

        before = {k: v.clone() for k, v in (*params.items(), *grads.items())}
        new_params, state = step(params, grads, state)
        # The first call already updated the parameters (no warm-up), and the
        # inputs were left as they were.
        assert s > 0 or not torch.equal(new_params["head.weight"], params["head.weight"])
        assert all(torch.equal(v, {**params, **grads}[k]) for k, v in before.items())
        params = new_params
        held = [x for x in _tree.flatten((o_params, o_state))[0] if not x.is_meta]
        copies = [x.clone() for x in held]
        (o_params, loss), o_state = overlapped(o_state, o_params, batch)
        assert all(torch.equal(a, b) for a, b in zip(held, copies, strict=True))  # untouched
        assert torch.equal(loss, ref_loss(model, batch)) or s > 0
        _assert_bitwise((o_params, o_state), (params, state), f"step {s}")

    assert params["conv.weight"].is_contiguous(memory_format=torch.channels_last)
    _assert_same(params, {k: v.detach() for k, v in ref.items()}, world_size)
    _assert_same(params, {k: v.detach() for k, v in ddp.module.named_parameters()}, world_size)

    full = fsync.optim.adamw(**ADAMW).init(params_of(model))
    return {
        "local": _nbytes(state.opt),
        "full": _nbytes(full),
        "owners": step.layout(state).owners,
        "bucket_numels": [spec.numel for spec in step.layout(state).plan.specs],
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4], indirect=True)
@pytest.mark.parametrize("shard_buckets", [True, False])
def test_parity_with_torch_adamw_and_zero_redundancy_optimizer(world: World, shard_buckets):
    reports = world.run(_on_rank_parity, shard_buckets)
    w, full, numels = world.size, reports[0]["full"], reports[0]["bucket_numels"]
    local = [r["local"] for r in reports]
    # AdamW keeps exp_avg and exp_avg_sq (2 x 4 bytes per float32 element) and one
    # replicated int64 step count.
    per_element, step_bytes = 2 * 4, 8
    assert full == per_element * sum(numels) + step_bytes
    per_param = full - step_bytes
    if shard_buckets:
        # Each rank holds ceil(numel / W) elements of every bucket: 1/W of the state
        # plus under one padding element per bucket.
        padding = per_element * sum(shard_numel(n, w) - n / w for n in numels)
        assert padding < per_element * len(numels)
        assert all(b == per_param / w + padding + step_bytes for b in local), local
    else:
        # Whole buckets by size, largest first to the least loaded rank: nothing is
        # held twice, and no rank holds more than its share plus the largest bucket.
        owners = reports[0]["owners"]
        assert all(r["owners"] == owners for r in reports) and len(owners) == len(numels)
        assert sum(local) == per_param + w * step_bytes
        largest = per_element * max(numels)
        assert all(b <= per_param / w + largest + step_bytes for b in local), local
    print(f"state bytes per rank, W={w}, shard_buckets={shard_buckets}: {local} (unsharded {full})")


# --- 3: save with 4 ranks, resume with 2 and 3 -------------------------------------------------

CKPT_STEPS = (3, 3)  # steps before the checkpoint, steps after it


def _exact_grads(params, s, rank):
    """The gradient of a fixed global batch, passed by rank 0 alone.

    Summed over ranks (hook allreduce("sum")) it arrives exactly, whatever the
    world size: x + 0 + ... + 0 == x. Runs on different world sizes can then be
    compared bit for bit.
    """
    grads = torch.func.grad(func_loss(ref_model()))(params, ref_batch(0, s, batch=12))
    return grads if rank == 0 else {k: torch.zeros_like(v) for k, v in grads.items()}


def _zero_step(shard_buckets):
    return fsync.ops.zero(
        fsync.optim.adamw(**ADAMW),
        hook=fsync.ops.allreduce("sum"),
        shard_buckets=shard_buckets,
        **SMALL,
    )


def _on_rank_save(path):
    rank = dist.get_rank()
    params = params_of(ref_model())
    step = _zero_step(True)
    state = step.init(params)
    for s in range(CKPT_STEPS[0]):
        params, state = step(params, _exact_grads(params, s, rank), state)
    full = fsync.ops.zero_state_dict(state, step, to=1)
    assert (full is None) == (rank != 1)
    if rank == 1:
        torch.save({"params": params, "opt": full}, path)
    dist.barrier()
    for s in range(CKPT_STEPS[0], sum(CKPT_STEPS)):  # the uninterrupted run goes on
        params, state = step(params, _exact_grads(params, s, rank), state)
    return params, _unsharded_run()


def _on_rank_resume(path, shard_buckets):
    rank = dist.get_rank()
    checkpoint = torch.load(path)  # weights_only: fsync's state classes are registered
    params = checkpoint["params"]
    step = _zero_step(shard_buckets)
    state = step.load(params, checkpoint["opt"])
    # Resumed with the overlapped call, over the loss whose gradient _exact_grads is (zero
    # on every rank but 0: the loss times 0, whose gradient sums with rank 0's exactly).
    loss = func_loss(ref_model())
    call = step.value_and_step(lambda p, batch, k: loss(p, batch) * k)
    for s in range(CKPT_STEPS[0], sum(CKPT_STEPS)):
        (params, _), state = call(state, params, ref_batch(0, s, batch=12), float(rank == 0))
    return params, fsync.ops.zero_state_dict(state, step)


def _unsharded_run():
    """The same training without ZeRO: fsync.optim.adamw in one process."""
    opt = fsync.optim.adamw(**ADAMW)
    params = params_of(ref_model())
    state = opt.init(params)
    for s in range(sum(CKPT_STEPS)):
        params, state = opt.update(params, _exact_grads(params, s, 0), state)
    return params, state


def test_checkpoint_from_4_ranks_resumes_on_2_and_3(tmp_path):
    from tests.conftest import get_world

    path = str(tmp_path / "zero.pt")
    uninterrupted = get_world(4).run(_on_rank_save, path)
    # The reference ran in a rank process, with the ranks' thread settings.
    expected, expected_state = uninterrupted[0][1]
    for params, _ in uninterrupted:
        assert all(torch.equal(params[k], expected[k]) for k in expected)
    # Resume with 2 ranks sharded and with 3 ranks owning whole buckets, the same bits.
    for world_size, shard_buckets in ((2, True), (3, False)):
        results = get_world(world_size).run(_on_rank_resume, path, shard_buckets)
        for params, _ in results:
            assert all(torch.equal(params[k], expected[k]) for k in expected)
        full = results[0][1]
        assert type(full) is type(expected_state) and int(full.step) == sum(CKPT_STEPS)
        for k in expected:
            assert torch.equal(full.exp_avg[k], expected_state.exp_avg[k]), k
            assert torch.equal(full.exp_avg_sq[k], expected_state.exp_avg_sq[k]), k
        assert all(r[1] is None for r in results[1:])


def test_a_state_saved_under_its_former_module_loads_weights_only(monkeypatch):
    """A ZeroState torch.save'd by the release that kept it in ``fsync._zero_layout``."""
    step = fsync.ops.zero(fsync.optim.adam(0.1), group=_groups.ALONE)  # no process group
    params = {"w": torch.ones(3)}
    params, state = step(params, {"w": torch.ones(3)}, step.init(params))
    former = types.ModuleType("fsync._zero_layout")
    former.ZeroState = fsync.ops.ZeroState  # type: ignore[attr-defined]
    with monkeypatch.context() as m:  # pickled as that release pickled it
        m.setitem(sys.modules, "fsync._zero_layout", former)
        m.setattr(fsync.ops.ZeroState, "__module__", "fsync._zero_layout")
        buffer = io.BytesIO()
        torch.save(state, buffer)
    assert b"fsync._zero_layout" in buffer.getvalue()
    buffer.seek(0)
    restored = torch.load(buffer)  # weights only
    assert type(restored) is fsync.ops.ZeroState
    for got, saved in zip(optree.tree_leaves(restored), optree.tree_leaves(state), strict=True):
        assert got.is_meta == saved.is_meta and got.shape == saved.shape
        assert got.is_meta or torch.equal(got, saved)


def _on_rank_mixed_dtypes(shard_buckets):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)  # the same parameters on every rank
    dtypes = {"a": torch.float32, "b": torch.bfloat16, "c": torch.float64, "d": torch.bfloat16}
    shapes = {"a": (7, 5), "b": (33,), "c": (4,), "d": (2, 3, 4, 4)}
    start = {k: torch.randn(shapes[k], generator=g).to(dtypes[k]) for k in dtypes}
    start["d"] = start["d"].to(memory_format=torch.channels_last)
    start["e"] = None
    for name, opt in (
        ("sgd", fsync.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
        ("adam", fsync.optim.adam(0.1, weight_decay=0.01)),
        ("adamw", fsync.optim.adamw(0.1, weight_decay=0.1)),
        ("adamw fused", fsync.optim.adamw(0.1, weight_decay=0.1, fused=True)),
    ):
        step = fsync.ops.zero(
            opt, hook=fsync.ops.allreduce("sum"), shard_buckets=shard_buckets, **SMALL
        )
        assert len(step.layout(step.init(start)).plan.buckets) >= 3
        params = overlapped = start
        state = o_state = step.init(start)
        call = step.value_and_step(linear_loss)
        expected, expected_state = start, opt.init(start)
        for s in range(4):
            g = torch.Generator().manual_seed(1 + s)
            coefficients = {k: torch.randn(shapes[k], generator=g) for k in dtypes}
            grads = {k: c.to(dtypes[k]) for k, c in coefficients.items()}
            grads["e"] = coefficients["e"] = None
            if rank != 0:
                coefficients = {k: None if c is None else 0 * c for k, c in coefficients.items()}
            mine = {
                k: v if rank == 0 or v is None else torch.zeros_like(v) for k, v in grads.items()
            }
            params, state = step(params, mine, state)
            (overlapped, _), o_state = call(o_state, overlapped, coefficients)
            expected, expected_state = opt.update(expected, grads, expected_state)
            # The gradient of the linear loss is this rank's gradient above, bit for bit:
            # the overlapped call is the step after backward.
            _assert_bitwise((overlapped, o_state), (params, state), f"{name} step {s}")
        # The sum of rank 0's gradients and zeros is exact, and the optimizer's
        # operations are elementwise: sharding changes nothing, whatever the dtype, but
        # for bfloat16 under SGD (_assert_elementwise), four steps.
        assert params["e"] is None and params["d"].is_contiguous(memory_format=torch.channels_last)
        assert all(params[k].dtype == dtypes[k] for k in dtypes)
        _assert_elementwise(params, expected, name, 4, f"{name}: parameters")


@pytest.mark.parametrize("world", [3], indirect=True)
@pytest.mark.parametrize("shard_buckets", [True, False])
def test_mixed_dtypes_and_none_leaves(world: World, shard_buckets):
    world.run(_on_rank_mixed_dtypes, shard_buckets)


# --- replicated: the same pipeline, nothing split ----------------------------------------------

_OPTIMIZERS = {
    "sgd": lambda: fsync.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda: fsync.optim.adam(0.1, weight_decay=0.01),
    "adamw": lambda: fsync.optim.adamw(0.1, weight_decay=0.1),
}


def _on_rank_replicated():
    """``fsync.ops.replicated`` on four dtypes, a None leaf and several buckets: its step and
    its overlapped call give the bits of ``GradSync`` with the same options followed by the
    optimizer, every rank holds the whole optimizer state, and nothing is gathered."""
    rank = dist.get_rank()
    start = _mixed_tree()
    steps = 3
    for name, make in _OPTIMIZERS.items():
        opt = make()
        step, sync = fsync.ops.replicated(opt, **SMALL), fsync.GradSync(**SMALL)
        state = step.init(start)
        layout = step.layout(state)
        assert step.shard_group is _groups.ALONE and layout.world_size == 1
        assert len(layout.plan.buckets) >= 3 and set(layout.owners) == {0}
        assert _nbytes(state.opt) == _nbytes(opt.init(start))  # whole on every rank
        call = step.value_and_step(linear_loss)
        params = overlapped = expected = start
        o_state, sync_state, opt_state = state, sync.init(start), opt.init(start)
        for s in range(steps):
            g = torch.Generator().manual_seed(100 * s + rank)
            coefficients = {
                k: None if v is None else torch.randn(v.shape, generator=g)
                for k, v in start.items()
            }
            grads = {
                k: None if c is None else c.to(start[k].dtype) for k, c in coefficients.items()
            }
            with mock.patch.object(_comm, "broadcast", wraps=_comm.broadcast) as sent:
                params, state = step(params, grads, state)
                (overlapped, _), o_state = call(o_state, overlapped, coefficients)
            # Each bucket's "gather" is a broadcast from this rank to itself: the identity.
            buckets = len(layout.plan.buckets)
            assert len(sent.call_args_list) == 2 * buckets, sent.call_args_list
            assert all(c.args[2] is _groups.ALONE for c in sent.call_args_list)
            synced, sync_state = sync(grads, sync_state)
            expected, opt_state = opt.update(expected, synced, opt_state)
            # The gradient of the linear loss is ``grads``, bit for bit.
            _assert_bitwise((overlapped, o_state), (params, state), f"{name} step {s}")
        assert params["e"] is None
        assert params["d"].is_contiguous(memory_format=torch.channels_last)
        _assert_elementwise(params, expected, name, steps, f"{name}: parameters")
        full = fsync.ops.zero_state_dict(state, step)  # every rank: its own state is whole
        _assert_elementwise(full, opt_state, name, steps, f"{name}: optimizer state")


@pytest.mark.parametrize("world", [1, 2, 3], indirect=True)
def test_replicated_is_the_optimizer_after_the_sync_bit_for_bit(world: World):
    world.run(_on_rank_replicated)


def _on_rank_replicated_compiled():
    """The replicated overlapped call under ``fsync.compile``: one all-reduce per bucket and
    no other collective, the eager call's numbers (AdamW, its lr a tensor changed every
    step without a recompile)."""
    rank = dist.get_rank()
    params = _mixed_tree()
    lr = torch.tensor(0.1, dtype=torch.float64)
    step = fsync.ops.replicated(fsync.optim.adamw(lr), **SMALL)
    call = step.value_and_step(linear_loss)
    buckets = len(step.layout(step.init(params)).plan.buckets)
    compiled = fsync.compile(call)
    eager = ours = (_cloned(params), step.init(params))
    for s in range(3):
        lr.fill_(0.1 / (s + 1))
        g = torch.Generator().manual_seed(100 * s + rank)
        coefficients = {
            k: None if v is None else torch.randn(v.shape, generator=g) for k, v in params.items()
        }
        (p, _), state = call(eager[1], eager[0], coefficients)
        eager = (p, state)
        with torch._dynamo.config.patch(error_on_recompile=s > 0):
            if s == 0:
                ((p, _), state), code = run_and_get_code(compiled, ours[1], ours[0], coefficients)
            else:
                (p, _), state = compiled(ours[1], ours[0], coefficients)
        ours = (p, state)
    count = _collectives(code[-1])
    assert count == {**dict.fromkeys(count, 0), "all_reduce": buckets}, count
    assert int(ours[1].step) == 3 and ours[0]["e"] is None
    for k, e in eager[0].items():
        if e is None:
            continue
        # As in the compiled ZeRO test below: exact gradients, and the optimizer's
        # intermediates kept in float32 registers by inductor where eager rounds each
        # operation: 1 ulp of the parameter's scale per step (4 for bfloat16), three steps.
        per_step = 4 if e.dtype == torch.bfloat16 else 1
        ulp = torch.finfo(e.dtype).eps * e.abs().max().double()
        diff = (ours[0][k].double() - e.double()).abs().max()
        assert ours[0][k].dtype == e.dtype and diff <= 3 * per_step * ulp, (k, diff / ulp)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_replicated_compiled_issues_one_all_reduce_per_bucket(world: World):
    world.run(_on_rank_replicated_compiled, timeout=300)


# --- hooks: compression composes; whole buckets are sharded locally -----------------------


def _whole_buckets(inner):
    """A hook that ignores ctx.scatter and returns whole reduced buckets."""

    def apply(buckets, state, ctx):
        return inner.apply(buckets, state, ctx._replace(scatter=False))

    return fsync.Hook(inner.init, apply)


@contextlib.contextmanager
def _wire():
    """Every collective the step issues, as (op, dtype, numel), passed on to fsync's own."""
    sent = []
    names = ("all_reduce", "reduce_scatters", "all_gather", "broadcast")
    originals = {name: getattr(_comm, name) for name in names}

    def recording(name):
        def collective(x, *args, **kwargs):
            sent.append((name, x.dtype, x.numel()))
            return originals[name](x, *args, **kwargs)

        return collective

    def scatters(xs, *args, **kwargs):  # reduce_scatter calls it too: one record each
        def each():
            for x in xs:
                sent.append(("reduce_scatter", x.dtype, x.numel()))
                yield x

        return originals["reduce_scatters"](each(), *args, **kwargs)

    for name in names:
        setattr(_comm, name, scatters if name == "reduce_scatters" else recording(name))
    try:
        yield sent
    finally:
        for name, original in originals.items():
            setattr(_comm, name, original)


def _on_rank_bf16_compress(shard_buckets):
    """zero(adamw, hook=bf16_compress()): bfloat16 on the wire, AdamW on the bfloat16 mean."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = ref_model()
    loss_fn = func_loss(model)
    params = params_of(model)
    step = fsync.ops.zero(
        fsync.optim.adamw(**ADAMW),
        hook=fsync.ops.bf16_compress(),
        shard_buckets=shard_buckets,
        **SMALL,
    )
    state = step.init(params)
    numels = [spec.numel for spec in step.layout(state).plan.specs]
    if shard_buckets:  # gradients reduce-scattered (padded to W shards), shards gathered
        padded = [world_size * shard_numel(n, world_size) for n in numels]
        grads_sent = [("reduce_scatter", torch.bfloat16, n) for n in padded]
        params_sent = [("all_gather", torch.float32, n // world_size) for n in padded]
    else:  # gradients all-reduced, whole buckets broadcast by their owners
        grads_sent = [("all_reduce", torch.bfloat16, n) for n in numels]
        params_sent = [("broadcast", torch.float32, n) for n in numels]

    # The reference: torch.optim.AdamW fed the bfloat16 mean as DDP's bf16_compress_hook
    # computes it: cast to bfloat16, scale by 1/W, sum in bfloat16, cast back.
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), **ADAMW)
    for s in range(3):
        grads = torch.func.grad(loss_fn)(params, ref_batch(rank, s))
        if world_size > 2:
            # Three ranks (padded shards): only rank 0 contributes, so that the sum of its
            # scaled value and zeros is exact, whatever order gloo adds in.
            grads = grads if rank == 0 else {k: torch.zeros_like(v) for k, v in grads.items()}
        with _wire() as sent:
            params, state = step(params, grads, state)
        # The ranks' agreement, then one bf16 collective per bucket.
        assert sent == [AGREEMENT, *grads_sent, *params_sent], sent
        for k, parts in _gathered(grads).items():
            # Two ranks: a * 0.5 is exact and a + b one rounding in either order, so
            # gloo's sum and torch's agree bit for bit. Three: x * (1/3) + 0 + 0.
            scaled = [p.bfloat16() * (1 / world_size) for p in parts]
            ref[k].grad = functools.reduce(torch.add, scaled).float()
        ref_opt.step()
        # fsync.optim.adamw runs torch.optim.AdamW's operations (bitwise, see
        # test_parity_with_torch_adamw_and_zero_redundancy_optimizer): the same bits.
        for k, r in ref.items():
            assert torch.equal(params[k], r.detach()), (s, k, (params[k] - r).abs().max())
    # The float32 mean would have given other parameters: the test sees the rounding.
    exact = fsync.ops.zero(fsync.optim.adamw(**ADAMW), shard_buckets=shard_buckets, **SMALL)
    grads = torch.func.grad(loss_fn)(params_of(model), ref_batch(rank, 0))
    plain, _ = exact(params_of(model), grads, exact.init(params_of(model)))
    first, _ = step(params_of(model), grads, step.init(params_of(model)))
    assert not all(torch.equal(plain[k], first[k]) for k in plain)


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("shard_buckets", [True, False])
def test_bf16_compress_sends_bfloat16_and_steps_on_the_bfloat16_mean(world: World, shard_buckets):
    world.run(_on_rank_bf16_compress, shard_buckets)


def _on_rank_whole_bucket_hooks():
    rank = dist.get_rank()
    params = params_of(ref_model())
    grads = torch.func.grad(func_loss(ref_model()))(params, ref_batch(rank))
    opt = fsync.optim.adamw(**ADAMW)
    plain = fsync.ops.zero(opt, **SMALL)
    whole = fsync.ops.zero(opt, hook=_whole_buckets(fsync.ops.allreduce()), **SMALL)
    a, _ = plain(params, grads, plain.init(params))
    b, _ = whole(params, grads, whole.init(params))
    # All-reduce and reduce-scatter of two terms agree bit for bit.
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_hooks_returning_whole_buckets_work_when_sharding(world: World):
    world.run(_on_rank_whole_bucket_hooks)


# --- the overlapped call: collectives in plan order, errors before any bucket ------------------

TINY = {"bucket_cap_mb": 1e-4, "first_bucket_mb": 1e-4}


def _on_rank_overlap_order(shard_buckets):
    """Backward completes the buckets in the reverse of the plan's order; every rank still
    issues the agreement, then each bucket's reduce in plan order; updating in backward,
    each gather after the reduce of the bucket that follows it (or its own, where that has
    arrived); on the CPU by default, the gathers after backward, in plan order."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = Backwards()
    loss = backwards_loss(model)
    params = params_of(model)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    step = fsync.ops.zero(
        fsync.optim.adam(0.1), shard_buckets=shard_buckets, update_in_backward=True, **TINY
    )
    state = step.init(params)
    numels = [spec.numel for spec in step.layout(state).plan.specs]
    assert len(numels) == 4
    if shard_buckets:
        padded = [world_size * shard_numel(n, world_size) for n in numels]
        reduces = [("reduce_scatter", torch.float32, n) for n in padded]
        gathers = [("all_gather", torch.float32, n // world_size) for n in padded]
    else:
        reduces = [("all_reduce", torch.float32, n) for n in numels]
        gathers = [("broadcast", torch.float32, n) for n in numels]
    r, g = reduces, gathers
    with _wire() as sent:
        (new, _), new_state = step.value_and_step(loss)(state, params, x)
    if shard_buckets:  # gloo's reduce-scatter has arrived when it returns: gathered at once
        assert sent == [AGREEMENT, r[0], g[0], r[1], g[1], r[2], g[2], r[3], g[3]], sent
    else:  # an all-reduce in flight: the gather after the next bucket's reduce
        assert sent == [AGREEMENT, r[0], r[1], g[0], r[2], g[1], r[3], g[2], g[3]], sent
    everyone = [None] * world_size
    dist.all_gather_object(everyone, sent)
    assert all(e == sent for e in everyone)
    _assert_bitwise((new, new_state), step(params, torch.func.grad(loss)(params, x), state), "")

    # On the CPU by default (None) and with False, every update after backward: the
    # reduces as backward completes the buckets, then the gathers, the same bits.
    for after in (None, False):
        opt = fsync.optim.adam(0.1)
        later = fsync.ops.zero(opt, shard_buckets=shard_buckets, update_in_backward=after, **TINY)
        with _wire() as sent:
            (out, _), out_state = later.value_and_step(loss)(state, params, x)
        assert sent == [AGREEMENT, *r, *g], (after, sent)
        _assert_bitwise((out, out_state), (new, new_state), f"update_in_backward={after}")

    # An optimizer that is not leafwise, or a hook that is not bucketwise, waits for every
    # bucket before the first update: the same bits, the gathers after every reduce.
    opt = fsync.optim.adam(0.1)
    whole = fsync.ops.zero(
        fsync.optim.Optimizer(opt.init, opt.update),
        shard_buckets=shard_buckets,
        update_in_backward=True,
        **TINY,
    )
    with _wire() as sent:
        (other, _), other_state = whole.value_and_step(loss)(state, params, x)
    assert sent == [AGREEMENT, *r, *g], sent
    _assert_bitwise((other, other_state.opt), (new, new_state.opt), "not leafwise")
    powersgd = fsync.ops.zero(
        opt, hook=fsync.ops.powersgd(1, min_compression_rate=0), shard_buckets=shard_buckets, **TINY
    )
    p_state = powersgd.init(params)
    expected = powersgd(params, torch.func.grad(loss)(params, x), p_state)
    _assert_bitwise(powersgd.value_and_step(loss)(p_state, params, x)[1], expected[1], "powersgd")


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("shard_buckets", [True, False])
def test_overlapped_call_issues_in_plan_order(world: World, shard_buckets):
    world.run(_on_rank_overlap_order, shard_buckets)


def _on_rank_overlap_errors():
    rank = dist.get_rank()
    model = Backwards()
    loss = backwards_loss(model)
    params = params_of(model)
    x = torch.randn(3, 8)
    step = fsync.ops.zero(fsync.optim.adam(0.1), **TINY)
    state = step.init(params)
    call = step.value_and_step(loss)
    # Another plan on one rank: every rank raises before any bucket collective.
    mine = fsync.ops.zero(fsync.optim.adam(0.1), **(TINY if rank == 0 else SMALL))
    with _wire() as sent, pytest.raises(ValueError, match="differ across ranks"):
        mine.value_and_step(loss)(mine.init(params), params, x)
    assert all(dtype != torch.float32 for _, dtype, _ in sent), sent
    # What one rank finds alone (a parameter of another shape) is every rank's error.
    wrong = {**params, "l0.bias": torch.zeros(5)} if rank == 1 else params
    with _wire() as sent, pytest.raises(ValueError, match=r"rank 1: params does not match"):
        call(state, wrong, x)
    assert all(dtype != torch.float32 for _, dtype, _ in sent), sent
    with pytest.raises(TypeError, match="expected the ZeroState"):
        call(state.opt, params, x)
    with pytest.raises(ValueError, match="expected a scalar tensor"):
        step.value_and_step(lambda p, x: torch.func.functional_call(model, p, (x,)))(
            state, params, x
        )
    with pytest.raises(TypeError, match="argnums must be an int"):
        step.value_and_step(loss, argnums="params")
    # Nothing above left a collective half done: the world still steps, from the same state.
    (new, value), new_state = call(state, params, x)
    assert int(new_state.step) == 1 and value.dim() == 0 and not value.requires_grad
    assert not torch.equal(new["l0.weight"], params["l0.weight"])


@pytest.mark.parametrize("world", [2], indirect=True)
def test_overlapped_call_errors_are_every_ranks_before_any_bucket(world: World):
    world.run(_on_rank_overlap_errors, timeout=60)


PG_TIMEOUT = 4.0


def _on_rank_backward_raises():
    """Rank 1's backward raises once the first two buckets have left (they complete in plan
    order here: layers applied in the order they are defined, the plan reversed)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Linear(8, 7), nn.Linear(7, 6), nn.Linear(6, 5), nn.Linear(5, 4)]
    params = {f"{i}.{k}": v.detach() for i, m in enumerate(layers) for k, v in m.named_parameters()}

    def loss(p, x):
        for i in range(4):
            x = torch.tanh(nn.functional.linear(x, p[f"{i}.weight"], p[f"{i}.bias"]))
            if i == 1:  # backward reaches this after layers 3 and 2: buckets 1 and 2
                x = Boom.apply(x, rank == 1)
        return x.pow(2).mean()

    # Updates in backward: the gathers are in flight too when backward raises.
    step = fsync.ops.zero(fsync.optim.adam(0.1), update_in_backward=True, **TINY)
    state = step.init(params)
    assert len(step.layout(state).plan.buckets) == 4
    started = time.monotonic()
    with _wire() as sent, pytest.raises(RuntimeError) as error:
        step.value_and_step(loss)(state, params, torch.randn(3, 8))
    return time.monotonic() - started, str(error.value), [op for op, _, _ in sent]


# The case on a world of its own, started as this module's first test starts: its ~9 s of
# waiting for the group's timeout pass during the module's other tests.
backward_raised = started_early(
    "backward_raised",
    "test_a_rank_whose_backward_raises_leaves_the_others_with_fsyncs_error",
    {"raises": (2, _on_rank_backward_raises)},
    pg_timeout=PG_TIMEOUT,
)


def test_a_rank_whose_backward_raises_leaves_the_others_with_fsyncs_error(backward_raised):
    results = backward_raised.results()["raises"]
    (kind0, value0), (kind1, value1) = results
    assert kind0 == "ok" and kind1 == "ok", results
    _, message1, sent1 = value1
    assert "boom" in message1  # the failing rank reports its own error ...
    # ... having issued whole stages only, in order, before its backward raised (how many
    # depends on how far the starter thread got): the agreement, then per complete bucket
    # its reduce-scatter and its gather (gloo's reduce-scatter has arrived when it returns).
    # Rank 0 issued the same.
    whole = ["all_reduce", "reduce_scatter", "all_gather", "reduce_scatter", "all_gather"]
    assert sent1 in (whole[:1], whole[:3], whole), sent1
    elapsed, message0, sent0 = value0
    assert sent0[: len(sent1)] == sent1 and sent0[len(sent1)] == "reduce_scatter", sent0
    # Rank 0 waits for the first bucket that rank 1 never sent: its error names it, and
    # rank 1 as the rank that did not arrive (it left the call with its own error).
    missing = sent1.count("reduce_scatter") + 1
    assert f"an fsync collective failed at bucket {missing} of 4 (the hook" in message0, message0
    assert "rank 1 did not arrive" in message0, message0
    # gloo gives up after the group's timeout, or at once when rank 1's sockets close; the
    # slack covers scheduling.
    assert elapsed < PG_TIMEOUT + REPORT_PATIENCE_S + 20, elapsed


# --- 4: clear errors ----------------------------------------------------------------------------


def _on_rank_errors():
    rank = dist.get_rank()
    params = {"w": torch.ones(4, 3), "b": torch.zeros(4)}
    grads = {"w": torch.ones(4, 3), "b": torch.ones(4)}
    step = fsync.ops.zero(fsync.optim.adam(0.1))
    with pytest.raises(TypeError, match=r"expected the ZeroState returned by ZeroStep\.init"):
        step(params, grads, None)
    state = step.init(params)

    other = fsync.ops.zero(fsync.optim.adam(0.1), bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
    with pytest.raises(ValueError, match="state belongs to another plan"):
        step(params, grads, other.init(params))
    with pytest.raises(ValueError, match="params does not match the plan: its structure is"):
        step(params, grads, step.init({"x": torch.ones(3)}))
    owned = fsync.ops.zero(fsync.optim.adam(0.1), shard_buckets=False)
    with pytest.raises(ValueError, match="made with shard_buckets=False but this step has"):
        step(params, grads, owned.init(params))
    layout = state.layout.clone()
    layout[1] = 4
    with pytest.raises(ValueError, match=r"sharded for a world of 4 ranks.*zero_state_dict"):
        step(params, grads, state._replace(layout=layout))
    layout = state.layout.clone()
    layout[2] = 1 - rank
    with pytest.raises(ValueError, match=f"holds rank {1 - rank}'s part, but this is rank {rank}"):
        step(params, grads, state._replace(layout=layout))
    with pytest.raises(TypeError, match="expected the ZeroState"):
        step(params, grads, state.opt)
    with pytest.raises(ValueError, match=r"grads does not match the plan: leaf 'b' has shape"):
        step(params, {**grads, "b": torch.ones(5)}, state)
    with pytest.raises(ValueError, match=r"grads leaf 'w' requires grad"):
        step(params, {**grads, "w": torch.ones(4, 3, requires_grad=True)}, state)
    with pytest.raises(ValueError, match=r"params leaf 'b' is None, but the plan holds"):
        step({**params, "b": None}, grads, state)
    # The step keeps settings only: another tree gets its own state, with its own plan.
    assert step.layout(step.init({"x": torch.ones(3)})).plan.num_leaves == 1
    with pytest.raises(TypeError, match=r"params leaf 'n' has dtype torch.int64; the ZeRO step"):
        fsync.ops.zero(fsync.optim.sgd(0.1)).init({**params, "n": torch.ones(2).long()})
    with pytest.raises(TypeError, match=r"expected an fsync.optim.Optimizer"):
        fsync.ops.zero(torch.optim.SGD)
    with pytest.raises(TypeError, match=r"update_in_backward is 'cpu'; expected True, False or"):
        fsync.ops.zero(fsync.optim.sgd(0.1), update_in_backward="cpu")  # type: ignore[arg-type]
    truncating = fsync.Hook(lambda plan: (), lambda b, s, c: ([x[:-1] for x in b], s))
    bad = fsync.ops.zero(fsync.optim.adam(0.1), hook=truncating)
    with pytest.raises(ValueError, match=r"hook output: buffer 0 has shape \(15,\).*or this rank"):
        bad(params, grads, bad.init(params))
    with pytest.raises(ValueError, match="to must be a rank of the group, 0 to 1; got 2"):
        fsync.ops.zero_state_dict(state, step, to=2)
    full = fsync.optim.adam(0.1).init(params)  # a full state, made without ZeRO
    wrong = full._replace(exp_avg={**full.exp_avg, "w": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match=r"full_state.exp_avg\['w'\] has shape \(3, 4\)"):
        step.load(params, wrong)
    with pytest.raises(ValueError, match="full_state has structure"):
        step.load(params, fsync.optim.sgd(0.1, momentum=0.9).init(params))
    assert torch.equal(step.load(params, full).opt.exp_avg[0], torch.zeros(8))  # 16 / 2

    # Trees that differ across ranks: every rank raises the same error at init.
    mine = {"w": torch.ones(4, 3 + rank), "b": torch.zeros(4)}
    with pytest.raises(
        ValueError,
        match=r"parameter trees passed to ZeroStep.init differ across ranks: leaf 'w' has "
        r"shape \(4, 3\).* on rank 0 but shape \(4, 4\).* on rank 1",
    ):
        fsync.ops.zero(fsync.optim.adam(0.1)).init(mine)
    # Nothing above left a collective half done: the world still steps.
    new, _ = step(params, grads, state)
    assert torch.all(new["b"] < 0)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_clear_errors(world: World):
    world.run(_on_rank_errors, timeout=60)


# --- compile: the overlapped call, one reduce-scatter and one all-gather per bucket -------------


def _mixed_tree():
    """Parameters of four dtypes and layouts, and a None leaf (the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    dtypes = {"a": torch.float32, "b": torch.bfloat16, "c": torch.float64, "d": torch.bfloat16}
    shapes = {"a": (7, 5), "b": (33,), "c": (4,), "d": (2, 3, 4, 4)}
    params = {k: torch.randn(shapes[k], generator=g).to(dtypes[k]) for k in dtypes}
    params["d"] = params["d"].to(memory_format=torch.channels_last)
    return {**params, "e": None}


def _cloned(tree):
    return {k: None if v is None else v.clone() for k, v in tree.items()}


# A collective's call in inductor's code (not the size and alignment checks that name it).
_CALL = re.compile(r"^\s*(?:\w+ = )?torch\.ops\.(?:_c10d_functional|fsync)\.(\w+)\.default\(")


def _collectives(code: str) -> dict[str, int]:
    """How many of each collective inductor's ``code`` issues (fsync's broadcasts op included)."""
    calls = [m.group(1) for m in map(_CALL.match, code.splitlines()) if m]
    kinds = ("reduce_scatter", "all_gather", "all_to_all", "all_reduce", "broadcast")
    return {kind: sum(call.startswith(kind) for call in calls) for kind in kinds}


def _on_rank_compiled_mixed(shard_buckets):
    """SGD, Adam and AdamW through the overlapped call on three ranks (padded shards), four
    dtypes, a None leaf, several buckets: compiled (one graph for the three) against eager,
    AdamW's learning rate a tensor changed every step without a recompile."""
    rank = dist.get_rank()
    params = _mixed_tree()
    lr = torch.tensor(0.1, dtype=torch.float64)
    optimizers = (
        fsync.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
        fsync.optim.adam(0.1, weight_decay=0.01),
        fsync.optim.adamw(lr),
    )
    steps = [fsync.ops.zero(o, shard_buckets=shard_buckets, **SMALL) for o in optimizers]
    n_buckets = [len(step.layout(step.init(params)).plan.buckets) for step in steps]
    assert n_buckets[0] >= 3
    calls = [step.value_and_step(linear_loss) for step in steps]

    def three(pairs, coefficients):
        """Each optimizer's step on its own parameters."""
        out = []
        for call, (p, state) in zip(calls, pairs, strict=True):
            (new, value), state = call(state, p, coefficients)
            out.append((new, state, value))
        return out

    # fsync.compile's overlap passes move collectives: in the owner mode the ranks' graphs
    # differ (an owner updates its bucket, the others do not), and a broadcast with nothing
    # to wait for once moved ahead of the all-reduces on the receiving ranks alone, so that
    # the ranks hung in mismatched collectives; an opaque op of broadcasts gave wrong numbers.
    compiled = fsync.compile(three)
    # Each optimizer's own copy: the compiled step is guarded on its inputs' identities.
    eager = [(_cloned(params), step.init(params)) for step in steps]
    ours = list(eager)
    for s in range(3):
        lr.fill_(0.1 / (s + 1))
        g = torch.Generator().manual_seed(100 * s + rank)
        coefficients = {
            k: None if v is None else torch.randn(v.shape, generator=g) for k, v in params.items()
        }
        eager = [(p, state) for p, state, _ in three(eager, coefficients)]
        with torch._dynamo.config.patch(error_on_recompile=s > 0):
            if s == 0:  # compiles: inductor's code kept, to read the collectives off
                out, code = run_and_get_code(compiled, ours, coefficients)
            else:
                out = compiled(ours, coefficients)
        assert all(value.dim() == 0 for _, _, value in out)
        ours = [(p, state) for p, state, _ in out]
    count = _collectives(code[-1])
    if shard_buckets:
        # On gloo fsync's comm module composes a reduce-scatter from an all-to-all and a
        # local sum (gloo's own is slower, see _comm.on_gloo), and a compiled all-gather
        # from an all-to-all of the shard repeated (see _comm.all_gather).
        expected = {"all_to_all": 2 * sum(n_buckets)}
    else:  # each owner's broadcast, received into the reduced bucket on the other ranks
        expected = {"all_reduce": sum(n_buckets), "broadcast": sum(n_buckets)}
    assert count == {**dict.fromkeys(count, 0), **expected}, count
    for (expected_, e_state), (got, state) in zip(eager, ours, strict=True):
        assert int(state.step) == int(e_state.step) == 3 and got["e"] is None
        for k, p in expected_.items():
            if p is None:
                continue
            # The gradients are exact in both (linear_loss), so only the optimizer's
            # arithmetic differs: eager rounds every operation to the parameter's dtype
            # (16-bit ones computed in float32 and rounded once each), inductor keeps the
            # intermediates of a piece in registers in float32 and rounds once. A step moves
            # a parameter by at most an ulp of its scale in float32/64 and by a few of its
            # bfloat16 ulps (the moment estimates are stored, and so rounded, in bfloat16 in
            # both; the rest is one rounding against three or four): 1 and 4 ulps per step,
            # three steps.
            per_step = 4 if p.dtype == torch.bfloat16 else 1
            ulp = torch.finfo(p.dtype).eps * p.abs().max().double()
            diff = (got[k].double() - p.double()).abs().max()
            assert got[k].dtype == p.dtype and diff <= 3 * per_step * ulp, (k, diff / ulp)
            assert got[k].stride() == p.stride(), k


@pytest.mark.parametrize("world", [3], indirect=True)
@pytest.mark.parametrize("shard_buckets", [True, False])
def test_compiled_overlapped_call_on_three_ranks_mixed_dtypes(world: World, shard_buckets):
    world.run(_on_rank_compiled_mixed, shard_buckets, timeout=400)

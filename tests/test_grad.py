"""fsync.grad_and_value and fsync.grad (``_grad``, ``_backward``) on gloo worlds.

The references: DDP's synced ``.grad`` (the same autograd, so bitwise where the
bucket layouts agree), ``torch.func.grad_and_value`` followed by ``sync_grads``
(bitwise wherever ``torch.func``'s local gradients equal autograd's, which each
test checks first through the ``noop`` hook: the local gradient, packed and
unpacked), and the order in which collectives leave each rank.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from fsync import _comm
from fsync._comm._failures import REPORT_PATIENCE_S
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
from tests._world import World, started_early

# Buckets of about one leaf each, so that a tree spans several.
TINY = {"bucket_cap_mb": 1e-4, "first_bucket_mb": 1e-4}


def _assert_equal(got, expected, what=""):
    """Two trees hold the same bits, ``None`` where the other has ``None``."""
    got_leaves, got_spec = fsync._tree.flatten(got)
    expected_leaves, expected_spec = fsync._tree.flatten(expected)
    assert got_spec == expected_spec, (what, got_spec, expected_spec)
    for path, a, b in zip(got_spec.paths(), got_leaves, expected_leaves, strict=True):
        if a is None or b is None:
            assert a is None and b is None, (what, path)
            continue
        assert a.dtype == b.dtype and torch.equal(a, b), (what, path, (a - b).abs().max())


@contextlib.contextmanager
def _recorded():
    """Every all-reduce fsync issues on this rank, as ``(dtype, numel)``, in issue order."""
    calls = []
    original = _comm.all_reduce

    def all_reduce(x, op, group, **kwargs):
        calls.append((str(x.dtype), x.numel()))
        return original(x, op, group, **kwargs)

    _comm.all_reduce = all_reduce
    try:
        yield calls
    finally:
        _comm.all_reduce = original


def _everyone(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --- parity with DDP and with torch.func + sync_grads --------------------------------------------


def _on_rank_ddp_parity(cap):
    rank = dist.get_rank()
    model = ref_model()
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=cap)
    for step in range(2):  # the second step runs on DDP's rebuilt buckets
        ddp.zero_grad(set_to_none=True)
        ref_loss(ddp, ref_batch(rank, step)).backward()
    ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    ddp_order = [
        index[id(p)] for b in ddp.reducer._get_zeros_like_grad_buckets() for p in b.parameters()
    ]
    params = params_of(model)
    saved = {n: (p.clone(), p.stride(), p._version) for n, p in params.items()}
    # DDP's bucket layout: the same all-reduces of the same bytes, bitwise on any world size.
    options = {"bucket_cap_mb": cap, "first_bucket_mb": cap, "order": ddp_order}
    batch = ref_batch(rank, 1)
    grads, loss = fsync.grad_and_value(func_loss(model), **options)(params, batch)
    for name, ref in ddp_grads.items():
        assert torch.equal(grads[name], ref), name
        assert grads[name].stride() == ref.stride(), name  # channels_last stays channels_last
    # torch.func's local gradients equal autograd's on this model: so does the sync.
    local, _ = fsync.grad_and_value(func_loss(model), hook=fsync.ops.noop())(params, batch)
    func_grads, func_loss_value = torch.func.grad_and_value(func_loss(model))(params, batch)
    _assert_equal(local, func_grads, "local")
    _assert_equal(grads, fsync.sync_grads(func_grads, **options), "synced")
    assert torch.equal(loss, func_loss_value) and not loss.requires_grad
    # fsync.grad is the same call without the value.
    _assert_equal(fsync.grad(func_loss(model), **options)(params, batch), grads, "grad")
    for name, p in params.items():  # nothing passed in was touched
        value, stride, version = saved[name]
        assert torch.equal(p, value) and p.stride() == stride and p._version == version
        assert not p.requires_grad


@pytest.mark.parametrize("world", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("cap", [25.0, 0.001])
def test_equals_ddp_bit_for_bit_and_torch_func_then_sync_grads(world: World, cap):
    world.run(_on_rank_ddp_parity, cap)


def _odd_params():
    """A tree of awkward leaves: None, non-contiguous, channels_last, bf16, fp16, unused."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 5, generator=g),
        "wt": torch.randn(5, 6, generator=g).t(),  # a transposed, non-contiguous parameter
        "conv": torch.randn(4, 3, 3, 3, generator=g).to(memory_format=torch.channels_last),
        "none": None,
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(5, generator=g).to(torch.float16),
        "unused": torch.randn(7, generator=g),  # fn never reads it: a zero gradient
    }


def _odd_loss(params, x, images):
    """A scalar loss of every leaf but ``unused``, and ``{"h": h, "n": 3}`` as aux."""
    h = torch.tanh(x @ params["w"] + x @ params["wt"])
    c = nn.functional.conv2d(images, params["conv"], padding=1).mean((1, 2, 3))
    half = (h.to(torch.bfloat16) * params["bf16"]).float().sum() + (
        h.to(torch.float16) * params["fp16"]
    ).float().sum()
    loss = (h.sum(1) * c).pow(2).mean() + half / 100
    return loss, {"h": h, "n": torch.tensor(3)}


def _func_grad_and_value(fn, params, *rest, argnums=0):
    """``torch.func.grad_and_value(fn, argnums, has_aux=True)`` on a tree with ``None`` leaves.

    torch.func refuses ``None`` leaves (fsync keeps them): differentiate the tree
    without them and put ``None`` back in place, in the same key order.
    """
    present = {k: v for k, v in params.items() if v is not None}
    grads, out = torch.func.grad_and_value(fn, argnums, has_aux=True)(present, *rest)
    tree = grads[0] if isinstance(argnums, tuple) else grads
    tree = {k: tree.get(k) for k in params}
    return ((tree, *grads[1:]) if isinstance(argnums, tuple) else tree), out


def _odd_batch(rank, step=0):
    g = torch.Generator().manual_seed(10 * rank + step + 1)
    x = torch.randn(4, 6, generator=g)
    images = torch.randn(4, 3, 5, 5, generator=g).to(memory_format=torch.channels_last)
    return x, images


_HOOKS = {
    "allreduce sum": fsync.ops.allreduce("sum"),
    "fp16": fsync.ops.fp16_compress(),
    "bf16": fsync.ops.bf16_compress(),
    "quantize 4 bits per channel": fsync.ops.quantize(4, per_channel=True, channel_size=8),
    "chain": fsync.chain(fsync.ops.bf16_compress(fsync.ops.allreduce("sum"))),
}


def _on_rank_trees_arguments_and_hooks():
    rank = dist.get_rank()
    params = _odd_params()
    x, images = _odd_batch(rank)
    for argnums in (0, (0, 1)):
        call = fsync.grad_and_value(_odd_loss, argnums, has_aux=True, **TINY)
        grads, (loss, aux) = call(params, x, images)
        local = fsync.grad_and_value(_odd_loss, argnums, True, hook=fsync.ops.noop(), **TINY)
        local_grads, _ = local(params, x, images)
        func_grads, (func_value, func_aux) = _func_grad_and_value(
            _odd_loss, params, x, images, argnums=argnums
        )
        _assert_equal(local_grads, func_grads, f"local, argnums={argnums}")
        _assert_equal(grads, fsync.sync_grads(func_grads, **TINY), f"argnums={argnums}")
        assert torch.equal(loss, func_value) and torch.equal(aux["h"], func_aux["h"])
        assert aux["n"] == 3 and not aux["h"].requires_grad
        tree = grads[0] if isinstance(argnums, tuple) else grads
        assert tree["none"] is None and not tree["unused"].any()
        assert tree["wt"].stride() == params["wt"].stride()
        assert tree["conv"].is_contiguous(memory_format=torch.channels_last)
        assert (tree["bf16"].dtype, tree["fp16"].dtype) == (torch.bfloat16, torch.float16)
    func_grads = _func_grad_and_value(_odd_loss, params, x, images)[0]
    for name, hook in _HOOKS.items():
        grads, _ = fsync.grad(_odd_loss, has_aux=True, hook=hook, **TINY)(params, x, images)
        _assert_equal(grads, fsync.sync_grads(func_grads, hook=hook, **TINY), name)
    for options in ({"reduce_dtype": torch.float64}, {"divide_by": "active"}, {}):
        grads = fsync.grad(_odd_loss, has_aux=True, **options)(params, x, images)[0]
        _assert_equal(grads, fsync.sync_grads(func_grads, **options), str(options))


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_trees_arguments_dtypes_and_hooks_equal_torch_func_then_sync_grads(world: World):
    world.run(_on_rank_trees_arguments_and_hooks)


_STATEFUL = {
    "powersgd": fsync.ops.powersgd(2, start_step=1, min_compression_rate=0.0),
    "batched powersgd": fsync.ops.batched_powersgd(2, start_step=0),
    "bf16 powersgd": fsync.ops.bf16_compress(fsync.ops.powersgd(1, start_step=0)),
}


def _on_rank_stateful():
    rank = dist.get_rank()
    params = _odd_params()
    for name, hook in _STATEFUL.items():
        sync = fsync.GradSync(hook=hook, **TINY)
        state, reference = sync.init(params), sync.init(params)
        call = sync.grad_and_value(_odd_loss, has_aux=True)
        for step in range(3):  # before and after PowerSGD starts compressing
            x, images = _odd_batch(rank, step)
            (grads, _), state = call(state, params, x, images)
            func_grads = _func_grad_and_value(_odd_loss, params, x, images)[0]
            expected, reference = sync(func_grads, reference)
            _assert_equal(grads, expected, f"{name}, step {step}")
            _assert_equal(state.hook, reference.hook, f"{name} state, step {step}")
        assert int(state.step) == 3
        grads, state = sync.grad(_odd_loss, has_aux=True)(state, params, x, images)
        assert isinstance(grads, tuple) and grads[1]["n"] == 3 and int(state.step) == 4


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_stateful_hooks_thread_their_state_as_grad_sync_does(world: World):
    world.run(_on_rank_stateful)


# --- the order of collectives --------------------------------------------------------------------


def _on_rank_plan_order():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Backwards()
    params = params_of(model)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    plan = fsync.plan_buckets(params, **TINY)
    assert len(plan.buckets) == 4
    planned = [("torch.float32", spec.numel) for spec in plan.specs]
    with _recorded() as calls:
        grads = fsync.grad(backwards_loss(model), **TINY)(params, x)
    # The agreement first, then every bucket in the plan's order: the same on every rank.
    assert calls == [("torch.int64", 13), *planned], calls
    assert len(set(map(tuple, _everyone(calls)))) == 1
    func_grads = torch.func.grad(backwards_loss(model))(params, x)
    _assert_equal(grads, fsync.sync_grads(func_grads, **TINY))


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_buckets_leave_in_plan_order_when_backward_completes_them_in_reverse(world: World):
    world.run(_on_rank_plan_order)


class _Reached(torch.autograd.Function):
    """The identity, whose backward notes that backward has reached it."""

    @staticmethod
    def forward(ctx, x, events):
        ctx.events = events
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append("first layer reached")
        return grad, None


def test_each_bucket_is_packed_as_soon_as_backward_completes_it(single_rank, monkeypatch):
    # DDP's overlap: a bucket leaves while backward computes the layers before it. Autograd
    # runs the ready node of the highest sequence number first, and a bucket's node is made
    # before the forward pass: left at its own number it would run after the whole backward.
    events = []
    original = fsync._pack.pack_grads

    def pack_grads(grads, spec, **kwargs):
        events.append(f"bucket of {spec.numel}")
        return original(grads, spec, **kwargs)

    monkeypatch.setattr(fsync._pack, "pack_grads", pack_grads)
    widths = [6, 7, 8, 9, 10]  # a bucket a layer (each over TINY's 26 floats), sizes apart

    def loss(params, x, mark=True):
        for k in range(len(widths) - 1):
            x = torch.tanh(x @ params[f"w{k}"])
            x = _Reached.apply(x, events) if k == 0 and mark else x
        return x.sum()

    params = {f"w{k}": torch.randn(widths[k], widths[k + 1]) for k in range(len(widths) - 1)}
    x = torch.randn(3, widths[0])
    sum_hook = fsync.ops.allreduce("sum")  # with one rank, the mean would pack nothing
    grads = fsync.grad(loss, hook=sum_hook, **TINY)(params, x)
    # Backward order: w3, w2, w1, then the first layer (w0). Every later layer's bucket is
    # packed before backward reaches the first layer; the first layer's after.
    assert events == ["bucket of 90", "bucket of 72", "bucket of 56", "first layer reached",
                      "bucket of 42"], events  # fmt: skip
    _assert_equal(grads, torch.func.grad(loss)(params, x, False))  # one rank: the gradient


def test_the_caller_starts_the_last_bucket_and_the_starter_thread_the_others(
    single_rank, monkeypatch
):
    # The last bucket in plan order is the last backward completes: the caller's thread
    # would only wait for the starter to take it, so it starts it itself; a plan of one
    # bucket makes no starter thread at all.
    started = []
    original = fsync._backward.Reducer.start

    def start(self, k, buffer):
        started.append((k, threading.current_thread() is threading.main_thread()))
        return original(self, k, buffer)

    monkeypatch.setattr(fsync._backward.Reducer, "start", start)
    widths = [6, 7, 8, 9, 10]  # a bucket a layer, as above

    def loss(params, x):
        for k in range(len(widths) - 1):
            x = torch.tanh(x @ params[f"w{k}"])
        return x.sum()

    params = {f"w{k}": torch.randn(widths[k], widths[k + 1]) for k in range(len(widths) - 1)}
    x = torch.randn(3, widths[0])
    sum_hook = fsync.ops.allreduce("sum")
    grads = fsync.grad(loss, hook=sum_hook, **TINY)(params, x)
    assert started == [(0, False), (1, False), (2, False), (3, True)], started
    _assert_equal(grads, torch.func.grad(loss)(params, x))

    started.clear()

    def no_thread(job):
        raise AssertionError("a plan of one bucket made a starter thread")

    monkeypatch.setattr(fsync._backward, "on_starter", no_thread)
    grads = fsync.grad(loss, hook=sum_hook)(params, x)  # 25 MiB buckets: one
    assert started == [(0, True)], started
    _assert_equal(grads, torch.func.grad(loss)(params, x))


class _Branchy(nn.Module):
    """A trunk, a branch that only rank 0 takes, and a head that no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, take: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if take:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def _on_rank_find_unused():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Branchy()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ddp(x, rank == 0).pow(2).mean().backward()
    ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}

    def loss(params, x):
        return torch.func.functional_call(model, params, (x, rank == 0)).pow(2).mean()

    params = params_of(model)
    sync = fsync.GradSync(find_unused=True, **TINY)
    state = sync.init(params)
    with _recorded() as calls:
        (grads, _), state = sync.grad_and_value(loss)(state, params, x)
    assert grads["never.weight"] is None and ddp_grads["never.weight"] is None
    # The reference with the same layout: GradSync's find_unused on torch.func's gradients,
    # None where this rank's graph does not reach (torch.func itself gives zeros there).
    func_grads = torch.func.grad(loss)(params, x)
    unreached = {"never"} | ({"branch"} if rank != 0 else set())
    func_grads = {n: None if n.split(".")[0] in unreached else g for n, g in func_grads.items()}
    expected, _ = sync(func_grads, sync.init(params))
    _assert_equal(grads, expected, "find_unused")
    if dist.get_world_size() == 2:  # a * 0.5 + b * 0.5 whatever DDP's layout: bitwise
        _assert_equal(grads, ddp_grads, "DDP")
    floats = [numel for dtype, numel in calls if dtype == "torch.float32"]
    planned = [spec.numel for spec in sync.plan(state).specs]
    assert floats == planned, (floats, planned)  # every bucket, in plan order, on every rank
    assert len(set(map(tuple, _everyone(calls)))) == 1


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_find_unused_follows_ddp_and_keeps_the_plan_order(world: World):
    world.run(_on_rank_find_unused)


# --- where torch.func's gradients differ from autograd's, and tied weights ----------------------


class _LlamaMLP(nn.Module):
    """A Llama-style gated MLP: SiLU's backward under torch.func differs from autograd's."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 88, bias=False)
        self.up = nn.Linear(32, 88, bias=False)
        self.down = nn.Linear(88, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _on_rank_silu():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _LlamaMLP()
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(rank))
    ddp = DDP(copy.deepcopy(model))
    ddp(x).pow(2).mean().backward()

    def loss(params, x):
        return torch.func.functional_call(model, params, (x,)).pow(2).mean()

    params = params_of(model)
    grads = fsync.grad(loss)(params, x)
    # The same autograd as DDP's: the same bits (two ranks: one rounding whatever the order).
    _assert_equal(grads, {n: p.grad for n, p in ddp.module.named_parameters()}, "DDP")
    # torch.func's local gradient may differ from autograd's by a few ulps (SiLU's backward
    # on torch 2.13 CPU); after the mean the two syncs differ by at most the mean of the
    # local differences plus one rounding of each result: |fl(m') - fl(m)| <= |m' - m| + eps|m|.
    local = fsync.grad(loss, hook=fsync.ops.noop())(params, x)
    func_grads = torch.func.grad(loss)(params, x)
    synced = fsync.sync_grads(func_grads)
    for name in grads:
        diff = (local[name] - func_grads[name]).abs()
        parts = [torch.empty_like(diff) for _ in range(world_size)]
        dist.all_gather(parts, diff)
        bound = torch.stack(parts).sum(0) / world_size + torch.finfo().eps * grads[name].abs()
        assert torch.all((grads[name] - synced[name]).abs() <= bound), name


@pytest.mark.parametrize("world", [2], indirect=True)
def test_equals_ddp_where_torch_func_differs_from_autograd(world: World):
    world.run(_on_rank_silu)


class _Tied(nn.Module):
    """GPT-2's tying: the token embedding is the output head's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 8)
        self.mix = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 11, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mix(self.wte(tokens))))


def _on_rank_tied():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Tied()
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(rank))
    ddp = DDP(copy.deepcopy(model))
    nn.functional.cross_entropy(ddp(tokens).flatten(0, 1), tokens.flatten()).backward()

    def loss(params, tokens):
        logits = torch.func.functional_call(model, params, (tokens,))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    params = dict(model.named_parameters())  # the tied twin, lm_head.weight, is left out
    assert "lm_head.weight" not in params
    params = {n: p.detach() for n, p in params.items()}
    grads = fsync.grad(loss)(params, tokens)  # functional_call ties it again
    _assert_equal(grads, {n: p.grad for n, p in ddp.module.named_parameters()}, "tied")


@pytest.mark.parametrize("world", [2], indirect=True)
def test_tied_weights_equal_ddp(world: World):
    world.run(_on_rank_tied)


# --- compiled ------------------------------------------------------------------------------------


def _on_rank_compiled():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Backwards()
    params = params_of(model)
    loss = backwards_loss(model)

    def with_aux(params, x):
        return loss(params, x), x.sum()

    def batch(step):
        return torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * rank + step))

    ours = fsync.compile(fsync.grad_and_value(with_aux, has_aux=True, **TINY))

    @fsync.compile
    def reference(params, x):
        grads, out = torch.func.grad_and_value(with_aux, has_aux=True)(params, x)
        return fsync.sync_grads(grads, **TINY), out

    sync = fsync.GradSync(hook=fsync.ops.batched_powersgd(1, start_step=0), **TINY)
    stateful = fsync.compile(sync.grad_and_value(loss))

    @fsync.compile
    def stateful_reference(state, params, x):
        grads, value = torch.func.grad_and_value(loss)(params, x)
        grads, state = sync(grads, state)
        return (grads, value), state

    state = reference_state = sync.init(params)
    for step in range(2):  # the second call must not recompile
        context = torch._dynamo.config.patch(error_on_recompile=True) if step else None
        with context or contextlib.nullcontext():
            x = batch(step)
            _assert_equal(ours(params, x), reference(params, x), f"stateless, step {step}")
            got, state = stateful(state, params, x)
            expected, reference_state = stateful_reference(reference_state, params, x)
            _assert_equal(got, expected, f"stateful, step {step}")
            _assert_equal(state.hook, reference_state.hook, f"state, step {step}")


@pytest.mark.parametrize("world", [2], indirect=True)
def test_compiled_is_torch_func_then_the_one_reduce(world: World):
    world.run(_on_rank_compiled, timeout=600)


# --- disagreements, faults, memory ---------------------------------------------------------------

# Well above what a disagreement takes (one control all-reduce and the exchange that
# names the difference: milliseconds), well below the group's timeout (60 s).
FAST = 10.0


def _on_rank_disagreement():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    odd = rank == world_size - 1
    torch.manual_seed(0)
    model = Backwards()
    params = params_of(model)
    x = torch.randn(3, 8)
    loss = backwards_loss(model)
    other = {**params, "l0.bias": torch.zeros(5)} if odd else params

    def shape_differs():
        def bigger(params, x):  # reads the extra element: a different tree, same forward
            return loss({**params, "l0.bias": params["l0.bias"][:4]}, x) + params["l0.bias"].sum()

        return fsync.grad(bigger if odd else loss, **TINY)(other, x)

    cases = {
        "shape": (shape_differs, r"leaf 'l0.bias' has shape \(4,\).* but shape \(5,\)"),
        "hook": (
            lambda: fsync.grad(loss, hook=fsync.ops.fp16_compress() if odd else None)(params, x),
            "the ranks' sync options differ: hook",
        ),
    }
    sync = fsync.GradSync(**TINY)
    state = sync.init(params)
    skipped = state._replace(step=state.step + 1) if odd else state  # a rank one sync ahead
    cases["step"] = (lambda: sync.grad(loss)(skipped, params, x), "ranks are at different syncs")
    for name, (call, match) in cases.items():
        started = time.monotonic()
        with _recorded() as calls, pytest.raises(ValueError, match=match):
            call()
        assert time.monotonic() - started < FAST, name
        # The agreement refused it before any bucket collective.
        assert all(dtype == "torch.int64" for dtype, _ in calls), (name, calls)
    # Nothing half-issued: the group works as before.
    _assert_equal(fsync.grad(loss)(params, x), fsync.sync_grads(torch.func.grad(loss)(params, x)))


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_a_disagreement_is_an_error_on_every_rank_before_any_bucket(world: World):
    world.run(_on_rank_disagreement)


PG_TIMEOUT = 4.0


def _on_rank_backward_raises():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Backwards()

    def loss(params, x):  # l3's and l2's buckets are done before backward reaches Boom
        h = torch.tanh(
            torch.func.functional_call(
                model.l3, {"weight": params["l3.weight"], "bias": params["l3.bias"]}, (x,)
            )
        )
        h = Boom.apply(
            torch.tanh(nn.functional.linear(h, params["l2.weight"], params["l2.bias"])), rank == 1
        )
        h = torch.tanh(nn.functional.linear(h, params["l1.weight"], params["l1.bias"]))
        return nn.functional.linear(h, params["l0.weight"], params["l0.bias"]).pow(2).mean()

    params = params_of(model)
    x = torch.randn(3, 8)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        fsync.grad(loss, **TINY)(params, x)
    return time.monotonic() - started, str(error.value)


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
    assert "boom" in value1[1]  # the failing rank reports its own error
    elapsed, message = value0
    # Rank 0 waits for a bucket that rank 1 never sends: its error names the bucket, and
    # rank 1 as the rank that did not arrive (it left the sync with its own error).
    assert "an fsync collective failed at bucket" in message, message
    assert "rank 1 did not arrive" in message, message
    # Rank 0 waits for a bucket rank 1 never sends: gloo gives up after the group's
    # timeout, or at once when rank 1's sockets close; the slack covers scheduling.
    assert elapsed < PG_TIMEOUT + REPORT_PATIENCE_S + 20, elapsed


def _rss_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _on_rank_memory():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Backwards()
    params = params_of(model)
    loss = backwards_loss(model)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    call = fsync.grad_and_value(loss, **TINY)
    sync = fsync.GradSync(**TINY)
    state = sync.init(params)
    stateful = sync.grad_and_value(loss)
    wide = {"w": torch.randn(1 << 16)}  # one 256 KiB bucket
    square = fsync.grad_and_value(lambda p: (p["w"] ** 2).sum())
    for i in range(350):  # 50 to warm the allocator and caches, then 300 measured
        if i == 50:
            before, threads = _rss_mib(), threading.active_count()
        call(params, x)
        _, state = stateful(state, params, x)
        square(wide)
    return _rss_mib() - before, threading.active_count() - threads


@pytest.mark.parametrize("world", [2], indirect=True)
def test_calls_keep_memory_and_threads_flat(world: World):
    results = world.run(_on_rank_memory, timeout=300)
    # Each call allocates and frees its buckets and hooks; its starter thread goes back idle
    # for the next call (a new thread per call leaked ~100 KiB in torch's collectives). A few MB
    # cover the allocator's own growth; a leak of the wide call's bucket would be 75 MiB over
    # these 300 calls, and a thread left running each call would be counted.
    assert all(growth < 4.0 and threads == 0 for growth, threads in results), results


def _on_rank_let_go():
    rank = dist.get_rank()
    torch.manual_seed(0)
    params = {"a": torch.randn(40, 30), "b": torch.randn(30)}

    def loss(p, x):
        return (x @ p["a"] + p["b"]).tanh().square().mean()

    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(rank))
    sync = fsync.GradSync(**TINY)
    calls = {
        "stateless": lambda: fsync.grad(loss, **TINY)(params, x),
        "stateful": lambda: sync.grad(loss)(sync.init(params), params, x)[0],
    }
    alive = {}
    for name, call in calls.items():
        grads = call()
        refs = [StorageWeakRef(g.untyped_storage()) for g in grads.values()]
        del grads
        # gloo's threads drop their hold on a finished collective's tensors a moment later.
        deadline = time.monotonic() + 5.0
        while not all(ref.expired() for ref in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        alive[name] = [not ref.expired() for ref in refs]
    return alive


@pytest.mark.parametrize("world", [2], indirect=True)
def test_a_call_keeps_no_bucket_once_the_caller_lets_go(world: World):
    # The gradients are views of the call's buckets; once the caller drops them, nothing of
    # fsync's may hold the buckets (an idle starter thread kept its last job, and with it
    # the last call's buckets, until the next call, however long that was).
    for alive in world.run(_on_rank_let_go, timeout=120):
        assert alive == {"stateless": [False, False], "stateful": [False, False]}, alive


# --- what a call costs the host ----------------------------------------------------------------


def _on_rank_per_bucket():
    """How often a call does per-leaf work: hooks registered, buckets packed."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(12)))  # 24 leaves
    params = params_of(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))

    def loss(p, x):
        return torch.func.functional_call(model, p, (x,)).square().mean()

    options = {"bucket_cap_mb": 1e-3, "first_bucket_mb": 1e-3}  # a few leaves a bucket
    plan = fsync.plan_buckets(params, **options)
    packed, hooks = [], []
    pack, register = fsync._pack.pack_grads, torch.Tensor.register_hook

    def counted_pack(grads, spec, **kwargs):
        packed.append(len(grads))
        return pack(grads, spec, **kwargs)

    def counted_register(tensor, hook):
        hooks.append(tensor.shape)
        return register(tensor, hook)

    fsync._backward._pack.pack_grads = counted_pack
    torch.Tensor.register_hook = counted_register
    try:
        grads, _ = fsync.grad_and_value(loss, **options)(params, x)
    finally:
        fsync._backward._pack.pack_grads, torch.Tensor.register_hook = pack, register
    reference = fsync.sync_grads(torch.func.grad(loss)(params, x), **options)
    _assert_equal(grads, reference)
    return len(plan.specs), packed, hooks, [len(spec.leaves) for spec in plan.specs]


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_a_call_packs_each_bucket_once_and_hooks_no_leaf(world: World):
    # The eager call's per-leaf Python was a hook on every leaf; a bucket is now packed once,
    # from one autograd node, with all its gradients (in plan order of its leaves). With one
    # rank nothing is packed: the gradients are autograd's own.
    for buckets, packed, hooks, sizes in world.run(_on_rank_per_bucket):
        assert buckets > 2 and not hooks
        assert sorted(packed) == (sorted(sizes) if world.size > 1 else []), (packed, sizes)


def _on_rank_alone_layouts():
    """autograd's gradients that share memory or have another layout, through the call."""
    conv = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    params = {"a": torch.randn(5), "b": torch.randn(5), "c": torch.randn(5), "d": torch.randn(2, 3)}
    params |= {"conv": conv, "unused": torch.randn(3), "scalar": torch.tensor(2.0)}

    def loss(p):
        shared = (p["a"] + p["b"]).sum()  # one gradient tensor for both
        broadcast = p["c"].sum()  # an expanded tensor: stride 0
        parts = torch.cat([p["d"].reshape(-1), p["scalar"].reshape(1)]).square().sum()  # views
        image = torch.nn.functional.conv2d(torch.ones(1, 3, 5, 5), p["conv"]).square().sum()
        return shared + broadcast + parts + image

    grads, _ = fsync.grad_and_value(loss)(params)
    expected = torch.func.grad(loss)(params)
    _assert_equal(grads, expected)
    for name, g in grads.items():
        assert g.stride() == params[name].stride(), name  # each in its leaf's layout
    assert torch.count_nonzero(grads["unused"]) == 0
    storages = [g.untyped_storage().data_ptr() for g in grads.values()]
    assert len(set(storages)) == len(storages)  # no two results share memory
    for g in grads.values():
        g.mul_(2)  # each may be written in place without touching another
    doubled = {name: 2 * g for name, g in expected.items()}
    _assert_equal(grads, doubled)
    return True


def test_one_rank_returns_autograds_gradients_each_its_own_and_in_its_layout(single_rank):
    assert _on_rank_alone_layouts()


# --- wrong input ---------------------------------------------------------------------------------


def test_compiled_call_keeps_none_leaves_as_the_eager_call_does(single_rank):
    """torch.func refuses a None leaf in what it differentiates; fsync's call does not."""
    params = {"w": torch.ones(3), "unused": None, "b": torch.zeros(3)}

    def loss(p, x):
        return (p["w"] * x + p["b"]).pow(2).sum()

    x = torch.arange(3.0)
    eager = fsync.grad_and_value(loss)(params, x)
    compiled = torch.compile(fsync.grad_and_value(loss), fullgraph=True)(params, x)
    for grads, value in (eager, compiled):
        assert grads["unused"] is None and torch.equal(value, torch.tensor(5.0))
        assert torch.equal(grads["w"], 2 * x * x) and torch.equal(grads["b"], 2 * x)


def test_wrong_input_gets_a_clear_error(single_rank):
    def loss(params, x):
        return (params["w"] * x).sum()

    params, x = {"w": torch.ones(3)}, torch.ones(3)
    with pytest.raises(TypeError, match="argnums must be an int or a non-empty tuple"):
        fsync.grad_and_value(loss, argnums=(0.5,))
    with pytest.raises(ValueError, match="argnums must not repeat"):
        fsync.grad(loss, argnums=(0, 0))
    with pytest.raises(ValueError, match="argnums names argument 2, but fn was called with 2"):
        fsync.grad(loss, argnums=2)(params, x)
    with pytest.raises(
        ValueError, match=r"fn returned a tensor of shape \(3,\); expected a scalar"
    ):
        fsync.grad(lambda p, x: p["w"] * x)(params, x)
    with pytest.raises(ValueError, match="with has_aux=True it must return a pair"):
        fsync.grad(loss, has_aux=True)(params, x)
    with pytest.raises(TypeError, match=r"argument leaf 'n' has dtype torch\.int64"):
        fsync.grad(lambda p, x: loss(p, x))({**params, "n": torch.ones(2, dtype=torch.int64)}, x)
    with pytest.raises(ValueError, match="this hook keeps state"):
        fsync.grad(loss, hook=fsync.ops.powersgd(1))(params, x)
    with pytest.raises(ValueError, match=r"find_unused is an option of fsync\.GradSync"):
        fsync.grad(loss, find_unused=True)
    with pytest.raises(TypeError, match="grad_and_value got unknown options"):
        fsync.grad_and_value(loss, bucket_cap=1)
    with pytest.raises(TypeError, match="expected the SyncState"):
        fsync.GradSync().grad(loss)({"w": torch.ones(3)}, params, x)
    sync = fsync.GradSync()
    with pytest.raises(ValueError, match="does not match the plan"):
        sync.grad(loss)(sync.init({"w": torch.ones(4)}), params, x)
    # fn's own error comes through as it is, and the next call works.
    with pytest.raises(ZeroDivisionError):
        fsync.grad(lambda p, x: 1 / 0)(params, x)
    assert torch.equal(fsync.grad(loss)(params, x)["w"], x)


# --- a 2-D mesh, and ranks without data ----------------------------------------------------------


def _on_rank_mesh():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    params = _odd_params()
    x, images = _odd_batch(rank)
    func_grads = _func_grad_and_value(_odd_loss, params, x, images)[0]
    grads = fsync.grad(_odd_loss, has_aux=True, group=mesh, **TINY)(params, x, images)[0]
    _assert_equal(grads, fsync.sync_grads(func_grads, group=mesh, **TINY), "hierarchical")
    for hook in (fsync.ops.bf16_compress(), fsync.ops.batched_powersgd(2, start_step=0)):
        sync = fsync.GradSync(group=mesh, hook=hook, **TINY)
        state, reference = sync.init(params), sync.init(params)
        for step in range(2):
            x, images = _odd_batch(rank, step)
            grads, state = sync.grad(_odd_loss, has_aux=True)(state, params, x, images)
            func_grads = _func_grad_and_value(_odd_loss, params, x, images)[0]
            expected, reference = sync(func_grads, reference)
            _assert_equal(grads[0], expected, f"{hook.spec}, step {step}")


@pytest.mark.parametrize("world", [4], indirect=True)
def test_a_2d_mesh_reduces_hierarchically_as_sync_grads(world: World):
    world.run(_on_rank_mesh)


def _on_rank_without_data():
    rank = dist.get_rank()
    params = _odd_params()
    x, images = _odd_batch(rank)
    active = rank != 2
    func_grads = _func_grad_and_value(_odd_loss, params, x, images)[0]
    # The mean over the ranks with data, each computed as sync_grads computes it.
    expected = fsync.sync_grads(func_grads, active=active, divide_by="active")
    sync = fsync.GradSync(divide_by="active")
    state = sync.init(params)
    if active:
        grads = fsync.grad(_odd_loss, has_aux=True, divide_by="active")(params, x, images)[0]
        stateful, state = sync.grad(_odd_loss, has_aux=True)(state, params, x, images)
        stateful = stateful[0]
    else:  # a rank without data joins the same collectives without a gradient call
        grads = fsync.sync_grads(func_grads, active=False, divide_by="active")
        stateful, state = sync(None, state, active=False)
    _assert_equal(grads, expected, "stateless")
    _assert_equal(stateful, expected, "stateful")


@pytest.mark.parametrize("world", [3], indirect=True)
def test_a_rank_without_data_joins_with_active_false(world: World):
    world.run(_on_rank_without_data)

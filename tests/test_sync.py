"""sync_grads and GradSync on real gloo worlds, against DDP and the exact mean.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`; they make
their own assertions and return what the test process needs to see.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from fsync import _planner
from tests._models import func_loss, params_of, ref_batch, ref_loss, ref_model
from tests._numerics import gathered, summation_bound
from tests._world import World

# --- parity with DDP -----------------------------------------------------------------------


def _on_rank_ddp_parity(cap):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = ref_model()
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=cap)
    ddp_grads = None
    for step in range(2):  # the second step runs on DDP's rebuilt buckets
        ddp.zero_grad(set_to_none=True)
        ref_loss(ddp, ref_batch(rank, step)).backward()
    ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    ddp_order = [
        index[id(p)] for b in ddp.reducer._get_zeros_like_grad_buckets() for p in b.parameters()
    ]

    # The same step without DDP: torch.func gradients equal local autograd ones bitwise.
    local = copy.deepcopy(model)
    ref_loss(local, ref_batch(rank, 1)).backward()
    grads = torch.func.grad(func_loss(model))(params_of(model), ref_batch(rank, 1))
    for name, p in local.named_parameters():
        assert torch.equal(grads[name], p.grad), name

    options = {"bucket_cap_mb": cap, "first_bucket_mb": cap}
    synced = fsync.sync_grads(grads, **options)
    # Laid out as DDP's rebuilt buckets, the all-reduces are the same calls on the same
    # bytes, so results match DDP bit for bit on any world size.
    same_layout = fsync.GradSync(order=ddp_order, **options)
    state = same_layout.init(params_of(model))
    synced_ddp_layout, _ = same_layout(grads, state)

    bound = {n: summation_bound(parts, world_size) for n, parts in gathered(grads).items()}
    report = {}
    for name, ref in ddp_grads.items():
        assert synced[name].stride() == ref.stride(), name  # channels_last stays channels_last
        assert torch.equal(synced_ddp_layout[name], ref), name
        diff = (synced[name] - ref).abs()
        assert torch.all(diff <= bound[name]), (name, diff.max(), bound[name].max())
        report[name] = torch.equal(synced[name], ref)
    return report


@pytest.mark.parametrize("world", [2, 3, 4], indirect=True)
@pytest.mark.parametrize("cap", [25.0, 0.001])
def test_parity_with_ddp(world: World, cap):
    reports = world.run(_on_rank_ddp_parity, cap)
    if world.size == 2:
        # Two ranks: a * 0.5 + b * 0.5 is one rounding whatever the order: bitwise.
        assert all(all(r.values()) for r in reports), reports


def _on_rank_exact_mean(bucket_cap_mb):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    shapes = {"a": (7, 5), "b": (3,), "c": (2, 3, 4, 4), "d": (), "e": (0, 3), "f": (130,)}
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
    grads = {
        name: (torch.randn(shape, generator=g) * 10).to(dtypes[i % 4])
        for i, (name, shape) in enumerate(shapes.items())
    }
    synced = fsync.sync_grads(grads, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=bucket_cap_mb)
    for name, parts in gathered(grads).items():
        exact = torch.stack([p.double() * (1.0 / world_size) for p in parts]).sum(0)
        # Each term is rounded once (x * 1/W) and the sum W - 1 times, all in the
        # gradient's dtype: within W * eps * sum|terms| of the exact mean.
        eps = torch.finfo(parts[0].dtype).eps
        bound = (
            world_size * eps * torch.stack([p.double().abs() / world_size for p in parts]).sum(0)
        )
        assert synced[name].dtype == grads[name].dtype
        assert torch.all((synced[name].double() - exact).abs() <= bound), name


@pytest.mark.parametrize("world", [1, 2, 3, 4], indirect=True)
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-4])
def test_mean_of_mixed_dtype_tree(world: World, bucket_cap_mb):
    world.run(_on_rank_exact_mean, bucket_cap_mb)


def _on_rank_sum_and_chain():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grads = {"w": torch.full((3,), float(rank + 1))}
    total = sum(range(1, world_size + 1))
    assert torch.equal(
        fsync.sync_grads(grads, hook=fsync.ops.allreduce("sum"))["w"],
        torch.full((3,), float(total)),
    )
    twice = fsync.chain(fsync.ops.allreduce("sum"), fsync.ops.allreduce("mean"))
    assert torch.equal(fsync.sync_grads(grads, hook=twice)["w"], torch.full((3,), float(total)))


@pytest.mark.parametrize("world", [3], indirect=True)
def test_sum_and_chained_hooks(world: World):
    world.run(_on_rank_sum_and_chain)


# --- compile ---------------------------------------------------------------------------------


def _on_rank_compiled_step():
    rank = dist.get_rank()
    model = ref_model()
    loss_fn = func_loss(model)
    options = {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001}
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    def step(params, batch):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
        grads = fsync.sync_grads(grads, **options)
        return {k: p - 0.1 * grads[k] for k, p in params.items()}, loss

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager_params = compiled_params = params_of(model)
    before = {k: v.clone() for k, v in compiled_params.items()}
    for s in range(5):
        batch = ref_batch(rank, s)
        eager_params, _ = step(eager_params, batch)
        with torch._dynamo.config.patch(error_on_recompile=s > 0):  # new data, no recompile
            compiled_params, _ = compiled(compiled_params, batch)
        if s == 0:  # the caller's parameters are never written to
            assert all(torch.equal(before[k], params_of(model)[k]) for k in before)
    # (On a cold cache dynamo may hand the backend the same graph twice: take the last.)
    collectives = [
        n.target
        for n in graphs[-1].graph.nodes
        if n.op == "call_function" and "c10d" in str(n.target)
    ]
    n_buckets = len(fsync.plan_buckets(params_of(model), **options).buckets)
    all_reduces = [t for t in collectives if "all_reduce" in str(t)]
    assert n_buckets == 3 and len(all_reduces) == n_buckets, collectives
    for k in eager_params:
        # Inductor fuses and reorders the float arithmetic of forward and backward
        # (not of the sync: see test_compiled_sync_is_bitwise_eager), so five SGD
        # steps drift by a few float32 ulps of the parameters' scale.
        torch.testing.assert_close(compiled_params[k], eager_params[k], rtol=1e-5, atol=1e-6)


def _on_rank_compiled_sync_bitwise():
    rank = dist.get_rank()
    model = ref_model()
    grads = torch.func.grad(func_loss(model))(params_of(model), ref_batch(rank))
    checksum = {k: v.clone() for k, v in grads.items()}
    graphs = []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def make(cap):  # bucket sizes from a closure, as in a training script
        return torch.compile(
            lambda g: fsync.sync_grads(g, bucket_cap_mb=cap, first_bucket_mb=cap),
            fullgraph=True,
            backend=backend,
        )

    # A float that changes between compilations reaches dynamo's second trace as a
    # symbolic value: the plan must still be the eager one, bucket for bucket.
    for cap in (0.001, 0.002, 25.0):
        out = make(cap)(grads)
        ref = fsync.sync_grads(grads, bucket_cap_mb=cap, first_bucket_mb=cap)
        for k in grads:
            assert torch.equal(out[k], ref[k]) and out[k].stride() == ref[k].stride(), k
            assert torch.equal(grads[k], checksum[k]), k
        plan = fsync.plan_buckets(grads, bucket_cap_mb=cap, first_bucket_mb=cap)
        reduces = [n for n in graphs[-1].graph.nodes if "all_reduce" in str(n.target)]
        assert len(reduces) == len(plan.buckets), (cap, len(reduces), plan.buckets)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_compiled_train_step(world: World):
    world.run(_on_rank_compiled_step, timeout=400)


@pytest.mark.parametrize("world", [3], indirect=True)
def test_compiled_sync_is_bitwise_eager(world: World):
    world.run(_on_rank_compiled_sync_bitwise, timeout=400)


# --- GradSync ----------------------------------------------------------------------------------


def _on_rank_gradsync():
    rank = dist.get_rank()
    model = ref_model()
    params = params_of(model)
    sync = fsync.GradSync(bucket_cap_mb=0.001, first_bucket_mb=0.001)
    state = sync.init(params)
    plan = sync.plan(state)
    assert plan == fsync.plan_buckets(params, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    assert state.hook == () and int(state.fingerprint) == plan.fingerprint
    grads = torch.func.grad(func_loss(model))(params, ref_batch(rank))
    out, state2 = sync(grads, state)
    ref = fsync.sync_grads(grads, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    assert torch.equal(state2.fingerprint, state.fingerprint)

    # A state made with other options for the same tree, or for another tree.
    with pytest.raises(ValueError, match="state belongs to another plan"):
        sync(grads, fsync.GradSync().init(params))
    other = fsync.GradSync().init({"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="grads does not match the plan: its structure is"):
        sync(grads, other)
    with pytest.raises(TypeError, match="expected the SyncState"):
        sync(grads, ())
    with pytest.raises(
        ValueError, match=r"grads does not match the plan: leaf 'fc.bias' has shape \(3,\)"
    ):
        sync({**grads, "fc.bias": torch.zeros(3)}, state)
    with pytest.raises(ValueError, match="grads does not match the plan: its structure is"):
        sync({k: v for k, v in grads.items() if k != "head.bias"}, state)
    # The object keeps settings only: it plans any tree, each state its own.
    assert sync.plan(sync.init({"x": torch.zeros(3)})).num_leaves == 1
    # The state keeps no device: the plan is on the group's (gloo: CPU) unless named, as
    # for CUDA tensors synced over gloo (the plan pack() of such gradients needs).
    assert {spec.device for spec in plan.specs} == {torch.device("cpu")}
    elsewhere = sync.plan(state, device="meta")
    on_meta = {k: v.to("meta") for k, v in params.items()}
    assert elsewhere == fsync.plan_buckets(on_meta, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    assert {spec.device for spec in elsewhere.specs} == {torch.device("meta")}
    assert fsync.pack(on_meta, elsewhere)[0].device == torch.device("meta")


@pytest.mark.parametrize("world", [2], indirect=True)
def test_gradsync(world: World):
    world.run(_on_rank_gradsync)


# --- bad input -----------------------------------------------------------------------------------


def _on_rank_bad_input():
    grads = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    with pytest.raises(
        TypeError, match=r"grads leaf 'b' is a float; expected a torch.Tensor or None"
    ):
        fsync.sync_grads({**grads, "b": 1.0})
    with pytest.raises(
        TypeError, match=r"grads leaf 'b' has dtype torch.int64; expected a floating point"
    ):
        fsync.sync_grads({**grads, "b": torch.ones(2, dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"grads leaf 'b' has dtype torch.complex64"):
        fsync.sync_grads({**grads, "b": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(
        ValueError, match=r"grads leaf 'w' requires grad.*Did you pass the parameters"
    ):
        fsync.sync_grads({**grads, "w": torch.ones(2, 2, requires_grad=True)})
    with pytest.raises(TypeError, match=r"expected an fsync\.Hook"):
        fsync.sync_grads(grads, hook=lambda b: b)
    with pytest.raises(ValueError, match="op must be 'mean' or 'sum'"):
        fsync.ops.allreduce("max")
    with pytest.raises(TypeError, match=r"expected a torch\.distributed\.ProcessGroup"):
        fsync.sync_grads(grads, group="world")
    with pytest.raises(ValueError, match="bucket_cap_mb must be a finite positive"):
        fsync.sync_grads(grads, bucket_cap_mb=-1)
    stateful = fsync.Hook(lambda plan: (torch.zeros(1),), lambda b, s, c: (b, s))
    with pytest.raises(ValueError, match=r"this hook keeps state.*Use fsync\.GradSync"):
        fsync.sync_grads(grads, hook=stateful)
    wrong_size = fsync.Hook(lambda plan: (), lambda b, s, c: ([x[:-1] for x in b], s))
    with pytest.raises(ValueError, match="hook output: buffer 0 has shape"):
        fsync.sync_grads(grads, hook=wrong_size)
    # All of the above failed before any collective: the world still works.
    assert torch.equal(fsync.sync_grads(grads)["w"], grads["w"])


@pytest.mark.parametrize("world", [2], indirect=True)
def test_bad_input_raises_on_every_rank(world: World):
    world.run(_on_rank_bad_input, timeout=60)


def _on_rank_trees_differ(kind):
    rank = dist.get_rank()
    last = dist.get_world_size() - 1
    grads = {"w": torch.ones(4, 3), "b": torch.ones(4)}
    if rank == last:
        if kind == "shape":
            grads["w"] = torch.ones(4, 5)
        elif kind == "dtype":
            grads["b"] = torch.ones(4, dtype=torch.float64)
        elif kind == "structure":
            grads = {"w": torch.ones(4, 3), "b": torch.ones(4), "extra": torch.ones(1)}
        elif kind == "layout":
            grads["w"] = torch.ones(3, 4).t()
        elif kind == "none":
            grads["b"] = None
    options = {}
    if kind == "options" and rank == last:
        options = {"bucket_cap_mb": 1e-5, "first_bucket_mb": 1e-5}
    expected = {
        "shape": rf"leaf 'w' has shape \(4, 3\).* on rank 0 but shape \(4, 5\).* on rank {last}",
        "dtype": rf"leaf 'b' has .*float32.* on rank 0 but .*float64.* on rank {last}",
        "structure": f"rank 0 has 2 leaves and rank {last} has 3; the first extra one is 'extra'",
        "layout": rf"leaf 'w' has .*contiguous on rank 0 but .*dim order \(1, 0\) on rank {last}",
        "none": rf"leaf 'b' has shape \(4,\).* on rank 0 but None on rank {last}",
        "options": rf"the bucket plans differ \(bucket_cap_mb, .*\) between rank 0 and rank {last}",
    }[kind]
    with pytest.raises(ValueError, match=f"grads differ across ranks: {expected}"):
        fsync.sync_grads(grads, **options)
    with pytest.raises(ValueError, match=r"trees passed to GradSync\.init differ across ranks"):
        fsync.GradSync(**options).init(grads)
    # Every rank raised before any bucket collective; the world is usable.
    assert fsync.sync_grads({"x": torch.ones(1)})["x"].item() == 1.0


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("kind", ["shape", "dtype", "structure", "layout", "none", "options"])
def test_trees_that_differ_between_ranks(world: World, kind):
    world.run(_on_rank_trees_differ, kind, timeout=60)


# --- plan cache, world size 1, groups, no mutation ------------------------------------------------


def _on_rank_plan_cache():
    _planner._cached_plan.cache_clear()
    grads = {"w": torch.ones(4, 3), "b": torch.ones(4)}
    for _ in range(3):
        fsync.sync_grads(grads)
        fsync.sync_grads({"w": torch.randn(4, 3), "b": torch.randn(4)})
    info = _planner._cached_plan.cache_info()
    assert (info.misses, info.hits) == (1, 5)
    fsync.sync_grads(grads, bucket_cap_mb=1.0)
    assert _planner._cached_plan.cache_info().misses == 2


@pytest.mark.parametrize("world", [2], indirect=True)
def test_plan_is_cached(world: World):
    world.run(_on_rank_plan_cache)


# Profiler names of collectives: the functional ops fsync issues, the c10d ops behind
# torch.distributed's own calls, and the backends' work (gloo:all_gather, nccl:...).
_COLLECTIVE_EVENTS = ("_c10d_functional::", "c10d::", "c10d_functional::", "gloo:", "nccl:")


def _on_rank_no_collective():
    torch.manual_seed(0)  # equal on all ranks: the mean is the input itself
    grads = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    buffers = {"mean": torch.randn(3), "count": torch.tensor(7)}
    sync = fsync.GradSync()
    state = sync.init(grads)
    fsync.sync_grads(grads)  # plans and checks the plan (one small all-gather)

    def find_unused():
        unused = fsync.GradSync(find_unused=True)
        return unused({"w": grads["w"], "b": None}, unused.init(grads))[0]

    calls = {
        "sync_grads": lambda: fsync.sync_grads(grads),
        "GradSync": lambda: sync(grads, state)[0],
        "inactive": lambda: fsync.sync_grads(grads, active=False, divide_by="active"),
        "find_unused": find_unused,
        "verify": lambda: fsync.verify(grads, values=True),
        "broadcast": lambda: fsync.broadcast(grads),
        "sync_buffers": lambda: fsync.sync_buffers(buffers),
        "sync_buffers mean": lambda: fsync.sync_buffers(buffers, mode="mean"),
    }
    issued, results = {}, {}
    for name, call in calls.items():
        # Whatever issues a collective (functional or in place, fsync or c10d), the
        # profiler sees it.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            results[name] = call()
        issued[name] = [e.name for e in prof.events() if e.name.startswith(_COLLECTIVE_EVENTS)]
    expected = {"sync_grads": grads, "GradSync": grads, "broadcast": grads}
    expected |= {"sync_buffers": buffers, "sync_buffers mean": buffers}  # a mean of equals
    for name, tree in expected.items():
        assert all(torch.equal(results[name][k], v) for k, v in tree.items()), name
    assert all(torch.count_nonzero(v) == 0 for v in results["inactive"].values())  # nobody active
    assert results["find_unused"]["b"] is None  # unused on every rank
    assert torch.equal(results["find_unused"]["w"], grads["w"])
    return issued


def _functional_ops(names):
    """The functional collectives among profiler event names (no waits), sorted."""
    skip = ("wait_tensor", "_wrap_tensor_autograd")
    return sorted(n for n in names if n.startswith("_c10d_functional::") and not n.endswith(skip))


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_world_size_one_issues_no_collective(world: World):
    issued = world.run(_on_rank_no_collective)
    if world.size == 1:
        assert issued == [{name: [] for name in issued[0]}]
        return
    # On two ranks every call communicates: the profiler would have seen it on one.
    for per_rank in issued:
        assert all(per_rank.values()), per_rank
        ops = {name: _functional_ops(names) for name, names in per_rank.items()}
        # One bucket: one all-reduce per sync, after the ranks' agreement (an all-reduce
        # of 13 int64) that every sync starts with, each in place (into a tensor the sync
        # owns); GradSync.init agrees on the plan the same way, and find_unused adds an
        # all-reduce of per-leaf counts.
        reduce = "_c10d_functional::all_reduce_"
        assert ops["GradSync"] == ops["sync_grads"] == ops["inactive"] == [reduce] * 2
        assert ops["find_unused"] == [reduce] * 4


def test_one_rank_returns_copies_laid_out_as_the_buckets_give_them(single_rank, monkeypatch):
    """With one rank the mean is each gradient: ``sync_grads`` copies every leaf into memory
    of its own, in the layout unpacking gives it (no bucket), the bits and strides of the
    packed path it stands in for; the caller's tree is left as it was."""
    g = torch.Generator().manual_seed(0)
    grads = {
        "w": torch.randn(6, 5, generator=g),
        "t": torch.randn(5, 6, generator=g).t(),
        "conv": torch.randn(4, 3, 2, 2, generator=g).to(memory_format=torch.channels_last),
        "slice": torch.randn(6, 8, generator=g)[:, ::2],  # not dense: copied densely
        "broadcast": torch.randn(1, 3, generator=g).expand(4, 3),  # overlapping
        "odd_stride": torch.randn(1, 5, generator=g).as_strided((1, 5), (7, 1)),
        "empty": torch.zeros(0, 3),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "none": None,
    }
    given = {k: None if v is None else (v.clone(), v.stride()) for k, v in grads.items()}
    for options in ({}, {"bucket_cap_mb": 1e-4, "first_bucket_mb": 1e-4}):
        sync = fsync.GradSync(**options)
        state = sync.init(grads)
        copied = fsync.sync_grads(grads, **options)
        stateful, after = sync(grads, state)
        assert int(after.step) == 1 and after.fingerprint is state.fingerprint
        with monkeypatch.context() as patch:
            patch.setattr(fsync._reduce, "gives_back", lambda *args: False)  # both syncs'
            packed = fsync.sync_grads(grads, **options)
            reduced, reduced_state = sync(grads, state)
            assert _same(reduced, stateful) and int(reduced_state.step) == 1
        for name, leaf in grads.items():
            if leaf is None:
                assert copied[name] is None and packed[name] is None
                continue
            assert copied[name].stride() == packed[name].stride(), name
            assert copied[name].dtype == leaf.dtype and torch.equal(copied[name], packed[name])
            if leaf.numel():
                assert copied[name].data_ptr() != leaf.data_ptr(), name
                assert stateful[name].data_ptr() != leaf.data_ptr(), name
            assert torch.equal(leaf, given[name][0]) and leaf.stride() == given[name][1]
    storages = [v.data_ptr() for v in copied.values() if v is not None and v.numel()]
    assert len(set(storages)) == len(storages)  # each its own memory


def _same(a, b) -> bool:
    """Two trees of the same structure with bit-equal tensors of the same strides."""
    la, lb = fsync._tree.flatten(a)[0], fsync._tree.flatten(b)[0]
    return len(la) == len(lb) and all(
        (x is None and y is None)
        or (x.stride() == y.stride() and x.dtype == y.dtype and torch.equal(x, y))
        for x, y in zip(la, lb, strict=True)
    )

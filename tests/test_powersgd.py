"""PowerSGD: exactness at full rank, error feedback, wire size, DDP parity, state, misuse.

Functions named ``_on_rank_*`` run on every rank of a :class:`World`.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import math
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from fsync import _comm
from tests._numerics import powersgd_full_rank_bound
from tests._world import World

CAP = {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001}  # several buckets
EPS = torch.finfo(torch.float32).eps


def _grads(rank, step, *, drift=None):
    """Gradients of every kind of leaf; different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    grads = {
        "conv": randn(8, 3, 3, 3).to(memory_format=torch.channels_last),
        "w": randn(24, 16),
        "t": randn(6, 10).t(),  # transposed: its memory holds a 10 x 6 matrix
        "x3": randn(6, 4, 5),
        "b": randn(24),
        "s": randn(()),
    }
    if drift is not None:  # a common signal under per-rank noise
        grads = {k: drift[k] + 0.3 * v for k, v in grads.items()}
    return grads


def _params():
    return {k: torch.zeros_like(v) for k, v in _grads(0, 0).items()}


def _exact_mean(grads):
    """The mean over ranks in float64, from every rank's gradients."""
    out = {}
    for name, t in grads.items():
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        out[name] = torch.stack([p.double() for p in parts]).mean(0)
    return out


# --- exactness -----------------------------------------------------------------------------------


def _on_rank_full_rank_is_exact(batched):
    rank = dist.get_rank()
    # Rank >= min(rows, cols) of every matrix and a rate of 0, so that every leaf
    # (vectors and scalars included) is compressed, losslessly.
    settings = {"start_step": 0, "min_compression_rate": 0.0}
    hook = (
        fsync.ops.batched_powersgd(10**4, **settings)
        if batched
        else fsync.ops.powersgd(64, **settings)
    )
    sync = fsync.GradSync(hook=hook, **CAP)
    state = sync.init(_params())
    numel = sum(v.numel() for v in _params().values())
    compressed = sum(e.numel() for e in state.hook.error)
    assert compressed >= numel  # everything is compressed (batched: plus padding)
    # The matrix each leaf is compressed in, and its rows x cols: per leaf its own (outermost
    # dimension in memory by the rest), batched its bucket's side x side square.
    batch_of, dims = {}, {}
    plan = sync.plan(state)
    for b, leaves in enumerate(plan.buckets):
        for i in leaves:
            name, t = plan.leaves[i].path, _params()[plan.leaves[i].path]
            rows = t.shape[max(range(t.dim()), key=t.stride)] if t.dim() else 1
            side = math.isqrt(state.hook.error[b].numel())
            batch_of[name] = b if batched else name
            dims[batch_of[name]] = (side, side) if batched else (rows, t.numel() // rows)
    fed_back = {name: torch.zeros_like(t) for name, t in _params().items()}  # per leaf
    previous = dict.fromkeys(dims, 0.0)
    for step in range(2):  # the second step starts from the first one's Q (warm start)
        grads = _grads(rank, step)
        # Rounding scales with each rank's whole matrix M = g + e (its error feedback; batched,
        # the bucket's buffer, padding included), not with the leaf: mean_i ||g_i|| + ||e_i||.
        g2 = dict.fromkeys(dims, 0.0)
        for name, g in grads.items():
            g2[batch_of[name]] += torch.linalg.vector_norm(g.double()).item() ** 2
        e = (
            {b: torch.linalg.vector_norm(state.hook.error[b].double()).item() for b in dims}
            if batched
            else {k: torch.linalg.vector_norm(v.double()).item() for k, v in fed_back.items()}
        )
        norms = torch.tensor([math.sqrt(g2[k]) + e[k] for k in dims], dtype=torch.float64)
        dist.all_reduce(norms)
        out, state = sync(grads, state)
        bound = {
            k: powersgd_full_rank_bound(n / dist.get_world_size(), *dims[k], dist.get_world_size())
            for k, n in zip(dims, norms.tolist(), strict=True)
        }
        for name, mean in _exact_mean(grads).items():
            # Within the derived bound of its whole matrix (tests/_numerics.py: matmuls of
            # inner dimension rows, cols and r, Householder QR of P), plus the previous
            # step's error, which the error feedback hands back with the opposite sign.
            err = torch.linalg.vector_norm(out[name].double() - mean).item()
            k = batch_of[name]
            assert err <= bound[k] + previous[k], (name, err, bound[k] + previous[k])
            assert out[name].stride() == grads[name].stride()
            fed_back[name] = grads[name] + fed_back[name] - out[name]  # e = (g + e) - P Q^T
        previous = bound


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("batched", [False, True], ids=["per_leaf", "batched"])
def test_full_rank_gives_the_exact_mean(world: World, batched):
    world.run(_on_rank_full_rank_is_exact, batched)


def _on_rank_error_feedback(rank_, error_feedback):
    """Relative error of the running sum of synced gradients at steps 10, 25 and 50."""
    rank = dist.get_rank()
    drift = _grads(99, 99)  # the same on every rank
    sync = fsync.GradSync(
        hook=fsync.ops.powersgd(rank_, start_step=0, error_feedback=error_feedback), **CAP
    )
    state = sync.init(_params())
    synced_sum = exact_sum = None
    errors = {}
    for step in range(1, 51):
        grads = _grads(rank, step, drift=drift)
        out, state = sync(grads, state)
        mean = _exact_mean(grads)
        synced = torch.cat([out[k].double().reshape(-1) for k in mean])
        exact = torch.cat([mean[k].reshape(-1) for k in mean])
        synced_sum = synced if synced_sum is None else synced_sum + synced
        exact_sum = exact if exact_sum is None else exact_sum + exact
        if step in (10, 25, 50):
            gap = torch.linalg.vector_norm(synced_sum - exact_sum)
            errors[step] = (gap / torch.linalg.vector_norm(exact_sum)).item()
    return errors


@pytest.mark.parametrize("world", [2, 3], indirect=True)
@pytest.mark.parametrize("rank_", [1, 2, 3, 4])
def test_error_feedback_keeps_the_running_sum_on_track(world: World, rank_):
    with_feedback = world.run(_on_rank_error_feedback, rank_, True)[0]
    without = world.run(_on_rank_error_feedback, rank_, False)[0]
    print(f"W={world.size} rank {rank_}: with feedback {with_feedback}, without {without}")
    # With error feedback what compression drops is delivered later: the running sums
    # differ by one step's error, so their relative gap shrinks like 1 / steps.
    assert with_feedback[50] < with_feedback[25] < with_feedback[10], with_feedback
    assert with_feedback[50] < 0.4 * with_feedback[10], with_feedback
    # Without it the bias of a low-rank approximation accumulates: no shrinking.
    assert without[50] > 0.7 * without[10], without
    assert with_feedback[50] < 0.5 * without[50], (with_feedback, without)


# --- what goes on the wire -----------------------------------------------------------------------


def _ddp_compressed_numel(shape, rank_, min_compression_rate):
    """DDP's PowerSGDState.compression_stats bookkeeping for one leaf (numel after)."""
    n = shape[0] if shape else 1
    m = math.prod(shape) // n if n else 0
    r = min(n, m, rank_)
    if (n + m) * r * min_compression_rate < n * m:
        return (n + m) * r
    return n * m


def _on_rank_wire_numel(batched, rank_):
    sizes = []
    original = _comm.all_reduce

    def recording(x, op, group, **kwargs):
        if not kwargs.get("control"):  # the buckets' collectives, not the ranks' agreement
            sizes.append(x.numel())
        return original(x, op, group, **kwargs)

    _comm.all_reduce = recording
    try:
        factory = fsync.ops.batched_powersgd if batched else fsync.ops.powersgd
        sync = fsync.GradSync(hook=factory(rank_, start_step=2), **CAP)
        state = sync.init(_params())
        per_step = []
        for step in range(4):
            sizes.clear()
            _, state = sync(_grads(dist.get_rank(), step), state)
            per_step.append(sum(sizes))
    finally:
        _comm.all_reduce = original
    return per_step, [spec.numel for spec in sync.plan(state).specs]


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize("rank_", [1, 3])
@pytest.mark.parametrize("batched", [False, True], ids=["per_leaf", "batched"])
def test_compression_ratio_is_the_theoretical_one(world: World, batched, rank_):
    (per_step, bucket_numels), _ = world.run(_on_rank_wire_numel, batched, rank_)
    shapes = [tuple(v.shape) for v in _grads(0, 0).values()]
    before = sum(math.prod(s) for s in shapes)
    if batched:
        after = 0
        for numel in bucket_numels:
            side = math.ceil(math.sqrt(numel))
            r = min(side, rank_)
            after += 2 * side * r if 2 * side * r * 2.0 < numel else numel
    else:
        after = sum(_ddp_compressed_numel(s, rank_, 2.0) for s in shapes)
    assert after < before  # something is compressed
    # Plain all-reduce before start_step, then the compressed size, every step.
    assert per_step == [before, before, after, after]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("rank_", [1, 4])
@pytest.mark.parametrize("batched", [False, True], ids=["per_leaf", "batched"])
def test_sync_stats_reports_the_theoretical_compression_ratio(batched, rank_, world_size):
    """fsync.sync_stats measures the hook's real code path (collectives recorded, not sent)."""
    factory = fsync.ops.batched_powersgd if batched else fsync.ops.powersgd
    hook = factory(rank_, start_step=2)
    plan = fsync.plan_buckets(_params(), **CAP)
    state = hook.init(plan)
    plain = fsync.sync_stats(plan, hook=hook, state=state, world_size=world_size)
    assert plain.compression == 1.0 and plain.num_collectives == len(plan.buckets)

    compressing = state._replace(step=torch.tensor(2))  # as after two synced steps
    stats = fsync.sync_stats(plan, hook=hook, state=compressing, world_size=world_size)
    before = after = 0
    collectives = []
    for spec in plan.specs:
        if batched:  # the whole bucket as a square of side ceil(sqrt(numel))
            side = math.ceil(math.sqrt(spec.numel))
            r = min(side, rank_)
            compressed = 2 * side * r * 2.0 < spec.numel  # min_compression_rate=2.0
            numel = 2 * side * r if compressed else spec.numel
        else:  # DDP's PowerSGDState.compression_stats bookkeeping, leaf by leaf
            shapes = [plan.leaves[i].shape for i in spec.leaves]
            numels = [_ddp_compressed_numel(shape, rank_, 2.0) for shape in shapes]
            compressed = any(n < math.prod(shape) for n, shape in zip(numels, shapes, strict=True))
            numel = sum(numels)
        before += spec.numel
        after += numel
        # P (with every uncompressed leaf of the bucket, vectors included) and Q; or,
        # with nothing worth compressing, the bucket in one all-reduce.
        collectives.append(2 if compressed else 1)
    assert 1 in collectives or rank_ == 1  # rank 4 leaves the convolution's bucket whole
    assert stats.num_collectives == sum(collectives)
    assert all(c.op == "all_reduce" and c.dtype == torch.float32 for c in stats.collectives)
    assert stats.bytes_reduced == 4 * before and stats.bytes_on_wire == 4 * after
    assert stats.compression == before / after  # the same quotient, correctly rounded


# --- parity with DDP's powerSGD_hook ---------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 24)
        self.b = nn.Linear(24, 24)
        self.b2 = nn.Linear(24, 24)  # a second matrix of b's shape: batched together
        self.c = nn.Linear(24, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b2(torch.tanh(self.b(h)))))


def _mlp_batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def _orthogonalize_2d_too(original):
    """DDP's ``_orthogonalize``, also taking the single matrices ``batched_powerSGD_hook`` passes.

    Since pytorch#75157 ``_orthogonalize`` takes batches of matrices (3-D) and asserts so,
    but ``batched_powerSGD_hook`` still hands it its (side x rank) Q and P: on torch 2.13
    the hook raises ``AssertionError`` at its first compressed step. As a batch of one (a
    view, orthonormalised in place like the matrix itself) the hook runs unchanged.
    """

    def orthogonalize(matrices, epsilon=0):
        return original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    return orthogonalize


def _on_rank_ddp_parity(rank_, batched):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _MLP()
    # One bucket: with several, DDP's hook issues the P and Q all-reduces of different
    # buckets from future callbacks, in an order that can differ between ranks (gloo
    # then fails on mismatched collectives).
    ddp = DDP(copy.deepcopy(model))
    ddp_state = ddp_powersgd.PowerSGDState(
        None, matrix_approximation_rank=rank_, start_powerSGD_iter=2
    )
    ddp_hook = ddp_powersgd.batched_powerSGD_hook if batched else ddp_powersgd.powerSGD_hook
    ddp.register_comm_hook(ddp_state, ddp_hook)
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}

    def ddp_step(step):
        ddp.zero_grad(set_to_none=True)
        x, y = _mlp_batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        return {n: p.grad.clone() for n, p in ddp.module.named_parameters()}

    for step in range(2):  # plain all-reduce; DDP rebuilds its buckets after the first
        ddp_step(step)
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    order = [index[id(p)] for b in buckets for p in b.parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    plan = fsync.plan_buckets(params, order=order)
    factory = fsync.ops.batched_powersgd if batched else fsync.ops.powersgd
    sync = fsync.GradSync(hook=factory(rank_, start_step=2), order=order)
    state = sync.init(params)
    assert sync.plan(state) == plan
    assert len(plan.buckets) == len(buckets) == 1
    # DDP draws its first Q from numpy's RNG; hand it fsync's instead (both lay Q out
    # leaf by leaf, grouped by shape, or as one side x rank matrix when batched). With
    # the same Q the two run the same algorithm. Elements of the first all-reduce: the
    # Ps and, per leaf, every leaf DDP does not compress (vectors, small matrices).
    q = state.hook.q[0]
    if batched:
        side = math.ceil(math.sqrt(plan.specs[0].numel))
        assert state.hook.error[0].numel() == side * side  # the bucket is compressed
        ddp_state.q_memory_dict[0] = q.view(side, rank_).clone()
        ddp_state.p_memory_dict[0] = torch.empty(side, rank_)
        first_all_reduce = side * rank_
    else:
        ddp_state.q_memory_dict[0] = q.clone()
        p_numel = uncompressed = 0
        for p in buckets[0].parameters():
            n, m = p.shape[0], p[0].numel()
            r = min(n, m, rank_)
            if ddp_powersgd._should_compress(n, m, r, ddp_state.min_compression_rate)[0]:
                p_numel += n * r
            else:
                uncompressed += p.numel()
        assert uncompressed > 0  # the biases
        ddp_state.p_memory_dict[0] = torch.empty(p_numel)
        first_all_reduce = uncompressed + p_numel

    def loss(params, batch):
        return nn.functional.mse_loss(
            torch.func.functional_call(model, params, batch[:1]), batch[1]
        )

    for step in range(2):
        out, state = sync(torch.func.grad(loss)(params, _mlp_batch(rank, step)), state)
    worst = 0.0
    sizes = []
    original_all_reduce, original_orthogonalize = _comm.all_reduce, ddp_powersgd._orthogonalize
    # The buckets' all-reduces, not the ranks' agreement (control).
    _comm.all_reduce = lambda x, *args, **kwargs: (
        (None if kwargs.get("control") else sizes.append(x.numel()))
        or original_all_reduce(x, *args, **kwargs)
    )
    ddp_powersgd._orthogonalize = _orthogonalize_2d_too(original_orthogonalize)
    try:
        for step in range(2, 6):
            expected = ddp_step(step)
            sizes.clear()
            out, state = sync(torch.func.grad(loss)(params, _mlp_batch(rank, step)), state)
            # Two all-reduces: the Ps with every uncompressed leaf (one collective, however
            # many vectors), then the Qs. DDP's powerSGD_hook sends the uncompressed
            # leaves in a third; its batched hook compresses them in the square.
            assert sizes == [first_all_reduce, len(q)], (sizes, first_all_reduce)
            for name, ref in expected.items():
                # Same algorithm, rounded differently in three places: fsync scales by 1/W
                # before summing where DDP divides after, and DDP keeps an error term for
                # uncompressed leaves that adds up to zero across ranks only to rounding.
                # Each is a few float32 ulps, which one matmul can spread over the leaf
                # (measured: under 1e-6). Batched on two ranks none of them applies (x / 2
                # is exact, every leaf is compressed): measured bit for bit.
                diff = torch.linalg.vector_norm(out[name] - ref)
                rel = (diff / torch.linalg.vector_norm(ref)).item()
                assert rel <= 1e-5, (step, name, rel)
                worst = max(worst, rel)
    finally:
        _comm.all_reduce, ddp_powersgd._orthogonalize = original_all_reduce, original_orthogonalize
    # DDP's own bookkeeping (elements, summed over its compressed steps) against what
    # fsync.sync_stats reports for one step (bytes, 4 per float32 element).
    _, ddp_before, ddp_after = ddp_state.compression_stats()
    stats = fsync.sync_stats(plan, hook=factory(rank_, start_step=2), state=state.hook)
    compressed_steps = 4
    assert ddp_before * 4 == compressed_steps * stats.bytes_reduced, (ddp_before, stats)
    assert ddp_after * 4 == compressed_steps * stats.bytes_on_wire, (ddp_after, stats)
    return worst


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize("rank_", [1, 3])
@pytest.mark.parametrize("batched", [False, True], ids=["per_leaf", "batched"])
def test_matches_ddp_powersgd_hook_given_the_same_initial_q(world: World, batched, rank_):
    """powersgd / batched_powersgd against DDP's powerSGD_hook / batched_powerSGD_hook.

    DDP's hooks run for real in DDP on gloo; the batched one needs _orthogonalize_2d_too.
    """
    worst = world.run(_on_rank_ddp_parity, rank_, batched)
    print(f"{'batched' if batched else 'per leaf'}, rank {rank_}: worst relative error {worst}")


# --- state: start_step, determinism, zero gradients, checkpoints ----------------------------------


def _on_rank_start_step_and_randomness():
    rank = dist.get_rank()
    sync = fsync.GradSync(hook=fsync.ops.powersgd(2, start_step=3), **CAP)
    state = sync.init(_params())
    initial = state.hook
    for step in range(3):
        grads = _grads(rank, step)
        out, state = sync(grads, state)
        plain = fsync.sync_grads(grads, **CAP)
        assert all(torch.equal(out[k], plain[k]) for k in grads), step
        assert int(state.hook.step) == step + 1
        for a, b in zip(state.hook.error + state.hook.q, initial.error + initial.q, strict=True):
            assert torch.equal(a, b)  # untouched until compression starts
    out, state = sync(_grads(rank, 3), state)
    assert not torch.equal(out["w"], fsync.sync_grads(_grads(rank, 3), **CAP)["w"])

    # Q: the same on every rank, a function of the seed.
    q = torch.cat(initial.q)
    gathered = [torch.empty_like(q) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, q)
    assert all(torch.equal(g, q) for g in gathered)
    other_seed = fsync.GradSync(hook=fsync.ops.powersgd(2, seed=1), **CAP).init(_params())
    assert not torch.equal(torch.cat(other_seed.hook.q), q)
    # Standard normal draws: with these 126, the sample mean and standard deviation
    # have standard errors of about 0.09 and 0.06; 0.2 is more than three of them.
    assert q.numel() == 126
    torch.testing.assert_close(q.mean(), torch.tensor(0.0), atol=0.2, rtol=0)
    torch.testing.assert_close(q.std(), torch.tensor(1.0), atol=0.2, rtol=0)

    # Without warm start a fresh Q is drawn at every step; the first compressed step
    # draws the Q that warm start begins with.
    outs = {}
    for warm in (True, False):
        sync = fsync.GradSync(hook=fsync.ops.powersgd(2, start_step=1, warm_start=warm), **CAP)
        state = sync.init(_params())
        assert all((q.numel() > 0) == warm for q in state.hook.q)  # no Q kept without it
        outs[warm] = []
        for s in range(3):
            out, state = sync(_grads(rank, s), state)
            outs[warm].append(out)
    assert all(torch.equal(outs[True][1][k], outs[False][1][k]) for k in outs[True][1])
    assert not torch.equal(outs[True][2]["w"], outs[False][2]["w"])


@pytest.mark.parametrize("world", [2], indirect=True)
def test_start_step_and_deterministic_random_q(world: World):
    world.run(_on_rank_start_step_and_randomness)


def _on_rank_zero_gradient():
    """A leaf whose gradient is zero on every rank (unused) neither poisons nor freezes."""
    rank = dist.get_rank()
    for epsilon in (0.0, 1e-8):
        # Rank >= min(rows, cols), so that the output is the mean once gradients return.
        hook = fsync.ops.powersgd(
            16, start_step=0, min_compression_rate=0.0, orthogonalization_epsilon=epsilon
        )
        sync = fsync.GradSync(hook=hook, **CAP)
        state = sync.init(_params())
        fed_back, previous = torch.zeros(24, 16), 0.0  # this rank's error feedback on w
        for step in range(5):
            grads = _grads(rank, step)
            if step < 2:
                grads["w"] = torch.zeros(24, 16)
            out, state = sync(grads, state)
            assert all(torch.isfinite(v).all() for v in out.values()), step
            mean = _exact_mean(grads)["w"]
            err = torch.linalg.vector_norm(out["w"].double() - mean).item()
            # As in test_full_rank_gives_the_exact_mean: the derived bound for w's 24 x 16
            # matrix, mean_i ||g_i|| + ||e_i||, plus the previous step's error handed back by
            # the error feedback. Zero (exactly zero out) while w's gradient is zero.
            norm = torch.tensor(
                [torch.linalg.vector_norm(t.double()).item() for t in (grads["w"], fed_back)]
            ).sum()
            dist.all_reduce(norm)
            world_size = dist.get_world_size()
            bound = powersgd_full_rank_bound(norm.item() / world_size, 24, 16, world_size)
            assert err <= bound + previous, (step, err, bound + previous)
            fed_back, previous = grads["w"] + fed_back - out["w"], bound


@pytest.mark.parametrize("world", [2], indirect=True)
def test_zero_gradients_give_zeros_then_the_mean(world: World):
    world.run(_on_rank_zero_gradient)


def _sgd_steps(sync, params, state, steps):
    rank = dist.get_rank()
    for step in steps:
        grads = _grads(rank, step)
        out, state = sync(grads, state)
        params = {k: p - 0.1 * out[k] for k, p in params.items()}
    return params, state


def _on_rank_checkpoint(batched):
    factory = fsync.ops.batched_powersgd if batched else fsync.ops.powersgd
    sync = fsync.GradSync(hook=factory(2, start_step=2), **CAP)
    params0 = _params()
    straight, _ = _sgd_steps(sync, params0, sync.init(params0), range(6))

    params, state = _sgd_steps(sync, params0, sync.init(params0), range(4))
    buffer = io.BytesIO()
    torch.save({"params": params, "sync": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only, torch's default
    assert isinstance(loaded["sync"].hook, fsync.ops.PowerSGDState)
    assert int(loaded["sync"].hook.step) == 4
    resumed, _ = _sgd_steps(sync, loaded["params"], loaded["sync"], range(4, 6))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize("batched", [False, True], ids=["per_leaf", "batched"])
def test_state_round_trips_through_torch_save_and_resumes_bitwise(world: World, batched):
    world.run(_on_rank_checkpoint, batched)


# --- misuse --------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [fsync.ops.powersgd, fsync.ops.batched_powersgd])
def test_bad_settings_raise(factory):
    with pytest.raises(ValueError, match=r"rank must be >= 1 .*; got 0"):
        factory(0)
    with pytest.raises(TypeError, match=r"rank must be an int; got 1\.5"):
        factory(1.5)
    with pytest.raises(ValueError, match="start_step must be >= 0; got -1"):
        factory(start_step=-1)
    with pytest.raises(ValueError, match="min_compression_rate must be a finite number >= 0"):
        factory(min_compression_rate=float("nan"))
    with pytest.raises(ValueError, match="orthogonalization_epsilon must be a finite number"):
        factory(orthogonalization_epsilon=-1e-8)
    ints = {"w": torch.zeros(4, 4), "n": torch.zeros(4, 4, dtype=torch.int32)}
    with pytest.raises(TypeError, match=r"got bucket 0 of dtype torch.int32 \(first leaf 'n'\)"):
        factory().init(fsync.plan_buckets(ints))


def _on_rank_state_from_elsewhere():
    grads = _grads(dist.get_rank(), 0)
    sync = fsync.GradSync(hook=fsync.ops.powersgd(2), **CAP)
    state = sync.init(_params())
    renamed = {f"{k}_": v for k, v in _params().items()}  # same shapes, another plan
    foreign = fsync.GradSync(hook=fsync.ops.powersgd(2), **CAP).init(renamed)
    with pytest.raises(ValueError, match="powersgd: the state does not fit this plan: its finger"):
        sync(grads, state._replace(hook=foreign.hook))
    smaller = fsync.GradSync(hook=fsync.ops.powersgd(2), **CAP).init({"w": torch.zeros(24, 16)})
    with pytest.raises(ValueError, match="does not fit this plan: it has 1 buckets, the plan has"):
        sync(grads, state._replace(hook=smaller.hook))
    other_rank = fsync.GradSync(hook=fsync.ops.powersgd(4), **CAP).init(_params())
    with pytest.raises(ValueError, match=r"does not fit this plan: error\[0\] has shape \(384,\)"):
        sync(grads, state._replace(hook=other_rank.hook))
    cold = fsync.GradSync(hook=fsync.ops.powersgd(2, warm_start=False), **CAP).init(_params())
    with pytest.raises(ValueError, match=r"does not fit this plan: q\[0\] has shape \(0,\)"):
        sync(grads, state._replace(hook=cold.hook))
    with pytest.raises(TypeError, match="powersgd: state is a tuple; expected the PowerSGDState"):
        sync(grads, state._replace(hook=()))
    # Nothing was communicated: the world is still in step.
    out, _ = sync(grads, state)
    assert out.keys() == grads.keys()


@pytest.mark.parametrize("world", [2], indirect=True)
def test_a_state_from_another_plan_raises(world: World):
    world.run(_on_rank_state_from_elsewhere)


# --- the main example ----------------------------------------------------------------------------


def _on_rank_train_example(hook, steps):
    path = pathlib.Path(__file__).parents[1] / "examples" / "train.py"
    spec = importlib.util.spec_from_file_location("fsync_example_train", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(["--hook", hook, "--steps", str(steps), "--no-compile"])
    result = example.train(args, torch.device("cpu"))
    fsync.verify(result["params"], values=True)  # identical on every rank
    return {k: result[k] for k in ("first_loss", "last_loss", "test_loss")}


@pytest.mark.parametrize("world", [2], indirect=True)
def test_training_with_powersgd_rank_4_ends_within_5_percent_of_allreduce(world: World):
    steps = 150  # half the example's default; PowerSGD starts at step 10
    plain = world.run(_on_rank_train_example, "allreduce", steps)[0]
    compressed = world.run(_on_rank_train_example, "powersgd", steps)[0]
    print(f"held-out loss after {steps} steps: allreduce {plain}, powersgd(4) {compressed}")
    assert compressed["test_loss"] < 0.2 * compressed["first_loss"]  # it learned
    assert abs(compressed["test_loss"] - plain["test_loss"]) <= 0.05 * plain["test_loss"]

"""fsync.optim against torch.optim: same parameters after 20 steps, fp32 and bf16.

The reference is torch.optim's default CPU implementation (the single-tensor
one: CPU is not a foreach device). fsync's optimizers run the same torch
operations in the same order with the same scalars; the scalars torch computes
in Python doubles from the step count are 0-d float64 CPU tensors here, which
torch's kernels read exactly as they read a Python float. Equality is
therefore checked bit for bit, except where noted.
"""

from __future__ import annotations

import io

import optree
import pytest
import torch
import torch._dynamo

import fsync
from fsync import _tree
from tests._models import params_of, ref_model

STEPS = 20
LR = 1e-2

# name -> (fsync optimizer from lr, torch.optim class, keyword arguments both take)
CASES = {
    "sgd": (fsync.optim.sgd, torch.optim.SGD, {}),
    "sgd_momentum": (
        fsync.optim.sgd,
        torch.optim.SGD,
        {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    ),
    "sgd_nesterov": (
        fsync.optim.sgd,
        torch.optim.SGD,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    "adam": (fsync.optim.adam, torch.optim.Adam, {}),
    "adam_l2": (fsync.optim.adam, torch.optim.Adam, {"betas": (0.8, 0.99), "weight_decay": 0.1}),
    "adamw": (fsync.optim.adamw, torch.optim.AdamW, {}),
    "adamw_eps": (fsync.optim.adamw, torch.optim.AdamW, {"eps": 1e-3, "weight_decay": 0.5}),
}


def _params(dtype):
    """The parity model's parameters (channels_last conv, embedding, norm, linears)."""
    return {k: v.to(dtype) for k, v in params_of(ref_model()).items()}


def _grads(params, step):
    g = torch.Generator().manual_seed(step)
    return {
        k: torch.randn(p.shape, generator=g).to(p.dtype).to(memory_format=_layout(p))
        for k, p in params.items()
    }


def _layout(p):
    cl = p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if cl else torch.contiguous_format


def _run_torch(cls, kwargs, params, fused=False):
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = cls(list(leaves.values()), lr=LR, fused=fused or None, **kwargs)
    for s in range(STEPS):
        for k, grad in _grads(params, s).items():
            leaves[k].grad = grad
        opt.step()
    return {k: v.detach() for k, v in leaves.items()}


def _run_fsync(make, kwargs, params, lr):
    opt = make(lr, **kwargs)
    state = opt.init(params)
    for s in range(STEPS):
        params, state = opt.update(params, _grads(params, s), state)
    assert int(state.step) == STEPS
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_optim(case, dtype):
    make, cls, kwargs = CASES[case]
    params = _params(dtype)
    ref = _run_torch(cls, kwargs, params)
    with_float = _run_fsync(make, kwargs, params, LR)
    with_tensor = _run_fsync(make, kwargs, params, torch.tensor(LR, dtype=torch.float64))
    for k in ref:
        assert with_float[k].stride() == ref[k].stride(), k  # channels_last stays channels_last
        assert torch.equal(with_float[k], ref[k]), (k, (with_float[k] - ref[k]).abs().max())
        if case.startswith("sgd") and dtype == torch.bfloat16:
            # p - lr * g with a tensor lr is torch.addcmul(p, g, -lr), with a float
            # torch.add(p, g, alpha=-lr) as in torch.optim. For 16-bit floats torch's
            # add rounds the product to bf16 before the sum on the elements its
            # vector loop leaves over (which ones depends on chunking), so the two
            # may differ by one rounding, one bf16 ulp, per step: at most STEPS ulps.
            ulp = torch.finfo(dtype).eps * ref[k].abs().max().float()
            diff = (with_tensor[k].float() - ref[k].float()).abs().max()
            assert diff <= STEPS * ulp, (k, diff, ulp)
        else:
            # A float64 lr tensor holds the same double as the float.
            assert torch.equal(with_tensor[k], ref[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_in_place_matches_torch_optim_in_the_given_tensors(case, dtype):
    """``in_place=True``: torch.optim's own in-place kernels on the caller's tensors, so the
    same bits as torch.optim (and as the pure update), written where torch.optim writes."""
    make, cls, kwargs = CASES[case]
    ref = _run_torch(cls, kwargs, _params(dtype))
    params = {k: v.clone() for k, v in _params(dtype).items()}
    opt = make(LR, in_place=True, **kwargs)
    assert opt.in_place and not make(LR, **kwargs).in_place
    state = opt.init(params)
    state_tensors = optree.tree_leaves(state)
    for s in range(STEPS):
        out, state = opt.update(params, _grads(params, s), state)
        assert all(out[k] is params[k] for k in params)  # the given tensors, updated
        now = optree.tree_leaves(state)
        assert all(a is b for a, b in zip(now, state_tensors, strict=True))
    assert int(state.step) == STEPS
    for k in ref:
        assert params[k].stride() == ref[k].stride(), k
        assert torch.equal(params[k], ref[k]), (k, (params[k] - ref[k]).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_fused_sgd_probe_says_whether_torch_optim_fused_updates_every_element(dtype):
    """The probe behind sgd(fused=True)'s refusal agrees with torch.optim.SGD(fused=True) on
    a parameter of several vector blocks: sound exactly where every element moves as the
    unfused update moves it (to within one rounding of the parameter's dtype)."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=g).to(dtype)
    grad = torch.randn(1000, generator=g).to(dtype)
    moved = {}
    for fused in (False, True):
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.SGD([p], lr=0.5, momentum=0.5, fused=fused)
        for _ in range(3):
            p.grad = grad.clone()
            opt.step()
        moved[fused] = p.detach().float()
    # three steps of lr 0.5 on |grad| ~ 1 move each element by ~2: unfused and fused
    # differ by the roundings of three steps (fused rounds once a step), far below that.
    ulps = 3 * 4 * torch.finfo(dtype).eps * (moved[False].abs() + 4)
    updates_all = bool(((moved[True] - moved[False]).abs() <= ulps).all())
    assert fsync.optim._base.fused_sgd_sound("cpu", dtype) == updates_all


@pytest.mark.parametrize("in_place", [False, True], ids=["pure", "in_place"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_torch_optim_fused(case, dtype, in_place):
    """``fused=True``: torch's fused kernel, so the bits of torch.optim with ``fused=True``
    (not its default's: the kernel rounds once where the default rounds per operation),
    written into the given tensors with ``in_place``, else into new ones, the given
    parameters, gradients and state untouched; a tensor lr reads as its float."""
    make, cls, kwargs = CASES[case]
    if cls is torch.optim.SGD and not fsync.optim._base.fused_sgd_sound("cpu", dtype):
        opt = make(LR, in_place=in_place, fused=True, **kwargs)  # torch's kernel is wrong
        with pytest.raises(ValueError, match="pytorch/pytorch#191763"):
            opt.update(_params(dtype), _grads(_params(dtype), 0), opt.init(_params(dtype)))
        return
    ref = _run_torch(cls, kwargs, _params(dtype), fused=True)
    for lr in (LR, torch.tensor(LR, dtype=torch.float64)):
        params = {k: v.clone() for k, v in _params(dtype).items()}
        opt = make(lr, in_place=in_place, fused=True, **kwargs)
        state = opt.init(params)
        for s in range(STEPS):
            grads = _grads(params, s)
            given = [t.clone() for t in optree.tree_leaves((params, grads, state))]
            out, new_state = opt.update(params, grads, state)
            assert all((out[k] is params[k]) == in_place for k in params)
            if not in_place:
                now = optree.tree_leaves((params, grads, state))
                assert all(torch.equal(a, b) for a, b in zip(given, now, strict=True))
            params, state = out, new_state
        assert int(state.step) == STEPS
        for k in ref:
            assert params[k].stride() == ref[k].stride(), k
            assert torch.equal(params[k], ref[k]), (k, lr, (params[k] - ref[k]).abs().max())


@pytest.mark.parametrize("in_place", [False, True], ids=["pure", "in_place"])
@pytest.mark.parametrize("case", ["sgd_momentum", "adamw"])
def test_fused_pairs_elements_whatever_the_layouts(case, in_place):
    """torch's fused kernels read every tensor in storage order (a channels_last parameter
    with a contiguous gradient gets wrong numbers from them): fsync runs such a parameter on
    contiguous copies, so its results are the contiguous update's, bit for bit, in the given
    layout. Cases: channels_last with a contiguous gradient, a transposed weight, and a
    parameter whose gradient and state match its layout (the kernel reads it directly)."""
    make, _, kwargs = CASES[case]
    g = torch.Generator().manual_seed(0)
    params = {
        "conv": torch.randn(4, 3, 3, 3, generator=g).to(memory_format=torch.channels_last),
        "t": torch.randn(7, 5, generator=g).t(),
        "plain": torch.randn(11, generator=g),
    }
    contiguous = {k: v.contiguous() for k, v in params.items()}
    opt = make(LR, fused=True, in_place=in_place, **kwargs)
    reference = make(LR, fused=True, **kwargs)
    mine, expected = {k: v.clone() for k, v in params.items()}, contiguous
    state, ref_state = opt.init(mine), reference.init(contiguous)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        out, state = opt.update(mine, grads, state)
        assert all((out[k] is mine[k]) == in_place for k in mine)
        mine = out
        expected, ref_state = reference.update(expected, grads, ref_state)
    for k in params:
        assert mine[k].stride() == params[k].stride(), k
        assert torch.equal(mine[k], expected[k]), (k, (mine[k] - expected[k]).abs().max())


@pytest.mark.parametrize(
    ("make", "fused"),
    [(fsync.optim.sgd, False), (fsync.optim.adamw, False), (fsync.optim.adamw, True)],
)
def test_compiled_in_place_update_writes_the_given_tensors(make, fused):
    """Traced, an in-place update is the pure one copied into the given tensors: the same
    tensors come back, holding what the eager update computes. A fused one traces (in one
    graph) as the unfused update, against the eager fused kernel's results."""
    steps = 3
    kwargs = {"momentum": 0.9} if make is fsync.optim.sgd else {"fused": fused}
    params = {"w": torch.randn(50, 30), "b": torch.randn(300).to(torch.bfloat16)}
    torch._dynamo.reset()
    opt = make(0.1, in_place=True, **kwargs)
    compiled = torch.compile(opt.update, fullgraph=True)
    mine = {k: v.clone() for k, v in params.items()}
    state = opt.init(mine)
    pure = make(0.1, **kwargs)  # eager
    expected, pure_state = params, pure.init(params)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape).to(v.dtype) for k, v in params.items()}
        out, new_state = compiled(mine, grads, state)
        assert all(out[k] is mine[k] for k in mine) and new_state.step is state.step
        state = new_state
        expected, pure_state = pure.update(expected, grads, pure_state)
    assert int(state.step) == steps
    for k in params:
        # As in the test above: inductor's kernel keeps float32 intermediates where the eager
        # update rounds after each operation (torch's fused kernel rounds once too, its
        # operations in its own order), one rounding of the parameter per step in both, so
        # at most about one ulp of the parameters' scale per step.
        ulp = torch.finfo(params[k].dtype).eps * expected[k].abs().max().float()
        assert (mine[k].float() - expected[k].float()).abs().max() <= steps * ulp, k


def test_zero_and_diloco_refuse_an_in_place_optimizer():
    in_place = fsync.optim.adamw(1e-3, in_place=True)
    with pytest.raises(TypeError, match=r"updates in place.*the ZeRO step owns the state"):
        fsync.ops.zero(in_place)
    with pytest.raises(TypeError, match=r"updates in place.*the ZeRO step owns the state"):
        fsync.ops.replicated(in_place)
    with pytest.raises(TypeError, match=r"outer updates in place.*diloco owns the state"):
        fsync.diloco(2, outer=in_place)
    with pytest.raises(TypeError, match=r"in_place must be True or False; got 1"):
        fsync.optim.sgd(0.1, in_place=1)
    with pytest.raises(TypeError, match=r"fused must be True or False; got 'yes'"):
        fsync.optim.adamw(0.1, fused="yes")


def test_float32_lr_tensor_is_read_as_its_value():
    # lr = 2**-7 is exact in float32, so a float32 tensor gives the float's results.
    params = _params(torch.float32)
    a = _run_fsync(fsync.optim.adamw, {}, params, 2**-7)
    b = _run_fsync(fsync.optim.adamw, {}, params, torch.tensor(2**-7))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("make", [fsync.optim.sgd, fsync.optim.adam])
def test_none_gradient_leaves_parameter_and_state(make, fused):
    kwargs = {"momentum": 0.9} if make is fsync.optim.sgd else {}
    opt = make(0.1, fused=fused, **kwargs)
    params = {"a": torch.ones(3), "b": torch.ones(2), "c": None}
    state = opt.init(params)
    new, state2 = opt.update(params, {"a": torch.ones(3), "b": None, "c": None}, state)
    assert new["b"] is params["b"] and new["c"] is None
    assert not torch.equal(new["a"], params["a"])
    buffers = state2.momentum if make is fsync.optim.sgd else state2.exp_avg
    assert torch.equal(buffers["b"], torch.zeros(2)) and buffers["c"] is None
    assert int(state2.step) == 1


@pytest.mark.parametrize("make", [fsync.optim.sgd, fsync.optim.adamw])
def test_update_is_pure_and_state_round_trips_through_torch_save(make):
    opt = make(0.1, momentum=0.9) if make is fsync.optim.sgd else make(0.1)
    params = _params(torch.float32)
    grads = _grads(params, 0)
    state = opt.init(params)
    params, state = opt.update(params, grads, state)
    before = [t.clone() for t in (*params.values(), *grads.values())]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only: the state classes are registered
    assert type(loaded) is type(state) and torch.equal(loaded.step, state.step)
    out1, s1 = opt.update(params, grads, state)
    out2, _ = opt.update(params, grads, loaded)
    assert all(torch.equal(out1[k], out2[k]) for k in out1)
    after = [*params.values(), *grads.values()]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert int(state.step) == 1 and int(s1.step) == 2


def test_lr_tensor_schedule_matches_torch_param_group_lr():
    lr = torch.tensor(LR, dtype=torch.float64)
    params = _params(torch.float32)
    opt = fsync.optim.adamw(lr)
    state = opt.init(params)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = torch.optim.AdamW(list(leaves.values()), lr=LR)
    for s in range(5):
        lr.fill_(LR / (s + 1))
        ref.param_groups[0]["lr"] = LR / (s + 1)
        grads = _grads(params, s)
        for k, grad in grads.items():
            leaves[k].grad = grad
        ref.step()
        params, state = opt.update(params, grads, state)
    assert all(torch.equal(params[k], leaves[k].detach()) for k in params)


def test_compiled_update_does_not_recompile_when_lr_changes():
    steps, base = 4, 0.1
    lr = torch.tensor(base, dtype=torch.float64)
    params = {"w": torch.randn(50, 30), "b": torch.randn(300).to(torch.bfloat16)}
    for opt in (fsync.optim.adamw(lr), fsync.optim.sgd(lr, momentum=0.9)):
        torch._dynamo.reset()
        compiled = torch.compile(opt.update, fullgraph=True)
        eager_p = compiled_p = params
        eager_s = compiled_s = opt.init(params)
        for s in range(steps):
            lr.fill_(base / (s + 1))  # a schedule: the tensor changes in place
            grads = {k: torch.randn(v.shape).to(v.dtype) for k, v in params.items()}
            eager_p, eager_s = opt.update(eager_p, grads, eager_s)
            # After the first call any recompile (a guard on the step count or on
            # the lr value) raises.
            with torch._dynamo.config.patch(error_on_recompile=s > 0):
                compiled_p, compiled_s = compiled(compiled_p, grads, compiled_s)
        assert int(compiled_s.step) == steps
        for k in params:
            # Inductor fuses a parameter's update into one kernel that keeps its
            # intermediates in float32 and may contract multiply-adds, where eager
            # rounds after every operation (to bf16 for "b"). The parameter is
            # rounded once per step in both, so they may drift apart by about one
            # ulp of the parameters' scale per step (measured: at most 1.25 ulp
            # after 4 steps); the 4 steps move them by 8 to 10**6 such ulps.
            ulp = torch.finfo(params[k].dtype).eps * eager_p[k].abs().max().float()
            diff = (compiled_p[k].float() - eager_p[k].float()).abs().max()
            assert diff <= steps * ulp, (k, diff / ulp)


def test_a_tensor_lr_is_traced_once():
    """A compiled update reading a tensor lr is traced once on its first compile.

    Held as a 0-d float64 tensor, dynamo gave its value a symbolic float and AOTAutograd's
    pass that tensorifies Python floats restarted the whole trace to specialise it (a second
    backend call; on an empty inductor cache, about 2 of 15 s of a small step's first
    compile). ``aot_eager`` runs the same AOT passes without inductor's code generation."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    lr = torch.tensor(0.1, dtype=torch.float64)
    params = {"w": torch.randn(5, 3), "b": torch.randn(3).to(torch.bfloat16)}
    grads = {k: torch.randn(v.shape).to(v.dtype) for k, v in params.items()}
    for opt in (fsync.optim.adamw(lr), fsync.optim.sgd(lr, momentum=0.9)):
        torch._dynamo.reset()
        calls = []

        def backend(gm, example_inputs, calls=calls):
            calls.append(gm)
            return aot_eager(gm, example_inputs)

        compiled = torch.compile(opt.update, backend=backend, fullgraph=True)
        state = opt.init(params)
        got, _ = compiled(params, grads, state)
        expected, _ = opt.update(params, grads, state)
        assert len(calls) == 1
        # aot_eager runs the same kernels as eager: the same bits.
        assert all(torch.equal(got[k], expected[k]) for k in params)


def test_compiled_train_step_matches_eager_with_gradients_from_matmuls():
    """Every optimizer inside one compiled torch.func step, against the same step eagerly.

    Linear weights' gradients come straight out of a matmul, which is what torch
    2.13's inductor fuses an ``add(p, g, alpha=-lr)`` with into an ``addmm`` that
    drops ``alpha`` (the compiled step then computed ``p + g``). Updating with
    gradients passed in, as the test above does, never meets that rewrite.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8, bias=False)
    )
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(24, 16), torch.randn(24, 8)
    opts = [make(LR, **kwargs) for make, _, kwargs in CASES.values()]

    def loss_fn(p):
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    def step(all_params, states):
        out = [
            opt.update(p, torch.func.grad(loss_fn)(p), s)
            for opt, p, s in zip(opts, all_params, states, strict=True)
        ]
        return [p for p, _ in out], [s for _, s in out]

    compiled = torch.compile(step, fullgraph=True)
    eager_p = compiled_p = [params] * len(opts)
    eager_s = compiled_s = [opt.init(params) for opt in opts]
    for _ in range(3):
        eager_p, eager_s = step(eager_p, eager_s)
        compiled_p, compiled_s = compiled(compiled_p, compiled_s)
    for case, e, c in zip(CASES, eager_p, compiled_p, strict=True):
        for k in params:
            # The compiled forward and backward reduce in other orders and the fused
            # update may contract multiply-adds: a few float32 ulps of the gradients
            # and parameters per step (measured: at most 6e-8 after 3 steps). Dropping
            # alpha moves a weight by its whole gradient, about 1e-1 here.
            torch.testing.assert_close(c[k], e[k], rtol=1e-5, atol=1e-6, msg=f"{case} {k}")


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"lr must be a finite number >= 0.0; got -1"):
        fsync.optim.sgd(-1)
    with pytest.raises(ValueError, match=r"a tensor lr must be a one-element floating point"):
        fsync.optim.adam(torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match=r"betas\[1\] must be a finite number in \[0.0, 1.0\)"):
        fsync.optim.adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="betas must be a pair"):
        fsync.optim.adamw(betas=0.9)
    with pytest.raises(ValueError, match="nesterov needs momentum > 0 and dampening == 0"):
        fsync.optim.sgd(0.1, nesterov=True)
    opt = fsync.optim.adam()
    with pytest.raises(TypeError, match=r"params leaf 'n' has dtype torch.int64; expected a float"):
        opt.init({"w": torch.ones(2), "n": torch.ones(2, dtype=torch.int64)})
    params = {"w": torch.ones(2), "b": torch.ones(3)}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"grads have structure .* but params have"):
        opt.update(params, {"w": torch.ones(2)}, state)
    with pytest.raises(ValueError, match=r"grads leaf 'b' has shape \(2,\) and dtype"):
        opt.update(params, {"w": torch.ones(2), "b": torch.ones(2)}, state)
    with pytest.raises(TypeError, match=r"adam state is a SGDState; expected the AdamState"):
        opt.update(params, params, fsync.optim.sgd(0.1).init(params))
    with pytest.raises(ValueError, match=r"the state has structure .* but params have"):
        opt.update(params, params, opt.init({"w": torch.ones(2)}))


def test_update_checks_the_leaves_of_plain_and_nested_trees_alike():
    """The update reads a dict of tensors directly and flattens any other tree: the same
    checks and messages either way (the leaf named by its path)."""
    opt = fsync.optim.sgd(0.1)
    for wrap in (lambda t: t, lambda t: {"layer": t}):
        where = "" if wrap({}) == {} else "layer."
        params = wrap({"w": torch.ones(2), "b": None})
        state = opt.init(params)
        with pytest.raises(ValueError, match=rf"grads leaf '{where}b' is a tensor but the param"):
            opt.update(params, wrap({"w": torch.ones(2), "b": torch.ones(1)}), state)
        with pytest.raises(TypeError, match=rf"grads leaf '{where}w' is a float; expected a torch"):
            opt.update(params, wrap({"w": 1.0, "b": None}), state)
        ints = wrap({"w": torch.ones(2, dtype=torch.int64), "b": None})
        with pytest.raises(TypeError, match=rf"params leaf '{where}w' has dtype torch.int64"):
            opt.update(ints, ints, state)
        out, _ = opt.update(params, wrap({"w": torch.ones(2), "b": None}), state)
        assert _tree.structure(out) == _tree.structure(params)
        leaves = _tree.flatten(out)[0]
        assert torch.equal(leaves[0], torch.full((2,), 0.9)) and leaves[1] is None

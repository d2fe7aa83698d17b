"""The training steps the pages time, each built inside a setting's own processes.

Every builder runs on each rank of a world that :func:`benchmarks.harness.turns` made and
returns what one call of the setting does: an autograd step on an ``nn.Module`` (alone or
in DDP, eager or compiled), a ``torch.func`` step with fsync's sync or without, a flat
all-reduce of the gradients' bytes. They train with SGD at ``LR`` (or AdamW, where a page
asks); a page picks them with ``functools.partial`` (:func:`setting`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from benchmarks.constants import LR, caps
from benchmarks.harness import Built, Setting
from benchmarks.models import Load, Workload
from fsync import _agree
from tests._inductor_code import overlapped_kernels

FLAT = "flat all-reduce (floor)"
PURE_MEAN = "scaled copy + flat all-reduce (pure mean)"


def setting(name: str, build: Callable[..., Any], /, *, repeat: int = 1, **kwargs: Any) -> Setting:
    """The setting ``name``, built by ``build(**kwargs)`` in its processes (``repeat``: see
    :class:`benchmarks.harness.Setting`)."""
    return Setting(name, functools.partial(build, **kwargs), repeat)


class Held:
    """``fn(params, state) -> (params, state)`` as a call that threads both from step to step."""

    def __init__(self, fn: Callable[[Any, Any], tuple[Any, Any]], params: Any, state: Any) -> None:
        self.fn, self.params, self.state = fn, params, state

    def __call__(self) -> None:
        self.params, self.state = self.fn(self.params, self.state)


# Each optimizer as torch and as fsync have it, at ``LR`` (AdamW: weight decay 1e-2 in both).
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], Callable[..., Any]]] = {
    "sgd": (torch.optim.SGD, fsync.optim.sgd),
    "adamw": (torch.optim.AdamW, fsync.optim.adamw),
}


def module(
    load: Load,
    *,
    ddp: bool,
    compiled: bool = False,
    cap: float | None = None,
    optimizer: str = "sgd",
) -> Built:
    """An autograd step on the module, alone or wrapped in DDP (buckets of ``cap`` MiB), its
    forward eager or under ``torch.compile``, with ``torch.optim``'s SGD or AdamW."""
    work = load.build()
    model: torch.nn.Module = DDP(work.model, bucket_cap_mb=cap) if ddp else work.model
    forward = torch.compile(model) if compiled else model
    torch_optimizer = OPTIMIZERS[optimizer][0](model.parameters(), lr=LR)
    step = autograd_step(work, forward, work.batch(dist.get_rank()), torch_optimizer)
    return Built(step, lambda: {"params": work.num_params})


def autograd_step(
    work: Workload, model: Any, batch: Any, optimizer: Any = None
) -> Callable[[], None]:
    """One autograd step of ``model``: the gradients zeroed (``optimizer``'s, else the
    model's), backward of its loss on ``batch``, then ``optimizer.step()`` where one is given."""
    zeroed = model if optimizer is None else optimizer

    def step() -> None:
        zeroed.zero_grad(set_to_none=True)
        torch.autograd.backward(work.loss(model, batch))
        if optimizer is not None:
            optimizer.step()

    return step


def functional(
    load: Load,
    *,
    sync: str | None,
    compiled: bool = False,
    overlap: bool = True,
    cap: float | None = None,
    optimizer: str = "sgd",
    in_place: bool = False,
) -> Built:
    """A ``torch.func`` step with ``fsync.optim``'s SGD or AdamW (``in_place``: made with
    ``in_place=True``, writing into the parameters as ``torch.optim`` does; else pure).

    ``sync``: ``None`` (no sync: the floor), ``"sync_grads"`` (after
    ``torch.func.grad_and_value`` returns) or ``"grad_and_value"`` (``fsync.grad_and_value``,
    which starts each bucket's all-reduce as backward completes it). Compiled, the step is
    ``fsync.compile(step, overlap=overlap)``; a compiled sync's ``info`` counts its
    collectives and the compute kernels launched while one is in flight
    (:func:`overlapped_kernels`), read off inductor's code as it compiles.
    """
    work = load.build()
    batch = work.batch(dist.get_rank())
    update = OPTIMIZERS[optimizer][1](LR, in_place=in_place)
    synced = fsync.grad_and_value(work.functional_loss, **caps(cap))

    def train(params: dict[str, torch.Tensor], state: Any) -> Any:
        if sync == "grad_and_value":
            grads, _ = synced(params, batch)
        else:
            grads, _ = torch.func.grad_and_value(work.functional_loss)(params, batch)
            if sync == "sync_grads":
                grads = fsync.sync_grads(grads, **caps(cap))
        return update.update(params, grads, state)

    params = work.params()
    fn = fsync.compile(train, overlap=overlap) if compiled else train
    step = Held(fn, params, update.init(params))
    if not (compiled and sync):
        return Built(step)
    _, code = run_and_get_code(step)  # compiles: the first warm-up step, its code kept
    counts = overlapped_kernels(code[-1])
    return Built(step, lambda: {"collectives": counts[0], "overlapped": counts[1]})


MODULE_BACKWARD = "module, loss.backward() (no sync)"
TORCH_FUNC = "torch.func.grad_and_value (no sync)"
DDP_BACKWARD = "DDP, loss.backward()"
FSYNC_CALL = "fsync.grad_and_value"
FSYNC_AFTER_BACKWARD = "module, loss.backward(), fsync.sync_grads"
DDP_POWERSGD = "DDP + powerSGD_hook, loss.backward()"
FSYNC_POWERSGD = "GradSync(hook=powersgd(1)).grad_and_value"
# PowerSGD compresses from this step on in both (DDP's start_powerSGD_iter), rank 1.
POWERSGD_FROM = 2


def grad_call(load: Load, how: str) -> Built:
    """One gradient call of ``load``: :func:`gradient_call`."""
    return Built(gradient_call(load.build(), how))


def gradient_call(work: Workload, how: str) -> Callable[[], object]:
    """One gradient call of ``work``, no optimizer: forward, backward and (but for the two
    floors) the sync, as ``how`` names it (one of the names above)."""
    batch = work.batch(dist.get_rank())
    if how == FSYNC_AFTER_BACKWARD:  # a DDP script's backward, the sync a function of .grad
        backward = autograd_step(work, work.model, batch)
        named = list(work.model.named_parameters())
        return lambda: (backward(), fsync.sync_grads({n: p.grad for n, p in named}))
    if how in (MODULE_BACKWARD, DDP_BACKWARD, DDP_POWERSGD):
        model = work.model if how == MODULE_BACKWARD else DDP(work.model)
        if isinstance(model, DDP) and how == DDP_POWERSGD:
            state = powerSGD.PowerSGDState(
                None, matrix_approximation_rank=1, start_powerSGD_iter=POWERSGD_FROM
            )
            model.register_comm_hook(state, powerSGD.powerSGD_hook)
        return autograd_step(work, model, batch)
    params = work.params()
    if how == FSYNC_POWERSGD:
        sync = fsync.GradSync(hook=fsync.ops.powersgd(1, start_step=POWERSGD_FROM))
        stateful = sync.grad_and_value(work.functional_loss)
        return Held(lambda p, s: (p, stateful(s, p, batch)[1]), params, sync.init(params))
    call = fsync.grad_and_value if how == FSYNC_CALL else torch.func.grad_and_value
    stateless = call(work.functional_loss)
    return lambda: stateless(params, batch)


def ceiling(load: Load) -> Callable[[], None]:
    """The flat all-reduce issued before the compiled compute and waited for after it: the
    most overlap any schedule that waits for gradients could reach."""
    flat = torch.cat([p.detach().reshape(-1) for p in load.build().model.parameters()])
    compute = functional(load, sync=None, compiled=True).step

    def step() -> None:
        pending = dist.all_reduce(flat, async_op=True)
        compute()
        assert pending is not None
        pending.wait()

    return step


def sync_alone(load: Load, how: str, cap: float | None = None) -> Built:
    """``sync_grads`` of the model's gradient tree (``how``: eager, or compiled three ways),
    or one flat all-reduce of its bytes (``FLAT``), or a scaled copy and that (``PURE_MEAN``)."""
    grads = load.build().grads(dist.get_rank())
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    calls: dict[str, Callable[[], object]] = {
        FLAT: lambda: dist.all_reduce(flat),
        # The least a mean that leaves its input alone can do: one scaled copy, then the
        # all-reduce (fsync's compiled sync is this plus the packing, fused into the copy).
        PURE_MEAN: lambda: dist.all_reduce(flat.mul(1 / dist.get_world_size())),
        "sync_grads eager": lambda: fsync.sync_grads(grads, **caps(cap)),
    }
    sync: Callable[[Any], Any] = lambda g: fsync.sync_grads(g, **caps(cap))  # noqa: E731
    compiled = {  # plain torch.compile, then fsync.compile's two additions one at a time
        "sync_grads torch.compile": torch.compile(sync, fullgraph=True),
        "sync_grads fsync.compile, overlap off": fsync.compile(sync, overlap=False),
        "sync_grads compiled": fsync.compile(sync),  # the default: overlap=True
    }
    if how in compiled:  # compiling is lazy: only this one compiles, at its first call
        calls[how] = lambda: compiled[how](grads)
    nbytes = flat.numel() * flat.element_size()
    return Built(calls[how], lambda: {"bytes": nbytes})


def agreement(load: Load) -> Callable[[], object]:
    """What every sync adds to be safe: the ranks' agreement alone (one all-reduce of 13
    int64 and its check), nothing packed meanwhile."""
    params = load.build().params()
    plan, leaves = fsync.plan_buckets(params), list(params.values())
    terms = _agree.Terms(fsync.ops.allreduce().spec)
    return lambda: _agree.agree_on(plan, leaves, None, terms, pack=lambda token: [])

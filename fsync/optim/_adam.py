"""Adam and AdamW, as ``torch.optim.Adam`` and ``torch.optim.AdamW`` compute them."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from fsync._state import register_state
from fsync.optim import _base
from fsync.optim._base import LearningRate, Optimizer


@register_state
class AdamState(NamedTuple):
    """The state of [adam][fsync.optim.adam] and [adamw][fsync.optim.adamw].

    Attributes:
        step: 0-d int64 CPU tensor, the number of updates made so far.
        exp_avg: A tree like the parameters: the first moment estimates.
        exp_avg_sq: A tree like the parameters: the second moment estimates.
    """

    step: torch.Tensor
    exp_avg: Any
    exp_avg_sq: Any


def _adam(
    name: str,
    lr: LearningRate,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    in_place: bool,
    fused: bool,
) -> Optimizer:
    lr = _base.check_lr(lr)
    in_place = _base.check_flag("in_place", in_place)
    fused = _base.check_flag("fused", fused)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2); got {betas!r}.")
    beta1 = _base.check_hyper("betas[0]", betas[0], high=1.0, high_open=True)
    beta2 = _base.check_hyper("betas[1]", betas[1], high=1.0, high_open=True)
    eps = _base.check_hyper("eps", eps)
    weight_decay = _base.check_hyper("weight_decay", weight_decay)

    def init(params: Any) -> AdamState:
        leaves, treespec = _base.flatten_params(params)
        return AdamState(
            step=_base.new_step(),
            exp_avg=_base.zeros_like_tree(leaves, treespec),
            exp_avg_sq=_base.zeros_like_tree(leaves, treespec),
        )

    def launch_fused(
        step: torch.Tensor, device: torch.device, columns: list[list[torch.Tensor]]
    ) -> None:
        ps, gs, ms, vs = columns
        steps = _base.fused_steps(step, device, len(ps))
        kernel(
            ps,
            gs,
            ms,
            vs,
            [],
            steps,
            lr=float(_base.lr_value(lr)),
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )

    def update(params: Any, grads: Any, state: AdamState) -> tuple[Any, AdamState]:
        _base.check_state(state, AdamState, name)
        p_leaves, g_leaves, (m_leaves, v_leaves), rebuild = _base.flatten_update(
            name, params, grads, [state.exp_avg, state.exp_avg_sq]
        )
        eager = not torch.compiler.is_compiling()
        writes = in_place and eager  # torch.optim's in-place kernels on the given tensors
        step = state.step.add_(1) if writes else state.step + 1
        if fused and eager:  # torch's fused kernel, one pass over each parameter
            rows = list(zip(p_leaves, g_leaves, m_leaves, v_leaves, strict=True))
            new_p, new_m, new_v = _base.fused_update(
                rows, writes=writes, launch=functools.partial(launch_fused, step)
            )
            return rebuild(new_p), AdamState(step, rebuild(new_m), rebuild(new_v))
        # The scalars torch.optim computes in Python doubles from step.item(), as
        # float64 tensors: same values, and no recompile as the step count grows.
        t = step.to(torch.float64)
        lr_t = _base.lr_value(lr)
        bias_correction1 = 1 - beta1**t
        bias_correction2_sqrt = (1 - beta2**t) ** 0.5
        neg_step_size = -(lr_t / bias_correction1)
        decay = 1 - lr_t * weight_decay
        # Eagerly, torch.optim's own kernels on tensors made here: the step size read as
        # the number torch.optim passes, the moment and the parameter updated in place
        # (four new tensors per parameter where the spelled-out forms make six, and no
        # page faults). The step count is a CPU tensor.
        step_size = neg_step_size.item() if eager else neg_step_size
        shrinks = bool(weight_decay and decoupled)  # then p below is a product made here
        new_p, new_m, new_v = [], [], []
        for p, g, m, v in zip(p_leaves, g_leaves, m_leaves, v_leaves, strict=True):
            if p is None or g is None:
                new_p.append(p)
                new_m.append(m)
                new_v.append(v)
                continue
            if shrinks:
                p = p.mul_(decay) if writes else torch.mul(p, decay)
            elif weight_decay:
                g = _base.add_scaled(g, p, weight_decay)
            m = m.lerp_(g, 1 - beta1) if writes else torch.lerp(m, g, 1 - beta1)
            # In-place operations only on tensors made here, or on the given ones where
            # ``in_place`` says so. (Not addcmul_ when compiling: functionalization would
            # split it into a multiply and an add, two roundings where the kernel makes one.)
            v = v.mul_(beta2) if writes else torch.mul(v, beta2)
            v = (
                v.addcmul_(g, g, value=1 - beta2)
                if eager
                else torch.addcmul(v, g, g, value=1 - beta2)
            )
            denom = torch.sqrt(v).div_(bias_correction2_sqrt).add_(eps)
            new_p.append(_base.addcdiv(p, m, denom, step_size, inplace=shrinks or writes))
            del denom  # freed before the next parameter's is made
            new_m.append(m)
            new_v.append(v)
        if in_place and not eager:  # traced: the pure results, copied into the given tensors
            new_p = _base.write_into(p_leaves, new_p)
            new_m, new_v = _base.write_into(m_leaves, new_m), _base.write_into(v_leaves, new_v)
            step = state.step.copy_(step)
        return rebuild(new_p), AdamState(step, rebuild(new_m), rebuild(new_v))

    return Optimizer(init, update, leafwise=True, in_place=in_place)


def adam(
    lr: LearningRate = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    in_place: bool = False,
    fused: bool = False,
) -> Optimizer:
    """Adam, numerically ``torch.optim.Adam``.

    Per parameter ``p`` with gradient ``g`` at update ``t`` (from 1):
    ``g += weight_decay * p``, ``m = lerp(m, g, 1 - beta1)``,
    ``v = beta2 * v + (1 - beta2) * g * g``, and
    ``p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``,
    each operation as ``torch.optim.Adam`` runs it on CPU. The state is kept
    in the parameters' dtype, as torch keeps it.

    Args:
        lr: The learning rate: a float, or a one-element tensor read at every
            update (change it in place for a schedule; a compiled step does not
            recompile). A float64 tensor gives the same results as the float.
        betas: Decay rates of the first and second moment estimates.
        eps: Added to the denominator.
        weight_decay: L2 penalty added to the gradient.
        in_place: ``update`` writes the new parameters into the tensors of the
            ``params`` it is given and the new state into the state's, as
            ``torch.optim.Adam`` does, and returns those tensors: no second copy of
            the parameters, and a memory pass less (see [Optimizer][fsync.optim.Optimizer]).
        fused: Eagerly, one pass of torch's fused kernel (``torch._fused_adam_``) over
            each parameter instead of an operation at a time: the numerics of
            ``torch.optim.Adam(..., fused=True)``, which differ from the default's by a
            rounding here and there. A pure update runs it on copies of the parameters
            and moments. Under ``torch.compile``, which cannot trace that
            kernel in torch 2.13, the update is the unfused one, compiled.

    Returns:
        An [Optimizer][fsync.optim.Optimizer] whose state is an [AdamState][fsync.optim.AdamState].

    Raises:
        ValueError: A hyper-parameter is out of range.
        TypeError: ``in_place`` or ``fused`` is not a bool.

    Example:
        >>> import torch, fsync
        >>> opt = fsync.optim.adam(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> params, state = opt.update(params, {"w": torch.tensor([1.0, -1.0])}, opt.init(params))
        >>> params["w"]
        tensor([-0.1000,  0.1000])
    """
    return _adam(
        "adam", lr, betas, eps, weight_decay, decoupled=False, in_place=in_place, fused=fused
    )


def adamw(
    lr: LearningRate = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    in_place: bool = False,
    fused: bool = False,
) -> Optimizer:
    """AdamW (Adam with decoupled weight decay), numerically ``torch.optim.AdamW``.

    As [adam][fsync.optim.adam], except that the weight decay shrinks the parameter,
    ``p *= 1 - lr * weight_decay``, before the moment update instead of being
    added to the gradient.

    ``lr``, ``betas``, ``eps``, ``in_place`` and ``fused`` are adam's (``fused`` runs
    ``torch._fused_adamw_``, the numerics of ``torch.optim.AdamW(..., fused=True)``), and
    so are the optimizer returned (its state an [AdamState][fsync.optim.AdamState]) and the
    errors raised.

    Args:
        weight_decay: Decoupled weight decay coefficient.

    Example:
        >>> import torch, fsync
        >>> opt = fsync.optim.adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = opt.update(params, {"w": torch.zeros(2)}, opt.init(params))
        >>> params["w"]
        tensor([0.9500, 0.9500])
    """
    return _adam(
        "adamw", lr, betas, eps, weight_decay, decoupled=True, in_place=in_place, fused=fused
    )

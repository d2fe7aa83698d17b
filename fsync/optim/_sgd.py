"""Stochastic gradient descent with momentum, as ``torch.optim.SGD`` computes it."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from fsync._state import register_state
from fsync.optim import _base
from fsync.optim._base import LearningRate, Optimizer


@register_state
class SGDState(NamedTuple):
    """The state of [sgd][fsync.optim.sgd].

    Attributes:
        step: 0-d int64 CPU tensor, the number of updates made so far.
        momentum: A tree like the parameters holding the momentum buffers, or
            ``None`` when ``momentum=0`` (no buffer is kept).
    """

    step: torch.Tensor
    momentum: Any


def sgd(
    lr: LearningRate,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    in_place: bool = False,
    fused: bool = False,
) -> Optimizer:
    """Stochastic gradient descent, numerically ``torch.optim.SGD``.

    Per parameter ``p`` with gradient ``g``: ``g += weight_decay * p``; with
    momentum, ``buf = g`` on the first update and
    ``buf = momentum * buf + (1 - dampening) * g`` after it, and ``g = buf``
    (or ``g + momentum * buf`` with ``nesterov``); then ``p -= lr * g``. Each
    operation is the one ``torch.optim.SGD`` runs on CPU, in the same order.

    Args:
        lr: The learning rate: a float, or a one-element tensor read at every
            update (change it in place for a schedule; a compiled step does not
            recompile). A float64 tensor gives the same results as the float.
        momentum: Momentum factor.
        dampening: Dampening for momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Use Nesterov momentum (needs ``momentum > 0`` and
            ``dampening == 0``).
        in_place: ``update`` writes the new parameters into the tensors of the
            ``params`` it is given and the new state into the state's, as
            ``torch.optim.SGD`` does, and returns those tensors: no second copy of the
            parameters, and one memory pass less (see [Optimizer][fsync.optim.Optimizer]).
        fused: Eagerly, one pass of torch's fused kernel (``torch._fused_sgd_``) over each
            parameter instead of an operation at a time: the numerics of
            ``torch.optim.SGD(..., fused=True)``. A pure update runs it on copies of the
            parameters and momentum buffers. Under ``torch.compile``, which cannot trace
            that kernel in torch 2.13, the update is the unfused one, compiled. Where
            torch's kernel is known wrong (torch 2.12 and 2.13 on the CPU, for float16
            and bfloat16 parameters: pytorch/pytorch#191763), an eager update refuses.

    Returns:
        An [Optimizer][fsync.optim.Optimizer] whose state is an [SGDState][fsync.optim.SGDState].

    Raises:
        ValueError: A hyper-parameter is out of range, or ``nesterov`` is set
            without momentum or with dampening; (at update time) ``fused`` is set for
            parameters where torch's fused kernel is wrong.
        TypeError: ``in_place`` or ``fused`` is not a bool.

    Example:
        >>> import torch, fsync
        >>> opt = fsync.optim.sgd(0.5, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update(params, {"w": torch.ones(2)}, state)
        >>> params["w"], int(state.step)
        (tensor([0.5000, 0.5000]), 1)
    """
    lr = _base.check_lr(lr)
    momentum = _base.check_hyper("momentum", momentum)
    dampening = _base.check_hyper("dampening", dampening)
    weight_decay = _base.check_hyper("weight_decay", weight_decay)
    in_place = _base.check_flag("in_place", in_place)
    fused = _base.check_flag("fused", fused)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov needs momentum > 0 and dampening == 0; got momentum={momentum}, "
            f"dampening={dampening}."
        )

    def init(params: Any) -> SGDState:
        leaves, treespec = _base.flatten_params(params)
        buffers = _base.zeros_like_tree(leaves, treespec) if momentum else None
        return SGDState(step=_base.new_step(), momentum=buffers)

    def launch_fused(starts: bool, device: torch.device, columns: list[list[Any]]) -> None:
        ps, gs, *bufs = columns
        torch._fused_sgd_(
            ps,
            gs,
            bufs[0] if momentum else [],
            weight_decay=weight_decay,
            momentum=momentum,
            lr=float(_base.lr_value(lr)),
            dampening=dampening,
            nesterov=nesterov,
            maximize=False,
            is_first_step=starts,
        )

    def update(params: Any, grads: Any, state: SGDState) -> tuple[Any, SGDState]:
        _base.check_state(state, SGDState, "sgd")
        trees = [state.momentum] if momentum else []
        p_leaves, g_leaves, state_leaves, rebuild = _base.flatten_update(
            "sgd", params, grads, trees
        )
        buf_leaves = state_leaves[0] if momentum else [None] * len(p_leaves)
        first = state.step == 0
        # Eagerly the first update is read as a number: the buffer is then a copy of the
        # gradient, as torch's, and later ones skip the full pass of torch.where (traced,
        # reading it would specialise the graph on it and recompile on the second step).
        eager = not torch.compiler.is_compiling()
        starts = eager and bool(first)
        writes = in_place and eager  # torch.optim's in-place kernels on the given tensors
        if fused and eager:  # torch's fused kernel, one pass over each parameter
            _base.check_fused_sgd(p_leaves)
            rows = zip(p_leaves, g_leaves, buf_leaves, strict=True)
            columns = [(p, g, buf) if momentum else (p, g) for p, g, buf in rows]
            launch = functools.partial(launch_fused, bool(first))
            new_p, *new_buf = _base.fused_update(columns, writes=writes, launch=launch)
            step = state.step.add_(1) if writes else state.step + 1
            return rebuild(new_p), SGDState(step, rebuild(new_buf[0]) if momentum else None)
        # p - lr * g as torch's add(p, g, alpha=-lr): addcmul takes the factor as a
        # tensor and rounds the product into the sum the same way.
        neg_lr = -_base.lr_value(lr)
        new_p, new_buf = [], []
        for p, g, buf in zip(p_leaves, g_leaves, buf_leaves, strict=True):
            if p is None or g is None:
                new_p.append(p)
                new_buf.append(buf)
                continue
            if weight_decay:
                g = _base.add_scaled(g, p, weight_decay)
            if momentum:
                if starts:
                    buf = buf.copy_(g) if writes else g.clone()
                else:
                    product = buf.mul_(momentum) if writes else torch.mul(buf, momentum)
                    later = _base.add_scaled(product, g, 1 - dampening, inplace=True)
                    buf = later if eager else torch.where(first.to(g.device), g, later)
                g = _base.add_scaled(g, buf, momentum) if nesterov else buf
            if isinstance(neg_lr, torch.Tensor):
                factor = neg_lr.to(p.device)
                p = p.addcmul_(g, factor) if writes else torch.addcmul(p, g, factor)
            else:
                p = _base.add_scaled(p, g, neg_lr, inplace=writes)
            new_p.append(p)
            new_buf.append(buf)
        step = state.step.add_(1) if writes else state.step + 1
        if in_place and not eager:  # traced: the pure results, copied into the given tensors
            new_p = _base.write_into(p_leaves, new_p)
            new_buf = _base.write_into(buf_leaves, new_buf)
            step = state.step.copy_(step)
        buffers = rebuild(new_buf) if momentum else None
        return rebuild(new_p), SGDState(step, buffers)

    return Optimizer(init, update, leafwise=True, in_place=in_place)

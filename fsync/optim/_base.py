"""The functional optimizer pair and what every optimizer shares.

An [Optimizer][fsync.optim.Optimizer] is ``init(params) -> state`` and
``update(params, grads, state) -> (params, state)``, both pure. A state is a
NamedTuple of a step counter (a 0-d int64 tensor) and trees shaped like the
parameters. Nothing is updated in place: the new parameters and state are new
tensors, so an update traces under ``torch.compile`` and can run on any pytree,
the flat per-bucket shards of the ZeRO step included. An optimizer made with
``in_place=True`` writes them into the given tensors instead, as ``torch.optim``
does (its ``update`` is then the caller's choice to give up the old values).

Numerics follow ``torch.optim``'s default (single-tensor) CPU implementation
operation by operation. Coefficients that depend on the step count or on a
tensor learning rate are 0-d float64 CPU tensors: torch's kernels treat such a
tensor exactly as the Python float ``torch.optim`` passes (read in the
operation's compute precision), so the arithmetic is the same without
turning the step count into a Python number, which would recompile every step.
Eagerly, where nothing recompiles, Adam reads its step size as that number and
runs torch's own in-place kernels on the tensors its update made, and SGD reads
whether its update is the first (to start the momentum without ``torch.where``).
An optimizer made with ``fused=True`` runs, eagerly, torch's fused kernel instead
(``torch._fused_sgd_``, ``torch._fused_adam_``, ``torch._fused_adamw_``: one pass
over each parameter), whose numerics are ``torch.optim``'s with ``fused=True``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fsync import _tree

LearningRate = float | torch.Tensor

_CPU = torch.device("cpu")


class Optimizer(NamedTuple):
    """A pure functional optimizer: ``init(params) -> state`` and ``update``.

    ``params`` may be any pytree of floating point tensors (``None`` leaves stay
    ``None``); a ``None`` gradient leaves its parameter and that parameter's
    state as they are.

    Attributes:
        init: ``init(params) -> state``: the optimizer's initial state for a
            parameter tree (an [fsync.optim.SGDState][] or [fsync.optim.AdamState][]).
        update: ``update(params, grads, state) -> (params, state)``: one step,
            returning new tensors and leaving the inputs untouched.
        leafwise: ``True`` for an optimizer whose update treats each leaf on its
            own: updating the leaves one at a time (each with its own entries of
            the per-parameter state and the same other entries, such as the step
            count) gives the same bits, and the same other entries, as updating
            them together. The overlapped ZeRO call
            ([fsync.ops.ZeroStep.value_and_step][]) then updates each bucket as
            soon as its gradients are reduced; another optimizer (one that clips
            by the global norm, say) waits for every bucket. fsync's ``sgd``,
            ``adam`` and ``adamw`` are leafwise. Default ``False``: always correct.
        in_place: ``True`` for an optimizer whose ``update`` writes the new
            parameters and state into the tensors it is given and returns those
            (``fsync.optim.sgd(..., in_place=True)``): the old values are gone, the
            caller's trees hold the new ones. Eagerly these are ``torch.optim``'s own
            in-place kernels, bit for bit the pure update's results; they spare the
            second copy of the parameters a pure update holds while it makes the new
            one, and the memory traffic of writing it (the guide "Performance"
            measures it). Under ``torch.compile`` the pure results are copied into the
            given tensors. The ZeRO step and DiLoCo own the state they update and
            refuse such an optimizer. Default ``False``.

    Example:
        >>> import torch, fsync
        >>> opt = fsync.optim.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update(params, {"w": torch.ones(2)}, state)
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]
    leafwise: bool = False
    in_place: bool = False


def check_flag(name: str, value: Any, /) -> bool:
    """``value`` if it is a bool; else raises ``TypeError`` naming the argument."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}.")
    return value


def fused_update(
    rows: Sequence[Sequence[Any]],
    *,
    writes: bool,
    launch: Callable[[torch.device, list[list[torch.Tensor]]], None],
) -> list[list[Any]]:
    """One step of torch's fused optimizer kernel over ``rows``.

    ``rows`` holds one sequence per parameter: the parameter, its gradient, then its state
    entries. A row with a ``None`` parameter or gradient is not updated. ``writes``: the
    kernel updates the given parameter and state tensors; else copies of them (a pure
    update). ``launch(device, columns)`` calls the kernel once for the parameters of one
    device and dtype, ``columns`` being their parameters, gradients and state entries.

    The kernels read each tensor as one run of memory in storage order, whatever its
    strides (torch 2.13: a channels_last parameter with a contiguous gradient gets wrong
    numbers, silently); a row whose tensors are not laid out alike runs on contiguous
    copies, written back afterwards in the given tensors' layouts.

    Returns the columns after the step, the gradients left out: the parameters, then each
    state entry, in the rows' order.
    """
    width = len(rows[0]) if rows else 2
    out: list[list[Any]] = [[] for _ in range(width - 1)]
    groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    staged: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = []
    for i, (p, g, *state) in enumerate(rows):
        given = [p, *state]
        if p is None or g is None:
            updated = given
        elif _one_run_alike(p, [g, *state]):
            updated = given if writes else [t.clone() for t in given]
            _append(groups.setdefault((p.device, p.dtype), [[] for _ in rows[0]]), updated, g)
        else:
            copies = [t.clone(memory_format=torch.contiguous_format) for t in given]
            staged.append((i, given, copies))
            updated = copies  # replaced below
            columns = groups.setdefault((p.device, p.dtype), [[] for _ in rows[0]])
            _append(columns, copies, g.contiguous())
        for column, value in zip(out, updated, strict=True):
            column.append(value)
    for (device, _), columns in groups.items():
        launch(device, columns)
    for i, given, copies in staged:
        for column, target, value in zip(out, given, copies, strict=True):
            column[i] = (target if writes else torch.empty_like(target)).copy_(value)
    return out


def _append(columns: list[list[torch.Tensor]], updated: list[torch.Tensor], grad: Any) -> None:
    """A row's tensors added to a kernel call's columns: parameter, gradient, state."""
    for column, value in zip(columns, (updated[0], grad, *updated[1:]), strict=True):
        column.append(value)


def _one_run_alike(p: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    """Whether ``p`` is one dense run of memory (contiguous, channels_last) and ``others``
    lay their elements out as it does, so a kernel reading storage in order pairs them."""
    if p.is_contiguous():
        return all(t.is_contiguous() for t in others)
    dense = p.is_contiguous(memory_format=torch.channels_last) or p.is_contiguous(
        memory_format=torch.channels_last_3d
    )
    return dense and all(t.stride() == p.stride() for t in others)


# Elements the probe of a fused kernel runs on: more than any vector width, and a remainder.
PROBED = 257


@functools.cache
def fused_sgd_sound(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's fused SGD kernel updates every element of ``dtype`` tensors on
    ``device_type``.

    torch 2.12 and 2.13's CPU kernel does not for float16 and bfloat16: it leaves each
    whole vector block of a parameter as it was, updates only the remainder, and with
    momentum writes garbage into the buffer (pytorch/pytorch#191763, fixed by
    pytorch/pytorch#192545). Probed once per device type and dtype, on values whose
    every step is exact in any floating point type, so a sound kernel gives them exactly.
    """
    if device_type != "cpu" or dtype.itemsize > 2:
        return True
    p, g, buf = (torch.ones(PROBED, dtype=dtype) for _ in range(3))
    torch._fused_sgd_(
        [p], [g], [buf], weight_decay=0.0, momentum=0.5, lr=0.5, dampening=0.0,
        nesterov=False, maximize=False, is_first_step=False,
    )  # fmt: skip
    return bool((buf == 1.5).all() and (p == 0.25).all())  # buf = 0.5 + 1, p = 1 - 0.5 * 1.5


def check_fused_sgd(params: Sequence[Any]) -> None:
    """Raises unless torch's fused SGD kernel is sound for every parameter's device and dtype."""
    kinds = {(p.device.type, p.dtype) for p in params if p is not None}
    for device_type, dtype in sorted(kinds, key=str):
        if not fused_sgd_sound(device_type, dtype):
            raise ValueError(
                f"sgd(fused=True) got {dtype} parameters on {device_type}, where torch "
                f"{torch.__version__}'s fused SGD kernel gives wrong numbers (it leaves whole "
                "vector blocks of a float16 or bfloat16 parameter un-updated: "
                "pytorch/pytorch#191763). Use fused=False (torch.optim's default kernels), "
                "keep these parameters in float32, or use a torch with that kernel fixed."
            )


def fused_steps(step: torch.Tensor, device: torch.device, count: int) -> list[torch.Tensor]:
    """The step count as torch's fused kernels read it: one float32 tensor per parameter on
    the parameters' device (the CUDA kernels read it as float32; exact below 2**24 updates,
    as torch.optim's own fused state)."""
    on_device = step.to(device=device, dtype=torch.float32)
    return [on_device] * count


def write_into(targets: Sequence[Any], values: Sequence[Any]) -> list[Any]:
    """Each value copied into its target (a traced in-place update), the targets returned;
    ``None`` and a value that is its target already stay as they are."""
    for target, value in zip(targets, values, strict=True):
        if target is not None and value is not None and value is not target:
            target.copy_(value)
    return list(targets)


def check_lr(lr: Any, /) -> LearningRate:
    """``lr`` as an optimizer holds it, or raises: a non-negative float, or a one-element
    floating tensor held as a 1-d view of the caller's (an in-place change is read at the
    next update).

    Not as a 0-d view: under ``torch.compile`` every 0-d float64 CPU tensor a function reads
    is given a symbolic float for its value, which torch 2.13's AOT pass that turns Python
    floats into tensors then specialises by restarting dynamo's trace: the whole step traced
    twice on its first compile (where inductor's cache has no entry for it). A 1-d tensor has
    no such symbol; ``lr_value`` makes it 0-d again inside the step.
    """
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.dtype.is_floating_point or lr.requires_grad:
            raise ValueError(
                f"a tensor lr must be a one-element floating point tensor that does not require "
                f"grad; got shape {tuple(lr.shape)}, dtype {lr.dtype}, requires_grad="
                f"{lr.requires_grad}. Use torch.tensor(1e-3, dtype=torch.float64)."
            )
        return lr.view(1)
    check_hyper("lr", lr, low=0.0)
    return float(lr)


def check_hyper(
    name: str, value: Any, *, low: float = 0.0, high: float = math.inf, high_open: bool = False
) -> float:
    """``value`` as a float if ``low <= value <= high`` (``< high`` if open); else raises."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and low <= value
        and (value < high if high_open else value <= high)
    )
    if not ok:
        bound = f"in [{low}, {high})" if high_open else f">= {low}"
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}.")
    return float(value)


def lr_value(lr: LearningRate) -> float | torch.Tensor:
    """``lr`` (as ``check_lr`` holds it) for coefficient arithmetic: a float, or a 0-d
    float64 CPU tensor read now (0-d, so that it does not promote the parameters' dtype)."""
    if isinstance(lr, torch.Tensor):
        return lr.reshape(()).to(device=_CPU, dtype=torch.float64)
    return lr


def new_step() -> torch.Tensor:
    """The step counter of a fresh state: a 0-d int64 CPU tensor, as torch.optim keeps it."""
    return torch.zeros((), dtype=torch.int64)


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The precision torch's CPU kernels compute ``dtype`` in (float32 for 16-bit floats)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def add_scaled(
    x: torch.Tensor, y: torch.Tensor, alpha: float, *, inplace: bool = False
) -> torch.Tensor:
    """``x + alpha * y``, as ``torch.add(x, y, alpha=alpha)`` computes it.

    Eagerly it is that call, so the bits are ``torch.optim``'s. Under
    ``torch.compile`` the product is written out: inductor's post-grad pass that
    fuses ``add(x, mm(a, b))`` into ``addmm(x, a, b)`` ignores ``alpha``, so with
    a gradient fresh from a matmul, as every ``nn.Linear`` weight's is, the
    compiled ``torch.add(p, g, alpha=-lr)`` computes ``p + g`` (torch 2.13).
    ``inplace=True`` writes into ``x`` (only for a tensor the caller made).
    """
    if alpha != 1 and torch.compiler.is_compiling():
        y, alpha = torch.mul(y, alpha), 1
    return x.add_(y, alpha=alpha) if inplace else torch.add(x, y, alpha=alpha)


def addcdiv(
    x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: Any, *, inplace: bool = False
) -> torch.Tensor:
    """``x + value * t1 / t2`` rounded as torch's ``addcdiv`` kernel rounds it.

    With a Python number for ``value`` (an eager update) it is that kernel: one pass, and
    with ``inplace=True`` (only for a tensor the caller made) written into ``x``.
    ``torch.addcdiv`` takes its ``value`` only as a Python number; with a tensor (under
    ``torch.compile``, where reading it as a number would recompile every step) the same
    arithmetic is spelled out: computed in the kernel's compute precision (float32 for
    16-bit inputs), one rounding per operation, left to right, and a single rounding back
    to ``x``'s dtype; that result has ``t1``'s memory layout.
    """
    if not isinstance(value, torch.Tensor):
        return x.addcdiv_(t1, t2, value=value) if inplace else torch.addcdiv(x, t1, t2, value=value)
    compute = opmath(x.dtype)
    # One new tensor, updated in place: (t1 * value) / t2, then + x (a sum commutes).
    out = torch.mul(t1.to(compute), value).div_(t2).add_(x)
    return out.to(x.dtype)


def check_state(state: Any, cls: type, name: str) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{name} state is a {type(state).__name__}; expected the {cls.__name__} that "
            f"fsync.optim.{name}(...).init returned (or the previous update)."
        )


def spec_paths(treespec: optree.PyTreeSpec) -> Callable[[int], str]:
    """Leaf ``i`` -> its path in a tree of ``treespec`` (read only for an error message)."""
    return lambda i: _tree.path_str(treespec.paths()[i])


def check_params(leaves: Sequence[Any], path: Callable[[int], str], what: str = "params") -> None:
    """Raises ``TypeError`` unless every leaf is ``None`` or a floating point tensor
    (``path(i)`` names leaf ``i`` in the message)."""
    for i, leaf in enumerate(leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what} leaf {path(i)!r} is a {type(leaf).__name__}; expected a "
                "torch.Tensor or None."
            )
        if not leaf.dtype.is_floating_point:
            raise TypeError(
                f"{what} leaf {path(i)!r} has dtype {leaf.dtype}; expected a floating "
                "point tensor. Keep integer buffers and counters out of the tree the optimizer "
                "updates."
            )


def flatten_params(params: Any, /) -> tuple[list[Any], optree.PyTreeSpec]:
    """The leaves and structure of a parameter tree, the leaves checked by ``check_params``."""
    leaves, treespec = _tree.flatten(params)
    check_params(leaves, spec_paths(treespec))
    return leaves, treespec


# ``flatten_update``'s leaves: params, grads, the state trees' leaves, leaf i's path, and how
# to build a tree like ``params`` from leaves.
_Flat = tuple[list[Any], list[Any], list[list[Any]], Callable[[int], str], Callable[..., Any]]


def flatten_update(
    name: str, params: Any, grads: Any, trees: Sequence[Any]
) -> tuple[list[Any], list[Any], list[list[Any]], Callable[[Sequence[Any]], Any]]:
    """Leaves of ``params``, ``grads`` and per-parameter state trees, all checked to line up.

    Returns ``(params, grads, [state leaves per tree], rebuild)``; ``rebuild(leaves)`` is a
    tree shaped like ``params``. Plain containers of tensors (a dict of them, the ZeRO step's
    lists) are read directly (``_tree.alike``), any other tree flattened.
    """
    same = _tree.alike([params, grads, *trees])
    if same is None:
        p_leaves, g_leaves, state_leaves, path, rebuild = _flatten_each(name, params, grads, trees)
    else:
        p_leaves, g_leaves, *state_leaves = same.leaves
        path, rebuild = same.path, same.rebuild
        check_params(p_leaves, path)
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
        if p is None or g is None:
            if p is None and g is not None:
                raise ValueError(
                    f"{name}.update: grads leaf {path(i)!r} is a tensor but the parameter is None."
                )
            continue
        if not isinstance(g, torch.Tensor):
            raise TypeError(
                f"grads leaf {path(i)!r} is a {type(g).__name__}; expected a torch.Tensor or None."
            )
        if g.shape != p.shape or g.dtype != p.dtype:
            raise ValueError(
                f"{name}.update: grads leaf {path(i)!r} has shape {tuple(g.shape)} and "
                f"dtype {g.dtype}; expected the parameter's shape {tuple(p.shape)} and dtype "
                f"{p.dtype}."
            )
    return p_leaves, g_leaves, state_leaves, rebuild


def _flatten_each(name: str, params: Any, grads: Any, trees: Sequence[Any]) -> _Flat:
    """``flatten_update``'s leaves for trees that are not plain containers: each flattened,
    the parameters' leaves checked and the structures compared."""
    p_leaves, treespec = flatten_params(params)
    path = spec_paths(treespec)
    g_leaves, g_spec = _tree.flatten(grads)
    if g_spec != treespec:
        raise ValueError(
            f"{name}.update: grads have structure {g_spec} but params have {treespec}; pass "
            "gradients shaped like the parameters (None for a parameter without one)."
        )
    state_leaves = []
    for tree in trees:
        leaves, spec = _tree.flatten(tree)
        if spec != treespec:
            raise ValueError(
                f"{name}.update: the state has structure {spec} but params have {treespec}; "
                f"pass the state that {name}(...).init(params) returned for these parameters."
            )
        state_leaves.append(leaves)
    return p_leaves, g_leaves, state_leaves, path, functools.partial(_tree.unflatten, treespec)


def zeros_like_tree(leaves: Sequence[Any], treespec: optree.PyTreeSpec) -> Any:
    """A tree of zeros like the leaves (same layout; ``None`` stays ``None``)."""
    return _tree.unflatten(
        treespec, [None if p is None else torch.zeros_like(p.detach()) for p in leaves]
    )

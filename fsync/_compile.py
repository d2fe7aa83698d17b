"""``fsync.compile``: ``torch.compile`` with the inductor settings that let a sync overlap."""

from __future__ import annotations

import functools
import hashlib
import pathlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from fsync import _tree

_F = TypeVar("_F", bound=Callable[..., Any])

# Inductor's scheduler passes that issue each bucket's collective as soon as its gradients
# exist and wait for it only where its result is used, so that the all-reduce runs while
# later gradients are computed. "raise_comms" schedules, before each collective, exactly
# what it needs (the ranks' agreement, the forward pass, the backward pass up to the kernel
# that writes the bucket's last gradient, the pack) and everything else after it. It never
# moves one collective past another (inductor chains the c10d collectives in graph order),
# and what no collective needs comes after the last collective on every rank. A custom op
# that communicates (fsync::agree) is not a collective to inductor: it is ordered by what
# it needs and what needs it, which is why a ZeRO owner's broadcast is a c10d collective
# whose input every rank computes alike (``_zero_stages``), not an opaque op. The
# peak-memory ordering that runs before these passes may instead put the agreement, and
# so every pack behind it, after the whole input-gradient
# chain: on the benchmark GPT the first of 20 all-reduces was issued after 67 of the step's
# 93 matrix-product and attention kernels, with "raise_comms" after 31, the forward pass
# (inductor's peak-memory estimate is the same). "sink_waits_iterative" then moves each
# wait to just before the update that reads its bucket, in the order the buckets were
# issued (after "raise_comms" alone the first wait is the last bucket's).
OVERLAP_OPTIONS: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["raise_comms", "sink_waits_iterative"],
}

# Inductor's graph caches (FX graph and AOTAutograd) refuse any graph holding a
# higher-order op unless that op is marked cacheable, and torch.cond is not: it bypassed
# them "to be safe" (pytorch#123325; the opt-in is ``unsafe_marked_cacheable_functions``,
# pytorch#135877). A cond's branches are GraphModules inside the graph, which both caches'
# keys hash with it: graphs whose branches differ by one constant got different keys, and a
# hit returned each branch's own result (checked with torch 2.13, and by
# tests/test_compile.py). fsync's PowerSGD ``start_step`` and DiLoCo's outer step are
# conds, so without this every process compiled them cold: the compiled hooks' graph of
# tests/test_ops.py took 26.7 s in every run, warm cache or not. The value is part of
# the key: changing it invalidates what was cached under it.
CACHE_OPTIONS: dict[str, Any] = {
    "unsafe_marked_cacheable_functions": {
        "torch.ops.higher_order.cond": "fsync: a cond's branches are hashed with its graph"
    }
}


class ScaleBeforeConcat:
    """An inductor pass: ``cat(xs) * c`` becomes ``cat([x * c for x in xs])``.

    A bucket is packed by concatenating its leaves and then divided by the world
    size; inductor copies the leaves into the bucket in one loop and multiplies the
    bucket in a second one. Scaling each leaf on its way into the bucket gives the
    same bits (an elementwise product by a scalar does not care where the element
    sits) in one pass over memory instead of two. Only floating-point
    concatenations with a single user and a Python scalar factor are rewritten.

    An inductor ``CustomGraphPass`` (its ``uuid`` keys inductor's cache), registered as
    one by [fsync.compile][] rather than subclassed here: importing inductor's interface
    imports inductor and dynamo, which ``import fsync`` does not (``fsync._trace``).
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for mul in list(graph.nodes):
            match = _scaled_concat(mul)
            if match is None:
                continue
            cat, parts, factor = match
            with graph.inserting_before(mul):
                scaled = []
                for part in parts:
                    node = graph.call_function(mul.target, (part, factor))
                    node.meta = dict(part.meta)  # same shape, strides and dtype as the part
                    scaled.append(node)
                fused = graph.call_function(torch.ops.aten.cat.default, (scaled, *cat.args[1:]))
            fused.meta = dict(mul.meta)
            mul.replace_all_uses_with(fused)
            graph.erase_node(mul)
            graph.erase_node(cat)

    def uuid(self) -> Any:
        """This file's hash: inductor's cache key for the pass (a new fsync, a new key)."""
        return _source_hash()


@functools.cache
def _source_hash() -> bytes:
    """The SHA-256 of this file, read once (inductor asks for the key at every compile)."""
    return hashlib.sha256(pathlib.Path(__file__).read_bytes()).digest()


def _scaled_concat(
    mul: torch.fx.Node,
) -> tuple[torch.fx.Node, list[torch.fx.Node], int | float] | None:
    """``(cat, parts, factor)`` when ``mul`` is ``cat(parts) * factor`` that can be rewritten."""
    aten = torch.ops.aten
    if mul.op != "call_function" or mul.target not in (aten.mul.Tensor, aten.mul.Scalar):
        return None
    if mul.kwargs or len(mul.args) != 2:
        return None
    cat, factor = mul.args
    if not isinstance(cat, torch.fx.Node) or cat.target is not aten.cat.default:
        return None
    if len(cat.users) != 1 or isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return None
    value = cat.meta.get("val")
    parts = cat.args[0]
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return None
    if not isinstance(parts, (list, tuple)) or not all(
        isinstance(part, torch.fx.Node)
        and isinstance(part.meta.get("val"), torch.Tensor)
        and part.meta["val"].dtype == value.dtype
        for part in parts
    ):
        return None
    return cat, [part for part in parts if isinstance(part, torch.fx.Node)], factor


def compile(fn: _F, /, *, overlap: bool = True, fullgraph: bool = True, **kwargs: Any) -> _F:
    """``torch.compile(fn, fullgraph=True)`` with fsync's recommended inductor settings.

    With ``overlap=True`` inductor reorders the compiled step so that each
    bucket's collective is issued as soon as its gradients exist and waited for
    only where its result is used, which lets communication run during the rest
    of the backward pass (the overlap DDP gets from autograd hooks, here from
    the compiler). In either case a post-grad pass (``ScaleBeforeConcat``)
    moves the ``1/world_size`` scaling of each bucket into the kernel that packs
    it, so a bucket is written once instead of written and rescaled; the bits are
    the same. Graphs holding a ``torch.cond`` (PowerSGD's ``start_step``,
    DiLoCo's outer step) are kept in inductor's caches like any other
    (``CACHE_OPTIONS``), so a new process loads them instead of compiling again.
    Everything else is ``torch.compile``; ``options=`` given here are applied on
    top (``options={"post_grad_custom_post_pass": None}`` turns the pass off).

    Args:
        fn: The train step (or any function calling fsync).
        overlap: Apply the overlap settings (``OVERLAP_OPTIONS``).
        fullgraph: As for ``torch.compile``; fsync traces without graph breaks.
        **kwargs: Passed to ``torch.compile`` (``mode``, ``options`` ...);
            ``dynamic`` defaults to ``False``: a gradient shape that changes
            between calls recompiles with a new plan, which the ranks check,
            instead of becoming symbolic (a bucket plan needs static shapes).

    Returns:
        The compiled function.

    Raises:
        RuntimeError: torch older than 2.13 with optree 0.20 or newer, a pair whose
            dynamo cannot trace fsync's pytree flattening (the message says what to install).

    Example:
        >>> import torch, fsync
        >>> def train_step(params, grads):
        ...     grads = fsync.sync_grads(grads)
        ...     return {k: p - 0.1 * grads[k] for k, p in params.items()}
        >>> train_step = fsync.compile(train_step)  # compiled on its first call
    """
    problem = _tree.compile_problem()
    if problem is not None:
        raise RuntimeError(problem)
    # Static shapes: buckets are planned from them, and a shape that changed between calls
    # must be a new plan (which the ranks then check) rather than a symbolic one.
    kwargs.setdefault("dynamic", False)
    # torch.compile imports inductor anyway; its pass interface is registered once loaded.
    from torch._inductor.custom_graph_pass import CustomGraphPass

    CustomGraphPass.register(ScaleBeforeConcat)
    options = {
        "post_grad_custom_post_pass": ScaleBeforeConcat(),
        **CACHE_OPTIONS,
        **(OVERLAP_OPTIONS if overlap else {}),
        **kwargs.pop("options", {}),
    }
    compiled = torch.compile(fn, fullgraph=fullgraph, options=options or None, **kwargs)
    return cast(_F, compiled)

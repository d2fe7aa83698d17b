"""``fsync.compile``: ``torch.compile`` with the inductor settings that let a sync overlap."""

from __future__ import annotations

import functools
import hashlib
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

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
# whose input every rank computes alike (``_zero._stages``), not an opaque op. The
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


# Buckets of up to this many leaves are lowered into one ``cat`` on the CPU, which inductor's
# C++ backend turns into one loop fused with the scale; beyond it the generated kernel, and
# its compile time, grow with every leaf, and the pack stays one opaque op.
FUSED_CAT_LEAVES = 32
# The devices whose inductor backend makes a cat of many inputs one kernel (on CUDA a cat of
# more than ``max_pointwise_cat_inputs``, 8, inputs is a kernel per input).
FUSED_CAT_DEVICES: tuple[str, ...] = ("cpu",)


class PackPass:
    """fsync's inductor pass over the post-grad graph: the pack's scale, then its lowering.

    Every dense bucket reaches this pass as one ``fsync::pack`` op (``_pack.pack_op``).
    First the mean's ``bucket * (1 / world_size)`` moves into it (``fold_scale``), so a
    bucket is written once, scaled, instead of written and rescaled: the same bits, an
    elementwise product by a scalar does not care where the element sits. Then, where
    inductor fuses a concatenation of many inputs into one kernel (its C++ backend, on the
    CPU), a pack of up to ``FUSED_CAT_LEAVES`` leaves becomes that ``cat`` of scaled leaves
    (``lower_pack``); on CUDA, whose ``cat`` of more than 8 inputs is a kernel per input,
    and for more leaves, the op stays whole.

    An inductor ``CustomGraphPass`` (its ``uuid`` keys inductor's cache), registered as
    one by [fsync.compile][] rather than subclassed here: importing inductor's interface
    imports inductor and dynamo, which ``import fsync`` does not (``fsync._trace``).
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.fsync.pack.default:
                lower_pack(graph, fold_scale(graph, node))

    def uuid(self) -> Any:
        """This file's hash: inductor's cache key for the pass (a new fsync, a new key)."""
        return _source_hash()


@functools.cache
def _source_hash() -> bytes:
    """The SHA-256 of this file, read once (inductor asks for the key at every compile)."""
    return hashlib.sha256(pathlib.Path(__file__).read_bytes()).digest()


class _PackArgs(NamedTuple):
    """A ``fsync::pack`` node's arguments (``_pack.pack_op``'s)."""

    parts: list[torch.fx.Node]
    after: torch.fx.Node | None
    dtype: torch.dtype
    factor: float


def _args_of(pack: torch.fx.Node) -> _PackArgs:
    return _PackArgs(*cast(tuple[Any, ...], pack.args))


def fold_scale(graph: torch.fx.Graph, pack: torch.fx.Node) -> torch.fx.Node:
    """``pack(..., 1.0) * c`` as ``pack(..., c)`` where the product is the pack's one user
    and ``c`` a Python number; the pack node that holds the product."""
    parts, after, dtype, factor = _args_of(pack)
    if len(pack.users) != 1 or factor != 1.0:
        return pack
    (user,) = pack.users
    if not _is_scaling(user, pack):
        return pack
    with graph.inserting_before(user):
        c = float(cast(float, user.args[1]))
        scaled = graph.call_function(torch.ops.fsync.pack.default, (parts, after, dtype, c))
    scaled.meta = dict(user.meta)  # the product's value: the pack's, of the same dtype
    user.replace_all_uses_with(scaled)
    graph.erase_node(user)
    graph.erase_node(pack)
    return scaled


def _is_scaling(node: torch.fx.Node, pack: torch.fx.Node) -> bool:
    """Whether ``node`` is ``pack * c`` of a Python number ``c``, giving the pack's floating
    point dtype (an integer bucket times a float would not be one)."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.target not in (aten.mul.Tensor, aten.mul.Scalar):
        return False
    if node.kwargs or len(node.args) != 2 or node.args[0] is not pack:
        return False
    factor, value = node.args[1], node.meta.get("val")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return False
    dtype = pack.meta["val"].dtype
    return isinstance(value, torch.Tensor) and value.dtype == dtype and dtype.is_floating_point


def lower_pack(graph: torch.fx.Graph, pack: torch.fx.Node) -> None:
    """``pack`` as the ``cat`` of its scaled leaves where inductor makes that one kernel.

    The leaves' arithmetic is the op's, in its order: each leaf flattened, times the
    agreement's token (``x * True`` is ``x``; the product keeps the agreement an input of
    the kernel), cast to the bucket's dtype, times the factor.
    """
    parts, after, dtype, factor = _args_of(pack)
    value = pack.meta["val"]
    if value.device.type not in FUSED_CAT_DEVICES or len(parts) > FUSED_CAT_LEAVES:
        return
    aten, prims = torch.ops.aten, torch.ops.prims
    with graph.inserting_before(pack):
        flats = []
        for part in parts:
            if part.meta["val"].dim() != 1:
                part = _call(graph, aten.reshape.default, part, [-1])
            if after is not None:
                part = _call(graph, aten.mul.Tensor, part, after)
            if part.meta["val"].dtype != dtype:
                part = _call(graph, prims.convert_element_type.default, part, dtype)
            if factor != 1.0:
                part = _call(graph, aten.mul.Tensor, part, factor)
            flats.append(part)
        cat = _call(graph, aten.cat.default, flats)
    pack.replace_all_uses_with(cat)
    graph.erase_node(pack)


def _call(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """A new node ``target(*args)`` whose value (``meta["val"]``) is computed on its
    inputs' values (fake tensors, which carry their device and strides)."""
    node = graph.call_function(target, args)
    values = torch.fx.node.map_arg(args, lambda arg: arg.meta["val"])
    node.meta["val"] = target(*values)
    return node


def compile(fn: _F, /, *, overlap: bool = True, fullgraph: bool = True, **kwargs: Any) -> _F:
    """``torch.compile(fn, fullgraph=True)`` with fsync's recommended inductor settings.

    With ``overlap=True`` inductor reorders the compiled step so that each
    bucket's collective is issued as soon as its gradients exist and waited for
    only where its result is used, which lets communication run during the rest
    of the backward pass (the overlap DDP gets from autograd hooks, here from
    the compiler). In either case a post-grad pass (``PackPass``) moves the
    ``1/world_size`` scaling of each bucket into the op that packs it, so a bucket
    is written once instead of written and rescaled, and lowers that op for the
    device: on the CPU a ``cat`` that inductor fuses into one loop, on CUDA one op
    whose kernel does not grow with the bucket's leaves; the bits are the same.
    Graphs holding a ``torch.cond`` (PowerSGD's ``start_step``, DiLoCo's outer
    step) are kept in inductor's caches like any other (``CACHE_OPTIONS``), so a
    new process loads them instead of compiling again.
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

    CustomGraphPass.register(PackPass)
    options = {
        "post_grad_custom_post_pass": PackPass(),
        **CACHE_OPTIONS,
        **(OVERLAP_OPTIONS if overlap else {}),
        **kwargs.pop("options", {}),
    }
    compiled = torch.compile(fn, fullgraph=fullgraph, options=options or None, **kwargs)
    return cast(_F, compiled)

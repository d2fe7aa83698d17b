"""The benchmark cases. Each ``case_*`` runs on every rank of an initialised group.

Every figure is the median of the per-step wall time over ``steps`` steps after
``warmup`` steps (compilation happens in the warm-up), taken on rank 0; the ranks
are kept in step by the collectives themselves. Ratios are always between figures
of the same run.
"""

from __future__ import annotations

import copy
import gc
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from benchmarks.models import Workload
from benchmarks.report import AGREEMENT
from fsync import _agree

LR = 1e-3
# The step table's row for fsync's own gradient call (fsync eager is sync_grads after torch.func).
GRAD_AND_VALUE = "fsync eager, grad_and_value"


def inductor_cache(tmp: str, smoke: bool) -> dict[str, str]:
    """The environment a page's processes compile in: an empty inductor cache under ``tmp``
    for a real run (compile times of a first run, not of whatever an earlier run left in
    ``/tmp/torchinductor_$USER``; the page's rates and ranks share it, so each graph compiles
    once); for a smoke run the caller's, so the pages of one test session reuse each other's
    compiled graphs (their smoke workloads are the same, ``benchmarks.link.workload``)."""
    return {} if smoke else {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}


def leave_group() -> None:
    """Waits for every rank, then destroys the default group, with no DDP left to outlive it.

    A ``DistributedDataParallel`` sits in a reference cycle, so it lives on until the
    garbage collector runs. Collected after ``destroy_process_group``, its Reducer holds the
    group's last reference and frees it with the GIL held; the gloo group's destructor then
    joins a worker thread that may be waiting for the GIL to free the work it just finished,
    and the rank hangs (pytorch/pytorch#56297): one of 20 of the memory page's DDP worlds
    did here, and CI's link page once. Collecting first frees every unreachable DDP while
    the group is still registered (a caller drops those it still holds first): none of 24
    hung.
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def median_ms(fn: Callable[[], Any], *, warmup: int, steps: int) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(times)


def interleaved_ms(
    calls: dict[str, Callable[[], Any]], *, warmup: int, steps: int, per_round: int = 2
) -> dict[str, float]:
    """Milliseconds per call of each of ``calls``, the calls timed in turn.

    Each call is warmed up (and so compiled) first; then every round runs each call
    ``per_round`` times in a block, one call after the other, until each has run about
    ``steps`` times. A call's figure is the median over rounds of its block's mean. A
    drift of a shared machine (another tenant, the clock) then weighs on every setting
    alike, instead of on whichever one ran while it lasted: the pages report ratios
    between settings, which timing each setting's steps in one stretch let such drifts
    decide. A barrier before each block starts every rank on the same call together. A
    call that does its work once in ``per_round`` calls (DiLoCo's outer sync) counts it in
    every block when its warm-up is a whole number of blocks.
    """
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    blocks: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(1, round(steps / per_round))):
        for name, fn in calls.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            blocks[name].append((time.perf_counter() - start) / per_round)
    return {name: 1000.0 * statistics.median(t) for name, t in blocks.items()}


_ISSUE = re.compile(
    r"_c10d_functional\.(?:all_reduce_|all_reduce|reduce_scatter_tensor|all_gather_into_tensor)\.default\((\w+)"
)
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)")
_KERNEL = re.compile(
    r"^\s*(?:\w+ = )?"
    r"(?:extern_kernels\.\w+|torch\.ops\.(?:aten|fsync)\.[\w.]+|cpp_fused_\w+|triton_\w+\.run)\("
)


def overlapped_kernels(code: str) -> tuple[int, int]:
    """(collectives, compute kernels launched while one is in flight) in inductor's output code.

    A collective is in flight from the line that issues it to the ``wait_tensor`` on its
    buffer; a kernel launched in between runs while the collective does, which is the
    overlap the compiler's reordering buys.
    """
    in_flight: set[str] = set()
    collectives = overlapped = 0
    for line in code.splitlines():
        if issued := _ISSUE.search(line):
            in_flight.add(issued.group(1))
            collectives += 1
        elif waited := _WAIT.search(line):
            in_flight.discard(waited.group(1))
        elif in_flight and _KERNEL.match(line):
            overlapped += 1
    return collectives, overlapped


# --- 1. step time ------------------------------------------------------------------------------


def case_step_time(
    work: Workload, warmup: int, steps: int
) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    """One training step (forward, backward, sync, SGD update) in each setting.

    The eager fsync steps sync after ``torch.func.grad_and_value`` (``fsync eager``)
    or through ``fsync.grad_and_value`` (``fsync eager, grad_and_value``), whose
    all-reduces start during backward; the compiled ones are ``fsync.compile`` of the
    former.

    Returns the milliseconds per step of each setting, the settings timed in turn
    (:func:`interleaved_ms`), and for the compiled fsync steps the
    number of collectives in the compiled code and of compute kernels launched while one
    of them is in flight (:func:`overlapped_kernels`), with and without overlap.
    """
    # Compile each workload as a fresh process would: the steps of both workloads share
    # code objects, and nothing dynamo learnt from the other model (such as which sizes
    # changed, for automatic dynamic shapes) should carry over.
    torch._dynamo.reset()
    rank = dist.get_rank()
    batch = work.batch(rank)
    calls: dict[str, Callable[[], Any]] = {}  # timed in turn, round after round

    # Autograd on an nn.Module: alone (the floor), then wrapped in DDP, eager and compiled.
    def module_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        def step() -> Any:
            optimizer.zero_grad(set_to_none=True)
            loss = work.loss(model, batch)
            loss.backward()
            optimizer.step()
            return loss

        return step

    local = copy.deepcopy(work.model)
    calls["local eager (no sync)"] = module_step(local, torch.optim.SGD(local.parameters(), lr=LR))
    ddp = DDP(copy.deepcopy(work.model))
    calls["DDP eager"] = module_step(ddp, torch.optim.SGD(ddp.parameters(), lr=LR))
    ddp_c = DDP(copy.deepcopy(work.model))
    compiled_ddp = torch.compile(ddp_c)
    calls["DDP compiled"] = module_step(compiled_ddp, torch.optim.SGD(ddp_c.parameters(), lr=LR))

    # The functional step: torch.func gradients, fsync's sync, fsync.optim's SGD.
    optimizer = fsync.optim.sgd(LR)
    params = {n: p.detach().clone() for n, p in work.model.named_parameters()}

    synced = fsync.grad_and_value(work.functional_loss)

    def functional_step(sync: bool, during_backward: bool = False) -> Callable[..., Any]:
        """With ``sync``: ``sync_grads`` after ``torch.func``, or, ``during_backward``,
        ``fsync.grad_and_value``, which starts each bucket's all-reduce as backward ends it."""

        def step(params: dict[str, torch.Tensor], state: Any) -> Any:
            if during_backward:
                grads, loss = synced(params, batch)
            else:
                grads, loss = torch.func.grad_and_value(work.functional_loss)(params, batch)
                if sync:
                    grads = fsync.sync_grads(grads)
            params, state = optimizer.update(params, grads, state)
            return params, state, loss

        return step

    def run(fn: Callable[..., Any]) -> Callable[[], Any]:
        state = {"params": params, "opt": optimizer.init(params)}

        def call() -> Any:
            new, opt, loss = fn(state["params"], state["opt"])
            state["params"], state["opt"] = new, opt
            return loss.item()

        return call

    def compiled(name: str, sync: bool, overlap: bool) -> None:
        call = run(fsync.compile(functional_step(sync), overlap=overlap))
        if sync:  # compile on the first call, keeping inductor's code to read the overlap off
            _, code = run_and_get_code(call)
            overlap_counts[name] = overlapped_kernels(code[-1])
        calls[name] = call

    overlap_counts: dict[str, tuple[int, int]] = {}
    calls["local functional eager (no sync)"] = run(functional_step(False))
    compiled("local compiled (no sync)", sync=False, overlap=False)
    calls["fsync eager"] = run(functional_step(True))
    calls[GRAD_AND_VALUE] = run(functional_step(True, during_backward=True))
    compiled("fsync compiled", sync=True, overlap=False)
    compiled("fsync compiled + overlap", sync=True, overlap=True)
    # What every sync adds to be safe: the ranks' agreement (one all-reduce of 13 int64 and
    # its check), eager or compiled alike, timed alone to set beside the step.
    plan = fsync.plan_buckets(params)
    leaves = list(params.values())
    hook = fsync.ops.allreduce().spec
    results = interleaved_ms(calls, warmup=warmup, steps=steps)
    # In a loop of its own: timed in blocks of two after a barrier, a 0.5 ms collective
    # would mostly measure how far apart the ranks leave the barrier.
    results[AGREEMENT] = median_ms(
        lambda: _agree.agree_on(
            plan,
            leaves,
            None,
            _agree.Terms(hook),
            pack=lambda token: [],  # the agreement alone: nothing packed meanwhile
        ),
        warmup=warmup,
        steps=steps,
    )
    return results, overlap_counts


# --- 2. sync only ------------------------------------------------------------------------------


def case_sync_only(work: Workload, warmup: int, steps: int) -> dict[str, float]:
    """``sync_grads`` of the model's gradient tree against one flat all-reduce of its bytes."""
    rank = dist.get_rank()
    grads = torch.func.grad(work.functional_loss)(work.params(), work.batch(rank))
    flat = torch.cat([g.reshape(-1) for g in grads.values()])

    def flat_allreduce() -> None:
        dist.all_reduce(flat)

    # The least a mean that leaves its input alone can do: one scaled copy, then the
    # all-reduce (fsync's compiled sync is this plus the packing, fused into the copy).
    def pure_mean() -> None:
        dist.all_reduce(flat.mul(1 / dist.get_world_size()))

    def eager() -> None:
        fsync.sync_grads(grads)

    # Plain torch.compile, then fsync.compile's two additions one at a time.
    plain = torch.compile(lambda g: fsync.sync_grads(g), fullgraph=True)
    fused = fsync.compile(lambda g: fsync.sync_grads(g), overlap=False)
    overlapped = fsync.compile(lambda g: fsync.sync_grads(g))  # the default: overlap=True

    return {
        "flat all-reduce (floor)": median_ms(flat_allreduce, warmup=warmup, steps=steps),
        "scaled copy + flat all-reduce (pure mean)": median_ms(
            pure_mean, warmup=warmup, steps=steps
        ),
        "sync_grads eager": median_ms(eager, warmup=warmup, steps=steps),
        "sync_grads torch.compile": median_ms(lambda: plain(grads), warmup=warmup, steps=steps),
        "sync_grads fsync.compile, overlap off": median_ms(
            lambda: fused(grads), warmup=warmup, steps=steps
        ),
        "sync_grads compiled": median_ms(lambda: overlapped(grads), warmup=warmup, steps=steps),
        "bytes": float(flat.numel() * flat.element_size()),
    }


# --- 3. leaf scaling ---------------------------------------------------------------------------


def case_leaf_scaling(
    total: int, counts: list[int], warmup: int, steps: int
) -> dict[str, dict[int, float]]:
    """The same bytes as 1, 100, ... leaves: eager and compiled sync time and compile time."""
    rank = dist.get_rank()
    out: dict[str, dict[int, float]] = {"eager": {}, "compiled": {}, "compile seconds": {}}
    for n in counts:
        g = torch.Generator().manual_seed(rank)
        grads = {f"leaf{i}": torch.randn(total // n, generator=g) for i in range(n)}
        eager, compiled, seconds = _leaf_timings(grads, warmup, steps)
        out["eager"][n], out["compiled"][n], out["compile seconds"][n] = eager, compiled, seconds
        torch._dynamo.reset()
    return out


def _leaf_timings(grads: dict[str, torch.Tensor], warmup: int, steps: int) -> tuple[float, ...]:
    compiled_sync = fsync.compile(lambda g: fsync.sync_grads(g))
    started = time.perf_counter()
    compiled_sync(grads)
    seconds = time.perf_counter() - started
    return (
        median_ms(lambda: fsync.sync_grads(grads), warmup=warmup, steps=steps),
        median_ms(lambda: compiled_sync(grads), warmup=warmup, steps=steps),
        seconds,
    )


# --- 4. hooks ----------------------------------------------------------------------------------


def _hooks() -> dict[str, Callable[[], fsync.Hook]]:
    ops = fsync.ops
    return {
        "allreduce": ops.allreduce,
        "fp16_compress": ops.fp16_compress,
        "bf16_compress": ops.bf16_compress,
        "powersgd(1)": lambda: ops.powersgd(1, start_step=0),
        "powersgd(4)": lambda: ops.powersgd(4, start_step=0),
        "quantize(8)": ops.quantize,
    }


def case_hooks(work: Workload, warmup: int, steps: int) -> dict[str, dict[str, float]]:
    """Bytes on the wire (measured by fsync.sync_stats) and eager sync time per hook."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grads = torch.func.grad(work.functional_loss)(work.params(), work.batch(rank))
    out: dict[str, dict[str, float]] = {}
    for name, make in _hooks().items():
        sync = fsync.GradSync(hook=make())
        holder = {"state": sync.init(grads)}
        ms = median_ms(_stateful(sync, grads, holder), warmup=warmup, steps=steps)
        stats = fsync.sync_stats(
            sync.plan(holder["state"]),
            hook=sync.hook,
            state=holder["state"].hook,
            world_size=world_size,
        )
        out[name] = {
            "ms": ms,
            "bytes on wire": float(stats.bytes_on_wire),
            "relative": stats.bytes_on_wire / stats.bytes_reduced,
            "collectives": float(stats.num_collectives),
        }
    return out


def _stateful(sync: fsync.GradSync, grads: Any, holder: dict[str, Any]) -> Callable[[], None]:
    def call() -> None:
        _, holder["state"] = sync(grads, holder["state"])

    return call


# --- 5. ZeRO -----------------------------------------------------------------------------------


def _state_bytes(tree: Any) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in fsync._tree.flatten(tree)[0]
        if isinstance(t, torch.Tensor) and t.dim() > 0  # step counters aside
    )


def _zero_step(
    work: Workload,
    batch: tuple[torch.Tensor, ...],
    step: fsync.ops.ZeroStep,
    holder: dict[str, Any],
    compiled: bool,
) -> Callable[[], None]:
    def train(params: Any, state: Any) -> Any:
        grads = torch.func.grad(work.functional_loss)(params, batch)
        return step(params, grads, state)

    fn = fsync.compile(train, overlap=False) if compiled else train

    def call() -> None:
        holder["params"], holder["state"] = fn(holder["params"], holder["state"])

    return call


def case_zero(work: Workload, warmup: int, steps: int) -> dict[str, dict[str, float]]:
    """A full AdamW step with ZeRO: fsync's two layouts against ZeroRedundancyOptimizer + DDP."""
    rank = dist.get_rank()
    batch = work.batch(rank)
    out: dict[str, dict[str, float]] = {}

    ddp = DDP(copy.deepcopy(work.model))
    zero_opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)

    def torch_step() -> None:
        zero_opt.zero_grad(set_to_none=True)
        work.loss(ddp, batch).backward()
        zero_opt.step()

    ms = median_ms(torch_step, warmup=warmup, steps=steps)
    out["ZeroRedundancyOptimizer + DDP"] = {
        "ms": ms,
        "state bytes": float(_state_bytes(zero_opt.optim.state_dict()["state"])),
    }

    for label, shard, compiled in (
        ("fsync zero sharded", True, False),
        ("fsync zero whole buckets", False, False),
        ("fsync zero sharded, compiled", True, True),
    ):
        step = fsync.ops.zero(fsync.optim.adamw(LR), shard_buckets=shard)
        holder = {"params": work.params()}
        holder["state"] = step.init(holder["params"])
        call = _zero_step(work, batch, step, holder, compiled)
        ms = median_ms(call, warmup=warmup, steps=steps)
        out[label] = {"ms": ms, "state bytes": float(_state_bytes(holder["state"].opt))}
    return out


# --- 6. the compiled sync up close ---------------------------------------------------------------


def kernels_launched(code: str) -> int:
    """Compute kernels (fused, extern and fallback ops) in inductor's output code.

    Collectives and waits are not counted, nor views (``reinterpret_tensor``), which
    launch nothing.
    """
    return sum(1 for line in code.splitlines() if _KERNEL.match(line))


def case_anatomy(work: Workload, warmup: int, steps: int, device: torch.device) -> dict[str, Any]:
    """The compiled sync of the model's gradients on ``device``, taken apart.

    Kernels per bucket (read off inductor's code), compile time, graphs compiled
    over ``steps`` more calls with new values, and the time of packing and
    unpacking (no communication) against one copy of the same bytes.
    """
    rank = dist.get_rank()
    grads = torch.func.grad(work.functional_loss)(work.params(), work.batch(rank))
    grads = {k: g.to(device) for k, g in grads.items()}
    plan = fsync.plan_buckets(grads)
    nbytes = sum(plan.nbytes)

    def timed(fn: Callable[[], Any]) -> Callable[[], None]:
        def call() -> None:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return call

    sync = fsync.compile(lambda g: fsync.sync_grads(g))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    # Inductor's caches off: the sync-only case compiled this very graph earlier in the run.
    with torch._inductor.config.patch(force_disable_caches=True):
        _, code = run_and_get_code(sync, grads)
    compile_s = time.perf_counter() - started
    for s in range(steps):
        sync({k: g * (s + 2) for k, g in grads.items()})
    recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs - 1

    def round_trip(g: dict[str, torch.Tensor]) -> Any:
        return fsync.unpack(fsync.pack(g, plan), plan)

    compiled_round_trip = fsync.compile(round_trip)
    # The floor copies the same bytes in pieces of the buckets' sizes, so that both sides
    # allocate alike (on CPU one 80 MiB tensor is mapped and faulted in afresh on every
    # call, where a bucket-sized one reuses the heap).
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    pieces = flat.split([spec.numel for spec in plan.specs])

    def copy() -> list[torch.Tensor]:
        return [piece.clone() for piece in pieces]

    return {
        "device": str(device),
        "buckets": len(plan.buckets),
        "kernels": kernels_launched(code[-1]),
        "compile s": compile_s,
        "recompiles": recompiles,
        "bytes": float(nbytes),
        "ms": {
            "copy of the same bytes (floor)": median_ms(timed(copy), warmup=warmup, steps=steps),
            "pack + unpack, eager": median_ms(
                timed(lambda: round_trip(grads)), warmup=warmup, steps=steps
            ),
            "pack + unpack, compiled": median_ms(
                timed(lambda: compiled_round_trip(grads)), warmup=warmup, steps=steps
            ),
            "sync_grads, compiled": median_ms(
                timed(lambda: sync(grads)), warmup=warmup, steps=steps
            ),
        },
    }

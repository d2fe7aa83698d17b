"""The hierarchical mean on two nodes: ``python -m benchmarks.twonodes`` (as root).

A 2-D mesh pays where the link between nodes is slower than the links within one, which
one shaped loopback cannot show. ``../shared/tools/twonodes`` (as root) makes two network
namespaces, each with its own fast loopback, joined by a cable shaped to a rate. For each
rate (10, 4 and 1 Gbit/s) this page runs itself once on each node (``--child RATE``): each
node forks its two ranks of every setting's world of 2 x 2 (:mod:`benchmarks.harness`),
node 0 gives the turns and writes JSON to a path both nodes share; the parent writes
``docs/benchmarks-twonodes.md`` and its figures (:mod:`benchmarks.page`). What each rate
measures is in :func:`sync_alone` and :func:`gpt_step`, the method in the page's
:data:`READING`. Where
``twonodes`` cannot make its namespaces (not root) the page says so and is not written.
``--smoke`` runs tiny sizes in worlds of 4 ranks on this machine's loopback (``--rates
local``, what CI runs); ``--smoke --rates 1gbit`` runs them on two nodes. By hand, one
rate, as the parent launches it (from the repository root)::

    ../shared/tools/twonodes --rate 1gbit -- \\
        'python -m benchmarks.twonodes --child 1gbit --json /tmp/1gbit.json'
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

if not __package__:  # run as a script: the repository first, not benchmarks/
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import fsync
from benchmarks import harness, page, plot, table
from benchmarks.constants import CAP_MB, LR
from benchmarks.harness import Row
from benchmarks.models import Load
from benchmarks.page import Page, label
from benchmarks.steps import Held, setting
from benchmarks.table import Spread

RATES = ("10gbit", "4gbit", "1gbit")
SMOKE_RATE = "local"  # --smoke: worlds of 4 ranks on this machine's loopback
NODES, LOCAL = 2, 2
PORT = 29500  # node 0's store; one more for each round of turns
INNER_STEPS = 8  # DiLoCo's H, and the steps of a turn
MICRO_BATCHES = 4
POWERSGD_RANK = 4
TREE = "20 MiB in 12 leaves"
GPT = "GPT"
MiB = 2**20
# 1. The sync alone, on each tree.
FLAT = "flat all-reduce of all the bytes (dist.all_reduce, 4 ranks)"
SYNC_FLAT = "sync_grads, flat (default group)"
HIER = "sync_grads(group=mesh), eager"
HIER_COMPILED = "sync_grads(group=mesh), compiled"
HIER_BF16 = "group=mesh, bf16 across nodes"
HIER_POWERSGD = f"group=mesh, batched PowerSGD rank {POWERSGD_RANK} across nodes (GradSync)"
SYNC_SETTINGS = (FLAT, SYNC_FLAT, HIER, HIER_COMPILED, HIER_BF16, HIER_POWERSGD)
# 2. The GPT's step on the 2 x 2 mesh.
DDP_EAGER = "DDP eager (all 4 ranks)"
STEP_FLAT = "fsync.grad_and_value, flat, eager"
STEP_HIER = "grad_and_value(group=mesh), eager"
STEP_HIER_COMPILED = "grad_and_value(group=mesh), compiled"
STEP_BF16 = "group=mesh, bf16 across nodes, eager"
DDP_NO_SYNC = f"DDP, no_sync over {MICRO_BATCHES} micro-batches"
DEFERRED = f"DeferredSync(group=mesh), {MICRO_BATCHES} micro-batches"
DILOCO = f"fsync.diloco, H = {INNER_STEPS}, bf16, group=mesh (compiled local step)"
STEP_SETTINGS = (
    DDP_EAGER,
    STEP_FLAT,
    STEP_HIER,
    STEP_HIER_COMPILED,
    STEP_BF16,
    DDP_NO_SYNC,
    DEFERRED,
    DILOCO,
)
# The settings whose cross-node traffic is one flat all-reduce over all ranks.
FLAT_SETTINGS = (FLAT, SYNC_FLAT, DDP_EAGER, STEP_FLAT, DDP_NO_SYNC)
# The cable's floors for the hierarchical mean on 2 x 2 against the flat ring (ring model):
# S of 1.5 S in fp32, S / 2 of 1.5 S with bf16 across nodes.
FLOORS = {"fp32 across nodes: 2/3": 2 / 3, "bf16 across nodes: 1/3": 1 / 3}


# --- what crosses nodes ----------------------------------------------------------------------


def cable_bytes(cross: float, flat: bool) -> float:
    """Bytes on each direction of the cable for ``cross`` bytes per rank, in a ring model.

    A ring all-reduce of ``B`` bytes over ``N`` ranks sends ``2 (N - 1) / N * B`` on
    each link of the ring. The flat ring over all ``NODES * LOCAL`` ranks (ordered by
    node) crosses the cable once each way: ``2 (N - 1) / N * B``, 1.5 B on 2 x 2. The
    hierarchical hop is ``LOCAL`` rings of ``NODES`` ranks, one per local rank, each
    crossing it: ``LOCAL * 2 (NODES - 1) / NODES * B``, 2 B on 2 x 2 (with B half the
    flat one's, 2/3 of the flat ring's bytes).
    """
    n = NODES * LOCAL if flat else NODES
    return (1 if flat else LOCAL) * 2 * (n - 1) / n * cross


def crossing(tree: dict[str, torch.Tensor], name: str) -> dict[str, float]:
    """``{"cross": bytes per rank, "cable": bytes each way}`` of one call or step of ``name``."""
    hook = fsync.ops.bf16_compress() if "bf16" in name else None
    hook = _powersgd() if name == HIER_POWERSGD else hook
    if name in FLAT_SETTINGS:  # one all-reduce of every byte, all of it across
        cross = float(sum(t.numel() * t.element_size() for t in tree.values()))
    else:
        micro = MICRO_BATCHES if name == DEFERRED else 0
        shape = (NODES, LOCAL)
        stats = fsync.sync_stats(
            tree, world_size=shape, micro_batches=micro, hook=hook, bucket_cap_mb=CAP_MB
        )
        cross = float(stats.bytes_on(0)) / (INNER_STEPS if name == DILOCO else 1)
    return {"cross": cross, "cable": cable_bytes(cross, name in FLAT_SETTINGS)}


# --- the workloads and settings, built in the settings' processes ---------------------------


def tree_20mib(rank: int, smoke: bool) -> dict[str, torch.Tensor]:
    """12 leaves of 20 MiB: 8 of 512 x 1024 floats (2 MiB) and 4 of 256 x 1024 (1 MiB),
    interleaved; 1/64 of the columns in a smoke run."""
    generator = torch.Generator().manual_seed(2000 + rank)
    columns = 1024 // (64 if smoke else 1)
    rows = [512, 512, 256] * 4
    return {
        f"layer{i}.weight": torch.randn(r, columns, generator=generator) for i, r in enumerate(rows)
    }


def gpt(smoke: bool) -> Load:
    """The benchmark GPT, batch 4 sequences of 64 tokens (a smoke run: 1 layer, narrow)."""
    return Load("GPT", 4 * 64, smoke)


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (NODES, LOCAL), mesh_dim_names=("node", "local"))


def _powersgd() -> fsync.Hook:
    return fsync.ops.batched_powersgd(POWERSGD_RANK, start_step=0)


def sync_alone(tree: str, smoke: bool, name: str) -> Callable[[], object]:
    """One setting of the sync alone on ``tree``: 20 MiB in 12 leaves (:data:`TREE`) or the
    GPT's gradients (21M parameters, 80 MiB): a flat ``dist.all_reduce`` of all the bytes
    over the 4 ranks (the floor), ``sync_grads`` over the default group, and over the mesh
    eager, under ``fsync.compile``, with ``bf16_compress()`` and with
    ``batched_powersgd(4, start_step=0)`` across nodes (through ``GradSync``, which threads
    its state); 4 MiB buckets."""
    mesh, rank = _mesh(), dist.get_rank()
    grads = tree_20mib(rank, smoke) if tree == TREE else gpt(smoke).build().grads(rank)
    if name == FLAT:
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        return lambda: dist.all_reduce(flat)
    if name == HIER_COMPILED:

        def hierarchical(g: dict[str, torch.Tensor]) -> Any:
            return fsync.sync_grads(g, group=mesh, bucket_cap_mb=CAP_MB)

        compiled = fsync.compile(hierarchical)
        return lambda: compiled(grads)
    if name == HIER_POWERSGD:
        sync = fsync.GradSync(group=mesh, hook=_powersgd(), bucket_cap_mb=CAP_MB)
        return Held(lambda g, state: (g, sync(g, state)[1]), grads, sync.init(grads))
    group = None if name == SYNC_FLAT else mesh
    hook = fsync.ops.bf16_compress() if name == HIER_BF16 else None
    return lambda: fsync.sync_grads(grads, group=group, hook=hook, bucket_cap_mb=CAP_MB)


def gpt_step(smoke: bool, name: str) -> Callable[[], None]:
    """One setting of the GPT's training step (batch 4 sequences of 64 tokens per rank,
    SGD): DDP eager, ``fsync.grad_and_value`` over the default group, over the mesh eager,
    compiled and with bf16 across nodes; ``DeferredSync`` over 4 micro-batches of one
    sequence against DDP's ``no_sync`` over the same; ``fsync.diloco(8, bf16)`` after a
    compiled local step; 4 MiB buckets."""
    work, mesh = gpt(smoke).build(), _mesh()
    batch = work.batch(dist.get_rank())
    micro = [tuple(t[i : i + 1] for t in batch) for i in range(MICRO_BATCHES)]
    optimizer = fsync.optim.sgd(LR)
    params = work.params()
    if name in (DDP_EAGER, DDP_NO_SYNC):
        ddp = DDP(work.model, bucket_cap_mb=CAP_MB)
        ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)

        def ddp_step() -> None:  # no_sync: DDP's accumulation, all the gradients across
            ddp_optimizer.zero_grad(set_to_none=True)
            with ddp.no_sync():
                for m in micro[:-1] if name == DDP_NO_SYNC else []:
                    torch.autograd.backward(work.loss(ddp, m) / MICRO_BATCHES)
            last = (micro[-1], MICRO_BATCHES) if name == DDP_NO_SYNC else (batch, 1)
            torch.autograd.backward(work.loss(ddp, last[0]) / last[1])
            ddp_optimizer.step()

        return ddp_step
    local_grad = torch.func.grad(work.functional_loss)
    if name == DEFERRED:  # within the node per micro-batch, across once per step
        deferred = fsync.DeferredSync(group=mesh, bucket_cap_mb=CAP_MB)

        def deferred_step(p: Any, state: Any) -> Any:
            opt, sync = state
            for m in micro:
                sync = deferred.add(local_grad(p, m), sync)
            grads, sync = deferred.finish(sync)
            p, opt = optimizer.update(p, grads, opt)
            return p, (opt, sync)

        return Held(deferred_step, params, (optimizer.init(params), deferred.init(params)))
    if name == DILOCO:

        def local_step(p: Any, opt: Any) -> Any:
            return optimizer.update(p, local_grad(p, batch), opt)

        local = fsync.compile(local_step)
        diloco = fsync.diloco(
            INNER_STEPS, group=mesh, hook=fsync.ops.bf16_compress(), bucket_cap_mb=CAP_MB
        )

        def diloco_step(p: Any, state: Any) -> Any:
            p, opt = local(p, state[0])
            p, outer = diloco.update(p, state[1])
            return p, (opt, outer)

        return Held(diloco_step, params, (optimizer.init(params), diloco.init(params)))
    group = None if name == STEP_FLAT else mesh
    hook = fsync.ops.bf16_compress() if name == STEP_BF16 else None
    synced = fsync.grad_and_value(
        work.functional_loss, group=group, hook=hook, bucket_cap_mb=CAP_MB
    )

    def step(p: Any, opt: Any) -> Any:
        return optimizer.update(p, synced(p, batch)[0], opt)

    return Held(
        fsync.compile(step) if name == STEP_HIER_COMPILED else step, params, optimizer.init(params)
    )


# --- one node's processes, at one rate --------------------------------------------------------


def measure(args: argparse.Namespace, rate: str, env: Mapping[str, str]) -> dict[str, Any] | None:
    """Runs this node's ranks of every world at ``rate``, in turns (``env`` set in every
    rank); node 0 returns the results. At :data:`SMOKE_RATE`, all four ranks here."""
    local = rate == SMOKE_RATE
    rank = 0 if local else int(os.environ["NODE_RANK"])
    host = "127.0.0.1" if local else os.environ["MASTER_ADDR"]

    def turns(k: int, settings: list[harness.Setting], **timing: Any) -> Row | None:
        """The ``k``-th round of turns: on two nodes, its store on a port of its own."""
        where = harness.Node(NODES, rank, LOCAL, host, PORT + k)
        where = harness.Node(1, 0, NODES * LOCAL, host) if local else where
        return harness.turns(settings, node=where, env=env, **(page.timing(args) | timing))

    sync = {
        tree: turns(
            k, [setting(n, sync_alone, tree=tree, smoke=args.smoke, name=n) for n in SYNC_SETTINGS]
        )
        for k, tree in enumerate((TREE,) if args.smoke else (TREE, GPT))  # smoke: one path
    }
    # A turn is a round of DiLoCo (one outer sync); the warm-up one too, compiling in it.
    step_settings = [setting(n, gpt_step, smoke=args.smoke, name=n) for n in STEP_SETTINGS]
    rounds = max(1, args.rounds // 2)
    step = turns(2, step_settings, rounds=rounds, steps=INNER_STEPS, warmup=INNER_STEPS)
    if rank != 0:
        return None
    trees = {TREE: tree_20mib(0, args.smoke), GPT: gpt(args.smoke).build().params()}
    return {
        "sync": sync,
        "step": step,
        "trees": {
            k: sum(t.numel() * t.element_size() for t in v.values()) for k, v in trees.items()
        },
        "bytes": {
            **{tree: {n: crossing(trees[tree], n) for n in SYNC_SETTINGS} for tree in sync},
            "step": {n: crossing(trees[GPT], n) for n in STEP_SETTINGS},
        },
    }


# --- the page ---------------------------------------------------------------------------------


def _row(results: dict[str, Any], rate: str, part: str, tree: str) -> Row:
    at = results[rate][part]
    return at[tree] if part == "sync" else at  # type: ignore[no-any-return]


def ratio(results: dict[str, Any], rate: str, part: str, tree: str, name: str, base: str) -> Spread:
    """``name``'s time over ``base``'s at ``rate`` in section ``part`` (``"sync"``, with
    ``tree`` a tree, or ``"step"``, with ``tree`` ignored), round by round."""
    return table.ratio(_row(results, rate, part, tree), name, base)


def targets(results: dict[str, Any]) -> list[table.Target]:
    """(target, measured, met) for every target; met: the median; ``not run``: that rate."""

    def check(
        text: str, rate: str, part: str, tree: str, name: str, base: str, bound: float
    ) -> table.Target:
        s = ratio(results, rate, part, tree, name, base) if rate in results else None
        return table.check(text, s, bound)

    out = []
    trees = [(TREE, f"sync alone, {TREE}"), (GPT, "sync alone, the GPT")]
    for tree, what in trees:
        for name, bound in ((HIER, 0.75), (HIER_COMPILED, 0.75), (HIER_BF16, 0.45)):
            text = f"{what}: {name} <= {bound:.2f}x the flat all-reduce, 1 Gbit/s"
            out.append(check(text, "1gbit", "sync", tree, name, FLAT, bound))
    text = f"GPT step: {STEP_HIER_COMPILED} <= 0.80x DDP eager, 1 Gbit/s"
    out.append(check(text, "1gbit", "step", GPT, STEP_HIER_COMPILED, DDP_EAGER, 0.80))
    text = f"GPT step: fsync.diloco (H = {INNER_STEPS}) <= 0.25x DDP eager, 1 Gbit/s"
    out.append(check(text, "1gbit", "step", GPT, DILOCO, DDP_EAGER, 0.25))
    for tree, what in trees:  # at 10 Gbit/s: against fsync's own flat path, not the floor
        text = f"{what}: hierarchical eager <= 1.05x sync_grads flat, 10 Gbit/s"
        out.append(check(text, "10gbit", "sync", tree, HIER, SYNC_FLAT, 1.05))
    text = "GPT step: grad_and_value hierarchical eager <= 1.05x flat eager, 10 Gbit/s"
    return [*out, check(text, "10gbit", "step", GPT, STEP_HIER, STEP_FLAT, 1.05)]


def _table(results: dict[str, Any], part: str, tree: str, base: str) -> list[list[str]]:
    """Per setting: MiB across nodes per rank, the cable's floor relative to ``base``'s, and
    per rate the ms and the ratio to ``base``."""
    crossed = next(iter(results.values()))["bytes"][tree if part == "sync" else "step"]
    out = []
    for name, cross in crossed.items():
        cells = [
            name,
            f"{cross['cross'] / MiB:.2f}",
            table.times(cross["cable"] / crossed[base]["cable"]),
        ]
        for rate in list(results):
            row = _row(results, rate, part, tree)
            vs = table.spread(table.ratio(row, name, base))
            cells.append(f"{table.ms(table.median(row, name))} ({vs})")
        out.append(cells)
    return out


def _header(results: dict[str, Any], base: str) -> list[str]:
    return [
        "",
        "MiB across nodes per rank",
        f"cable each way vs {base} (floor)",
        *[f"{label(r)}: ms (vs {base})" for r in list(results)],
    ]


def figures(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """The sync alone relative to the flat all-reduce per rate and tree, the GPT's step
    relative to DDP eager per rate, and the bytes each setting puts across nodes."""
    groups = [label(r) for r in list(results)]

    def floors(ax: Any) -> None:
        for (name, floor), style in zip(FLOORS.items(), ("--", ":"), strict=True):
            ax.axhline(
                floor, color="grey", linestyle=style, linewidth=0.8, label=f"cable floor, {name}"
            )
        ax.axhline(1.0, color="black", linewidth=0.8)

    def against(part: str, tree: str, base: str) -> Callable[[str, str], Spread]:
        return lambda g, s: ratio(results, list(results)[groups.index(g)], part, tree, s, base)

    trees = list(next(iter(results.values()))["sync"])
    figure, axes = plot.figure(len(trees), size=(9, 4.2 * len(trees)))
    for ax, tree in zip(axes, trees, strict=True):
        plot.bars(ax, groups, list(SYNC_SETTINGS[1:]), against("sync", tree, FLAT))
        floors(ax)
        size = next(iter(results.values()))["trees"][tree] / MiB
        ax.set_ylabel("time / flat all-reduce's")
        ax.set_title(
            f"The sync alone, {tree} ({size:.1f} MiB): 2 nodes x 2 ranks (lower is better)"
        )
    axes[0].legend(fontsize=7, ncol=2)
    paths = [plot.save(figure, out / "benchmarks-twonodes-sync.png")]
    figure, (ax,) = plot.figure(size=(9, 4.8))
    plot.bars(ax, groups, list(STEP_SETTINGS[1:]), against("step", GPT, DDP_EAGER))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("step / DDP eager's")
    ax.set_title(
        "The GPT's training step on 2 nodes x 2 ranks, relative to DDP eager (lower is better)"
    )
    ax.legend(fontsize=7, ncol=2)
    paths.append(plot.save(figure, out / "benchmarks-twonodes-step.png"))
    crossed = next(iter(results.values()))["bytes"]["step"]
    figure, (ax,) = plot.figure(size=(10, 0.4 * len(crossed) + 1.6))
    values = [c["cable"] / crossed[DDP_EAGER]["cable"] for c in crossed.values()]
    ax.barh(list(crossed), values, color=["grey", *[f"C{i}" for i in range(len(values) - 1)]])
    for y, value in enumerate(values):
        ax.annotate(f" {value:.2f}x", (value, y), va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes on the cable per step, each way, relative to DDP's (ring model)")
    ax.set_title("The GPT's step, 2 nodes x 2 ranks: what crosses nodes (lower is better)")
    ax.invert_yaxis()
    return [*paths, plot.save(figure, out / "benchmarks-twonodes-bytes.png")]


READING = (
    "Written by `python benchmarks/run.py --only twonodes` (as root; see "
    "`benchmarks/twonodes.py`). "
    f"Each rate ran as two nodes of {LOCAL} gloo ranks in two network namespaces made by "
    "`../shared/tools/twonodes`, each node with its own fast loopback, joined by a cable shaped "
    "to the rate; every setting ran in a world of its own, "
    f"{NODES} nodes x {LOCAL} processes, a mesh "
    f'`init_device_mesh("cpu", ({NODES}, {LOCAL}), mesh_dim_names=("node", "local"))`. '
    "The settings took turns, world after world (`benchmarks/harness.py`): the sync alone "
    f"two calls a turn, the step a whole round of H = {INNER_STEPS} steps a turn; a figure in "
    "ms is the median over the rounds of a turn's time per call or step on rank 0, a ratio is "
    "taken round by round and given as `median [lowest, highest]`; a target is judged on the "
    f"median. Every setting uses {CAP_MB:g} MiB buckets (`bucket_cap_mb={CAP_MB:g}`, DDP and "
    "fsync alike). *MiB across nodes per rank*: what each rank hands to collectives that cross "
    "nodes per call or step, from `fsync.sync_stats(tree, world_size=(2, 2)).bytes_on(0)` (a "
    "flat all-reduce's bytes all count). *Cable each way (floor)*: what that puts on each "
    "direction of the cable in a ring model, relative to the flat ring's: a ring all-reduce of "
    "B bytes over N ranks sends 2 (N - 1) / N * B on each link; the flat ring over 4 ranks "
    "crosses the cable once each way (1.5 B), the hierarchical hop is 2 rings of 2 ranks, both "
    "on the cable (2 x B, B half the flat one's): the least time a cable-bound sync can take, "
    'as a share of the flat one\'s (`docs/hierarchical.md`, "When the hierarchical mean pays").'
)
STEP_NOTE = (
    "The GPT: 6 layers, d_model 512, 21M parameters, batch 4 sequences of 64 tokens per rank, "
    f"SGD. The accumulating settings split the same 4 sequences into {MICRO_BATCHES} "
    "micro-batches of one (DDP: `no_sync` for the first three; `DeferredSync`: `add` each, "
    "`finish` once), so that every step trains on the same tokens. DiLoCo's local steps are "
    "one compiled `torch.func` step; its cross-node bytes are a bf16 sync's over "
    f"H = {INNER_STEPS}."
)


def tables(results: dict[str, Any]) -> list[tuple[table.Table, str]]:
    """The sync alone on each tree, then the GPT's step: per setting what crosses nodes and
    its time at each rate."""
    first = next(iter(results.values()))
    out: list[tuple[table.Table, str]] = []
    for tree in first["sync"]:
        title = f"The sync alone: {tree} ({first['trees'][tree] / MiB:.1f} MiB)"
        rows = _table(results, "sync", tree, FLAT)
        out.append(((title, _header(results, "flat all-reduce"), rows), ""))
    rows = _table(results, "step", GPT, DDP_EAGER)
    title = "The GPT's training step on 2 nodes x 2 ranks"
    return [*out, ((title, _header(results, "DDP eager"), rows), STEP_NOTE)]


PAGE = Page(
    file="benchmarks-twonodes.md",
    title="Benchmarks on two nodes",
    module="benchmarks.twonodes",
    measure=measure,
    targets=targets,
    tables=tables,
    intro=(READING,),
    figures=figures,
    timing=page.Timing(rounds=6, steps=2, warmup=3),
    rates=RATES,
    smoke_rates=(SMOKE_RATE,),
    tool="twonodes",
    env={"OMP_NUM_THREADS": "1"},
    environment=lambda args, results: {"sizes": "smoke (tiny)" if args.smoke else "full"},
)


if __name__ == "__main__":
    from benchmarks import twonodes  # this module by name, so that its builders pickle

    sys.exit(page.main(twonodes.PAGE))

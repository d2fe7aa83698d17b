"""DiLoCo against a sync at every step: the GPT trained both ways, loss against bytes sent.

    torchrun --standalone --nproc-per-node 2 examples/diloco.py --plot diloco.png
    torchrun --standalone --nproc-per-node 4 examples/diloco.py --steps 400 --inner-steps 16

Each rank stands for a node, so every byte a rank hands to a collective
crosses the slow link between nodes. The character-level GPT of
``examples/gpt.py`` trains twice from the same start on the same batches:

* ``ddp``: the gradients are all-reduced at every step (``fsync.sync_grads``,
  DDP's sync) before an AdamW step;
* ``diloco``: every rank takes AdamW steps on its own gradients, and
  ``fsync.diloco(H)`` averages the pseudo-gradient ``anchor - params`` every
  ``H`` steps, in bfloat16 (``hook=fsync.ops.bf16_compress()``), then DiLoCo's
  outer Nesterov SGD (lr 0.7, momentum 0.9) steps the anchor, which becomes
  every rank's parameters.

The bytes of one sync are measured by ``fsync.sync_stats`` (the collectives the
real path issues, the ranks' agreement included). At the end a table gives the
training loss (mean over ranks of the last steps), the held-out loss of the
parameters every rank shares (for DiLoCo, the last anchor) and the bytes each
rank sent; ``--plot PATH`` draws the training loss against the bytes sent and
against the step. The steps run eagerly; ``--compile`` compiles each run's step,
DiLoCo's ``update`` included (its every-``H``-th-step branch is a ``torch.cond``
in the one graph). ``--device cuda`` runs on GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from _common import describe_world, distributed, parser, print0
from _corpus import Corpus, batch_at, batch_seed, held_out_loss, next_char_loss
from gpt_model import GPT, GPTConfig
from matplotlib.figure import Figure
from tqdm import tqdm

import fsync

Params = dict[str, torch.Tensor]
MiB = 2**20


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, steps=160, compiled=False)
    p.add_argument("--inner-steps", type=int, default=8, help="H, steps between DiLoCo's syncs")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (both runs)")
    p.add_argument("--plot", type=pathlib.Path, default=None, help="where to draw the plot (png)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Run(NamedTuple):
    name: str
    losses: list[float]  # per step, mean over ranks
    bytes_sent: list[int]  # per step, this rank's running total
    held_out: float
    syncs: int


def main() -> None:
    args = parse_args()
    with distributed(args) as device:
        compare(args, device)


def compare(args: argparse.Namespace, device: torch.device) -> None:
    corpus = Corpus.load()
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=len(corpus.chars))).to(device)
    initial = fsync.broadcast({n: p.detach() for n, p in model.named_parameters()})
    world_size = dist.get_world_size()
    print0(
        f"fsync {fsync.__version__}: {describe_world()} (one rank per node), GPT with "
        f"{model.num_params():,} parameters, {args.steps} steps, DiLoCo with H = "
        f"{args.inner_steps} and bfloat16 pseudo-gradients, "
        f"{'fsync.compile' if not args.no_compile else 'eager'}"
    )
    # What one sync puts on the wire per rank: the buckets' collectives and the agreement.
    every_step = fsync.sync_stats(initial, world_size=world_size)
    pseudo = fsync.sync_stats(initial, world_size=world_size, hook=fsync.ops.bf16_compress())
    print0(f"ddp, every step:     {every_step}")
    print0(f"diloco, every H-th:  {pseudo}")

    runs = [
        train("ddp", ddp_step, initial, every_step, model, corpus, args, device),
        train("diloco", diloco_step, initial, pseudo, model, corpus, args, device),
    ]

    last = max(1, args.steps // 10)  # the training loss: mean of the last tenth of the steps
    print0(f"\nafter {args.steps} steps on {describe_world()}, per rank:")
    print0(f"{'run':<8} {'train loss':>10} {'held-out':>8} {'syncs':>6} {'MiB sent':>10}")
    for run in runs:
        train_loss = sum(run.losses[-last:]) / last
        print0(
            f"{run.name:<8} {train_loss:>10.4f} {run.held_out:>8.4f} {run.syncs:>6} "
            f"{run.bytes_sent[-1] / MiB:>10.3f}"
        )
    ddp, diloco = runs
    print0(f"diloco sent {ddp.bytes_sent[-1] / diloco.bytes_sent[-1]:.1f}x fewer bytes than ddp")
    if not all(math.isfinite(x) for run in runs for x in (*run.losses, run.held_out)):
        raise RuntimeError("a run diverged: a loss is not finite")
    if args.plot is not None and dist.get_rank() == 0:
        plot(runs, args, world_size)
        print0(f"plot: {args.plot}")
    print0(f"OK: parameters identical on all {world_size} ranks after each run")


# A run's step: (params, state, x, y) -> (params, state, loss).
Step = Callable[..., tuple[Params, Any, torch.Tensor]]


def ddp_step(args: argparse.Namespace, loss_fn: Callable[..., torch.Tensor]) -> tuple[Step, Any]:
    """A sync at every step: the mean gradient, then AdamW (every rank takes the same step)."""
    opt = fsync.optim.adamw(args.lr)

    def step(params: Params, state: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        grads = fsync.sync_grads(grads)
        params, state = opt.update(params, grads, state)
        return params, state, loss

    return step, opt.init


def diloco_step(args: argparse.Namespace, loss_fn: Callable[..., torch.Tensor]) -> tuple[Step, Any]:
    """A local AdamW step on this rank's gradients, then DiLoCo (a sync every H-th step)."""
    opt = fsync.optim.adamw(args.lr)
    outer = fsync.diloco(args.inner_steps, hook=fsync.ops.bf16_compress())

    def step(params: Params, state: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        opt_state, diloco_state = state
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        params, opt_state = opt.update(params, grads, opt_state)  # no communication
        params, diloco_state = outer.update(params, diloco_state)
        return params, (opt_state, diloco_state), loss

    return step, lambda params: (opt.init(params), outer.init(params))


def train(
    name: str,
    make_step: Callable[[argparse.Namespace, Callable[..., torch.Tensor]], tuple[Step, Any]],
    params: Params,
    stats: fsync.SyncStats,
    model: GPT,
    corpus: Corpus,
    args: argparse.Namespace,
    device: torch.device,
) -> Run:
    """Trains from ``params``; returns the losses, the bytes sent and the held-out loss."""
    rank = dist.get_rank()
    loss_fn = next_char_loss(model)
    step_fn, init = make_step(args, loss_fn)
    state = init(params)
    if not args.no_compile:
        step_fn = fsync.compile(step_fn)
    per_sync = stats.bytes_on_wire + stats.control_bytes
    every = 1 if name == "ddp" else args.inner_steps
    losses, bytes_sent = [], []
    for step in tqdm(range(args.steps), disable=rank != 0, desc=f"{name:<8}", unit="step"):
        seed = batch_seed(args.seed, step, rank)
        x, y = batch_at(corpus.train, seed, args.batch, model.config.block_size, device)
        params, state, loss = step_fn(params, state, x, y)
        losses.append(loss.detach())
        bytes_sent.append((step + 1) // every * per_sync)
    # The losses of every step, averaged over ranks at the end: one collective, not one a step.
    mean_losses = torch.stack(losses).double()
    dist.all_reduce(mean_losses)
    mean_losses /= dist.get_world_size()
    # The parameters every rank shares: DiLoCo's anchor (the last sync's), else the params.
    shared = state[1].anchor if name == "diloco" else params
    fsync.verify(shared, values=True)
    held_out = held_out_loss(
        loss_fn,
        shared,
        corpus,
        batches=8,
        batch=args.batch,
        block=model.config.block_size,
        device=device,
    )
    return Run(name, mean_losses.tolist(), bytes_sent, held_out, args.steps // every)


def plot(runs: list[Run], args: argparse.Namespace, world_size: int) -> None:
    """The training loss against the MiB each rank sent, and against the step."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    by_bytes, by_step = fig.subplots(1, 2)
    labels = {"ddp": "sync every step (fp32)", "diloco": f"DiLoCo, H = {args.inner_steps} (bf16)"}
    for run in runs:
        mib = [b / MiB for b in run.bytes_sent]
        by_bytes.plot(mib, run.losses, label=labels[run.name])
        by_step.plot(range(1, len(run.losses) + 1), run.losses, label=labels[run.name])
    by_bytes.set_xscale("symlog", linthresh=0.1)
    by_bytes.set_xlabel("MiB sent per rank over the cross-node link")
    by_step.set_xlabel("step")
    for ax in (by_bytes, by_step):
        ax.set_ylabel("training loss (mean over ranks)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPT on {world_size} ranks, one per node")
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()

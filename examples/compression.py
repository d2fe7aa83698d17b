"""Gradient compression: one model trained with each of fsync's hooks, loss against bytes sent.

    torchrun --standalone --nproc-per-node 2 examples/compression.py
    torchrun --standalone --nproc-per-node 2 examples/compression.py --hook powersgd \\
        --powersgd-rank 8 --steps 300

The character-level GPT of ``examples/gpt.py`` trains from the same starting
point on the same batches once per hook: plain all-reduce, fp16 and bf16
compression, PowerSGD, PowerSGD with its P and Q sent in bf16
(``bf16_compress(powersgd(r))``: wrappers compose) and 8-bit quantisation.
Every hook runs through ``fsync.GradSync``, whose state (PowerSGD's error
feedback and Q) is threaded through the step like the optimizer's. The step
runs eagerly by default (``--compile`` compiles it once per hook, which is
slow on CPU).

At the end a table gives, per hook, the held-out loss, the bytes each rank
hands to the collectives per step (measured by ``fsync.sync_stats`` with the
hook's final state, so PowerSGD is past its uncompressed warm-up) relative to
all-reduce, and the time per step. Every run ends with identical parameters on
all ranks, which is checked. ``--device cuda`` runs on GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from _common import describe_world, distributed, mean_over_ranks, parser, print0
from _corpus import Corpus, batch_at, batch_seed, held_out_loss, next_char_loss
from gpt_model import GPT, GPTConfig
from tqdm import tqdm

import fsync

Params = dict[str, torch.Tensor]

HOOKS: dict[str, Callable[[argparse.Namespace], fsync.Hook]] = {
    "allreduce": lambda args: fsync.ops.allreduce(),
    "fp16": lambda args: fsync.ops.fp16_compress(),
    "bf16": lambda args: fsync.ops.bf16_compress(),
    "powersgd": lambda args: fsync.ops.powersgd(args.powersgd_rank, start_step=args.start_step),
    "bf16-powersgd": lambda args: fsync.ops.bf16_compress(
        fsync.ops.powersgd(args.powersgd_rank, start_step=args.start_step)
    ),
    "quantize": lambda args: fsync.ops.quantize(args.bits),
}


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, steps=60, compile_flag=False)
    p.add_argument(
        "--hook", choices=[*HOOKS, "all"], default="all", help="the hook to train with (all)"
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--powersgd-rank", type=int, default=4, help="rank of PowerSGD's P and Q")
    p.add_argument(
        "--start-step", type=int, default=10, help="PowerSGD's uncompressed warm-up steps"
    )
    p.add_argument("--bits", type=int, default=8, choices=[1, 2, 4, 8], help="quantize's bits")
    p.add_argument("--bucket-cap-mb", type=float, default=0.1, help="bucket size in MiB")
    p.add_argument("--compile", action="store_true", help="compile each hook's step")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Result(NamedTuple):
    hook: str
    train_loss: float
    held_out: float
    bytes_on_wire: int
    seconds_per_step: float
    collectives: int


def main() -> None:
    args = parse_args()
    with distributed(args) as device:
        run(args, device)


def run(args: argparse.Namespace, device: torch.device) -> None:
    corpus = Corpus.load()
    config = GPTConfig(vocab_size=len(corpus.chars))
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    initial = fsync.broadcast({n: p.detach() for n, p in model.named_parameters()})
    sizes = {"bucket_cap_mb": args.bucket_cap_mb, "first_bucket_mb": args.bucket_cap_mb}
    plain = fsync.sync_stats(initial, world_size=dist.get_world_size(), **sizes)
    print0(
        f"fsync {fsync.__version__}: {describe_world()}, GPT with {model.num_params():,} "
        f"parameters, {args.steps} steps per hook, {'compiled' if args.compile else 'eager'}"
    )
    print0(plain)

    names = list(HOOKS) if args.hook == "all" else [args.hook]
    results = [
        train(name, HOOKS[name](args), initial, model, corpus, args, device) for name in names
    ]

    print0(f"\nafter {args.steps} steps on {describe_world()}, per rank and step:")
    print0(
        f"{'hook':<14} {'train loss':>10} {'held-out':>8} {'bytes sent':>10} "
        f"{'vs allreduce':>12} {'collectives':>11} {'ms/step':>8}"
    )
    for r in results:
        print0(
            f"{r.hook:<14} {r.train_loss:>10.4f} {r.held_out:>8.4f} {r.bytes_on_wire:>10,} "
            f"{r.bytes_on_wire / plain.bytes_on_wire:>12.4f} {r.collectives:>11} "
            f"{1000 * r.seconds_per_step:>8.1f}"
        )
    if not all(math.isfinite(r.train_loss) and math.isfinite(r.held_out) for r in results):
        raise RuntimeError("a run diverged: a loss is not finite")
    print0(f"OK: every hook trained, parameters identical on all {dist.get_world_size()} ranks")


def train(
    name: str,
    hook: fsync.Hook,
    params: Params,
    model: GPT,
    corpus: Corpus,
    args: argparse.Namespace,
    device: torch.device,
) -> Result:
    """Trains from ``params`` with ``hook``; returns what it cost and what it reached."""
    rank = dist.get_rank()
    loss_fn = next_char_loss(model)
    sync = fsync.GradSync(
        hook=hook, bucket_cap_mb=args.bucket_cap_mb, first_bucket_mb=args.bucket_cap_mb
    )
    sync_state = sync.init(params)
    opt = fsync.optim.adamw(args.lr)
    opt_state = opt.init(params)

    def train_step(
        params: Params,
        opt_state: Any,
        sync_state: fsync.SyncState,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> tuple[Params, Any, fsync.SyncState, torch.Tensor]:
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        grads, sync_state = sync(grads, sync_state)
        params, opt_state = opt.update(params, grads, opt_state)
        return params, opt_state, sync_state, loss

    step_fn = torch.compile(train_step, fullgraph=True) if args.compile else train_step
    progress = tqdm(range(args.steps), disable=rank != 0, desc=f"{name:<14}", unit="step")
    started: float | None = None
    train_loss = math.nan
    for step in progress:
        x, y = batch_at(
            corpus.train,
            batch_seed(args.seed, step, rank),
            args.batch,
            model.config.block_size,
            device,
        )
        params, opt_state, sync_state, loss = step_fn(params, opt_state, sync_state, x, y)
        if step == 0:
            started = time.perf_counter()  # after the first step, which may compile
        if step % 10 == 0 or step == args.steps - 1:
            train_loss = mean_over_ranks(loss, device)
            progress.set_postfix(loss=f"{train_loss:.4f}")
    progress.close()
    seconds = (
        (time.perf_counter() - started) / max(args.steps - 1, 1)
        if started is not None
        else math.nan
    )

    fsync.verify(params, values=True)  # compressed or not, every rank took the same step
    held_out = held_out_loss(
        loss_fn,
        params,
        corpus,
        batches=8,
        batch=args.batch,
        block=model.config.block_size,
        device=device,
    )
    # The bytes of one step from the final state (PowerSGD past its warm-up, its Q warm).
    stats = fsync.sync_stats(
        sync.plan(sync_state), hook=hook, state=sync_state.hook, world_size=dist.get_world_size()
    )
    return Result(name, train_loss, held_out, stats.bytes_on_wire, seconds, stats.num_collectives)


if __name__ == "__main__":
    main()

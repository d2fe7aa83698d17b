"""Trains a small character-level GPT on the corpus in examples/data, data-parallel with fsync.

    torchrun --standalone --nproc-per-node 2 examples/gpt.py
    torchrun --standalone --nproc-per-node 2 examples/gpt.py --steps 100 --decay-steps 300 \\
        --checkpoint /tmp/gpt-ckpt
    torchrun --standalone --nproc-per-node 2 examples/gpt.py --steps 300 \\
        --checkpoint /tmp/gpt-ckpt --resume

Every rank draws its own random windows of the training text (the first 90% of
``examples/data/corpus.txt``) and computes synced gradients with
``fsync.grad_and_value``; the step (forward, backward with the all-reduces
started as it goes, ``fsync.optim.adamw``) runs eagerly, or with ``--compile`` as
one ``fsync.compile`` graph (faster steps, but
compiling takes about a minute on a two-core machine the first time). The
learning rate is a tensor changed in place by the schedule, so the compiled
step never recompiles. The progress bar shows the loss (mean over ranks) and
tokens per second; the loss on the held-out last 10% is printed every
``--eval-every`` steps and at the end, followed by a sample of generated text.

With ``--checkpoint PATH`` (a directory) every rank saves the parameters, the
optimizer state, the step and the model's shape through
``torch.distributed.checkpoint`` at every evaluation and at the end
(``dcp.save(fsync.checkpoint.state_dict(...))``, written beside PATH and swapped in
once complete); ``--resume`` loads them on every rank (``fsync.checkpoint.load``)
and continues to ``--steps``. The batches and the learning rate are functions of the step, so a
run stopped and resumed gives the same numbers as one that never stopped, as
long as both use the same ``--decay-steps`` (the length of the schedule, by
default ``--steps``). ``--device cuda`` runs on GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import describe_world, distributed, mean_over_ranks, parser, print0
from _corpus import Corpus, batch_at, batch_seed, held_out_loss, next_char_loss
from gpt_model import GPT, GPTConfig
from tqdm import tqdm

import fsync

Params = dict[str, torch.Tensor]


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, steps=150, compiled=False)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=10, help="steps of linear warm-up")
    p.add_argument(
        "--decay-steps", type=int, default=None, help="cosine decay length (default: --steps)"
    )
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches, split over ranks")
    p.add_argument(
        "--checkpoint", type=pathlib.Path, default=None, help="where to save (a directory)"
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument(
        "--sample-chars", type=int, default=200, help="characters to generate at the end"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.resume and args.checkpoint is None:
        p.error("--resume needs --checkpoint PATH")
    args.decay_steps = args.decay_steps or args.steps
    return args


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``--lr``, then a cosine decay to a tenth of it at ``--decay-steps``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min((step - args.warmup) / max(args.decay_steps - args.warmup, 1), 1.0)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


# --- training -------------------------------------------------------------------------------


def save(
    path: pathlib.Path, step: int, params: Params, opt_state: Any, opt: Any, model: GPT
) -> None:
    """Every rank writes its part (into a directory beside ``path``, swapped in once complete:
    a crash never leaves half of one, nor mixes two)."""
    sd = fsync.checkpoint.state_dict(params, opt_state, step=opt)
    sd["example"] = {"step": step, "config": json.dumps(dataclasses.asdict(model.config))}
    partial, old = (path.with_name(path.name + suffix) for suffix in (".partial", ".old"))
    if dist.get_rank() == 0:  # what an interrupted save may have left
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    dcp.save(sd, checkpoint_id=partial)  # returns on every rank once .metadata is written
    if dist.get_rank() == 0:
        if path.exists():
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # the checkpoint is in place before anyone goes on


def saved_step_and_config(path: pathlib.Path) -> tuple[int, GPTConfig]:
    """The step and the model's shape a checkpoint was saved at (read by every rank)."""
    entry: dict[str, Any] = {"example": {"step": 0, "config": ""}}
    dcp.load(entry, checkpoint_id=path)
    return entry["example"]["step"], GPTConfig(**json.loads(entry["example"]["config"]))


def main() -> None:
    args = parse_args()
    with distributed(args) as device:
        train(args, device)


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    corpus = Corpus.load()
    lr = torch.tensor([args.lr], dtype=torch.float64)  # read by the optimizer at every update
    opt = fsync.optim.adamw(lr, weight_decay=args.weight_decay)

    if args.resume:
        start, config = saved_step_and_config(args.checkpoint)
        model = GPT(config).to(device)
        # Into the new model's shapes and devices (its values are not read); the
        # optimizer's step count stays on the CPU, as opt.init makes it (and torch.optim
        # keeps it: on a GPU its powers would round differently).
        params = {n: p.detach() for n, p in model.named_parameters()}
        params, opt_state = fsync.checkpoint.load(args.checkpoint, params, step=opt)
        fsync.verify(params, values=True)  # every rank read the same values
        print0(f"resumed from {args.checkpoint} at step {start}")
    else:
        config = GPTConfig(
            vocab_size=len(corpus.chars),
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            d_model=args.d_model,
        )
        torch.manual_seed(args.seed)
        model = GPT(config).to(device)
        # Every rank starts from rank 0's values, as DDP's constructor would make it.
        params = fsync.broadcast({n: p.detach() for n, p in model.named_parameters()})
        opt_state = opt.init(params)
        start = 0
    if config.vocab_size != len(corpus.chars):
        raise ValueError(
            f"the checkpoint's model has {config.vocab_size} tokens but the corpus has "
            f"{len(corpus.chars)} characters; it was trained on another text."
        )

    # torch.func.grad_and_value with DDP's bucketed all-reduce mean: eagerly each bucket's
    # all-reduce starts as backward completes it.
    loss_fn = next_char_loss(model)
    grad_fn = fsync.grad_and_value(loss_fn)

    def train_step(
        params: Params, opt_state: Any, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[Params, Any, torch.Tensor]:
        grads, loss = grad_fn(params, x, y)
        params, opt_state = opt.update(params, grads, opt_state)
        return params, opt_state, loss

    step_fn = train_step if args.no_compile else fsync.compile(train_step)
    mode = "eager" if args.no_compile else "fsync.compile"
    tokens_per_step = world_size * args.batch * config.block_size
    print0(
        f"fsync {fsync.__version__}: {describe_world()}, GPT with {model.num_params():,} "
        f"parameters ({config.n_layer} layers, {config.n_head} heads, width "
        f"{config.d_model}, context {config.block_size}), {len(corpus.chars)} characters, "
        f"{len(corpus.train):,} training / {len(corpus.held_out):,} held-out tokens, {mode}"
    )

    progress = tqdm(
        range(start, args.steps), disable=rank != 0, desc="train", unit="step", initial=start
    )
    first_done = None  # the clock starts after the first step, which includes compilation
    train_loss = held_out = float("nan")
    for step in progress:
        x, y = batch_at(
            corpus.train, batch_seed(args.seed, step, rank), args.batch, config.block_size, device
        )
        lr.fill_(learning_rate(step, args))
        params, opt_state, loss = step_fn(params, opt_state, x, y)
        done = step + 1
        if first_done is None:
            first_done, started = done, time.perf_counter()
        last = done == args.steps
        if done % 10 == 0 or done % args.eval_every == 0 or last:
            train_loss = mean_over_ranks(loss, device)
            elapsed = time.perf_counter() - started
            rate = (done - first_done) * tokens_per_step / elapsed if done > first_done else 0.0
            progress.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{rate:,.0f}")
        if done % args.eval_every == 0 or last:
            held_out = held_out_loss(
                loss_fn,
                params,
                corpus,
                batches=args.eval_batches,
                batch=args.batch,
                block=config.block_size,
                device=device,
            )
            if rank == 0:  # tqdm.write prints even where the bar is disabled
                progress.write(f"step {done}: train loss {train_loss:.4f}, held-out {held_out:.4f}")
            if args.checkpoint is not None:
                save(args.checkpoint, done, params, opt_state, opt, model)
    progress.close()

    if first_done is None:
        print0(f"nothing to do: the checkpoint is at step {start}, --steps is {args.steps}")
        return
    fsync.verify(params, values=True)  # every rank ends with the same parameters, bit for bit
    if first_done < args.steps:
        steps_timed = args.steps - first_done
        rate = steps_timed * tokens_per_step / (time.perf_counter() - started)
        print0(f"{rate:,.0f} tokens/s over {steps_timed} steps on all ranks (after the first)")
    print0(f"final: step {args.steps}, train loss {train_loss:.4f}, held-out loss {held_out:.4f}")
    if args.checkpoint is not None:
        print0(f"checkpoint: {args.checkpoint}")
    print0(f"OK: parameters identical on all {world_size} ranks")
    if rank == 0 and args.sample_chars > 0:
        model.load_state_dict(params)
        prompt = corpus.encode("The ")[None].to(device)
        sample = model.generate(
            prompt,
            args.sample_chars,
            temperature=0.8,
            generator=torch.Generator(device=device).manual_seed(args.seed),
        )
        print(f"sample:\n{corpus.decode(sample[0])}", flush=True)


if __name__ == "__main__":
    main()

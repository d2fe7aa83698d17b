"""ZeRO with fsync: the AdamW state split across ranks, its update fused with the gradient sync.

    torchrun --standalone --nproc-per-node 2 examples/zero.py
    torchrun --standalone --nproc-per-node 2 examples/zero.py --whole-buckets
    torchrun --standalone --nproc-per-node 4 examples/zero.py --checkpoint /tmp/zero-ckpt

The character-level GPT of ``examples/gpt.py`` trains with
``step = fsync.ops.zero(fsync.optim.adamw(...))`` and its gradient call
``step.value_and_step(loss_fn)``: per bucket, as backward completes it, the
gradients are reduce-scattered; every rank updates its shard of the parameters
with its shard of the AdamW state and the shards are all-gathered (on a GPU as
each reduce is over, on the CPU after backward: ``update_in_backward``)
(``--whole-buckets``: each bucket is all-reduced and updated by the one rank
that owns it, which broadcasts it). The step runs eagerly, or with
``--compile`` as one ``fsync.compile`` graph.

It prints the optimizer-state bytes each rank holds against what plain AdamW
holds, trains, and then checkpoints through ``torch.distributed.checkpoint``:
``dcp.save(fsync.checkpoint.state_dict(params, state, step=step))``, every rank
writing its own shard of the AdamW state (none gathers the whole); every rank loads
the checkpoint into a ZeRO step of the *other* layout (``fsync.checkpoint.load``,
each rank reading the elements its new shard needs) and takes one more step with
both, which must agree bit for bit. It ends by checking that every rank
holds the same parameters. ``--device cuda`` runs it on GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import describe_world, distributed, mean_over_ranks, parser, print0
from _corpus import Corpus, batch_at, batch_seed, held_out_loss, next_char_loss
from gpt_model import GPT, GPTConfig
from tqdm import tqdm

import fsync


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, steps=200, compiled=False)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=0.1,
        help="bucket size in MiB (small, so that this small model has several buckets)",
    )
    p.add_argument(
        "--whole-buckets",
        action="store_true",
        help="each bucket owned whole by one rank (shard_buckets=False)",
    )
    p.add_argument(
        "--checkpoint",
        type=pathlib.Path,
        default=None,
        help="the checkpoint's directory (default: a temporary one, deleted at the end)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def state_bytes(tree: Any) -> int:
    """Bytes held by the tensors of a tree."""
    return sum(t.nbytes for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def report_memory(step: fsync.ops.ZeroStep, state: fsync.ops.ZeroState, params: Any) -> None:
    """Prints every rank's optimizer-state bytes against those of unsharded AdamW."""
    mine = state_bytes(state.opt)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    unsharded = state_bytes(step.optimizer.init(params))
    layout = "sharded buckets" if step.shard_buckets else "whole buckets"
    print0(f"AdamW state per rank ({layout}), against {unsharded:,} bytes unsharded:")
    for rank, nbytes in enumerate(everyone):
        owned = ""
        if not step.shard_buckets:
            owners = step.layout(state).owners
            owned = f", buckets {[b for b, r in enumerate(owners) if r == rank]}"
        print0(f"  rank {rank}: {nbytes:,} bytes ({nbytes / unsharded:.1%}{owned})")


@contextlib.contextmanager
def checkpoint_path(args: argparse.Namespace) -> Iterator[pathlib.Path]:
    """``--checkpoint``, or a temporary directory made by rank 0, named to all and removed
    after."""
    if args.checkpoint is not None:
        yield args.checkpoint
        return
    with contextlib.ExitStack() as stack:
        name: list[Any] = [None]
        if dist.get_rank() == 0:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="fsync-zero-"))
            name = [str(pathlib.Path(directory) / "zero")]
        dist.broadcast_object_list(name, src=0)
        try:
            yield pathlib.Path(name[0])
        finally:
            dist.barrier()  # nobody reads the checkpoint any more when rank 0 removes it


def main() -> None:
    args = parse_args()
    with distributed(args) as device:
        train(args, device)


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    corpus = Corpus.load()
    config = GPTConfig(vocab_size=len(corpus.chars))
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    loss_fn = next_char_loss(model)
    params = fsync.broadcast({n: p.detach() for n, p in model.named_parameters()})

    def make_step(shard_buckets: bool) -> fsync.ops.ZeroStep:
        # Buckets as small as --bucket-cap-mb, the first one too (DDP's is 1 MiB).
        return fsync.ops.zero(
            fsync.optim.adamw(args.lr, weight_decay=args.weight_decay),
            shard_buckets=shard_buckets,
            bucket_cap_mb=args.bucket_cap_mb,
            first_bucket_mb=args.bucket_cap_mb,
        )

    step = make_step(shard_buckets=not args.whole_buckets)
    state = step.init(params)  # plans the buckets, checks the ranks agree, shards the state

    mode = "eager" if args.no_compile else "fsync.compile"
    print0(
        f"fsync {fsync.__version__}: {describe_world()}, GPT with {model.num_params():,} "
        f"parameters, ZeRO AdamW, {mode}"
    )
    print0(step.layout(state).plan)
    report_memory(step, state, params)

    # One backward that reduce-scatters, updates and all-gathers each bucket as it completes.
    train_step = step.value_and_step(loss_fn)
    step_fn = train_step if args.no_compile else fsync.compile(train_step)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_at(
            corpus.train, batch_seed(args.seed, i, rank), args.batch, config.block_size, device
        )

    started = time.perf_counter()
    progress = tqdm(range(args.steps), disable=rank != 0, desc="train", unit="step")
    first_loss = last_loss = float("nan")
    for i in progress:
        (params, loss), state = step_fn(state, params, *batch(i))
        if i % 10 == 0 or i == args.steps - 1:
            last_loss = mean_over_ranks(loss, device)
            first_loss = last_loss if i == 0 else first_loss
            progress.set_postfix(loss=f"{last_loss:.4f}")
    progress.close()
    elapsed = time.perf_counter() - started
    held_out = held_out_loss(
        loss_fn, params, corpus, batches=8, batch=args.batch, block=config.block_size, device=device
    )
    print0(
        f"loss {first_loss:.4f} -> {last_loss:.4f} in {args.steps} steps ({elapsed:.1f} s"
        f"{'' if args.no_compile else ', compilation included'}); held-out loss {held_out:.4f}"
    )

    # The gradients of one more batch, for the check after the checkpoint.
    grads = torch.func.grad(loss_fn)(params, *batch(args.steps))
    with checkpoint_path(args) as path:
        check_checkpoint(path, params, grads, step, state, make_step(not step.shard_buckets))
    fsync.verify(params, values=True)  # every rank ends with the same parameters, bit for bit
    print0(f"OK: parameters identical on all {world_size} ranks")


def check_checkpoint(
    path: pathlib.Path,
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    step: fsync.ops.ZeroStep,
    state: fsync.ops.ZeroState,
    other: fsync.ops.ZeroStep,
) -> None:
    """Saves a checkpoint, every rank its shard; loads it into ``other``; checks that the
    next steps agree."""
    dcp.save(fsync.checkpoint.state_dict(params, state, step=step), checkpoint_id=path)
    if dist.get_rank() == 0:
        files = sorted(path.glob("*.distcp"))
        nbytes = sum(f.stat().st_size for f in files)
        print(f"checkpoint: {path} ({nbytes:,} bytes in {len(files)} files, one per rank)")

    # Every rank reads the elements of its shard in the other layout (and the parameters,
    # into new tensors shaped and placed like these: their values are not read).
    loaded, other_state = fsync.checkpoint.load(path, params, step=other)

    # One more step in each layout, eagerly, from the same parameters, state and gradients.
    here, _ = step(params, grads, state)
    there, _ = other(loaded, grads, other_state)
    differ = [k for k in here if not torch.equal(here[k], there[k])]
    if differ:
        raise AssertionError(f"after reloading, the next step differs in {differ}")
    layout = "sharded buckets" if other.shard_buckets else "whole buckets"
    print0(f"OK: the checkpoint reloaded as {layout} takes a bit-identical next step")


if __name__ == "__main__":
    main()

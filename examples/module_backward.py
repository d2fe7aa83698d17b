"""fsync with an ordinary nn.Module, loss.backward() and a torch.optim optimizer: no DDP wrapper.

    torchrun --standalone --nproc-per-node 2 examples/module_backward.py
    torchrun --standalone --nproc-per-node 2 examples/module_backward.py --optimizer sgd
    torchrun --standalone --nproc-per-node 8 examples/module_backward.py --no-check-ddp

Each rank classifies its own synthetic samples with an MLP that has BatchNorm
layers, training as one would on a single process, plus the three things DDP
does behind the scenes, written out:

1. at start-up, ``fsync.broadcast`` gives every rank rank 0's parameters and
   buffers (DDP's constructor);
2. before every forward, ``fsync.sync_buffers`` gives every rank rank 0's
   BatchNorm running statistics (DDP's ``broadcast_buffers=True``);
3. after ``loss.backward()``, ``fsync.sync_grads`` averages the ``.grad`` tree
   and the result is written back before ``optimizer.step()`` (DDP's Reducer).

With ``--check-ddp`` (the default on CPU with up to 4 ranks) an identical model
wrapped in ``DistributedDataParallel`` trains beside it on the same batches,
and after every step the two must hold the same parameters and buffers bit for
bit: fsync buckets the gradients as DDP does (same bucket sizes, same reverse
parameter order, same scaling), so the sums are made in the same order. Before
evaluating, ``fsync.sync_buffers(mode="mean")`` averages the running statistics.
``--device cuda`` runs on GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from _common import describe_world, distributed, mean_over_ranks, parser, print0
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import fsync

FEATURES, CLASSES = 32, 4


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, steps=200, compile_flag=False)
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 for adamw, 0.05 for sgd")
    p.add_argument(
        "--check-ddp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train a DDP model beside it and compare every step (default: on CPU, <= 4 ranks)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.lr is None:
        args.lr = 1e-3 if args.optimizer == "adamw" else 0.05
    return args


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, width),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        nn.Linear(width, CLASSES),
    )


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


class Task:
    """Samples labelled by a fixed random linear "teacher": the class of the largest score."""

    def __init__(self, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(FEATURES, CLASSES, generator=g)
        self.device = device

    def batch(self, seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(size, FEATURES, generator=g) * torch.linspace(0.5, 2.0, FEATURES)
        y = (x @ self.teacher).argmax(dim=1)
        return x.to(self.device), y.to(self.device)


def main() -> None:
    args = parse_args()
    with distributed(args) as device:
        train(args, device)


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_ddp = args.check_ddp
    if check_ddp is None:
        check_ddp = device.type == "cpu" and world_size <= 4
    task = Task(args.seed, device)

    torch.manual_seed(args.seed + rank)  # different initial values on every rank, on purpose
    model = make_model(args.width).to(device)
    ddp = None
    if check_ddp:
        # DDP's constructor broadcasts rank 0's parameters and buffers to its copy.
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DDP(copy.deepcopy(model), device_ids=device_ids)
    # 1. Start-up: every rank takes rank 0's parameters and buffers.
    model.load_state_dict(fsync.broadcast(model.state_dict()))
    optimizer = make_optimizer(model, args)
    ddp_optimizer = make_optimizer(ddp.module, args) if ddp is not None else None
    if ddp is not None:
        compare(model, ddp.module, "after start-up")
        settle_ddp_buckets(ddp, task.batch(seed=-2, size=args.batch)[0])

    n = sum(p.numel() for p in model.parameters())
    print0(
        f"fsync {fsync.__version__}: {describe_world()}, MLP with BatchNorm, {n:,} parameters, "
        f"torch.optim.{type(optimizer).__name__}, loss.backward()"
        + (", checked against DDP at every step" if ddp is not None else "")
    )
    print0(fsync.plan_buckets({k: p.detach() for k, p in model.named_parameters()}))

    model.train()
    progress = tqdm(range(args.steps), disable=rank != 0, desc="train", unit="step")
    first_loss = last_loss = float("nan")
    for step in progress:
        x, y = task.batch(seed=step * world_size + rank, size=args.batch)  # this rank's own

        # 2. Before the forward: rank 0's BatchNorm running statistics everywhere.
        buffers = fsync.sync_buffers(dict(model.named_buffers()))
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])

        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # 3. After the backward: the mean of every rank's .grad, written back.
        grads = fsync.sync_grads({name: p.grad for name, p in model.named_parameters()})
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.grad.copy_(grads[name])
        optimizer.step()

        if ddp is not None:
            ddp_loss = nn.functional.cross_entropy(ddp(x), y)
            ddp_optimizer.zero_grad(set_to_none=True)
            ddp_loss.backward()  # DDP's autograd hooks all-reduce the buckets
            ddp_optimizer.step()
            compare(model, ddp.module, f"at step {step}")

        if step % 20 == 0 or step == args.steps - 1:
            last_loss = mean_over_ranks(loss, device)
            first_loss = last_loss if step == 0 else first_loss
            progress.set_postfix(loss=f"{last_loss:.4f}")
    progress.close()

    # Evaluation with the running statistics averaged over the ranks.
    with torch.no_grad():
        averaged = fsync.sync_buffers(dict(model.named_buffers()), mode="mean")
        for name, buffer in model.named_buffers():
            buffer.copy_(averaged[name])
    model.eval()
    x, y = task.batch(seed=-1, size=4096)  # the same held-out samples on every rank
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).double().mean().item()
    print0(
        f"loss {first_loss:.4f} -> {last_loss:.4f} in {args.steps} steps; held-out accuracy "
        f"{accuracy:.1%} (chance: {1 / CLASSES:.0%})"
    )
    if ddp is not None:
        print0(f"OK: parameters and buffers equal to DDP's, bit for bit, at all {args.steps} steps")
    fsync.verify(model.state_dict(), values=True)
    print0(f"OK: parameters identical on all {world_size} ranks")


def settle_ddp_buckets(ddp: DDP, x: torch.Tensor) -> None:
    """One iteration without effect, after which DDP's buckets are the ones fsync uses.

    DDP's first backward runs on provisional buckets (the parameters in forward
    order) and records the order in which the gradients became ready; its next
    forward rebuilds the buckets in that order (roughly the reverse order). fsync
    uses the final layout from the first step. On two ranks the layout does not
    change a bit (the sum of two numbers does not depend on their order), but on
    more, gloo's ring adds up each element in an order that depends on where the
    element sits in its bucket. This iteration is in eval mode (the BatchNorm
    statistics stay as they are), its loss is zero times the output and no
    optimizer step follows, so the model is unchanged.
    """
    ddp.eval()
    (0.0 * ddp(x).sum()).backward()
    ddp.zero_grad(set_to_none=True)
    ddp.train()


def compare(model: nn.Module, reference: nn.Module, when: str) -> None:
    """Raises unless the two modules hold bit-identical parameters and buffers."""
    ours, theirs = model.state_dict(), reference.state_dict()
    for name, value in ours.items():
        if not torch.equal(value, theirs[name]):
            diff = (value.double() - theirs[name].double()).abs().max().item()
            raise AssertionError(
                f"rank {dist.get_rank()}: {name} differs from DDP's {when} (max |diff| {diff:.3g})"
            )


if __name__ == "__main__":
    main()

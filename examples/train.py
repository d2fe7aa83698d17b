"""The main job: data-parallel training with fsync, the whole step under torch.compile.

Run with two CPU processes on gloo:

    torchrun --standalone --nproc-per-node 2 examples/train.py
    torchrun --standalone --nproc-per-node 2 examples/train.py --hook powersgd --powersgd-rank 4

and on two machines of two processes each, as a 2 x 2 mesh: on each machine, with
``--node-rank`` 0 on the first and 1 on the second (``docs/torchrun.md`` shows how to
try it on one machine with ``twonodes``):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr node0.example \\
        --master-port 29500 examples/train.py --mesh 2x2

Each rank trains the same MLP on its own shard of a synthetic regression task
(a fixed random "teacher" network), syncing gradients inside one compiled
function (forward, backward, sync, ``fsync.optim.adam`` update): the gradient
call is ``fsync.grad_and_value`` for stateless hooks, ``GradSync.grad_and_value``
with its state for PowerSGD. With ``--mesh NODESxLOCAL`` the ranks form a
``DeviceMesh`` of NODES x LOCAL (dims ``"node"``, ``"local"``) and the gradients
are the hierarchical mean: reduce-scatter within each node, the hook across
nodes on ``1/LOCAL`` of every bucket, all-gather within. With ``--no-compile``
the same step runs eagerly, each bucket's all-reduce starting as backward
completes it. It prints the bucket plan, shows progress and loss, reports the
loss on held-out data, and ends by checking that every rank holds bit-identical
parameters. ``--device cuda`` runs it on GPUs
(NCCL, one GPU per process).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from tqdm import tqdm

import fsync

HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "quantize")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25)
    parser.add_argument("--hook", choices=HOOKS, default="allreduce", help="how buckets are synced")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="rank of PowerSGD's P and Q")
    parser.add_argument(
        "--backend", default=None, help="process group backend (default: nccl on cuda, else gloo)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    parser.add_argument(
        "--mesh",
        type=mesh_shape,
        default=None,
        metavar="NODESxLOCAL",
        help="sync hierarchically over a (nodes, local) DeviceMesh, e.g. 2x2 for 2 machines "
        "of 2 processes (default: one flat group); --hook is then the cross-node hook, and "
        "powersgd is batched_powersgd there",
    )
    return parser.parse_args(argv)


def mesh_shape(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: the ``--mesh`` option's value, NODESxLOCAL."""
    nodes, sep, local = text.lower().partition("x")
    if not (sep and nodes.isdigit() and local.isdigit() and int(nodes) and int(local)):
        raise argparse.ArgumentTypeError(
            f"expected NODESxLOCAL with positive integers, such as 2x2; got {text!r}"
        )
    return int(nodes), int(local)


def make_mesh(shape: tuple[int, int] | None, device: torch.device) -> DeviceMesh | None:
    """The (node, local) mesh of ``shape`` over all ranks, or ``None`` for the flat default group.

    Raises:
        SystemExit: ``shape`` does not hold exactly the ranks torchrun started.
    """
    if shape is None:
        return None
    nodes, local = shape
    world_size = dist.get_world_size()
    if nodes * local != world_size:
        raise SystemExit(
            f"--mesh {nodes}x{local} has {nodes * local} ranks, but torchrun started "
            f"{world_size}; give NODESxLOCAL with NODES * LOCAL = {world_size} (LOCAL: the "
            f"processes per machine, --nproc-per-node), such as --mesh 1x{world_size}."
        )
    return init_device_mesh(device.type, (nodes, local), mesh_dim_names=("node", "local"))


def make_hook(name: str, powersgd_rank: int, mesh: bool = False) -> fsync.Hook:
    """The hook named on the command line; on a mesh, the hook across nodes.

    Across nodes a hook sees each bucket's 1-D shard, which per-leaf PowerSGD would
    leave uncompressed: there PowerSGD is ``batched_powersgd``, which compresses each
    shard as a square matrix.
    """
    powersgd = fsync.ops.batched_powersgd if mesh else fsync.ops.powersgd
    return {
        "allreduce": fsync.ops.allreduce,
        "fp16": fsync.ops.fp16_compress,
        "bf16": fsync.ops.bf16_compress,
        "powersgd": lambda: powersgd(powersgd_rank),
        "quantize": fsync.ops.quantize,
    }[name]()


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, width),
        nn.GELU(),
        nn.Linear(width, width),
        nn.LayerNorm(width),
        nn.GELU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 1),
    )


def train(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Trains on every rank of the initialised default group; returns losses and parameters."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same teacher and initial student on every rank
    teacher = make_model(64).to(device)
    model = make_model(args.width).to(device)
    params = {name: p.detach() for name, p in model.named_parameters()}
    params = fsync.broadcast(params, src=0)  # start every rank from rank 0's values
    opt = fsync.optim.adam(args.lr)  # torch.optim.Adam's arithmetic, as a pure function
    opt_state = opt.init(params)  # AdamState(step, exp_avg, exp_avg_sq)
    sync_options = {"bucket_cap_mb": args.bucket_cap_mb, "first_bucket_mb": args.bucket_cap_mb}
    # None: every rank of the default group; a 2-D mesh: the hierarchical mean over it.
    mesh = make_mesh(args.mesh, device)
    hook = make_hook(args.hook, args.powersgd_rank, mesh=mesh is not None)
    # A hook that keeps state (PowerSGD's error feedback and Q) needs GradSync, whose
    # state is threaded through the step like the optimizer's.
    grad_sync = (
        fsync.GradSync(group=mesh, hook=hook, **sync_options) if args.hook == "powersgd" else None
    )
    sync_state = grad_sync.init(params) if grad_sync is not None else ()

    def loss_fn(params, x, y):
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    # torch.func.grad_and_value whose gradients come back averaged over the ranks.
    if grad_sync is None:
        grad_fn = fsync.grad_and_value(loss_fn, group=mesh, hook=hook, **sync_options)
    else:
        stateful_grad_fn = grad_sync.grad_and_value(loss_fn)

    def train_step(params, opt_state, sync_state, x, y):
        if grad_sync is None:
            grads, loss = grad_fn(params, x, y)
        else:
            (grads, loss), sync_state = stateful_grad_fn(sync_state, params, x, y)
        params, opt_state = opt.update(params, grads, opt_state)
        return params, opt_state, sync_state, loss

    step_fn = train_step if args.no_compile else fsync.compile(train_step)
    if rank == 0:
        mode = "eager" if args.no_compile else "fsync.compile"
        n = sum(p.numel() for p in params.values())
        layout = "" if mesh is None else " as a {} x {} mesh (node, local)".format(*args.mesh)
        print(
            f"fsync {fsync.__version__}: {world_size} ranks on {dist.get_backend()}{layout}, "
            f"{n:,} parameters, hook {args.hook}, {mode}"
        )
        print(fsync.plan_buckets(params, **sync_options))

    data = torch.Generator(device="cpu").manual_seed(1 + rank)  # each rank its own shard
    started = time.perf_counter()
    progress = tqdm(range(args.steps), disable=rank != 0, desc="train", unit="step")
    for step in progress:
        x = torch.randn(args.batch, 32, generator=data).to(device)
        with torch.no_grad():
            y = teacher(x)
        params, opt_state, sync_state, loss = step_fn(params, opt_state, sync_state, x, y)
        if step % 25 == 0 or step == args.steps - 1:
            # The loss shown is the mean over ranks.
            total = loss.detach().clone()
            dist.all_reduce(total)
            mean_loss = total.item() / world_size
            progress.set_postfix(loss=f"{mean_loss:.4f}")
            if step == 0:
                first_loss = mean_loss
    elapsed = time.perf_counter() - started

    # Held-out data, the same on every rank.
    held_out = torch.Generator(device="cpu").manual_seed(12345)
    x = torch.randn(4096, 32, generator=held_out).to(device)
    with torch.no_grad():
        test_loss = loss_fn(params, x, teacher(x)).item()
    return {
        "first_loss": first_loss,
        "last_loss": mean_loss,
        "test_loss": test_loss,
        "elapsed": elapsed,
        "params": params,
    }


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend or ("nccl" if device.type == "cuda" else "gloo"))
    result = train(args, device)
    # Every rank must end with the same parameters, bit for bit.
    fsync.verify(result["params"], values=True)
    if dist.get_rank() == 0:
        print(
            f"loss {result['first_loss']:.4f} -> {result['last_loss']:.4f} in {args.steps} steps "
            f"({result['elapsed']:.1f} s, first step includes compilation); held-out loss "
            f"{result['test_loss']:.5f}"
        )
        print(f"OK: parameters identical on all {dist.get_world_size()} ranks")
    # Every rank done with every group before any tears its sockets down: on two nodes a
    # node-0 worker once failed in teardown after the run (CI, 2026-11-26), its cause unseen.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

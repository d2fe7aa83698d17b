"""What every example needs besides fsync: its command line, the process group, the device.

The examples are launched by torchrun, which sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous address; gloo on CPU is the default, and
``--device cuda`` (NCCL, one GPU per process, chosen by ``LOCAL_RANK``)
scales the same script to GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist


def parser(
    doc: str | None, *, steps: int, compile_flag: bool = True, compiled: bool = True
) -> argparse.ArgumentParser:
    """An argument parser with the options every example shares.

    Args:
        doc: The example's module docstring; its first paragraph describes the command.
        steps: The default number of training steps.
        compile_flag: Whether the example can run its step compiled (``args.no_compile``).
        compiled: Compiled by default with a ``--no-compile`` switch, or eager by default
            with a ``--compile`` switch (for examples whose compilation alone would take
            most of a minute on a small machine).
    """
    description = (doc or "").split("\n\n")[0]
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help="training steps (default %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for one GPU per process")
    p.add_argument(
        "--backend", default=None, help="process group backend (default: nccl on cuda, else gloo)"
    )
    if compile_flag and compiled:
        p.add_argument("--no-compile", action="store_true", help="run the train step eagerly")
    elif compile_flag:
        p.add_argument(
            "--compile",
            dest="no_compile",
            action="store_false",
            help="run the train step as one fsync.compile graph",
        )
    return p


@contextlib.contextmanager
def distributed(args: argparse.Namespace) -> Iterator[torch.device]:
    """Joins the default process group for the life of the block; yields this rank's device."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend)
    try:
        yield device
    finally:
        # A DistributedDataParallel lives in a reference cycle until the garbage collector
        # runs; collected after the group is destroyed, its teardown can deadlock in
        # torch's gloo group (pytorch/pytorch#56297), so collect it while the group lives.
        gc.collect()
        dist.destroy_process_group()


def describe_world() -> str:
    """``"2 ranks on gloo"``."""
    return f"{dist.get_world_size()} ranks on {dist.get_backend()}"


def mean_over_ranks(value: torch.Tensor | float, device: torch.device) -> float:
    """The mean of a scalar over all ranks (for printing: a blocking all-reduce)."""
    total = torch.as_tensor(value, dtype=torch.float64, device=device).detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def print0(*values: object) -> None:
    """``print`` on rank 0 only."""
    if dist.get_rank() == 0:
        print(*values, flush=True)

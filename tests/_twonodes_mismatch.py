"""A rank of node 1 passes another tree: every rank of the 2 x 2 mesh must say so.

Launched by ``tests/test_twonodes.py`` on two nodes of two ranks (torchrun through
``twonodes``). Every rank calls ``fsync.sync_grads(grads, group=mesh)``; global rank 3
(local rank 1 of node 1) passes a gradient of another shape. The ranks' agreement runs
over the whole mesh before any bucket collective, so all four raise the same
``ValueError``; each prints ``rank R: ValueError: <its first line>`` and exits 0, or
``rank R: no error`` and exits 1.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsync

ODD_RANK = 3  # node 1, local rank 1


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    shape = (8, 5) if rank == ODD_RANK else (8, 4)
    grads = {"layer.weight": torch.ones(shape), "layer.bias": torch.ones(8)}
    try:
        fsync.sync_grads(grads, group=mesh)
    except ValueError as error:
        print(f"rank {rank}: ValueError: {str(error).splitlines()[0]}", flush=True)
        code = 0
    else:
        print(f"rank {rank}: no error", flush=True)
        code = 1
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())

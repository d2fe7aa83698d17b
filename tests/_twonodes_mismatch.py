"""A rank of node 1 passes another tree: every rank of the 2 x 2 mesh must say so.

Launched by ``tests/test_twonodes.py`` on two nodes of two ranks (torchrun through
``twonodes``). Every rank calls ``fsync.sync_grads(grads, group=mesh)``; global rank 3
(local rank 1 of node 1) passes a gradient of another shape. The ranks' agreement runs
over the whole mesh before any bucket collective, so all four raise the same
``ValueError``; each writes ``ValueError: <its first line>`` to ``DIR/rank<R>`` (DIR, the
one argument, is on the file system both nodes share) and exits 0, or writes ``no error``
and exits 1. A file per rank, not a printed line: four processes on two nodes write to one
pipe, and their lines can interleave mid-line there.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsync

ODD_RANK = 3  # node 1, local rank 1


def main(out: pathlib.Path) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    shape = (8, 5) if rank == ODD_RANK else (8, 4)
    grads = {"layer.weight": torch.ones(shape), "layer.bias": torch.ones(8)}
    try:
        fsync.sync_grads(grads, group=mesh)
    except ValueError as error:
        said, code = f"ValueError: {str(error).splitlines()[0]}", 0
    else:
        said, code = "no error", 1
    (out / f"rank{rank}").write_text(said)
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    code = main(pathlib.Path(sys.argv[1]))
    # Nothing is left to do: skip the interpreter's teardown, in which a rank once died of
    # "terminate called without an active exception" (SIGABRT, a C++ thread of torch's
    # destroyed unjoined) after writing its file, failing its node's torchrun and so the
    # other node's exit barrier (CI, 2026-11-27).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""What a checkpoint costs a rank: ``fsync.checkpoint`` through DCP beside a gathered file.

``python -m benchmarks.checkpoint`` trains one ZeRO step (``fsync.ops.zero`` of AdamW,
bucket-sharded) of the deep MLP and of the GPT (``benchmarks.models``) on 2 and 4 gloo
ranks, then times, each in a world of fresh processes of its own (so that no operation
reuses memory another freed), ``--rounds`` times:

* ``gathered save``: ``zero_state_dict(state, step, to=0)`` and ``torch.save`` on rank 0;
* ``DCP save``: ``dcp.save(fsync.checkpoint.state_dict(...))``, every rank its own part;
* ``DCP async_save, blocking part``: what ``dcp.async_save`` holds the step for (staging);
* ``file load``: ``torch.load`` of the gathered file and ``ZeroStep.load``;
* ``DCP load``: ``fsync.checkpoint.load``.

Per operation: the median time over the rounds and its range, and each rank's peak rise
of resident memory (``/proc/self/statm``, sampled every 0.5 ms: torch's CPU tensors are
``malloc``'s, which ``tracemalloc`` does not see), the largest over the ranks. A load's
rise includes what it returns (the parameters and this rank's state). ``docs/checkpoints.md``
quotes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict_saver import async_save, save

import fsync
from benchmarks import models, table

OPS = ("gathered save", "DCP save", "DCP async_save, blocking part", "file load", "DCP load")
WORKLOADS: dict[str, Callable[[], models.Workload]] = {
    "deep MLP": models.deep_mlp,
    "GPT": models.gpt,
}
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _Peak:
    """The time a block takes and the peak rise of this process's resident memory in it."""

    def __enter__(self) -> _Peak:
        self.base = self.peak = _resident()
        self._watching = True
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        self._start = time.perf_counter()
        return self

    def _watch(self) -> None:
        while self._watching:
            self.peak = max(self.peak, _resident())
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._start
        self._watching = False
        self._thread.join()
        self.mib = (max(self.peak, _resident()) - self.base) / 2**20


def _rank(rank: int, world: int, port: int, job: tuple[str, str, str, int], out: Any) -> None:
    workload, op, root, rounds = job
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    work = WORKLOADS[workload]()
    params = {n: p.detach().clone() for n, p in work.model.named_parameters()}
    step = fsync.ops.zero(fsync.optim.adamw(1e-3))
    state = step.init(params)
    params, state = step(params, {k: torch.randn_like(v) for k, v in params.items()}, state)
    saving = dist.new_group(backend="gloo")  # async_save's collectives run in its thread
    path, file = os.path.join(root, "dcp"), os.path.join(root, "gathered.pt")
    found = []
    for _ in range(rounds):
        dist.barrier()
        with _Peak() as peak:
            pending = _run(op, params, state, step, path, file, saving)
            dist.barrier()
        if pending is not None:
            pending.result()
        found.append((peak.s, peak.mib))
    out.put((rank, found))
    dist.barrier()
    dist.destroy_process_group()


def _run(op: str, params: Any, state: Any, step: Any, path: str, file: str, saving: Any) -> Any:
    if op == "gathered save":
        full = fsync.ops.zero_state_dict(state, step, to=0)
        if dist.get_rank() == 0:
            torch.save({"params": params, "opt": full}, file)
    elif op == "DCP save":
        save(fsync.checkpoint.state_dict(params, state, step=step), checkpoint_id=path)
    elif op == "DCP async_save, blocking part":
        sd = fsync.checkpoint.state_dict(params, state, step=step)
        return async_save(sd, checkpoint_id=path + "-async", process_group=saving)
    elif op == "file load":
        loaded = torch.load(file, weights_only=True)
        step.load(loaded["params"], loaded["opt"])
    else:
        fsync.checkpoint.load(path, params, step=step)
    return None


def measure(workload: str, op: str, world: int, root: str, rounds: int) -> list[list[Any]]:
    """Every rank's ``(seconds, MiB)`` per round of ``op``, in a world of its own."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = 29500 + os.getpid() % 1000 + OPS.index(op)
    job = (workload, op, root, rounds)
    ranks = [
        context.Process(target=_rank, args=(r, world, port, job, results)) for r in range(world)
    ]
    for p in ranks:
        p.start()
    found = sorted(results.get(timeout=600) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    return [rounds_ for _, rounds_ in found]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    args = parser.parse_args(argv)
    rows = []
    for workload in args.workloads:
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as root:
                for op in OPS:  # in this order: each load reads what a save wrote
                    ranks = measure(workload, op, world, root, args.rounds)
                    times = [s for found in ranks for s, _ in found]
                    rise = max(mib for found in ranks for _, mib in found)
                    median = statistics.median(times)
                    spread = f"{median:.2f} s [{min(times):.2f}, {max(times):.2f}]"
                    rows.append([workload, world, op, spread, f"{rise:.0f}"])
                    print(*rows[-1], sep=" | ", flush=True)
    header = ["workload", "ranks", "operation", "time, median [range]", "peak rise, MiB"]
    print(table.markdown(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fsync beside DDP on the same work, in one run: ``python benchmarks/run.py``.

Starts a gloo world of ``--world-size`` CPU processes (2 by default), runs every case
in :mod:`benchmarks.cases`, prints the tables, and writes ``docs/benchmarks.md`` and
``docs/benchmarks.png``. ``--smoke`` runs tiny sizes and few steps (what CI runs);
``--only`` picks cases. Each figure is a median over steps after warm-up, and every
comparison is a ratio of figures taken in this run. Two cases have pages and processes of
their own: ``link`` (:mod:`benchmarks.link`, a loopback shaped to a rate) and ``twonodes``
(:mod:`benchmarks.twonodes`, two network namespaces joined by a shaped cable, 2 nodes x 2
ranks); both need root, and ``twonodes`` is skipped, saying so, where it cannot run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fsync  # noqa: E402
from benchmarks import cases, link, models, twonodes  # noqa: E402

CASES = ("step", "sync", "leaves", "hooks", "zero", "anatomy", "link", "twonodes")
# What runs on a GPU: the other cases compare with DDP on CPU processes.
CUDA_CASES = ("anatomy",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few steps (CI)")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks on this machine; cuda: NCCL, one rank per GPU, case 6 only",
    )
    parser.add_argument("--world-size", type=int, default=None, help="2 on CPU, 1 on CUDA")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per figure")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per figure")
    parser.add_argument(
        "--leaves",
        default="1,100,1000,10000",
        help="leaf counts to scale over (10,000 leaves compile in 2 to 3 minutes on 2 cores)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs", help="report folder")
    parser.add_argument("--no-report", action="store_true", help="print only")
    args = parser.parse_args(argv)
    args.only = [c for c in args.only.split(",") if c]
    unknown = set(args.only) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    if args.device == "cuda":
        args.only = [c for c in args.only if c in CUDA_CASES]
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA device; none is visible")
    args.world_size = args.world_size or (2 if args.device == "cpu" else 1)
    args.steps = args.steps or (3 if args.smoke else 20)
    args.warmup = args.warmup or (2 if args.smoke else 5)
    return args


def _workloads(smoke: bool) -> list[models.Workload]:
    """The MLP first (ZeRO's workload), the GPT last (the sync, hooks and anatomy cases')."""
    if smoke:  # the slow-link page's smoke workloads, whose compiled graphs they share
        return [link.workload(name, batch, smoke=True) for name, batch in link.SMOKE_RUNS]
    return [models.mlp(), models.deep_mlp(), models.gpt()]


def _worker(rank: int, args: argparse.Namespace, init_file: str, result_file: str) -> None:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        _backend(args),
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=args.world_size,
    )
    results: dict[str, Any] = {}
    workloads = _workloads(args.smoke)
    timing = {"warmup": args.warmup, "steps": args.steps}
    if "step" in args.only:
        step = {w.name: cases.case_step_time(w, **timing) for w in workloads}
        results["step"] = {name: times for name, (times, _) in step.items()}
        results["overlap"] = {name: counts for name, (_, counts) in step.items()}
        results["params"] = {w.name: w.num_params for w in workloads}
    if "sync" in args.only:
        results["sync"] = cases.case_sync_only(workloads[-1], **timing)
    if "leaves" in args.only:
        counts = [int(n) for n in args.leaves.split(",")]
        # Floats: 256 KiB or 24 MiB. Under glibc's largest mmap threshold (32 MiB), so
        # that one leaf's bucket reuses heap memory as the split ones do rather than
        # being mapped and faulted in afresh on every call.
        total = 1 << 16 if args.smoke else 6 << 20
        results["leaves"] = cases.case_leaf_scaling(total, counts, **timing)
        results["leaves_bytes"] = total * 4
    if "hooks" in args.only:
        results["hooks"] = cases.case_hooks(workloads[-1], **timing)
    if "zero" in args.only:
        results["zero"] = cases.case_zero(workloads[0], **timing)
    if "anatomy" in args.only:
        results["anatomy"] = cases.case_anatomy(workloads[-1], **timing, device=device)
    results["gpu"] = _gpu_note(args)
    if rank == 0:
        pathlib.Path(result_file).write_text(json.dumps(results))
    cases.leave_group()


def _backend(args: argparse.Namespace) -> str:
    return "nccl" if args.device == "cuda" else "gloo"


def _gpu_note(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        measured = "Section 6 was measured on the GPU."
    elif torch.cuda.is_available():
        measured = "Section 6 ran on CPU; `--device cuda` measures it on the GPU."
    else:
        measured = "No CUDA device in this run: section 6 ran on CPU."
    return (
        f"{measured} Overlap of collectives with backward compute on GPUs needs two or more "
        "GPUs: with one GPU, NCCL has one rank and fsync issues no collective at all."
    )


def _environment(args: argparse.Namespace) -> dict[str, str]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{socket.gethostname()}: {cpu}, {os.cpu_count()} cores, {platform.system()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fsync": fsync.__version__,
        "backend": f"{_backend(args)} on {args.device.upper()}, "
        f"{args.world_size} rank{'s' if args.world_size > 1 else ''}, 1 intra-op thread each",
        "sizes": "smoke (tiny)" if args.smoke else "full",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fsync-bench-") as tmp:
        os.environ.update(cases.inductor_cache(tmp, args.smoke))
        result_file = os.path.join(tmp, "results.json")
        mp.spawn(
            _worker,
            args=(args, os.path.join(tmp, "init"), result_file),
            nprocs=args.world_size,
            join=True,
        )
        results: dict[str, Any] = json.loads(pathlib.Path(result_file).read_text())
    results["environment"] = _environment(args)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks import report

    # Their own pages, each rate in its own processes.
    shaped, nodes = "link" in args.only, "twonodes" in args.only
    args.only = [c for c in args.only if c not in ("link", "twonodes")]
    if args.only:
        results = run(args)
        report.print_tables(results)
        if not args.no_report:
            paths = report.write(results, args.out)
            print("wrote " + ", ".join(str(p) for p in paths))
    if shaped and args.device == "cpu":
        link_args = ["--out", str(args.out), *(["--smoke"] if args.smoke else [])]
        link_args += [f"--steps={args.steps}", f"--warmup={args.warmup}"] if args.smoke else []
        link.main(link_args)
    if nodes and args.device == "cpu":
        nodes_args = ["--out", str(args.out), *(["--smoke"] if args.smoke else [])]
        nodes_args += [f"--steps={args.steps}", f"--warmup={args.warmup}"] if args.smoke else []
        twonodes.main(nodes_args)  # says so and skips where twonodes cannot make two nodes
    return 0


if __name__ == "__main__":
    sys.exit(main())

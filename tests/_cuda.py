"""What the CUDA tests share: the skip without a GPU, a rank's device, comparisons, reports.

The CUDA tests (``tests/test_cuda.py``, ``tests/test_cuda_streams.py``) skip where torch
sees no GPU, as in CI. On a GPU, two ranks share the one device over gloo: NCCL refuses
two ranks on one device, gloo carries CUDA tensors through host memory (DDP supports
it), so every cross-rank result can be checked against DDP in the same processes.
``benchmarks/gpu.py`` runs these tests and makes ``docs/benchmarks-gpu.md`` from the
figures each one leaves with :func:`report`.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")

# Where the tests leave their figures, as JSON files named after the report: a folder that
# benchmarks/gpu.py names; unset, nothing is written.
REPORTS = "FSYNC_GPU_REPORTS"


def device() -> torch.device:
    """This rank's GPU (the first: the ranks of a test share it), cuDNN deterministic.

    The references are DDP's gradients, computed by the same kernels as fsync's: they
    agree bit for bit only where a kernel gives the same bits twice, which cuDNN's
    convolution backward does not promise unless asked.
    """
    torch.cuda.set_device(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return torch.device("cuda", 0)


def ddp(model: torch.nn.Module, device: torch.device, **kwargs: Any) -> DDP:
    """DDP around a copy of ``model`` on ``device`` (its one device named, as DDP asks of a
    single-device GPU module; none for a CPU one)."""
    ids = [device.index] if device.type == "cuda" else None
    return DDP(copy.deepcopy(model), device_ids=ids, **kwargs)


def on(tree: dict[str, torch.Tensor], where: torch.device | str) -> dict[str, torch.Tensor]:
    """A dict of tensors moved to ``where`` (layouts kept)."""
    return {k: v.to(where) for k, v in tree.items()}


def compare(
    check: str,
    reference: str,
    got: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    *,
    tolerance: float | None = None,
    strides: bool = False,
) -> dict[str, Any]:
    """One row of a parity report: ``got`` against ``expected``, leaf by leaf.

    ``tolerance`` ``None`` asks for the same bits; otherwise for a relative difference
    (the norm of the difference over the norm of the reference) at most that, per leaf.
    ``strides`` asks for the same memory layouts too. The row says what was asked, what
    was found, and whether it passes.
    """
    assert got.keys() == expected.keys(), (check, sorted(got), sorted(expected))
    bitwise, worst, relative, layouts = True, 0.0, 0.0, True
    for name, ref in expected.items():
        mine = got[name].to(ref.device)
        assert mine.shape == ref.shape and mine.dtype == ref.dtype, (check, name)
        layouts = layouts and got[name].stride() == ref.stride()
        bitwise = bitwise and torch.equal(mine, ref)
        diff = (mine.double() - ref.double()).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        norm = float(torch.linalg.vector_norm(ref.double()))
        relative = max(relative, float(torch.linalg.vector_norm(diff)) / max(norm, 1e-300))
    ok = (bitwise if tolerance is None else relative <= tolerance) and (layouts or not strides)
    expected_words = "bit for bit" if tolerance is None else f"relative <= {tolerance:g}"
    return {
        "check": check,
        "reference": reference,
        "expected": expected_words + (", same strides" if strides else ""),
        "bitwise": bitwise,
        "max_diff": worst,
        "relative": relative,
        "strides": layouts,
        "ok": ok,
    }


def merge(rows: list[dict[str, Any]], check: str | None = None) -> dict[str, Any]:
    """One row for several comparisons of the same check (steps, ranks): all must pass."""
    first = rows[0]
    return {
        **first,
        "check": first["check"] if check is None else check,
        "bitwise": all(row["bitwise"] for row in rows),
        "max_diff": max(row["max_diff"] for row in rows),
        "relative": max(row["relative"] for row in rows),
        "strides": all(row["strides"] for row in rows),
        "ok": all(row["ok"] for row in rows),
    }


def across_ranks(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every rank's rows (the same checks in the same order) as one row per check."""
    return [merge(list(rows)) for rows in zip(*per_rank, strict=True)]


def failed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that do not pass."""
    return [row for row in rows if not row["ok"]]


def report(name: str, data: Any) -> None:
    """Leaves ``data`` (JSON) as the report ``name`` where ``$FSYNC_GPU_REPORTS`` says."""
    folder = os.environ.get(REPORTS)
    if not folder:
        return
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.json").write_text(json.dumps(data, indent=1))

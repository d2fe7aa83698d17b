"""The benchmark suite runs end to end at tiny sizes; its targets read the right figures.

The real numbers come from ``python benchmarks/run.py`` on a quiet machine (see
``docs/benchmarks.md``); here only that every case runs on two ranks and that the
report is complete.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402


@pytest.mark.timeout(600)
def test_smoke_run_writes_every_section(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--smoke", "--leaves", "1,10", "--out", tmp_path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    md = (tmp_path / "benchmarks.md").read_text()
    for section in ("Targets", "1. Step time, MLP", "1. Step time, GPT", "1b. Overlap", "2. Sync"):
        assert f"## {section}" in md
    for section in ("3. Leaf scaling", "4. Hooks", "5. ZeRO", "6. The compiled sync", "7. GPU"):
        assert f"## {section}" in md
    for row in (
        "fsync compiled + overlap",
        "local functional eager (no sync)",
        "scaled copy + flat all-reduce (pure mean)",
        "ZeroRedundancyOptimizer + DDP",
        "pack + unpack, compiled",
    ):
        assert f"| {row} |" in md
    assert "pack + unpack kernels per bucket <= 2 (cpu)" in md
    for png in ("step", "leaves", "hooks", "link-step", "link-hidden"):
        assert (tmp_path / f"benchmarks-{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The slow-link page (smoke: the unshaped loopback only, so no root is needed).
    link = (tmp_path / "benchmarks-link.md").read_text()
    for section in (
        "Targets",
        "Step time against link rate",
        "the sync alone",
        "ZeRO",
        "GPT on 4 ranks",
    ):
        assert section in link, section
    assert "| fsync compiled: share of the all-reduce hidden |" in link


def test_targets_are_ratios_of_the_right_figures():
    step = {
        "DDP eager": 100.0,
        "DDP compiled": 80.0,
        "fsync compiled": 90.0,
        "fsync compiled + overlap": 84.0,
    }
    results = {
        "step": {"MLP": step},
        "sync": {
            "flat all-reduce (floor)": 10.0,
            "sync_grads eager": 12.0,
            "sync_grads compiled": 10.5,
        },
        "leaves": {"compiled": {"1": 2.0, "100": 2.2, "10000": 2.8}},
        "anatomy": {
            "device": "cuda:0",
            "buckets": 4,
            "kernels": 6,
            "recompiles": 0,
            "ms": {"copy of the same bytes (floor)": 4.0, "pack + unpack, compiled": 4.8},
        },
        "gpu": "No CUDA device in this run.",
    }
    got = {name: (measured, met) for name, measured, met in report.targets(results)}
    assert got["MLP: fsync compiled <= 0.85 x DDP eager"] == ("0.84x", True)
    assert got["MLP: fsync compiled <= DDP compiled"] == ("1.05x", False)
    assert got["sync only (compiled) <= 1.10 x flat all-reduce"] == ("1.05x", True)
    assert got["sync only (eager) <= 1.10 x flat all-reduce"] == ("1.20x", False)
    assert got["compiled sync of 10,000 leaves <= 1.3 x 1 leaf"] == ("1.40x", False)
    assert got["pack + unpack kernels per bucket <= 2 (cuda:0)"] == ("1.5", True)
    assert got["pack + unpack >= 80% of copy bandwidth (cuda:0)"] == ("83%", True)
    assert got["no recompile after the first step (cuda:0)"] == ("0", True)
    assert got["compute/communication overlap on GPUs, above DDP's"] == ("not measured", None)

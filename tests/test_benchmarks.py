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

from benchmarks import link, link_report, report, twonodes, twonodes_report  # noqa: E402
from tests._launch import torchrun  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _smoke(out: pathlib.Path, *args: str) -> None:
    """``benchmarks/run.py --smoke`` into ``out``; each page in its own test and time limit."""
    done = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--smoke", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.timeout(600)
def test_smoke_run_writes_every_section(tmp_path):
    _smoke(tmp_path, "--leaves", "1,10", "--only", "step,sync,leaves,hooks,zero,anatomy")
    md = (tmp_path / "benchmarks.md").read_text()
    for section in ("Targets", "1. Step time, MLP", "1. Step time, deep MLP", "1. Step time, GPT"):
        assert f"## {section}" in md
    for section in ("1b. Overlap", "2. Sync"):
        assert f"## {section}" in md
    for section in ("3. Leaf scaling", "4. Hooks", "5. ZeRO", "6. The compiled sync", "7. GPU"):
        assert f"## {section}" in md
    for row in (
        "fsync compiled + overlap",
        "fsync eager, grad_and_value",
        "local functional eager (no sync)",
        "scaled copy + flat all-reduce (pure mean)",
        "ZeroRedundancyOptimizer + DDP",
        "pack + unpack, compiled",
    ):
        assert f"| {row} |" in md
    assert "pack + unpack kernels per bucket <= 2 (cpu)" in md
    for png in ("step", "leaves", "hooks"):
        assert (tmp_path / f"benchmarks-{png}.png").read_bytes()[:8] == PNG


@pytest.mark.timeout(120)
def test_timeline_tells_when_each_setting_issued_its_buckets():
    args = ("--smoke", "--steps", "2", "--workload", "GPT")
    out = torchrun("benchmarks/timeline.py", *args, timeout=100)  # killed before the test is
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    times = {(r[0].strip(), r[1].strip()): [float(x) for x in r[2:]] for r in rows[1:]}
    assert set(times) == {(s, r) for s in ("DDP eager", "fsync.grad_and_value") for r in "01"}
    # Each call's events in the order they happen: forward, first and last bucket, return.
    assert all(row == sorted(row) and row[0] > 0 for row in times.values()), times


@pytest.mark.timeout(600)
def test_smoke_run_writes_the_slow_link_page(tmp_path):
    # Smoke: the unshaped loopback only, so no root is needed.
    _smoke(tmp_path, "--only", "link")
    md = (tmp_path / "benchmarks-link.md").read_text()
    for section in (
        "Targets",
        "Step time against link rate",
        "the sync alone",
        "ZeRO",
        "Every workload: step time relative to DDP eager",
        "deep MLP: step time at batch 64 and 256",
        "GPT: step time at batch 64 and 256",
        "Memory: peak RSS of the eager step",
    ):
        assert section in md, section
    for setting in link.SETTINGS:
        assert f"| {setting}: share of the all-reduce hidden |" in md
    for row in ("deep MLP, batch 256, unshaped", "GPT, batch 256, unshaped"):
        assert f"| {row} |" in md
    for row in ("deep MLP: DDP eager", "deep MLP: fsync eager, grad_and_value"):
        assert f"| {row} |" in md
    assert "| GPT, batch 64: grad_and_value eager <= 1.05x DDP eager, unshaped | not run |" in md
    memory = "deep MLP, batch 256: grad_and_value eager's peak RSS <= DDP eager's + one bucket"
    assert memory in md
    for png in ("step", "hidden", "workloads", "workloads-hidden", "memory"):
        assert (tmp_path / f"benchmarks-link-{png}.png").read_bytes()[:8] == PNG


@pytest.mark.timeout(600)
def test_smoke_run_writes_the_two_node_page(tmp_path):
    # Smoke: one 4-rank world on this machine's loopback, without twonodes or root.
    _smoke(tmp_path, "--only", "twonodes")
    md = (tmp_path / "benchmarks-twonodes.md").read_text()
    for section in (
        "## Targets",
        f"## The sync alone: {twonodes.TREE}",
        f"## The sync alone: {twonodes.GPT}",
        "## The GPT's training step on 2 nodes x 2 ranks",
    ):
        assert section in md, section
    for setting in (*twonodes.SYNC_SETTINGS, *twonodes.STEP_SETTINGS):
        assert f"| {setting} |" in md, setting
    # The rates of the real run were not run: their targets say so.
    target = f"GPT step: {twonodes.STEP_HIER_COMPILED} <= 0.80x DDP eager, 1 Gbit/s"
    assert f"| {target} | not run | - |" in md
    # What crosses nodes does not depend on the rate: the floors of the ring model.
    cells = [line.split(" | ") for line in md.splitlines() if line.startswith("| ")]
    rows = {row[0][2:]: row[2] for row in cells if len(row) > 3}  # the settings' tables
    assert rows[twonodes.HIER] == rows[twonodes.HIER_COMPILED] == "0.67x"
    assert rows[twonodes.HIER_BF16] == "0.33x"
    for png in ("sync", "step", "bytes"):
        assert (tmp_path / f"benchmarks-twonodes-{png}.png").read_bytes()[:8] == PNG


def _link_row(**settings: float) -> dict[str, float]:
    """A slow-link row: 100 ms of compute for every floor, a 50 ms all-reduce, ``settings``."""
    row = dict.fromkeys(link.FLOORS, 100.0)
    return {**row, link.FLAT: 50.0, link.CEILING: 120.0, **settings}


def test_link_targets_read_the_right_rows():
    gpt = _link_row(**{"DDP eager": 130.0, link.GAV: 126.0, "fsync compiled": 120.0})
    deep = _link_row(**{"DDP eager": 120.0, link.GAV: 125.0, "fsync compiled": 117.0})
    peaks = {"DDP eager": 600.0, link.GAV: 603.0}
    results = {
        "8gbit": {"GPT, batch 256": gpt, "deep MLP, batch 64": deep},
        "unshaped": {
            "GPT, batch 256": gpt,
            "memory": {"GPT": {s: {"built": 500.0, "peak": v} for s, v in peaks.items()}},
        },
    }
    got = {name: (measured, met) for name, measured, met in link_report.targets(results)}
    # DDP hides (100 + 50 - 130) / 50 = 40%, grad_and_value (100 + 50 - 126) / 50 = 48%.
    assert got["GPT, batch 256: grad_and_value eager <= 1.00x DDP eager, 8 Gbit/s"] == (
        "0.97x",
        True,
    )
    assert got["GPT, batch 256: grad_and_value eager hides >= DDP eager's share, 8 Gbit/s"] == (
        "48% vs 40%",
        True,
    )
    assert got["GPT, batch 256: fsync compiled <= 0.90x DDP eager, 8 Gbit/s"] == ("0.92x", False)
    assert got["deep MLP, batch 64: grad_and_value eager hides >= DDP eager's share, 8 Gbit/s"] == (
        "50% vs 60%",
        False,
    )
    assert got["deep MLP, batch 64: fsync compiled <= 1.00x DDP eager, 8 Gbit/s"] == ("0.97x", True)
    assert got["GPT, batch 256: grad_and_value eager <= 1.05x DDP eager, unshaped"] == (
        "0.97x",
        True,
    )
    assert got["GPT, batch 64: grad_and_value eager <= 1.00x DDP eager, 8 Gbit/s"] == (
        "not run",
        None,
    )
    memory = "GPT, batch 256: grad_and_value eager's peak RSS <= DDP eager's + one bucket (4 MiB)"
    assert got[memory] == ("+3.0 MiB (+0.75 buckets)", True)


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


def _timed(**settings: float) -> dict[str, dict[str, float]]:
    return {name: {"ms": ms, "cross": 1.0, "cable": 1.0} for name, ms in settings.items()}


def test_two_node_targets_read_the_right_rows():
    sync = _timed(
        **{
            twonodes.FLAT: 100.0,
            twonodes.SYNC_FLAT: 104.0,
            twonodes.HIER: 74.0,
            twonodes.HIER_COMPILED: 80.0,
            twonodes.HIER_BF16: 40.0,
        }
    )
    step = _timed(
        **{
            twonodes.DDP_EAGER: 1000.0,
            twonodes.STEP_FLAT: 900.0,
            twonodes.STEP_HIER: 950.0,
            twonodes.STEP_HIER_COMPILED: 790.0,
            twonodes.DILOCO: 300.0,
        }
    )
    results = {
        "10gbit": {"sync": {twonodes.TREE: sync, twonodes.GPT: sync}, "step": step},
        "1gbit": {"sync": {twonodes.TREE: sync, twonodes.GPT: sync}, "step": step},
    }
    got = {name: (measured, met) for name, measured, met in twonodes_report.targets(results)}
    assert len(got) == len(twonodes_report.TARGETS) == 11
    tree = f"sync alone, {twonodes.TREE}"
    assert got[f"{tree}: {twonodes.HIER} <= 0.75x the flat all-reduce, 1 Gbit/s"] == ("0.74x", True)
    assert got[
        f"sync alone, the GPT: {twonodes.HIER_COMPILED} <= 0.75x the flat all-reduce, 1 Gbit/s"
    ] == ("0.80x", False)
    assert got[f"{tree}: {twonodes.HIER_BF16} <= 0.45x the flat all-reduce, 1 Gbit/s"] == (
        "0.40x",
        True,
    )
    assert got[f"GPT step: {twonodes.STEP_HIER_COMPILED} <= 0.80x DDP eager, 1 Gbit/s"] == (
        "0.79x",
        True,
    )
    assert got["GPT step: fsync.diloco (H = 8) <= 0.25x DDP eager, 1 Gbit/s"] == ("0.30x", False)
    # At 10 Gbit/s the hierarchical path against fsync's own flat one, not the floor.
    assert got[f"{tree}: hierarchical eager <= 1.05x sync_grads flat, 10 Gbit/s"] == ("0.71x", True)
    flat_step = "GPT step: grad_and_value hierarchical eager <= 1.05x flat eager, 10 Gbit/s"
    assert got[flat_step] == ("1.06x", False)
    del results["10gbit"]
    got = dict((n, m) for n, m, _ in twonodes_report.targets(results))
    assert got[flat_step] == "not run"


def test_the_ring_model_puts_the_floors_of_the_docs_on_the_cable():
    s = 6.0  # a gradient of S bytes; the hierarchical hop hands each rank S / 2, bf16 S / 4
    assert twonodes.cable_bytes(s, flat=True) == 1.5 * s
    assert twonodes.cable_bytes(s / 2, flat=False) == s  # 0.67x the flat ring
    assert twonodes.cable_bytes(s / 4, flat=False) == s / 2  # 0.33x

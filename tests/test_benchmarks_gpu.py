"""``benchmarks/gpu.py``, the GPU check, where there is no GPU: its plumbing and its page.

The check itself runs on a lent GPU (see its docstring). Here: without CUDA every part
says it was skipped and the page is still written; a part that runs over its limit is
killed with its children; and the page renders every section from figures shaped as the
parts and the CUDA tests make them, passing and failing, so that a first run on a GPU
does not stop at a typo in the page.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import gpu  # noqa: E402
from benchmarks.gpu_page import Outcome, render  # noqa: E402
from benchmarks.page import run_child  # noqa: E402
from tests._cuda import compare  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this is the whole check")
@pytest.mark.timeout(120)
def test_without_cuda_every_part_says_so_and_the_page_is_written(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    page = (tmp_path / gpu.PAGE).read_text()
    assert "**Not yet run on a GPU.**" in page
    assert page.count("skipped: no CUDA device") == 5  # sections 1 to 5
    assert "| environment | ok |" in page  # the one part that runs anywhere, in a child
    assert page.count("| not measured |") == 8  # every target


@pytest.mark.timeout(60)
def test_a_part_over_its_limit_is_killed_with_its_children():
    grandchild = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    done = run_child([sys.executable, "-c", grandchild], limit_s=3.0)
    assert done.status == "timed out" and done.seconds < 30, done
    stat = pathlib.Path(f"/proc/{int(done.output.split()[0])}/stat")

    def alive() -> bool:  # a zombie is dead: its parent died first, init reaps it
        try:
            return not stat.read_text().split(") ")[1].startswith("Z")
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10  # SIGKILL is delivered, not waited for
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(), stat


def test_a_part_killed_at_its_limit_keeps_what_it_saved(tmp_path):
    saved = tmp_path / "kernels.json"
    script = (
        f"import pathlib, sys, time; sys.path.insert(0, {str(ROOT)!r}); "
        "from benchmarks import page; "
        f"page.save_json(pathlib.Path({str(saved)!r}), {{'rows': [1]}}); time.sleep(60)"
    )
    done = run_child([sys.executable, "-c", script], limit_s=5.0)
    assert done.status == "timed out" and json.loads(saved.read_text()) == {"rows": [1]}


def test_a_failing_part_keeps_its_output():
    done = run_child([sys.executable, "-c", "raise SystemExit('no luck')"], limit_s=30)
    assert done.status == "failed" and done.code == 1 and "no luck" in done.output


def test_test_outcomes_from_junit_and_from_verbose_lines(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda" name="test_a[2]" time="1.5"/>'
        '<testcase classname="tests.test_cuda" name="test_b" time="2.0">'
        '<failure message="AssertionError: 3 | 4&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.test_cuda_streams" name="test_c" time="0.1">'
        '<skipped message="no CUDA device"/></testcase>'
        "</testsuite></testsuites>"
    )
    found = gpu.read_outcomes(junit, "")
    assert [(t["test"], t["outcome"]) for t in found] == [
        ("tests/test_cuda.py::test_a[2]", "passed"),
        ("tests/test_cuda.py::test_b", "failed"),
        ("tests/test_cuda_streams.py::test_c", "skipped"),
    ]
    assert found[1]["message"] == "AssertionError: 3 | 4" and found[0]["seconds"] == 1.5
    # Killed before the XML: the -v lines that got out.
    lines = "tests/test_cuda.py::test_a[2] PASSED [ 50%]\ntests/test_cuda.py::test_b FAILED\n"
    found = gpu.read_outcomes(tmp_path / "missing.xml", lines)
    assert [t["outcome"] for t in found] == ["passed", "failed"]


def test_gpu_events_are_counted_as_kernels_copies_or_nothing():
    events = [
        ("triton_poi_fused_cat_mul_0", "kernel", 10.0),
        ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 4.0),
        ("## Call CompiledFxGraph ##", "gpu_user_annotation", 99.0),
        ("void at::native::vectorized_elementwise_kernel<4>", None, 6.0),
        ("Memset (Device)", None, 2.0),
    ]
    assert gpu.gpu_work(events, calls=2) == {"kernels": 1.0, "copies": 1.0, "us": 11.0}


# --- the page, from figures shaped as the parts make them ---------------------------------------


def _parity_reports() -> dict:
    a = {"w": torch.ones(3)}
    good = compare("fsync.grad_and_value", "DDP", a, {"w": torch.ones(3)}, strides=True)
    bad = compare("fsync.GradSync", "DDP", a, {"w": torch.full((3,), 1.5)})
    near = compare("GradSync(hook=powersgd(1))", "CPU", a, {"w": torch.ones(3)}, tolerance=1e-4)
    run = {"setting": "one stream", "layers": 8, "buckets": 8, "sleep_cycles": [5],
           "steps": 6, "busy": 6, "max_diff": 0.0, "premise": True}  # fmt: skip
    return {
        "entry_points": [good, bad],
        "hooks": [near],
        "streams_one_stream_as_shipped": {**run, "patch": "as shipped", "equal": 6},
        "streams_one_stream_no_wait": {**run, "patch": "no wait", "equal": 0, "max_diff": 3.0},
    }


def _kernel_row(tree: str, smallest_mib: float, unpack_kernels: float) -> dict:
    return {
        "tree": tree,
        "dtype": "float32",
        "leaves": 6,
        "buckets": 2,
        "bucket_mib": [smallest_mib, 24.0],
        "bytes": 30 * 2**20,
        "compile_s": 3.2,
        "same_as_eager": True,
        "pack": {"kernels": 2.0, "copies": 0.0, "us": 25.0},
        "unpack": {"kernels": unpack_kernels, "copies": 0.0, "us": 22.0 if unpack_kernels else 0},
        "copy": {"kernels": 0.0, "copies": 2.0, "us": 21.0},
    }


_SLOW_PACK = {"kernels": 60.0, "copies": 0.0, "us": 250.0}
_LONG = "Traceback\nRuntimeError: Unexpected optimization option x, known options are " + "y" * 999


def _outcomes(tests_status: str = "ok", gpt_ran: bool = True) -> dict:
    tests = [
        {"test": "tests/test_cuda.py::test_a", "outcome": "passed", "seconds": 1.0, "message": ""},
        {
            "test": "tests/test_cuda.py::test_b",
            "outcome": "failed",
            "seconds": 2.0,
            "message": "AssertionError: a | b",
        },
    ]
    kernels = {
        "rows": [
            _kernel_row("MLP", 8.0, 0.0),
            _kernel_row("GPT", 1.0, 2.0),
            # A trial beside the shipped settings: shown, but no target reads it.
            {**_kernel_row("MLP", 8.0, 0.0), "variant": "combo kernels", "pack": _SLOW_PACK},
            {"tree": "deep MLP", "dtype": "bfloat16", "error": "Traceback\nRuntimeError: boom"},
            {"tree": "GPT", "dtype": "bfloat16", "variant": "combo kernels", "error": _LONG},
        ],
        "mean_of": 2,
        "calls": 20,
    }
    gpt_figures = {
        # Two rounds: fsync over DDP compiled 0.95 and 0.90.
        "rounds": {
            "DDP eager": [12.0, 12.0],
            "DDP compiled": [10.0, 10.0],
            "fsync.grad_and_value, eager": [12.0, 13.2],  # over DDP eager 1.00 and 1.10
            "fsync.compile, whole step": [9.5, 9.0],
        },
        "graphs_after_step": [1] * 10,
        "graph_breaks": 0,
        "recompiles_after_step_2": 0,
        "compile_s": 40.0,
        "params": 21_000_000,
        "tokens": 4096,
    }
    return {
        "environment": Outcome("ok", 2, 30, {"device": "NVIDIA H100", "torch": "2.11.0"}),
        "tests": Outcome(tests_status, 150, 200, tests, "pytest's last lines"),
        "kernels": Outcome("ok", 60, 100, kernels),
        "gpt": Outcome("ok", 90, 120, gpt_figures)
        if gpt_ran
        else Outcome("timed out", 120, 120, None, "compiling..."),
    }


def test_the_page_renders_every_section_and_target():
    page = render(_outcomes(), _parity_reports(), cuda=True, seconds=400)
    assert "Measured " in page and "NVIDIA H100" in page and "6.7 minutes" in page
    targets = page.split("## Targets")[1].split("## 1.")[0]
    assert "| Every CUDA test passes | 1 passed, 1 failed, 0 skipped | **not met** |" in targets
    assert "| 1 of 2 checks | **not met** |" in targets  # the bit-for-bit rows only
    assert "one stream, as shipped: 6/6; one stream, no wait: 0/6 | met |" in targets
    assert "| at most 1.00 | met |" in targets  # kernels per bucket, the failed tree aside
    assert "| lowest 84%, 1 trees | met |" in targets  # 21 / 25: only the MLP has big buckets
    assert "| 0 graph breaks, 0 recompiles | met |" in targets
    assert "| 0.93x [0.90, 0.95] | met |" in targets
    # Judged on the median of the rounds' ratios, (1.00 + 1.10) / 2 = 1.05: at the line.
    assert "| Eager GPT step at world 1 (`fsync.grad_and_value`) <= 1.05x DDP eager | 1.05x " in (
        targets
    )
    assert "| fsync.compile, whole step | 9.25 | 0.93x [0.90, 0.95] |" in page
    assert "AssertionError: a \\| b" in page  # a cell's | escaped
    assert "| fsync.GradSync | DDP | bit for bit | no | 0.5 | **fails** |" in page
    row = "| MLP | float32 | as shipped | 2 (8.0 to 24.0 MiB) | 1.00 | 0.00 | 2517 (84%) | views |"
    assert row in page
    assert "| MLP | float32 | combo kernels | 2 (8.0 to 24.0 MiB) | 30.00 | 0.00 |" in page
    assert "| deep MLP | bfloat16 | as shipped | **failed** | RuntimeError: boom |" in page
    failed = page.split("| GPT | bfloat16 | combo kernels | **failed** | ")[1].split(" |")[0]
    assert failed.startswith("RuntimeError: Unexpected") and failed.endswith("y...")
    assert len(failed) == 200


def test_the_page_says_what_a_part_that_died_left():
    outcomes = _outcomes(tests_status="timed out", gpt_ran=False)
    page = render(outcomes, {}, cuda=True, seconds=400)
    assert page.count("pytest timed out after 150 s (limit 200 s).") == 3  # sections 1 to 3
    assert "This part timed out after 120 s (limit 120 s)." in page and "compiling..." in page
    targets = page.split("## Targets")[1].split("## 1.")[0]
    assert targets.count("| not measured |") == 5  # sections 2, 3 and 5
    page = render({"environment": outcomes["environment"]}, {}, cuda=False, seconds=1)
    assert "**Not yet run on a GPU.**" in page and "Not run: not asked for" in page


def test_the_tests_leave_their_reports_where_the_check_reads_them(tmp_path, monkeypatch):
    from tests import _cuda

    env = gpu.environment_for_children(tmp_path / "reports")
    assert env[_cuda.REPORTS] == str(tmp_path / "reports")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    monkeypatch.setenv(_cuda.REPORTS, env[_cuda.REPORTS])
    _cuda.report("hooks", [{"check": "x"}])
    assert gpu.read_reports(tmp_path / "reports") == {"hooks": [{"check": "x"}]}
    assert gpu.read_reports(tmp_path / "nothing") == {}

"""Launching a script as a user does: ``torchrun --standalone``, two ranks unless told.

``python -m torch.distributed.run --standalone`` takes a free port per run; this
repository goes first on ``PYTHONPATH``; a run that outlives its timeout is killed with
its ranks.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).parents[1]
RUN_TIMEOUT = 150  # seconds for one torchrun; each test's own timeout is above its runs' total
# The smoke run of the four benchmark pages (conftest's ``smoke_pages``) took 175-201 s on
# 2 cores with a warm inductor cache, 227 s cold (2026-11-28); the limit leaves room for a
# cold cache on a machine loaded twice over. A page test's own limit is this plus its
# checks (the run is set up in the first test that reads a page).
PAGES_TIMEOUT_S = 600


def environment() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH`` and one
    OpenMP thread per rank unless set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun(script: str, *args: str, timeout: float = RUN_TIMEOUT, nproc: int = 2) -> str:
    """Runs ``script`` (a path from the repository's root) on ``nproc`` ranks; returns rank
    0's stdout, or fails with the log."""
    # Its logs' folder with the run: by default torchrun leaves a /tmp/torchelastic_* behind.
    with tempfile.TemporaryDirectory(prefix="fsync-torchrun-") as logs:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--log-dir",
            logs,
            "--nproc-per-node",
            str(nproc),
            str(ROOT / script),
            *args,
        ]
        return bounded(command, timeout, f"{script} {' '.join(args)}")


def bounded(command: list[str], timeout: float, what: str) -> str:
    """Runs ``command`` from the repository's root in a session of its own; returns its
    stdout, or fails with its output. A run past ``timeout`` is killed with every process
    it started (ranks, settings' worlds, replicas), not only the first."""
    with subprocess.Popen(
        command,
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{what} ran over {timeout} s:\n{out}\n{err[-4000:]}")
    assert proc.returncode == 0, f"{what} failed:\n{out}\n{err[-4000:]}"
    return out

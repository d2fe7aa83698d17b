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
import time

import pytest

ROOT = pathlib.Path(__file__).parents[1]
RUN_TIMEOUT = 150  # seconds for one torchrun; each test's own timeout is above its runs' total
# The smoke run of the four benchmark pages (conftest's ``_pages_run``) took 175-201 s on
# 2 cores with a warm inductor cache, 227 s cold (2026-11-28); the limit leaves room for a
# cold cache on a machine loaded twice over. It counts from the session's first test, where
# the run starts (niced, beside the other tests); the tests that read a page run last and
# wait for it until then, each within this plus its checks.
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
    return Launched(command, timeout, what).result()


class Launched:
    """``command`` started now from the repository's root, in a session of its own, its
    output in files (a pipe nobody reads would stop it once full); :meth:`result` waits
    for it, at most until ``timeout`` from now (once)."""

    def __init__(self, command: list[str], timeout: float, what: str) -> None:
        self._what = what
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        # Closed by result() or close(): they outlive this call.
        self._out = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self._proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=environment(),
            stdout=self._out,
            stderr=self._err,
            text=True,
            start_new_session=True,
        )

    def result(self) -> str:
        """The command's stdout once it exited with 0; else fails with its output. Past its
        deadline it is killed with every process it started."""
        try:
            self._proc.wait(timeout=max(self._deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            self._kill()
            out, err = self._output()
            pytest.fail(f"{self._what} ran over {self._timeout} s:\n{out}\n{err[-4000:]}")
        out, err = self._output()
        assert self._proc.returncode == 0, f"{self._what} failed:\n{out}\n{err[-4000:]}"
        return out

    def close(self) -> None:
        """Kills the command with every process it started if it is still running; its
        output is dropped."""
        self._kill()
        self._out.close()
        self._err.close()

    def _kill(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def _output(self) -> tuple[str, str]:
        """What the command wrote to stdout and to stderr; the files are closed after."""
        texts = []
        for file in (self._out, self._err):
            file.seek(0)
            texts.append(file.read())
            file.close()
        return texts[0], texts[1]

"""Gloo worlds on loopback for the test suite.

A :class:`World` is ``size`` processes that joined one gloo process
group and wait for work. ``world.run(fn, *args)`` runs a module-level function
on every rank and returns the per-rank results; an exception on any rank
fails the call with that rank's traceback, and a rank that does not answer
within the timeout gets the whole world killed (no test can hang the suite).
Worlds are reused across tests, so each process joins the group and keeps its
compiled code only once. Ranks are forked from a server that imported torch, its
compiler and fsync once for the whole session (``multiprocessing``'s forkserver), so a
world costs a fork and a gloo rendezvous, not an interpreter importing torch per rank
(on a machine with a GPU, an interpreter per rank: CUDA does not survive the fork).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import functools
import gc
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import pytest

DEFAULT_TIMEOUT = 180.0
# What the ranks' server imports once: torch, its compiler and fsync, with what inductor
# asks each process once worked out (``tests/_preload.py``), and this module.
_PRELOAD = ("tests._preload", "tests._world")


class RankFailedError(AssertionError):
    """A rank raised; the message holds every failing rank's traceback."""


def _worker(rank: int, size: int, init_file: str, pg_timeout: float, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    # What the server imported stays alive: out of the collector's way, so that a collection
    # walks the tests' objects only, not torch's and inductor's millions.
    gc.freeze()
    # Ranks share two cores: one intra-op thread each keeps them from fighting.
    torch.set_num_threads(1)
    # Warnings are errors, as in the pytest process; torch's own deprecation notices
    # about its internals (raised while inductor imports them) are not ours to fix.
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    conn.send(("ok", "ready"))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    if dist.is_initialized():
        # A test's DDP lives in a reference cycle until collected; collected after the
        # group is gone, its Reducer frees the group with the GIL held and the gloo
        # destructor can deadlock on it (pytorch/pytorch#56297).
        gc.collect()
        dist.destroy_process_group()
    # Nothing is left to do: skip the interpreter's teardown of torch and inductor (0.5 s
    # and more of CPU a rank, with two cores for every world's ranks at the session's end).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@functools.cache
def _context() -> Any:
    """Where the ranks start: a forkserver preloaded with :data:`_PRELOAD`; on a machine with
    a GPU, fresh interpreters (spawn), since a process forked from one that has touched the
    CUDA driver cannot use CUDA, and the preloaded imports do."""
    import torch

    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))  # once: before the server starts
    return context


def forked(fn: Callable[..., None], *args: Any) -> Any:
    """``fn(*args)`` in a process of its own, started as the ranks are (torch and fsync
    imported already); a ``multiprocessing`` process, not a daemon (it may start children)."""
    proc = _context().Process(target=fn, args=args)
    proc.start()
    return proc


class World:
    """``size`` gloo ranks in processes of their own, ready to run functions."""

    def __init__(self, size: int, *, pg_timeout: float = 60.0, start_timeout: float = 120.0):
        self.size = size
        self._dir = tempfile.TemporaryDirectory(prefix="fsync-world-")
        init_file = os.path.join(self._dir.name, "init")
        context = _context()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_worker,
                args=(rank, size, init_file, pg_timeout, child),
                daemon=True,
                name=f"fsync-rank{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("start-up", start_timeout)

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self._procs)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results in rank order."""
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", repr(fn)), timeout)

    def run_unchecked(
        self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT
    ) -> list[tuple[str, Any]]:
        """Like :meth:`run` for fault tests: per rank ``("ok", result)``, ``("error",
        traceback)`` or ``("died", exit code)``, and the world is closed afterwards."""
        for conn in self._conns:
            conn.send((fn, args, {}))
        try:
            return self._gather(timeout)
        finally:
            self.close()

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results = self._gather(timeout, what)
        errors = [f"--- rank {r} ---\n{v}" for r, (kind, v) in enumerate(results) if kind != "ok"]
        if errors:
            # A failed rank may have left its peers mid-collective: start afresh.
            self.close()
            raise RankFailedError(
                f"{what} failed on {len(errors)} of {self.size} ranks:\n" + "\n".join(errors)
            )
        return [value for _, value in results]

    def _gather(self, timeout: float, what: str = "the call") -> list[tuple[str, Any]]:
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[str, Any]] = {}
        while len(results) < self.size:
            pending = {conn: r for r, conn in enumerate(self._conns) if r not in results}
            left = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(left, 0.0)) if left > 0 else []
            if not ready:
                self.close()
                missing = sorted(pending.values())
                raise TimeoutError(
                    f"ranks {missing} did not finish {what} within {timeout:.0f} s; "
                    "the world was killed."
                )
            for conn in ready:
                rank = pending[conn]
                try:
                    results[rank] = conn.recv()
                except EOFError:
                    self._procs[rank].join(timeout=5.0)
                    results[rank] = ("died", self._procs[rank].exitcode)
        return [results[r] for r in range(self.size)]

    def close(self) -> None:
        self._stop()
        self._join(time.monotonic() + 5.0)

    def _stop(self) -> None:
        """Tells every rank to leave its group and exit (:meth:`_join` waits for them)."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)

    def _join(self, deadline: float) -> None:
        """Waits until ``deadline`` for the ranks to exit, then kills those still running."""
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        self._dir.cleanup()


def close_all(worlds: list[World]) -> None:
    """Closes ``worlds`` together: each rank exits while the others do (a rank takes 1-3 s to
    leave its group and exit, so closing four worlds one after the other took up to 12 s)."""
    for world in worlds:
        world._stop()
    deadline = time.monotonic() + 5.0
    for world in worlds:
        world._join(deadline)


class AtOnce:
    """``{key: (size, fn, *args)}``: each case's ``fn(*args)`` on a fresh world of ``size`` ranks
    whose group times out after ``pg_timeout``, all cases started at once, now, so that the
    fault tests' waits for timeouts overlap each other and whatever the caller does before
    it reads :meth:`results` (a wait costs no CPU)."""

    def __init__(
        self,
        cases: dict[Any, tuple[Any, ...]],
        *,
        pg_timeout: float,
        timeout: float = 60.0,
    ) -> None:
        self._worlds: dict[Any, World] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(len(cases))  # no thread till used
        try:
            for key, (size, *_) in cases.items():
                self._worlds[key] = World(size, pg_timeout=pg_timeout)
        except BaseException:
            self.close()
            raise
        self._futures = {
            key: self._pool.submit(self._worlds[key].run_unchecked, fn, *args, timeout=timeout)
            for key, (_, fn, *args) in cases.items()
        }

    def results(self) -> dict[Any, list[tuple[str, Any]]]:
        """``{key: results}`` as :meth:`World.run_unchecked` gives them (each world is
        closed after)."""
        try:
            return {key: future.result() for key, future in self._futures.items()}
        finally:
            self._pool.shutdown()

    def close(self) -> None:
        """Stops the cases' worlds, whether or not their results were read."""
        close_all(list(self._worlds.values()))
        self._pool.shutdown()


def run_at_once(
    cases: dict[Any, tuple[Any, ...]],
    *,
    pg_timeout: float,
    timeout: float = 60.0,
) -> dict[Any, list[tuple[str, Any]]]:
    """:class:`AtOnce`'s cases, started and read at once."""
    return AtOnce(cases, pg_timeout=pg_timeout, timeout=timeout).results()


def started_early(name: str, test: str, cases: dict[Any, tuple[Any, ...]], **options: Any) -> Any:
    """A module's autouse fixture ``name`` that starts ``cases`` (:class:`AtOnce`, with
    ``options``) as the module's first test starts, where the session runs the module's
    ``test``, which reads them through it; else its value is ``None``. Their waits for the
    group's timeout then pass during the module's other tests."""

    @pytest.fixture(scope="module", autouse=True, name=name)
    def fixture(request: Any) -> Any:
        chosen = any(  # a doctest's item has no module
            getattr(item, "module", None) is request.module and item.originalname == test
            for item in request.session.items
        )
        if not chosen:
            yield None
            return
        started = AtOnce(cases, **options)
        try:
            yield started
        finally:
            started.close()

    return fixture

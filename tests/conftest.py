"""Fixtures: gloo worlds shared across the session, one per size; the benchmark pages
written once for every test that reads one."""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Iterator

import pytest

# Two inductor compile workers per process, for every process the suite starts (worlds,
# examples, benchmark runs inherit it). A cold suite spends much of its time in g++, one
# kernel at a time, while the other rank of a world waits for that same kernel (inductor
# locks it); two workers keep both cores busy: the main benchmark page's smoke step
# section, cold, 112 s -> 87 s; the two heaviest compiled tests 94 s -> 80 s.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")

from tests._launch import PAGES_TIMEOUT_S, Launched
from tests._world import World, close_all

_WORLDS: dict[int, World] = {}


def get_world(size: int) -> World:
    """The session's world of ``size`` ranks, started (again) if needed."""
    world = _WORLDS.get(size)
    if world is None or not world.alive or not world._conns:
        world = _WORLDS[size] = World(size)
    return world


@pytest.fixture
def world(request: pytest.FixtureRequest) -> World:
    """A gloo world; parametrise with ``indirect=True`` and the number of ranks."""
    return get_world(request.param)


@pytest.fixture(scope="session", autouse=True)
def _close_worlds() -> Iterator[None]:
    yield
    close_all(list(_WORLDS.values()))
    _WORLDS.clear()


# ``benchmarks/run.py --only``'s cases for each page a test can read (``page(NAME)``).
_PAGE_CASES = {
    "main": "step,sync,leaves,hooks,host,anatomy",
    "link": "link",
    "twonodes": "twonodes",
    "ft": "ft",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that read a page run last (otherwise in their order): the pages' smoke run
    starts with the session and runs beside every other test, niced, on the cores they
    leave idle (alone, it took 68 s of a 390-400 s suite warm, 170 s of 810 s cold, its
    cores a quarter idle; see ``_pages_run``)."""
    items.sort(key=lambda item: any(item.iter_markers("page")))


@pytest.fixture(scope="session", autouse=True)
def _pages_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Launched, pathlib.Path] | None]:
    """One ``benchmarks/run.py --smoke`` for every page that this session's tests read
    (``page(NAME)``), started with the first test: one interpreter and one forkserver for
    all of them (each page's own run started three interpreters before its first
    setting)."""
    pages = {mark.args[0] for item in request.session.items for mark in item.iter_markers("page")}
    if not pages:
        yield None
        return
    cases = ",".join(_PAGE_CASES[page] for page in sorted(pages))
    out = tmp_path_factory.mktemp("pages")
    # Below the tests in the scheduler's eyes, so that it takes the cores they leave idle
    # (ranks waiting on each other or on a timeout) rather than slowing the tests' ranks:
    # beside them at the same priority, the tests that ran meanwhile took 35-100 s longer
    # (warm: gloo ranks of two worlds on two cores wait for each other's turns), niced 25 s.
    command = ["nice", "-n", "10", sys.executable, "benchmarks/run.py", "--smoke"]
    command += ["--leaves", "1,10", "--only", cases, "--out", str(out)]
    run = Launched(command, PAGES_TIMEOUT_S, "the pages' smoke run")
    try:
        yield run, out
    finally:
        run.close()


@pytest.fixture(scope="session")
def smoke_pages(_pages_run: tuple[Launched, pathlib.Path]) -> pathlib.Path:
    """The folder where the pages' smoke run (``_pages_run``) wrote its pages, once it is
    done."""
    run, out = _pages_run
    run.result()
    return out

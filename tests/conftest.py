"""Fixtures: gloo worlds shared across the session, one per size."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Two inductor compile workers per process, for every process the suite starts (worlds,
# examples, benchmark runs inherit it). A cold suite spends much of its time in g++, one
# kernel at a time, while the other rank of a world waits for that same kernel (inductor
# locks it); two workers keep both cores busy: the main benchmark page's smoke step
# section, cold, 112 s -> 87 s; the two heaviest compiled tests 94 s -> 80 s.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")

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

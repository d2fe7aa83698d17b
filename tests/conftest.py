"""Fixtures: gloo worlds shared across the session, one per size."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._world import World

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
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()

"""Fixtures: gloo worlds shared across the session, one per size."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist

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


@pytest.fixture(scope="session")
def single_rank() -> Iterator[None]:
    """A one-rank gloo group in the test process itself, for code that needs a group."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="fsync-single-") as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _close_worlds() -> Iterator[None]:
    yield
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()

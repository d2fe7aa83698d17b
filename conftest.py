"""Fixtures for the whole repository: a one-rank process group for doctests and tests."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from _pytest.doctest import DoctestItem


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
            gc.collect()  # no DDP may outlive the group (``benchmarks.harness.leave_group``)
            dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _group_for_doctests(request: pytest.FixtureRequest) -> None:
    """Docstring examples run as written, in a one-rank world like a single-GPU run."""
    if isinstance(request.node, DoctestItem):
        request.getfixturevalue("single_rank")

"""Settings whose time is known, for the benchmark harness's test (built in its processes)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch._inductor.cpu_vec_isa
import torch.distributed as dist

from benchmarks.harness import Built, UnavailableError


def sleeper(ms: float) -> Callable[[], None]:
    """A step that all-reduces one float, then sleeps ``ms``."""
    x = torch.ones(1)

    def step() -> None:
        dist.all_reduce(x)
        time.sleep(ms / 1000)

    return step


def refused() -> Callable[[], None]:
    """A setting that cannot run here, on every rank."""
    raise UnavailableError("not on this machine")


def broken() -> Callable[[], None]:
    """A setting whose rank 1 fails as it builds, while rank 0 goes on and waits for it."""
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 cannot build this setting")
    return sleeper(1)


def forked_knowing() -> Built:
    """A step that does nothing; its info says whether this process started knowing the
    vector instruction sets inductor may use (worked out in its server, not by itself)."""
    known = torch._inductor.cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1
    return Built(lambda: None, lambda: {"vector ISAs known": known})

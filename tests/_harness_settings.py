"""Settings whose time is known, for the benchmark harness's test (built in its processes)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch._inductor.cpu_vec_isa
import torch._inductor.fx_passes.joint_graph
import torch._inductor.fx_passes.post_grad
import torch.distributed as dist
import torch.hub

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
    """A step that does nothing; its info says what this process started knowing (worked out
    in its server, not by itself): the vector instruction sets inductor may use, and the
    graph passes' patterns (the joint graph's for no device and for the CPU, the post-grad
    ones); and whether tqdm's monitor thread was stopped in the server before it forked (a
    child thinks one runs, and starts none, where the server's was running)."""
    known = {
        "vector ISAs known": torch._inductor.cpu_vec_isa.valid_vec_isa_list,
        "joint-graph patterns known": torch._inductor.fx_passes.joint_graph.lazy_init,
        "post-grad patterns known": torch._inductor.fx_passes.post_grad.lazy_init,
    }
    info = {what: fn.cache_info().currsize for what, fn in known.items()}
    monitor = getattr(torch.hub.tqdm, "monitor", None)
    info["no tqdm monitor thought to run"] = monitor is None or not monitor.report()
    return Built(lambda: None, lambda: info)

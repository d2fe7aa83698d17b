"""Reading inductor's generated code: the collectives, their waits and the kernels between.

The compile tests check the overlap ``fsync.compile`` buys by counting it here; the
benchmark pages (``benchmarks/steps.py``) report the same counts beside their step times.
"""

from __future__ import annotations

import re

_ISSUE = re.compile(
    r"_c10d_functional\.(?:all_reduce_|all_reduce|reduce_scatter_tensor|all_gather_into_tensor)"
    r"\.default\((\w+)"
)
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)")
_KERNEL = re.compile(
    r"^\s*(?:\w+ = )?"
    r"(?:extern_kernels\.\w+|torch\.ops\.(?:aten|fsync)\.[\w.]+|cpp_fused_\w+|triton_\w+\.run)\("
)


def overlapped_kernels(code: str) -> tuple[int, int]:
    """(collectives, compute kernels launched while one is in flight) in inductor's code.

    A collective is in flight from the line that issues it to the ``wait_tensor`` on its
    buffer; a kernel launched in between runs while the collective does, which is the
    overlap the compiler's reordering buys.
    """
    in_flight: set[str] = set()
    collectives = overlapped = 0
    for line in code.splitlines():
        if issued := _ISSUE.search(line):
            in_flight.add(issued.group(1))
            collectives += 1
        elif waited := _WAIT.search(line):
            in_flight.discard(waited.group(1))
        elif in_flight and _KERNEL.match(line):
            overlapped += 1
    return collectives, overlapped


def kernels_launched(code: str) -> int:
    """Compute kernels (fused, extern and fallback ops) in inductor's code: not collectives,
    waits or views (``reinterpret_tensor``), which launch nothing."""
    return sum(1 for line in code.splitlines() if _KERNEL.match(line))

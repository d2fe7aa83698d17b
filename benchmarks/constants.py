"""What every page shares: where things are, the learning rate, the bucket size on a slow link.

The bottom of ``benchmarks/``: it imports nothing of the package, and every other module
may import it (workloads and the harness above it, pages on top).
"""

from __future__ import annotations

import pathlib
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TOOLS = ROOT.parent / "shared" / "tools"  # slownet and twonodes

LR = 1e-3
CAP_MB = 4.0  # the bucket size of every setting on the slow-link and two-node pages
GPT_BLOCK = 64  # tokens per GPT sequence: a batch of 256 tokens is 4 sequences


def caps(cap: float | None) -> dict[str, Any]:
    """The keyword for buckets of ``cap`` MiB, as DDP and fsync both take it (``None``: each
    library's default)."""
    return {} if cap is None else {"bucket_cap_mb": cap}

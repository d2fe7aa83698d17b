"""Reference numerics shared by the tests: gathered per-rank values and error bounds."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gathered(tree: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Every rank's copy of a dict of tensors: {name: [rank0, rank1, ...]}."""
    out = {}
    for name, t in tree.items():
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        out[name] = parts
    return out


def summation_bound(
    parts: list[torch.Tensor], world_size: int, divisor: int | None = None
) -> torch.Tensor:
    """How far two summation orders of ``sum(g * (1/divisor))`` may be apart, elementwise.

    Summing W terms in floating point is within (W - 1) * u * sum|terms| of the
    exact sum (u = eps / 2), so two different orders are within
    (W - 1) * eps * sum|terms| of each other. ``divisor`` defaults to W.
    """
    eps = torch.finfo(parts[0].dtype).eps
    scale = 1.0 / (divisor or world_size)
    terms = torch.stack([p * scale for p in parts]).abs().sum(0)
    return (world_size - 1) * eps * terms


def assert_same_as_ddp(
    synced: torch.Tensor,
    ddp: torch.Tensor,
    parts: list[torch.Tensor],
    name: str,
    divisor: int | None = None,
) -> None:
    """``synced`` equals DDP's result: bitwise on two ranks, else within the summation bound.

    ``parts`` are every rank's gradients before the sync (from :func:`gathered`);
    ``divisor`` is what the mean divides by (default: the world size).
    """
    world_size = len(parts)
    if world_size <= 2:  # a * s + b * s is one rounding whatever the order
        assert torch.equal(synced, ddp), name
        return
    bound = summation_bound(parts, world_size, divisor)
    diff = (synced - ddp).abs()
    assert torch.all(diff <= bound), (name, diff.max(), bound.max())

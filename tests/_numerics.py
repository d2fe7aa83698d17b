"""Reference numerics shared by the tests: gathered per-rank values and error bounds."""

from __future__ import annotations

import math

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


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_k = k * eps / (1 - k * eps): what k roundings in ``dtype`` may add, relative.

    Written with eps (twice the unit roundoff u), so also a bound where Higham's gamma~_k
    = c * k * u / (1 - c * k * u) hides a small constant c <= 2.
    """
    eps = torch.finfo(dtype).eps
    assert k * eps < 1, k
    return k * eps / (1 - k * eps)


def powersgd_full_rank_bound(
    norm: float, rows: int, cols: int, world_size: int, dtype: torch.dtype = torch.float32
) -> float:
    """How far full-rank PowerSGD's ``P Q^T`` may be from the mean of the matrices it compresses.

    ``norm`` is the mean over ranks of ||M_i||_F (or a bound on it, such as ||g_i|| + ||e_i||),
    M_i the rows x cols matrix rank i compresses: a leaf's, or batched, the whole
    side x side square of its bucket (padding included), its error feedback added.
    With r = min(rows, cols) columns, P spans M's columns (r = cols) or is square
    (r = rows), so P P^T M = M but for rounding. Normwise, to first order (the eps
    in gamma, twice u, leaves room for the rest), k = max(rows, cols):

    - P = sum_i M_i Q: gamma_cols * sqrt(r) (|M| |Q| with ||Q||_F = sqrt(r)), and
      (W - 1) * eps for the sum over ranks;
    - Householder QR of P (Higham, ASNA 2nd ed., Thm 19.4 and the explicit Q
      after it): backward error gamma_{rows*cols} (k * r = rows * cols), and
      columns within sqrt(r) * gamma_{rows*cols} of orthonormal, twice that in P P^T;
    - Q = sum_i (M_i^T P) / W: gamma_rows * sqrt(r), and W * eps for 1/W and the sum;
    - P Q^T: gamma_r * sqrt(r);
    - error feedback, x = g + e and e = x - P Q^T: one rounding each, eps.

    Gram-Schmidt (r <= 2) is a normalisation for r = 1, within the QR terms; for
    r = 2 its loss of orthogonality grows with P's condition number: no a-priori
    bound, so r = 2 is refused.
    """
    r = min(rows, cols)
    assert r != 2, "Gram-Schmidt on two columns: the error depends on P's conditioning"
    eps = torch.finfo(dtype).eps
    matmuls = math.sqrt(r) * (gamma(cols, dtype) + gamma(rows, dtype) + gamma(r, dtype))
    qr = (1 + 2 * math.sqrt(r)) * gamma(rows * cols, dtype)
    return norm * (matmuls + qr + 2 * world_size * eps)


# The ranks' agreement, which every sync sends before its buckets: one all-reduce of 13
# int64 (see fsync/_control.py), as (op, dtype, numel).
AGREEMENT = ("all_reduce", torch.int64, 13)


def linear_loss(params: dict[str, torch.Tensor], coefficients: dict[str, torch.Tensor | None]):
    """sum(p * c) over the leaves of ``coefficients`` (a ``None`` one, or a ``None``
    parameter, left out), in float64: its gradient is ``c`` in each leaf's dtype (``c`` is
    float32, held exactly in float64 and rounded once to the leaf's dtype)."""
    return sum(
        (params[k].double() * c.double()).sum()
        for k, c in coefficients.items()
        if c is not None and params[k] is not None
    )

"""PowerSGD on one bucket: its matrices compressed by one power iteration, two all-reduces.

Given a bucket, its ``Layout`` (``_powersgd_layout``) and the Q to start from:
the compressed elements get this rank's error feedback, each matrix ``M`` is
multiplied by its orthonormalised Q (``P = M Q``), the Ps are summed by one
all-reduce together with the mean of the elements left uncompressed, each P is
orthonormalised, ``Q = M^T P`` is averaged by a second all-reduce, and ``P Q^T``
is the synced matrix, equal on every rank. The new error is what compression lost
on this rank; the averaged Q is the next step's warm start.

Owns: the power iteration, its orthogonalisation and the error feedback of one
bucket. May import: ``_comm``, ``_hook`` (for the context) and ``_powersgd_layout``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fsync import _comm
from fsync._hook import SyncContext
from fsync.ops._powersgd_layout import Group, Layout


def compress(
    bucket: torch.Tensor,
    layout: Layout,
    error: torch.Tensor | None,
    q: torch.Tensor,
    epsilon: float,
    ctx: SyncContext,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The synced bucket, this rank's new error (empty when ``error`` is None) and the new Q.

    ``layout`` must compress something (have groups); ``q`` is the Q to start from, flat
    and in the layout's order; ``epsilon`` is added to each column norm when
    orthonormalising.
    """
    x, rest = layout.split(bucket)
    if error is not None:
        x = x + error
    approx, mean_rest, new_q = _power_step(x, rest, q, layout.groups, epsilon, ctx)
    new_error = x - approx if error is not None else bucket.new_zeros(0)
    return layout.join(approx, mean_rest), new_error, new_q


def _power_step(
    x: torch.Tensor,
    rest: torch.Tensor,
    q: torch.Tensor,
    groups: Sequence[Group],
    epsilon: float,
    ctx: SyncContext,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One PowerSGD step over a bucket's matrices ``x``, with the mean of ``rest`` on the side.

    Returns the synced matrices ``P Q^T`` (flat, as ``x``), the mean of ``rest`` and
    the averaged Q to start the next step from.
    """
    ms = _batches(x, [(g.batch, g.rows, g.cols) for g in groups])
    qs = [
        _orthogonalise(v, epsilon) for v in _batches(q, [(g.batch, g.cols, g.rank) for g in groups])
    ]
    ps = [torch.bmm(m, v) for m, v in zip(ms, qs, strict=True)]
    # One collective for the Ps (summed: they are orthonormalised next, so their scale
    # does not matter) and the mean of the uncompressed leaves.
    # Waited for here, where the result is needed: a failure is fsync's named error.
    reduced = _comm.wait(
        _comm.all_reduce(
            torch.cat([ctx.divide(rest), *(p.reshape(-1) for p in ps)]), "sum", ctx.group
        )
    )
    p_sums = _batches(reduced[rest.numel() :], [(g.batch, g.rows, g.rank) for g in groups])
    ps = [_orthogonalise(p, epsilon) for p in p_sums]
    q_local = torch.cat(
        [torch.bmm(m.transpose(1, 2), p).reshape(-1) for m, p in zip(ms, ps, strict=True)]
    )
    q_mean = _comm.wait(_comm.all_reduce(ctx.divide(q_local), "sum", ctx.group))
    new_qs = _batches(q_mean, [(g.batch, g.cols, g.rank) for g in groups])
    approx = torch.cat(
        [torch.bmm(p, v.transpose(1, 2)).reshape(-1) for p, v in zip(ps, new_qs, strict=True)]
    )
    # A column that came back all zeros (the leaf's gradient was zero on every rank)
    # would stay zero for good; keep the column used this step instead.
    kept = [
        torch.where(torch.linalg.vector_norm(v, dim=1, keepdim=True) > 0, v, used)
        for v, used in zip(new_qs, qs, strict=True)
    ]
    return approx, reduced[: rest.numel()], torch.cat([v.reshape(-1) for v in kept])


def _batches(flat: torch.Tensor, shapes: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Consecutive (batch, rows, cols) blocks of a 1-D tensor, as views."""
    pieces = torch.split(flat, [math.prod(shape) for shape in shapes])
    return [p.view(shape) for p, shape in zip(pieces, shapes, strict=True)]


def _normalise(cols: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Each of a batch of column vectors (batch, n) divided by its norm."""
    norm: torch.Tensor = torch.linalg.vector_norm(cols, dim=1, keepdim=True)
    if epsilon:
        return cols / (norm + epsilon)
    # An all-zero column (a leaf whose gradient is zero on every rank) stays zero
    # rather than becoming NaN; DDP means to do the same but divides by zero.
    return torch.where(norm > 0, cols / norm, torch.zeros_like(cols))


def _orthogonalise(matrices: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Orthonormal columns spanning each matrix's of a batch (batch, n, r), r <= n.

    Modified Gram-Schmidt for rank <= 2, Householder QR above, as DDP does,
    but in at least float32: Gram-Schmidt in half precision (DDP's choice for
    half buckets, which QR does not take) loses orthogonality quickly, and the
    few columns cost nothing to upcast. The result has the input's dtype.
    """
    dtype, rank = matrices.dtype, matrices.shape[2]
    matrices = matrices.to(torch.promote_types(dtype, torch.float32))
    if rank > 2:
        q: torch.Tensor = torch.linalg.qr(matrices).Q
        return q.to(dtype)
    cols: list[torch.Tensor] = []
    for i in range(rank):
        col = matrices[:, :, i]
        for done in cols:
            col = col - (done * col).sum(dim=1, keepdim=True) * done
        cols.append(_normalise(col, epsilon))
    return torch.stack(cols, dim=2).to(dtype)

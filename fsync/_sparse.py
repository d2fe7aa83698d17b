"""Sparse gradients (``nn.Embedding(sparse=True)``): a mean by all-gather and coalesce."""

from __future__ import annotations

import torch

from fsync import _comm
from fsync._hook import SyncContext


def sparse_mean(x: torch.Tensor, ctx: SyncContext) -> torch.Tensor:
    """The mean over ``ctx.group`` of a sparse COO tensor, as DDP computes it.

    As DDP does, each rank divides its values by the divisor, then the ranks'
    entries are summed: every rank's indices and values are all-gathered (padded
    to the largest count, one small all-gather of the counts first) and
    coalesced, which adds the values of repeated indices. The result is a
    coalesced sparse tensor.
    """
    x = x.coalesce()
    divisor = ctx.divisor
    values = x.values() / (divisor.to(x.dtype) if isinstance(divisor, torch.Tensor) else divisor)
    indices = x.indices()
    if ctx.world_size == 1:
        return torch.sparse_coo_tensor(indices, values, x.shape, check_invariants=True).coalesce()
    nnz = torch.tensor([values.shape[0]], dtype=torch.int64, device=x.device)
    counts = _comm.wait(_comm.all_gather(nnz, ctx.group)).tolist()
    most = max(counts)
    # Gathered along dim 0, so entries go first: indices as (nnz, sparse_dims).
    padded_indices = indices.new_zeros(most, indices.shape[0])
    padded_indices[: values.shape[0]] = indices.t()
    padded_values = values.new_zeros(most, *values.shape[1:])
    padded_values[: values.shape[0]] = values
    all_indices = _comm.wait(_comm.all_gather(padded_indices, ctx.group))
    all_values = _comm.wait(_comm.all_gather(padded_values, ctx.group))
    keep = torch.cat(
        [torch.arange(r * most, r * most + n, device=x.device) for r, n in enumerate(counts)]
    )
    # The indices come from other processes: have torch check them.
    return torch.sparse_coo_tensor(
        all_indices[keep].t(), all_values[keep], x.shape, check_invariants=True
    ).coalesce()

"""fsync.compile: torch.compile with the overlap settings, same results as without."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsync
from tests._models import func_loss, params_of, ref_batch, ref_model
from tests._world import World


def _on_rank_overlap_settings():
    rank = dist.get_rank()
    model = ref_model()
    loss_fn = func_loss(model)

    def step(params, batch):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
        grads = fsync.sync_grads(grads, bucket_cap_mb=0.001, first_bucket_mb=0.001)
        return {k: p - 0.1 * grads[k] for k, p in params.items()}, loss

    results = {}
    for overlap in (True, False):
        compiled = fsync.compile(step, overlap=overlap)
        params = params_of(model)
        for s in range(3):
            with torch._dynamo.config.patch(error_on_recompile=s > 0):
                params, _ = compiled(params, ref_batch(rank, s))
        results[overlap] = params
    # Reordering moves collectives and waits, not arithmetic: bit for bit the same.
    for k in results[True]:
        assert torch.equal(results[True][k], results[False][k]), k
    fsync.verify(results[True], values=True)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_overlap_settings_change_no_result(world: World):
    world.run(_on_rank_overlap_settings, timeout=400)

"""DDP's quantisation hooks, step by step: the reference for ``fsync.ops.quantize``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as ddp_quant


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t``, in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def ddp_quantized_mean(
    bucket: torch.Tensor, per_channel: bool, channel_size: int = 512
) -> torch.Tensor:
    """DDP's quantization_pertensor_hook / _perchannel_hook, step by step.

    DDP's hooks themselves fail on torch 2.13 with gloo (their callbacks index the
    all-gather future's value as if it were nested), so this runs their operations:
    torch's min-max observers for the parameters, the hooks' own (de)quantisation
    helpers, the sum in rank order and the division by the world size. As the hooks do,
    the observers and the scales live on the bucket's device: on CUDA, where dividing by
    a Python number is a product by its reciprocal but dividing by a CUDA tensor is a
    division, where the operands live decides the last bits.
    """
    world_size = dist.get_world_size()
    if per_channel:
        # DDP pads to whole channels (a whole extra one when the size divides).
        pad = channel_size - len(bucket) % channel_size
        x = torch.nn.functional.pad(bucket, (0, pad)).view(-1, channel_size)
        observer = PerChannelMinMaxObserver().to(bucket.device)
        observer(x)
        scale, zero_point = observer.calculate_qparams()
        s_and_z = all_gather(torch.stack((scale, zero_point)).float())
        mine = s_and_z[dist.get_rank()]
        quantized = all_gather(ddp_quant._quantize_per_channel_backend(x, mine[0], mine[1]))
        total = torch.zeros_like(x, dtype=torch.float32)
        for q, sz in zip(quantized, s_and_z, strict=True):
            total += ddp_quant._dequantize_per_channel_backend(q, sz[0], sz[1])
        return total.flatten()[: len(bucket)] / world_size
    observer = MinMaxObserver().to(bucket.device)
    observer(bucket)
    scale, zero_point = observer.calculate_qparams()
    s_and_z = all_gather(
        torch.tensor([scale.item(), zero_point.item()], dtype=torch.float32, device=bucket.device)
    )
    mine = s_and_z[dist.get_rank()]
    quantized = all_gather(ddp_quant._quantize_per_tensor_backend(bucket, mine[0], mine[1]))
    total = torch.zeros_like(bucket, dtype=torch.float32)
    for q, sz in zip(quantized, s_and_z, strict=True):
        total += ddp_quant._dequantize_per_tensor_backend(q, sz[0], sz[1])
    return total / world_size

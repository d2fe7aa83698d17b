"""The benchmark workloads: two MLPs of ~8M parameters (3 wide layers, 8 narrow) and a small GPT
of ~20M."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from gpt_model import GPT, GPTConfig


@dataclasses.dataclass
class Workload:
    """A model, its data and its loss, usable by autograd (``loss``) and torch.func."""

    name: str
    model: nn.Module
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def batch(self, rank: int) -> tuple[torch.Tensor, ...]:
        return self.make_batch(torch.Generator().manual_seed(1000 + rank))

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return self.criterion(model(x), y)

    def functional_loss(
        self, params: dict[str, torch.Tensor], batch: tuple[Any, ...]
    ) -> torch.Tensor:
        x, y = batch
        return self.criterion(torch.func.functional_call(self.model, params, (x,)), y)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def mlp(width: int = 2048, depth: int = 3, batch: int = 64, scale: float = 1.0) -> Workload:
    """Linear layers of ``width`` (8.4M parameters by default), MSE on random targets."""
    torch.manual_seed(0)
    width = int(width * scale)
    layers: list[nn.Module] = [nn.Linear(width // 2, width), nn.GELU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, width // 2))
    model = nn.Sequential(*layers)

    def make_batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(batch, width // 2, generator=g), torch.randn(
            batch, width // 2, generator=g
        )

    return Workload("MLP", model, make_batch, nn.functional.mse_loss)


def deep_mlp(width: int = 1024, depth: int = 8, batch: int = 64, scale: float = 1.0) -> Workload:
    """``depth`` equal linear layers of ``width`` with GELU between them (8.4M parameters by
    default), cross-entropy over ``width`` classes on random labels.

    Many gradients of one bucket's size (4 MiB each by default), produced one after the
    other by backward: the shape where starting each bucket's all-reduce as soon as
    backward completes it pays.
    """
    torch.manual_seed(0)
    width = int(width * scale)
    layers: list[nn.Module] = [nn.Linear(width, width)]
    for _ in range(depth - 1):
        layers += [nn.GELU(), nn.Linear(width, width)]
    model = nn.Sequential(*layers)

    def make_batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(batch, width, generator=g), torch.randint(
            0, width, (batch,), generator=g
        )

    return Workload("deep MLP", model, make_batch, nn.functional.cross_entropy)


def gpt(
    n_layer: int = 6,
    d_model: int = 512,
    vocab_size: int = 2048,
    block_size: int = 64,
    batch: int = 4,
    scale: float = 1.0,
) -> Workload:
    """A small GPT (about 21M parameters by default) on random tokens."""
    torch.manual_seed(0)
    d_model = max(32, int(d_model * scale))
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=max(1, d_model // 64),
        d_model=d_model,
    )
    model = GPT(config)

    def make_batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        tokens = torch.randint(0, vocab_size, (batch, block_size + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    return Workload("GPT", model, make_batch, criterion)

"""Models and data shared by the tests."""

from __future__ import annotations

import pathlib
import sys
from typing import NamedTuple

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))  # gpt_model


class RefModel(nn.Module):
    """The parity model: Linear, channels_last Conv2d, Embedding, LayerNorm, a layer used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(24)
        self.fc = nn.Linear(24, 24)
        self.head = nn.Linear(24, 5)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        e = self.emb(tokens).mean(1)
        c = self.conv(images).mean((2, 3))
        h = self.norm(torch.cat([e, c], 1))
        h = torch.tanh(self.fc(h))
        h = torch.tanh(self.fc(h))  # the same parameters a second time
        return self.head(h)


class Backwards(nn.Module):
    """Four layers of distinct sizes, applied last-defined first: ``l0`` runs last.

    Its gradients therefore arrive first, and the buckets (planned in reverse
    definition order, ``l3`` first) complete in the reverse of the plan's order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(5, 4), nn.Linear(6, 5)
        self.l2, self.l3 = nn.Linear(7, 6), nn.Linear(8, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l0(torch.tanh(self.l1(torch.tanh(self.l2(torch.tanh(self.l3(x)))))))


def backwards_loss(model: nn.Module):
    """``loss(params, x)``, the mean square of ``model``'s output (a ``Backwards``, say)."""

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).pow(2).mean()

    return loss


class Boom(torch.autograd.Function):
    """The identity, whose backward raises on the rank told to."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise RuntimeError("boom: this rank's backward failed")
        return grad, None


def ref_model() -> RefModel:
    """The same initial model on every rank, conv weights in channels_last."""
    torch.manual_seed(0)
    return RefModel().to(memory_format=torch.channels_last)


def ref_batch(rank: int, step: int = 0, batch: int = 8) -> tuple[torch.Tensor, ...]:
    """Different data on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 50, (batch, 6), generator=g)
    images = torch.randn(batch, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
    targets = torch.randint(0, 5, (batch,), generator=g)
    return tokens, images, targets


def ref_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    tokens, images, targets = batch
    return nn.functional.cross_entropy(model(tokens, images), targets)


def func_loss(model: nn.Module):
    """``loss(params, batch)`` for torch.func over ``model``'s parameters."""

    def loss(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tokens, images, targets = batch
        logits = torch.func.functional_call(model, params, (tokens, images))
        return nn.functional.cross_entropy(logits, targets)

    return loss


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached parameters in ``named_parameters()`` order."""
    return {name: p.detach() for name, p in model.named_parameters()}


class GPTWork(NamedTuple):
    """A small GPT of ``examples/gpt_model.py`` on random tokens, as torch.func trains it."""

    model: nn.Module
    sequences: int
    vocab_size: int

    def batch(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Different tokens on every rank: inputs and the next tokens."""
        g = torch.Generator().manual_seed(1000 + rank)
        block = self.model.config.block_size
        tokens = torch.randint(0, self.vocab_size, (self.sequences, block + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def functional_loss(
        self, params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x, y = batch
        logits = torch.func.functional_call(self.model, params, (x,))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def gpt(n_layer: int = 2, scale: float = 1 / 8, vocab_size: int = 256) -> GPTWork:
    """The examples' GPT at ``scale`` of d_model 512 (one head per 64), blocks of 64 tokens,
    4 sequences a batch: the same model on every rank."""
    from gpt_model import GPT, GPTConfig  # type: ignore[import-not-found]  # examples/

    torch.manual_seed(0)
    d_model = max(32, int(512 * scale))
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=64,
        n_layer=n_layer,
        n_head=max(1, d_model // 64),
        d_model=d_model,
    )
    return GPTWork(GPT(config), 4, vocab_size)

"""The benchmark workloads: two MLPs of 8.4M parameters (3 wide layers, 8 narrow) and a
small GPT of 21M, each named by a :class:`Load` that any process can rebuild."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from benchmarks.constants import GPT_BLOCK, ROOT

sys.path.insert(0, str(ROOT / "examples"))
from gpt_model import GPT, GPTConfig  # type: ignore[import-not-found]  # examples/


@dataclasses.dataclass
class Workload:
    """A model, its data and its loss, usable by autograd (``loss``) and torch.func."""

    name: str
    model: nn.Module
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def batch(self, rank: int) -> tuple[torch.Tensor, ...]:
        return self.make_batch(torch.Generator().manual_seed(1000 + rank))

    def loss(self, model: Callable[..., torch.Tensor], batch: tuple[Any, ...]) -> torch.Tensor:
        x, y = batch
        return self.criterion(model(x), y)

    def functional_loss(
        self, params: dict[str, torch.Tensor], batch: tuple[Any, ...]
    ) -> torch.Tensor:
        x, y = batch
        return self.criterion(torch.func.functional_call(self.model, params, (x,)), y)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def grads(self, rank: int) -> dict[str, torch.Tensor]:
        """``rank``'s local gradients: of the functional loss on its batch."""
        grads: dict[str, torch.Tensor] = torch.func.grad(self.functional_loss)(
            self.params(), self.batch(rank)
        )
        return grads

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

    def make_batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(batch, width // 2, generator=g)
        return x, torch.randn(batch, width // 2, generator=g)

    return Workload("MLP", nn.Sequential(*layers), make_batch, nn.functional.mse_loss)


def deep_mlp(width: int = 1024, depth: int = 8, batch: int = 64, scale: float = 1.0) -> Workload:
    """``depth`` equal linear layers of ``width`` with GELU between them (8.4M parameters by
    default), cross-entropy over ``width`` classes on random labels.

    Many gradients of one bucket's size (4 MiB each by default), produced one after the
    other by backward: the shape where starting each bucket's collective as soon as
    backward completes it pays.
    """
    torch.manual_seed(0)
    width = int(width * scale)
    layers: list[nn.Module] = [nn.Linear(width, width)]
    for _ in range(depth - 1):
        layers += [nn.GELU(), nn.Linear(width, width)]

    def make_batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(batch, width, generator=g)
        return x, torch.randint(0, width, (batch,), generator=g)

    return Workload("deep MLP", nn.Sequential(*layers), make_batch, nn.functional.cross_entropy)


def gpt(
    n_layer: int = 6,
    d_model: int = 512,
    vocab_size: int = 2048,
    block_size: int = GPT_BLOCK,
    batch: int = 4,
    scale: float = 1.0,
    n_head: int | None = None,
) -> Workload:
    """A small GPT (about 21M parameters by default) on random tokens, ``batch`` sequences
    (``n_head``: one head per 64 of ``d_model`` unless given)."""
    torch.manual_seed(0)
    d_model = max(32, int(d_model * scale))
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head or max(1, d_model // 64),
        d_model=d_model,
    )

    def make_batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        tokens = torch.randint(0, vocab_size, (batch, block_size + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    return Workload("GPT", GPT(config), make_batch, criterion)


HOST_BOUND = "host-bound GPT"


def host_bound(blocks: int = 12) -> Workload:
    """The host-bound GPT: ``blocks`` blocks of width 32 (2 heads) on one sequence of 8
    tokens, 6 + 12 x ``blocks`` parameter leaves and almost no arithmetic."""
    return gpt(n_layer=blocks, d_model=32, vocab_size=64, block_size=8, batch=1, n_head=2)


class Load(NamedTuple):
    """A workload by name and batch per rank (the GPT's batch counts tokens, in sequences of
    ``GPT_BLOCK``): a small value that a page hands to the processes that build it.

    ``smoke`` builds tiny sizes that take every code path (the deep MLP: 3 layers; the GPT:
    1 layer, narrow); the MLPs at 1/16 of their width. The host-bound GPT is 12 blocks of
    width 32 (2 heads) on one sequence of 8 tokens: 150 parameter leaves and almost no
    arithmetic, the regime where the host's time is the step, as on a GPU (``batch`` is
    ignored; smoke: 2 blocks).
    """

    name: str
    batch: int
    smoke: bool = False

    def __str__(self) -> str:
        return f"{self.name}, batch {self.batch}"

    def build(self) -> Workload:
        scale = 1 / 16 if self.smoke else 1.0
        if self.name == "MLP":
            return mlp(batch=self.batch, scale=scale)
        if self.name == "deep MLP":
            return deep_mlp(batch=self.batch, scale=scale, **({"depth": 3} if self.smoke else {}))
        if self.name == HOST_BOUND:
            return host_bound(2 if self.smoke else 12)
        if self.name != "GPT":
            raise ValueError(
                f"no workload {self.name!r}; expected MLP, deep MLP, GPT or {HOST_BOUND}"
            )
        sequences = max(1, self.batch // GPT_BLOCK)
        if self.smoke:
            return gpt(n_layer=1, scale=1 / 8, vocab_size=256, batch=sequences)
        return gpt(batch=sequences)

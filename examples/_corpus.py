"""The text the GPT examples learn: characters of ``data/corpus.txt`` and random windows of it.

Batches are pure functions of a seed, and the seed of a rank's batch is a
function of the step (:func:`batch_seed`), so a run that stops and resumes
draws exactly the batches of a run that never stopped.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

CORPUS = pathlib.Path(__file__).parent / "data" / "corpus.txt"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The text as token ids (one per character), split into training and held-out parts.

    Attributes:
        chars: The vocabulary: token ``i`` is ``chars[i]``.
        train: The first part of the text, as a 1-D int64 tensor of token ids.
        held_out: The rest, for evaluation.
    """

    chars: str
    train: torch.Tensor
    held_out: torch.Tensor

    @classmethod
    def load(cls, path: pathlib.Path = CORPUS, held_out: float = 0.1) -> Corpus:
        """Reads ``path`` (lines starting with ``#`` are a header, left out)."""
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        text = "".join(line for line in lines if not line.startswith("#"))
        chars = "".join(sorted(set(text)))
        ids = torch.tensor([chars.index(c) for c in text], dtype=torch.int64)
        cut = int(len(ids) * (1 - held_out))
        return cls(chars, ids[:cut], ids[cut:])

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.chars.index(c) for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def batch_at(
    data: torch.Tensor, seed: int, batch: int, block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``data`` (inputs, and targets one character later)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - block - 1, (batch,), generator=g)
    windows = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


def batch_seed(seed: int, step: int, rank: int) -> int:
    """The random seed of a rank's batch at a step: different everywhere, known in advance."""
    return (seed * 1_000_003 + step) * 1_009 + rank


def held_out_seed(index: int) -> int:
    """The seed of held-out batch ``index``: the same batches at every evaluation."""
    return 10_000 + index


@torch.no_grad()
def held_out_loss(
    loss_fn: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor],
    params: Any,
    corpus: Corpus,
    *,
    batches: int,
    batch: int,
    block: int,
    device: torch.device,
) -> float:
    """The mean loss over the same ``batches`` held-out batches at every call.

    Rank ``r`` computes batches ``r, r + W, ...``; one all-reduce adds them up.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of losses, batches
    for b in range(rank, batches, world_size):
        x, y = batch_at(corpus.held_out, held_out_seed(b), batch, block, device)
        total += torch.stack([loss_fn(params, x, y).double(), torch.ones((), device=device)])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def next_char_loss(
    model: torch.nn.Module,
) -> Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn(params, x, y)``: the model's cross-entropy on the next characters.

    A pure function of the parameter dict (``torch.func.functional_call``), so
    that ``torch.func.grad`` differentiates it and ``torch.compile`` traces it.
    """

    def loss_fn(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model, params, (x,))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    return loss_fn

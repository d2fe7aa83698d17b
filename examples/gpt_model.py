"""A small GPT (decoder-only transformer) language model, for the examples and benchmarks.

Pre-norm blocks of causal self-attention and a GELU MLP, learned position
embeddings, no dropout and no weight tying, so that the parameters are a plain
dict of independent tensors and a step is a pure function of its inputs. It
depends on torch only::

    from gpt_model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=96, block_size=64))  # the examples' tiny default
    model = GPT(GPTConfig(vocab_size=96, block_size=256, n_layer=6, n_head=8, d_model=512))
    model.num_params()  # 19,144,800 for the second one: about 20M

Each block holds ``12 * d_model**2 + 13 * d_model`` parameters; the embeddings
and the head add ``(2 * vocab_size + block_size) * d_model + vocab_size + 2 * d_model``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`.

    Attributes:
        vocab_size: Number of token ids.
        block_size: Longest context, in tokens.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide ``d_model``.
        d_model: Width of the residual stream.
    """

    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int; got {value!r}.")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.n_head ({self.n_head}) must divide d_model ({self.d_model})."
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        # (batch, time, 3 * width) -> three (batch, heads, time, head width)
        q, k, v = (
            t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer: token ids ``(batch, time)`` to logits ``(batch, time, vocab)``.

    Linear and embedding weights start from ``N(0, 0.02)``, the output
    projections of each block scaled down by ``sqrt(2 * n_layer)`` (GPT-2's
    initialisation); biases start at zero.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.Sequential(*(Block(config) for _ in range(config.n_layer)))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """The number of parameters."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(
                f"the input has {time} tokens; this model's block_size is "
                f"{self.config.block_size}. Crop the context to its last block_size tokens."
            )
        positions = torch.arange(time, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        return self.head(self.ln_f(self.blocks(x)))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extends the token ids ``idx`` (``(batch, time)``) by sampling ``max_new_tokens`` more.

        Each new token is drawn from the softmax of the last position's logits
        divided by ``temperature``, restricted to the ``top_k`` most likely
        tokens if given, with ``generator`` as the source of randomness.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = functional.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx

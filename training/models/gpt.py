"""A decoder-only transformer (GPT) and sampling from it.

Layout, kept plain on purpose for the parallelism that wraps it later: embeddings, then
`blocks` (a ModuleList; each block is one pipeline unit), then a final norm and the output
head. In each block the attention has separate q, k, v and out linears and the MLP two
linears, so a tensor-parallel plan shards q/k/v and `fc_in` by columns and `out` and
`fc_out` by rows. Attention counts its heads from the width it is given (`head_dim` is
fixed), so it still works when q/k/v hold only a rank's share of the heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.dropout = dropout
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape

        def split_heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, H*D) -> (B, H, T, D)
            return t.view(batch, time, -1, self.head_dim).transpose(1, 2)

        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, time, -1)
        return self.out_dropout(self.out(y))


class FeedForward(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-LayerNorm: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = FeedForward(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token ids (B, T) with T <= context -> next-token logits (B, T, vocab_size)."""

    def __init__(
        self,
        vocab_size: int,
        *,
        layers: int,
        heads: int,
        width: int,
        context: int,
        dropout: float,
        tied_embeddings: bool,
    ) -> None:
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self._init_weights(layers)
        if tied_embeddings:
            self.head.weight = self.token_embedding.weight

    def _init_weights(self, layers: int) -> None:
        # GPT-2's scheme: small normal weights, and the projections that add into the
        # residual stream scaled down by depth so the stream's variance stays bounded.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:
            for residual in (block.attention.out, block.mlp.fc_out):
                nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        time = ids.shape[1]
        if time > self.context:
            raise ValueError(f"{time} tokens given; the model attends over {self.context} at most")
        positions = torch.arange(time, device=ids.device)
        x = self.dropout(self.token_embedding(ids) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    context: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append `max_new_tokens` sampled tokens to `ids` (B, T) and return (B, T + new).

    The model sees at most its last `context` tokens (when None: the model's own `context`
    attribute, or every token for a model without one).
    `temperature` <= 0 picks the most likely token; `top_k` samples among the k most likely
    (None or 0: all). A seeded `generator` makes the samples reproducible. The model runs
    in eval mode (no dropout) and is put back in the mode it was in.
    """
    context = context or getattr(model, "context", None) or ids.shape[1] + max_new_tokens
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(ids[:, -context:])[:, -1, :].float()
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
    finally:
        model.train(was_training)
    return ids

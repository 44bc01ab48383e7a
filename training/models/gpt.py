"""A decoder-only transformer (GPT).

Layout, kept plain on purpose for the parallelism applied from outside (training/engine/
parallelize.py): embeddings, then `blocks` (a ModuleDict keyed "0", "1"...: each block is
a unit to shard and to cut the pipeline at), then a final norm and the output head. In
each block the attention has separate q, k, v and out linears and the MLP two linears, so
the tensor-parallel plan shards q/k/v and `fc_in` by columns and `out` and `fc_out` by
rows. Attention counts its heads from the width it is given (`head_dim` is fixed), so it
still works when q/k/v hold only a rank's share of the heads.

The model describes how it may be split and holds no distributed code:
`tensor_parallel_plan()` names each linear's split, and `pipeline_stage(i, n)` keeps only
the parts of stage i of n (a stage without the embedding takes and returns activations).
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
        self.blocks = nn.ModuleDict({str(i): Block(width, heads, dropout) for i in range(layers)})
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
        for block in self.blocks.values():
            for residual in (block.attention.out, block.mlp.fc_out):
                nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # A pipeline stage may lack the embedding (it receives activations) or the head
        # (it returns activations): see pipeline_stage.
        if self.token_embedding is not None:
            time = ids.shape[1]
            if time > self.context:
                raise ValueError(
                    f"{time} tokens given; the model attends over {self.context} at most"
                )
            positions = torch.arange(time, device=ids.device)
            x = self.dropout(self.token_embedding(ids) + self.position_embedding(positions))
        else:
            x = ids
        for block in self.blocks.values():
            x = block(x)
        if self.head is None:
            return x
        return self.head(self.final_norm(x))

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Module name patterns -> how their weights split across tensor-parallel ranks.
        Column-split q/k/v/fc_in give each rank whole heads and a slice of the MLP; the
        row-split out/fc_out sum the ranks' shares. Embeddings, norms and the head stay
        whole on every rank."""
        return {
            "blocks.*.attention.q": "colwise",
            "blocks.*.attention.k": "colwise",
            "blocks.*.attention.v": "colwise",
            "blocks.*.attention.out": "rowwise",
            "blocks.*.mlp.fc_in": "colwise",
            "blocks.*.mlp.fc_out": "rowwise",
        }

    def shard_units(self) -> list[nn.Module]:
        """The modules sharded (and recomputed, with activation checkpointing) as units."""
        return list(self.blocks.values())

    def pipeline_stage(self, index: int, count: int) -> GPT:
        """Keep only stage `index` of `count` (in place; returns self): the first stage
        keeps the embeddings, the last the final norm and head, each a contiguous run of
        blocks (earlier stages take one more when they do not divide evenly). Parameter
        names stay those of the whole model, so checkpoints of any layout line up."""
        if self.head is not None and self.head.weight is self.token_embedding.weight:
            raise ValueError("a model with tied embeddings cannot be cut into pipeline stages")
        names = list(self.blocks)
        if not 0 <= index < count <= len(names):
            raise ValueError(
                f"cannot cut {len(names)} blocks into {count} pipeline stages and keep stage "
                f"{index}: every stage needs a block (raise model.layers or lower parallel.pp)"
            )
        per, extra = divmod(len(names), count)
        start = index * per + min(index, extra)
        keep = names[start : start + per + (1 if index < extra else 0)]
        for name in names:
            if name not in keep:
                del self.blocks[name]
        if index > 0:
            self.token_embedding = self.position_embedding = None
        if index < count - 1:
            self.final_norm = self.head = None
        return self

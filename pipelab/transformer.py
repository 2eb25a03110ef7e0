"""The decoder-only Transformer of the `torch.distributed.pipelining` example (lesson 09).

An embedding, `n_layers` decoder layers, a norm and an output projection. The layers sit in a
`ModuleDict` keyed "0", "1", ... so that deleting some (a manual split) keeps the others' names, and
the forward skips any part set to `None`: that is how the example cuts the model by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ModelArgs:
    """The example's sizes by default (dim 512, 8 layers, 8 heads, vocabulary 10000)."""

    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    vocab_size: int = 10000


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab). `tie_weights` makes the output
    projection use the embedding's matrix (one parameter, used at both ends)."""

    def __init__(self, args: ModelArgs, tie_weights: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({
            str(i): nn.TransformerDecoderLayer(args.dim, args.n_heads, dim_feedforward=4 * args.dim,
                                               dropout=0.0, batch_first=True)
            for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if tie_weights:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, h)  # the example's decoder layers attend to their own input as "memory"
        h = self.norm(h) if self.norm else h
        return self.output(h).float() if self.output else h


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per token, averaged over the batch's tokens."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


class Attention(nn.Module):
    """Causal multi-head self-attention with its four matrices apart (queries, keys, values,
    output), as Megatron-LM writes it, so that lesson 12 can cut each one across ranks."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} does not divide into n_heads={n_heads} heads; use a dim that is "
                             f"a multiple of {n_heads}")
        self.n_heads = n_heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(attend(self.q(x), self.k(x), self.v(x), self.n_heads))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V per head, each token seeing only itself and the tokens before it.
    (batch, seq, n_heads * d) in, the same shape out."""
    b, s, width = q.shape
    heads = [t.view(b, s, n_heads, width // n_heads).transpose(1, 2) for t in (q, k, v)]
    out = nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, width)


class MLP(nn.Module):
    """The block's feed-forward part: widen 4x, GELU, narrow back."""

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden or 4 * dim)
        self.fc2 = nn.Linear(hidden or 4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class Block(nn.Module):
    """A GPT block (pre-LayerNorm): x + attention(norm(x)), then x + MLP(norm(x)). Dropout after
    the attention and the MLP, as in Megatron-LM (off by default, so runs compare exactly)."""

    def __init__(self, dim: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, n_heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))

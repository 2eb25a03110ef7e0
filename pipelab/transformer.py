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

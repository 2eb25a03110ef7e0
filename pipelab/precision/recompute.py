"""Activation recomputation on a Transformer block (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022).

Backward needs what forward computed. Keeping all of it costs, per block, about sbh(34 + 5as/h)
bytes in 16-bit (s tokens, b sequences, h width, a heads): the 5as/h part is the attention's
scores and softmax, a x s x s per sequence, which grows with s squared. Recomputation keeps less and
runs part of the forward again in backward:

- "none": keep everything;
- "full": keep only the block's input and run its whole forward again (about a third more compute);
- "selective": keep everything but the attention's scores and softmax, and recompute only those:
  the s-squared part is gone, and its matrix products are a few percent of the block's FLOPs.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipelab.transformer import Block

MODES = ("none", "full", "selective")


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V per head, causal, written out so its a x s x s scores are tensors
    autograd keeps (a fused kernel would hide them). (batch, seq, width) in and out."""
    b, s, width = q.shape
    q, k, v = (t.view(b, s, n_heads, width // n_heads).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(width // n_heads)
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, width)


class RecomputedBlock(nn.Module):
    """Lesson 12's GPT block (`pipelab.transformer.Block`, its weights) run with recomputation
    `mode`: "none", "full" (checkpoint the block) or "selective" (checkpoint the attention core)."""

    def __init__(self, block: Block, mode: str = "none"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.block, self.mode = block, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "full":  # keep x only; the whole forward runs again in backward
            return checkpoint(self.layer, x, use_reentrant=True)
        return self.layer(x)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        blk, attn = self.block, self.block.attn
        h = blk.ln1(x)
        q, k, v = attn.q(h), attn.k(h), attn.v(h)
        if self.mode == "selective":  # keep q, k, v; scores and softmax are recomputed in backward
            core = checkpoint(attention_core, q, k, v, attn.n_heads, use_reentrant=True)
        else:
            core = attention_core(q, k, v, attn.n_heads)
        x = x + blk.dropout(attn.out(core))
        return x + blk.dropout(blk.mlp(blk.ln2(x)))

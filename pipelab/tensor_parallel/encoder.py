"""Lesson 10's encoder layer (`nn.TransformerEncoderLayer`, queries, keys and values packed in one
matrix) cut across a tensor-parallel group, for the 3-D grid of lesson 12.

The same two cuts as `layers.ParallelBlock`: the packed matrix's query, key and value rows are split
by heads into one column-parallel layer, the output projection is row parallel; the feed-forward's
first layer is column parallel, its second row parallel. The LayerNorms stay whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelab.tensor_parallel.comm import TensorParallelGroup
from pipelab.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, _check_divides, _copy_layer_norm
from pipelab.transformer import attend


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """A plain linear layer holding these weights (a view into the packed matrix is enough to cut)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


class ParallelEncoderLayer(nn.Module):
    """`layer` (causal self-attention, then the feed-forward, each with a residual and a LayerNorm,
    after the sum by default or before it with `norm_first`) with its matrices cut over `tp`."""

    def __init__(self, layer: nn.TransformerEncoderLayer, tp: TensorParallelGroup):
        super().__init__()
        attn, width = layer.self_attn, layer.self_attn.embed_dim
        _check_divides("nhead", attn.num_heads, tp)
        w, b = attn.in_proj_weight.detach(), attn.in_proj_bias.detach()
        packed = [_linear(w[i * width:(i + 1) * width], b[i * width:(i + 1) * width]) for i in range(3)]
        self.qkv = ColumnParallelLinear(packed, tp)
        self.out = RowParallelLinear(attn.out_proj, tp)
        self.local_heads = attn.num_heads // tp.size
        self.fc1 = ColumnParallelLinear(layer.linear1, tp)
        self.fc2 = RowParallelLinear(layer.linear2, tp)
        self.norm1, self.norm2 = _copy_layer_norm(layer.norm1), _copy_layer_norm(layer.norm2)
        self.activation, self.norm_first = layer.activation, layer.norm_first

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(attend(q, k, v, self.local_heads))  # causal, as lesson 10's layer masks itself

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_first:
            x = x + self.attention(self.norm1(x))
            return x + self.feed_forward(self.norm2(x))
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.feed_forward(x))


def parallel_stage(stage: nn.Sequential, tp: TensorParallelGroup) -> nn.Sequential:
    """A pipeline stage of lesson 10's model with its encoder layers cut over `tp` (the embedding,
    positional encoding and decoder stay whole on every rank of the group); names are kept."""
    return nn.Sequential(*[ParallelEncoderLayer(layer, tp) if isinstance(layer, nn.TransformerEncoderLayer) else layer
                           for layer in stage])

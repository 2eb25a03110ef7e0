"""All-to-all context parallelism (DeepSpeed-Ulysses, Jacobs et al., 2023): re-shard from the
sequence to the heads, attend over the whole sequence for a subset of heads, re-shard back.

Each rank holds every head for s/n tokens. One `all_to_all_single` sends head group j of its tokens
to rank j, so afterwards rank j holds head group j for all s tokens: plain attention runs on it,
causal or not, with nothing to merge. A second all-to-all puts the output back on the sequence
shards. Backward is the same two exchanges in reverse. The heads must divide by the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from pipelab.context_parallel.ring import Ring


def _all_to_all(send: torch.Tensor, ring: Ring, direction: str) -> torch.Tensor:
    """Rank i's send[j] arrives as rank j's recv[i]; each rank keeps 1/n of its tensor and sends the rest."""
    recv = torch.empty_like(send)
    if ring.meter is not None:
        ring.meter.add("all_to_all", direction, send.numel() * send.element_size() * (ring.size - 1) // ring.size)
    with ring.span("all_to_all", "comm"):
        dist.all_to_all_single(recv, send, group=ring.group)
    return recv


def sequence_to_heads(x: torch.Tensor, ring: Ring, direction: str = "forward") -> torch.Tensor:
    """(batch, heads, s/n, d) on every rank -> (batch, heads/n, s, d): its head group, all tokens."""
    b, h, s_local, d = x.shape
    n = ring.size
    send = x.reshape(b, n, h // n, s_local, d).transpose(0, 1).contiguous()  # [j] = head group j
    recv = _all_to_all(send, ring, direction)  # [i] = rank i's tokens of my head group
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s_local, d)


def heads_to_sequence(y: torch.Tensor, ring: Ring, direction: str = "forward") -> torch.Tensor:
    """(batch, heads/n, s, d) -> (batch, heads, s/n, d): the inverse of `sequence_to_heads`."""
    b, h_local, s, d = y.shape
    n = ring.size
    send = y.reshape(b, h_local, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [j] = rank j's tokens
    recv = _all_to_all(send, ring, direction)  # [i] = head group i of my tokens
    return recv.transpose(0, 1).reshape(b, n * h_local, s // n, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x, ring: Ring):
        ctx.ring = ring
        return sequence_to_heads(x, ring)

    @staticmethod
    def backward(ctx: FunctionCtx, grad):
        return heads_to_sequence(grad, ctx.ring, "backward"), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, y, ring: Ring):
        ctx.ring = ring
        return heads_to_sequence(y, ring)

    @staticmethod
    def backward(ctx: FunctionCtx, grad):
        return sequence_to_heads(grad, ctx.ring, "backward"), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                      causal: bool = False) -> torch.Tensor:
    """This rank's contiguous sequence shard of attention: q, k, v are (batch, heads, s/n, head_dim)."""
    q, k, v = (_SequenceToHeads.apply(t, ring) for t in (q, k, v))
    with ring.span("attn", "compute"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _HeadsToSequence.apply(out, ring)

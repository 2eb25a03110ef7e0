"""Ring attention (Liu et al., "Ring Attention with Blockwise Transformers", 2023): the sequence is
sharded over n ranks; each rank keeps its queries, and the key/value blocks travel around the ring.

Forward, n steps: attend the queries to the key/value block in hand while the block is already
being passed to the next rank (one batched isend/irecv pair per step, so the transfer can hide
behind the compute), and merge each step's partial result with the online softmax. A rank keeps
only its own rows of the output and their log-sum-exp.

Backward, n steps again: each block's gradient contribution is rebuilt from the final output and
log-sum-exp; dQ stays home, while dK and dV travel with their keys and values, each rank adding its
part, and one last pass brings them home.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from pipelab.context_parallel.layout import Layout, causal_pair
from pipelab.context_parallel.online_softmax import attend_block, block_grads, merge
from pipelab.tensor_parallel.comm import CommMeter


@dataclass
class Ring:
    """The ranks of a context-parallel group in ring order: this rank sends to the next and
    receives from the previous. Every message adds its bytes to `meter`; `rec` (a timeline
    Recorder) gets a span per block of attention and per transfer."""

    rank: int
    size: int
    group: object = None  # a torch.distributed ProcessGroup (None: the default group)
    meter: CommMeter | None = None
    rec: object = None

    @classmethod
    def world(cls, **kwargs) -> "Ring":
        return cls(dist.get_rank(), dist.get_world_size(), **kwargs)

    def pass_on(self, block: torch.Tensor, direction: str):
        """Start sending `block` to the next rank and receiving the previous rank's into a new
        buffer, as one batch (so NCCL pairs them and neither waits for the other). Returns the
        buffer and the handles to wait on."""
        incoming = torch.empty_like(block)
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [dist.P2POp(dist.isend, block, nxt, self.group), dist.P2POp(dist.irecv, incoming, prev, self.group)]
        if self.meter is not None:
            self.meter.add("ring", direction, block.numel() * block.element_size())
        return incoming, dist.batch_isend_irecv(ops)

    def span(self, kind: str, lane: str, **meta):
        return self.rec.span(kind, lane=lane, **meta) if self.rec is not None else nullcontext()


def _pairs(layout: Layout, q_rank: int, k_rank: int, chunk: int, causal: bool, device=None):
    """The (query chunk, key chunk, mask) blocks rank `q_rank` computes against the keys of rank
    `k_rank`, as positions within the two shards. Causal blocks entirely in the future are left out."""
    for i, qc in enumerate(layout.chunks(q_rank)):
        for j, kc in enumerate(layout.chunks(k_rank)):
            sees, mask = causal_pair(qc, kc, chunk) if causal else (True, None)
            if sees:
                mask = mask if mask is None else mask.to(device)
                yield slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk), mask


class RingAttention(torch.autograd.Function):
    """softmax(Q K^T / sqrt(d)) V for this rank's queries over every rank's keys and values."""

    @staticmethod
    def forward(ctx: FunctionCtx, q, k, v, ring: Ring, layout: Layout, causal: bool):
        scale = q.shape[-1] ** -0.5
        chunk = q.shape[2] // len(layout.chunks(ring.rank))
        state: dict[int, tuple] = {}  # per query chunk (by its first row): output and log-sum-exp so far
        kv, owner = torch.stack([k, v]), ring.rank
        for step in range(ring.size):
            if step < ring.size - 1:  # the next block is on its way while this one is computed
                incoming, handles = ring.pass_on(kv, "forward")
            with ring.span("attn", "compute", step=step, source=owner):
                for qs, ks, mask in _pairs(layout, ring.rank, owner, chunk, causal, q.device):
                    o, l = attend_block(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, mask)
                    state[qs.start] = merge(*state.get(qs.start, (None, None)), o, l)
            if step < ring.size - 1:
                with ring.span("kv", "comm", step=step):
                    for h in handles:
                        h.wait()
                kv, owner = incoming, (owner - 1) % ring.size
        out = torch.cat([state[s][0] for s in sorted(state)], 2)
        lse = torch.cat([state[s][1] for s in sorted(state)], 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout, ctx.causal, ctx.scale, ctx.chunk = ring, layout, causal, scale, chunk
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, n = ctx.ring, ctx.ring.size
        dq = torch.zeros_like(q)
        travelling = torch.cat([torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)])  # K, V, dK, dV
        owner = ring.rank
        for step in range(n):
            kk, vv, dk, dv = travelling  # views: adding to dk, dv adds to the travelling buffer
            with ring.span("attn grad", "compute", step=step, source=owner):
                for qs, ks, mask in _pairs(ctx.layout, ring.rank, owner, ctx.chunk, ctx.causal, q.device):
                    gq, gk, gv = block_grads(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], out[:, :, qs],
                                             lse[:, :, qs], grad_out[:, :, qs], ctx.scale, mask)
                    dq[:, :, qs] += gq
                    dk[:, :, ks] += gk
                    dv[:, :, ks] += gv
            # Pass keys, values and their gradients so far on; after the last block only the
            # gradients travel, one more hop, home to the rank that owns those keys.
            outgoing = travelling if step < n - 1 else travelling[2:].contiguous()
            if n > 1:
                incoming, handles = ring.pass_on(outgoing, "backward")
                with ring.span("kv grad", "comm", step=step):
                    for h in handles:
                        h.wait()
                travelling, owner = incoming, (owner - 1) % n
            else:
                travelling = outgoing
        dk, dv = travelling[-2], travelling[-1]
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, layout: Layout,
                   causal: bool = False) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence: q, k, v are (batch, heads, tokens,
    head_dim), this rank's shard in `layout`; the output is sharded the same way."""
    return RingAttention.apply(q, k, v, ring, layout, causal)

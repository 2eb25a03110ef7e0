"""Attention over one block of keys, and the online softmax that merges blocks into the whole.

softmax(S) V over all keys can be computed one block of keys at a time (Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018; FlashAttention, Dao et al., 2022): each block
gives its output already normalised over its own keys, O_b, and its log-sum-exp, L_b = log sum_j
exp(S_j) over the block's keys. Two blocks merge exactly:

    L = log(exp(L_a) + exp(L_b)),   O = exp(L_a - L) O_a + exp(L_b - L) O_b

Keeping L, not the scores, is what lets ring attention hold only its own queries' rows: the
backward pass rebuilds each block's probabilities as exp(S - L) from the final L.
"""

from __future__ import annotations

import torch


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """S = Q K^T * scale, with -inf where `mask` is False (a key the query may not see)."""
    s = q @ k.transpose(-2, -1) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def attend_block(q, k, v, scale: float, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries `q` over one block of keys and values: (O_b, L_b), O_b normalised over
    the block only. Every query row must see at least one key of the block."""
    s = scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def merge(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' partial results -> the result over both (exact: no approximation)."""
    if out_a is None:  # nothing merged yet
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


def block_grads(q, k, v, out, lse, grad_out, scale: float, mask: torch.Tensor | None = None):
    """The gradients one block of keys and values contributes, from the final `out` and `lse`
    (FlashAttention's backward): P = exp(S - L), dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(dO * O)), dQ = dS K * scale, dK = dS^T Q * scale."""
    p = torch.exp(scores(q, k, scale, mask) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ grad_out
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv

"""Lesson 14's exercise: merge two blocks' partial attention results with the online softmax."""

import torch


def my_merge(out_a, lse_a, out_b, lse_b):
    """out_*: (batch, heads, queries, head_dim) normalised over its own block; lse_*: (batch, heads,
    queries), the log-sum-exp of its block's scores. Return (out, lse) over both blocks."""
    lse = torch.logaddexp(lse_a, lse_b)  # log(exp(L_a) + exp(L_b)) without overflow
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse

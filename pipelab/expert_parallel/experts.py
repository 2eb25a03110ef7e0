"""A bank of expert MLPs: expert e computes gelu(x W_in[e]) W_out[e] on the tokens routed to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """`n_experts` two-layer MLPs of width `dim` and hidden size `hidden`, stored as two stacked
    weights (E, dim, hidden) and (E, hidden, dim) so a subset can be cut out for one rank."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(n_experts, dim, hidden) * dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(n_experts, hidden, dim) * hidden ** -0.5)

    @property
    def count(self) -> int:
        return self.w_in.shape[0]

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert` (an index into this bank) on its tokens x (n, dim)."""
        return F.gelu(x @ self.w_in[expert]) @ self.w_out[expert]

    def slice(self, first: int, count: int) -> "Experts":
        """A new bank holding copies of experts first .. first + count - 1 (one rank's share)."""
        part = Experts(count, self.w_in.shape[1], self.w_in.shape[2])
        with torch.no_grad():
            part.w_in.copy_(self.w_in[first:first + count])
            part.w_out.copy_(self.w_out[first:first + count])
        return part

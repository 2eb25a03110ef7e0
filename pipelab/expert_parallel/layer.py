"""A Mixture-of-Experts layer in one process: route, keep within capacity, compute, combine."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipelab.expert_parallel.experts import Experts
from pipelab.expert_parallel.routing import Routing, capacity, keep_within_capacity, load_balancing_loss, route


@dataclass
class MoEOutput:
    """The layer's output for T tokens, its balancing loss, and where the tokens went."""

    y: torch.Tensor  # (T, dim): the weighted sum of each token's kept experts' outputs
    aux_loss: torch.Tensor  # Switch Transformer's load-balancing loss of this batch
    routing: Routing
    tokens_per_expert: torch.Tensor  # (E,): assignments each expert computed (after capacity)


def route_tokens(router: nn.Module, x: torch.Tensor, n_experts: int, k: int, capacity_factor: float) -> Routing:
    """Each token's top-k experts and weights, and which assignments fit in their expert's capacity."""
    probs, weights, experts = route(router(x), k)
    cap = capacity(x.shape[0], n_experts, k, capacity_factor)
    return Routing(probs, weights, experts, keep_within_capacity(experts, n_experts, cap), cap)


class MoELayer(nn.Module):
    """A router (one linear layer, a score per expert) and `n_experts` expert MLPs; each token goes
    to its `k` most probable experts, each expert takes at most capacity_factor x its fair share."""

    def __init__(self, dim: int, hidden: int, n_experts: int, k: int, capacity_factor: float):
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden)
        self.n_experts, self.k, self.capacity_factor = n_experts, k, capacity_factor

    def route(self, x: torch.Tensor) -> Routing:
        return route_tokens(self.router, x, self.n_experts, self.k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        """x: (T, dim) tokens. Every expert computes its kept tokens; each token's output is the
        weighted sum of its experts' outputs (zero for a token all of whose assignments dropped)."""
        r = self.route(x)
        y = torch.zeros_like(x)
        for e in range(self.n_experts):
            token, slot = torch.nonzero((r.experts == e) & r.keep, as_tuple=True)
            if token.numel():
                out = self.experts(x[token], e) * r.weights[token, slot, None]
                y = y.index_add(0, token, out)
        kept = r.experts[r.keep]
        return MoEOutput(y, load_balancing_loss(r.probs, r.experts, self.n_experts), r,
                         torch.bincount(kept, minlength=self.n_experts))

"""Routing a token to its experts: the router's scores, top-k, capacity, and the balancing loss.

A router is one linear layer: a score per expert for each token. Softmax turns the scores into
probabilities; each token goes to its k most probable experts, weighted by those probabilities.
An expert takes at most `capacity` assignments per batch (a fixed buffer, so shapes are known
ahead); the rest are dropped (the token skips that expert; a residual connection carries it on).
Switch Transformer's auxiliary loss pushes the router toward an even load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Routing:
    """Where a batch of T tokens goes: each token's k experts and their weights, and which of those
    assignments fit within their expert's capacity."""

    probs: torch.Tensor  # (T, E): the router's softmax over experts
    weights: torch.Tensor  # (T, k): the chosen experts' probabilities, the combine's weights
    experts: torch.Tensor  # (T, k): the chosen experts, most probable first
    keep: torch.Tensor  # (T, k): True where the assignment fits in its expert's capacity
    capacity: int

    @property
    def dropped(self) -> torch.Tensor:
        return ~self.keep


def route(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over the experts' scores (T, E), then each token's top k: (probs, weights, experts)."""
    probs = F.softmax(scores, dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    return probs, weights, experts


def capacity(tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Assignments one expert takes per batch: capacity_factor x its fair share, tokens x k / E
    (Switch Transformer, eq. 3; GShard's expert capacity)."""
    return math.ceil(capacity_factor * tokens * k / n_experts)


def keep_within_capacity(experts: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments (T, k) an expert with room for `capacity` takes. Every token's first choice
    queues before any token's second choice (GShard), and tokens queue in batch order; an
    assignment whose place in its expert's queue is `capacity` or later is dropped."""
    tokens, k = experts.shape
    queue = experts.t().reshape(-1)  # first choices of all tokens, then second choices, ...
    one_hot = F.one_hot(queue, n_experts)
    place = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # how many went to this expert before it
    return (place < capacity).reshape(k, tokens).t()


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_i f_i * P_i (eq. 4): f_i the fraction of
    assignments routed to expert i (counted, no gradient), P_i the mean probability the router gave
    it (differentiable). Its minimum, 1, is an even load; it grows as the load concentrates."""
    f = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype) / experts.numel()
    p = probs.mean(dim=0)
    return n_experts * (f * p).sum()

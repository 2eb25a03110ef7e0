"""Modelled time of a Mixture-of-Experts layer on an emulated node (lesson 15): an expert MLP's
forward or backward on so many tokens, one rank's all-to-all, a whole expert-parallel step from
where the tokens went, and the scaling book's condition for the all-to-alls to hide."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from pipelab.emulate.cost import Counts, compute_seconds, forward_backward_counts, message_seconds
from pipelab.emulate.specs import parse_node, torch_dtype
from pipelab.timeline import Span, Timeline


def all_to_all_seconds(nbytes: float, node: str) -> float:
    """Modelled seconds of a rank sending `nbytes` to the `node`'s other ranks ("2xH100-nvlink"),
    one message each, back to back (latency + bytes / bandwidth each)."""
    n = parse_node(node)
    peers = n.count - 1
    return peers * message_seconds(nbytes / peers, n.link) if peers and nbytes else 0.0


def expert_seconds(kind: str, tokens: int, dim: int, hidden: int, node: str, dtype: str = "bfloat16") -> float:
    """Modelled seconds of one expert MLP (dim -> hidden -> dim) on `tokens` tokens, `kind` "forward"
    or "backward", counted on the meta device and timed by the calibrated roofline of `node`'s device."""
    if kind not in ("forward", "backward"):
        raise ValueError(f"kind must be 'forward' or 'backward', got {kind!r}")
    if tokens == 0:
        return 0.0
    fixed, per_token = _expert_counts(kind, dim, hidden, dtype)
    counts = Counts(fixed.flops + tokens * per_token.flops, fixed.bytes + tokens * per_token.bytes, fixed.kernels)
    return compute_seconds(counts, parse_node(node).device, dtype)


@lru_cache(maxsize=64)
def _expert_counts(kind: str, dim: int, hidden: int, dtype: str) -> tuple[Counts, Counts]:
    """An expert MLP's FLOPs and bytes as fixed + per token (both are affine in the token count:
    the weights are read once, every activation grows with the tokens), counted at 1 and 2 tokens."""
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.GELU(), nn.Linear(hidden, dim, bias=False))

    def counts(tokens: int) -> Counts:
        f, i, w = forward_backward_counts(mlp, torch.empty(tokens, dim, device="meta"), torch_dtype(dtype))
        return f if kind == "forward" else i + w

    one, two = counts(1), counts(2)
    per_token = Counts(two.flops - one.flops, two.bytes - one.bytes, 0)
    return Counts(one.flops - per_token.flops, one.bytes - per_token.bytes, one.kernels), per_token


def hiding_condition(node: str, tokens: int, top_k: int, experts: int, dim: int, hidden: int,
                     dtype: str = "bfloat16") -> dict:
    """The scaling book's comparison for one expert layer, per rank with T `tokens`, k experts each,
    width D, expert hidden size F, b bytes per value, over n ranks: four all-to-alls of
    T k D b (n-1)/n bytes at W bytes/s against the experts' 12 T k D F FLOPs at C FLOP/s. Hidden
    when F > (n-1)/n * b * C / (3 W); C and W are what the calibrated model reaches at these sizes."""
    n, b = parse_node(node), torch_dtype(dtype).itemsize
    per_expert = tokens * top_k // experts  # one expert's tokens at an even load
    rate = 4 * per_expert * dim * hidden / expert_seconds("forward", per_expert, dim, hidden, node, dtype)
    sent = tokens * top_k * dim * b * (n.count - 1) / n.count
    bandwidth = sent / all_to_all_seconds(sent, node)
    threshold = (n.count - 1) / n.count * b * rate / (3 * bandwidth)
    return {"link": n.link.name, "threshold F": threshold, "formula: compute / all-to-all": hidden / threshold}


@dataclass
class ModelledStep:
    """One step of an expert-parallel layer in modelled time, from where the tokens really went."""

    timeline: Timeline
    node: str
    all_to_all: float  # seconds of one all-to-all (the busiest rank's share sets it)
    experts: list[float]  # per rank: its experts' forward + backward seconds
    assignments: list[int]  # per rank: the assignments its experts computed

    @property
    def step(self) -> float:
        return self.timeline.makespan

    @property
    def communication(self) -> float:
        return 4 * self.all_to_all  # dispatch and combine, forward and backward


def moe_step(counts: torch.Tensor, node: str, dim: int, hidden: int, dtype: str = "bfloat16") -> ModelledStep:
    """The step of an expert-parallel group of `node`'s ranks, `counts` (ranks, experts) the assignments
    each rank sends each expert: dispatch, the experts' forward, combine; in backward the combine's and
    dispatch's all-to-alls the other way around the experts' backward. An all-to-all ends for all
    when the last rank reaches it."""
    n = parse_node(node).count
    local = counts.shape[1] // n
    between = counts.view(n, n, local).sum(2) * (1 - torch.eye(n, dtype=counts.dtype))  # [source, dest], off-rank
    row = dim * torch_dtype(dtype).itemsize
    a2a = all_to_all_seconds(float(torch.maximum(between.sum(1), between.sum(0)).max()) * row, node)
    arrived = counts.sum(0).view(n, local).round().long()  # per rank, per local expert

    def experts(kind: str, rank: int) -> float:
        return sum(expert_seconds(kind, int(t), dim, hidden, node, dtype) for t in arrived[rank])

    fwd, bwd = [experts("forward", r) for r in range(n)], [experts("backward", r) for r in range(n)]
    spans, t = [], 0.0
    for phase in ("dispatch", "F", "combine", "combine backward", "B", "dispatch backward"):
        lengths = {"F": fwd, "B": bwd}.get(phase, [a2a] * n)
        lane = "compute" if phase in ("F", "B") else "comm"
        spans += [Span(r, lane, phase, t, t + lengths[r]) for r in range(n) if lengths[r] > 0]
        t += max(lengths)
    return ModelledStep(Timeline(spans), node, a2a, [f + b for f, b in zip(fwd, bwd)],
                        [int(a) for a in arrived.sum(1)])

"""Experts over ranks: each rank of an expert-parallel group holds E / n experts; tokens travel to
the rank of their expert and back with two all-to-alls.

Every rank routes its own tokens (the router is replicated). Because a rank cannot know how many
tokens the others will send it, the counts go first: one small all-to-all of per-expert counts, then
`all_to_all_single` with uneven split sizes carries the tokens (dispatch); the experts compute; a
second all-to-all with the splits swapped brings the outputs home (combine). Both are differentiable:
backward runs the same all-to-alls the other way, so an expert's gradient sums the tokens of every
rank of its group.

Expert parallel x data parallel: `world_size = ep x copies` ranks, consecutive ranks form an
expert-parallel group, and ranks at the same place in each group hold copies of the same experts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipelab.expert_parallel.layer import MoELayer, MoEOutput, route_tokens
from pipelab.expert_parallel.routing import load_balancing_loss


@dataclass
class ExpertParallelGroups:
    """This rank's two groups: `ep`, the ranks that split the experts between them, and `copies`,
    the ranks that hold the same experts as this one (one per expert-parallel group)."""

    ep: Any
    ep_size: int
    ep_rank: int
    copies: Any
    copies_size: int
    world_size: int

    @classmethod
    def build(cls, rank: int, world_size: int, ep_size: int) -> "ExpertParallelGroups":
        """Every rank creates every group, in the same order (`new_group` is collective)."""
        ep_groups = [dist.new_group(list(range(s, s + ep_size))) for s in range(0, world_size, ep_size)]
        copy_groups = [dist.new_group(list(range(i, world_size, ep_size))) for i in range(ep_size)]
        return cls(ep_groups[rank // ep_size], ep_size, rank % ep_size, copy_groups[rank % ep_size],
                   world_size // ep_size, world_size)


def all_to_all_counts(send: torch.Tensor, group) -> torch.Tensor:
    """Rank i sends rank j its counts for rank j's experts and receives rank j's counts for its own:
    `send` (E,) per expert, the result (n x E / n) per source rank and local expert."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


class AllToAll(torch.autograd.Function):
    """all_to_all_single that autograd can go back through: row i of the output came from some rank,
    so its gradient goes back to that rank; backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelMoE(nn.Module):
    """`layer` with only this rank's experts (E / ep_size of them, consecutive); the router is a
    copy on every rank. Equal to `layer` run on this rank's tokens in one process."""

    def __init__(self, layer: MoELayer, groups: ExpertParallelGroups):
        super().__init__()
        self.groups = groups
        self.local = layer.n_experts // groups.ep_size
        self.first = groups.ep_rank * self.local
        self.router = copy.deepcopy(layer.router)
        self.experts = layer.experts.slice(self.first, self.local)
        self.n_experts, self.k, self.capacity_factor = layer.n_experts, layer.k, layer.capacity_factor

    def forward(self, x: torch.Tensor) -> MoEOutput:
        r = route_tokens(self.router, x, self.n_experts, self.k, self.capacity_factor)
        token, slot = torch.nonzero(r.keep, as_tuple=True)  # the kept assignments
        expert = r.experts[token, slot]
        order = torch.argsort(expert, stable=True)  # grouped by expert, so by destination rank
        token, slot, expert = token[order], slot[order], expert[order]

        n, g = self.groups.ep_size, self.groups.ep
        send = torch.bincount(expert, minlength=self.local * n)  # per expert, of all ranks
        recv = all_to_all_counts(send, g)  # per (source rank, my expert): counts first
        send_split = send.view(n, self.local).sum(1).tolist()
        recv_split = recv.view(n, self.local).sum(1).tolist()

        arrived = AllToAll.apply(x[token], recv_split, send_split, g)  # dispatch
        # each arrival's local expert: from every source rank, its rows for expert 0, then 1, ...
        mine = torch.arange(self.local, device=x.device).repeat(n).repeat_interleave(recv)
        out = torch.zeros_like(arrived)
        for j in range(self.local):
            rows = torch.nonzero(mine == j, as_tuple=True)[0]
            if rows.numel():
                out = out.index_copy(0, rows, self.experts(arrived[rows], j))
        back = AllToAll.apply(out, send_split, recv_split, g)  # combine: the same exchange reversed

        y = torch.zeros_like(x).index_add(0, token, back * r.weights[token, slot, None])
        return MoEOutput(y, load_balancing_loss(r.probs, r.experts, self.n_experts), r, send)


def reduce_gradients(moe: ExpertParallelMoE) -> None:
    """Gradients of the global loss, the mean over every rank's loss, after each rank's backward.
    The router is a copy on every rank: sum over all ranks, divide by the world size. An expert's
    gradient already sums the tokens of its whole expert-parallel group (the combine's backward
    brought them): sum it over the ranks holding copies, then divide by the WORLD size too, not by
    the number of copies (that leaves it ep_size times too large: pytorch#160285's doubled
    gradients at EP=2)."""
    world = moe.groups.world_size
    for p in moe.router.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    for p in moe.experts.parameters():
        if moe.groups.copies_size > 1:
            dist.all_reduce(p.grad, group=moe.groups.copies)
        p.grad /= world

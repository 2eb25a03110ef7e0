"""Replicas: the same shapes on every rank, and rank 0's values on every rank.

Data parallelism only works if every rank holds the same model. A wrapper checks the shapes first
(so a rank with another model fails loudly on every rank instead of hanging in a collective), then
copies rank 0's parameters and buffers everywhere, so all replicas start equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipelab.models import trainable_parameters


def _shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    params = [(f"parameter {n}", tuple(p.shape), str(p.dtype)) for n, p in trainable_parameters(module)]
    buffers = [(f"buffer {n}", tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return params + buffers


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x[0]} {x[1]} {x[2]} on rank 0 but {y[0]} {y[1]} {y[2]}"
    longer, extra = ("rank 0", a[len(b)]) if len(a) > len(b) else ("it", b[len(a)])
    return f"{longer} has {len(a) if longer == 'rank 0' else len(b)} entries, with {extra[0]}"


def check_replicas(module: nn.Module, group=None) -> None:
    """Raise ValueError on every rank unless all ranks hold a model of the same shape.

    Every rank sends the list of its parameter and buffer shapes to all others, so all ranks
    reach the same verdict and raise together, instead of some hanging in a later collective."""
    mine = _shapes(module)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ValueError(f"rank {rank}'s model differs from rank 0's: {_first_difference(everyone[0], theirs)} "
                             f"on rank {rank}. Every rank must build the same model (same class and "
                             "arguments) before wrapping it; only the weights may differ")
    if not any(kind.startswith("parameter") for kind, _, _ in mine):
        raise ValueError("the module has no parameters that require gradients: there is nothing to "
                         "average. Wrap the model you train (e.g. pipelab.models.mlp([8, 16, 4])), "
                         "or set requires_grad=True on the parameters to train")


def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers into every rank's replica, so all start equal."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            # detached: the same memory without autograd, whichever thread runs the broadcast (grad
            # mode is per thread, and a timed communication layer may run collectives on a thread of its own)
            dist.broadcast(t.detach(), src=src, group=group)

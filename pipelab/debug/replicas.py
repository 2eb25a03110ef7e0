"""Cross-replica checks after a step: replicas that should hold the same gradients (or weights)
compare a checksum of each parameter, and the ones that disagree are named, with the first
parameter that differs.

Data-parallel replicas must end every step with identical gradients (after the all-reduce) and
identical weights (after the optimizer). A bug that skips the gradient sync on some parameters
leaves the loss looking fine -- each replica still trains on its own data -- while the replicas
drift apart. One all-gather of a few numbers per parameter finds it: each rank sums its
parameters' gradients (and their squares, so a sign flip shows), and every rank compares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


def checksums(module: nn.Module, what: str = "grad") -> torch.Tensor:
    """Per parameter (in `named_parameters` order): the sum and the sum of squares of its gradient
    (`what="grad"`) or of its values (`what="weight"`), in float64; a missing gradient counts 0."""
    if what not in ("grad", "weight"):
        raise ValueError(f"what must be 'grad' or 'weight', got {what!r}")
    sums = []
    for _, p in module.named_parameters():
        t = p.grad if what == "grad" else p.detach()
        t = torch.zeros(1) if t is None else t.detach().double().cpu()
        sums += [t.sum(), (t * t).sum()]
    return torch.stack(sums)


@dataclass(frozen=True)
class ReplicaReport:
    """What the check found: the ranks that disagree with the group's first rank (`differ`), and
    for each the first parameter that differs."""

    what: str
    ranks: list[int]
    differ: dict[int, str]  # rank -> first differing parameter's name

    @property
    def agree(self) -> bool:
        return not self.differ

    def __str__(self) -> str:
        if self.agree:
            return f"the {len(self.ranks)} replicas' {self.what}s agree"
        first = self.ranks[0]
        return "; ".join(f"rank {r}'s {self.what}s differ from rank {first}'s, first at parameter {name!r}"
                         for r, name in self.differ.items())


def check_replicas(module: nn.Module, group=None, what: str = "grad", rtol: float = 1e-6) -> ReplicaReport:
    """All-gather every replica's checksums in `group` (default: all ranks) and name the replicas
    whose checksums differ from the group's first rank's, with the first differing parameter.
    Every rank of the group must call it; every rank gets the same report."""
    mine = checksums(module, what)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    names = [name for name, _ in module.named_parameters()]
    differ = {}
    for rank, theirs in zip(ranks[1:], gathered[1:]):
        close = torch.isclose(theirs, gathered[0], rtol=rtol, atol=1e-12).view(-1, 2).all(dim=1)
        if not close.all():
            differ[rank] = names[int((~close).nonzero()[0])]
    return ReplicaReport(what, ranks, differ)

"""A layer's parameters as one flat vector, padded at the end so it splits into `world_size`
equal shards: rank r owns elements [r * shard_numel, (r + 1) * shard_numel).

Sharding works on flat vectors because the collectives do: a reduce-scatter leaves rank r the
r-th equal piece of a vector, an all-gather puts the pieces back together. A layer of 35 values on
4 ranks is padded to 36 (shards of 9); the padding is zero, gets zero gradients, and is never
written back into the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of one layer sits in its flat vector, and how that vector is sharded."""

    names: tuple[str, ...]  # the layer's own parameter names, e.g. ("weight", "bias")
    shapes: tuple[torch.Size, ...]
    world_size: int

    @classmethod
    def of(cls, module: nn.Module, world_size: int) -> "FlatLayout":
        named = list(module.named_parameters(recurse=False))
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named), world_size)

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        """Values in the layer (no padding)."""
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """Values each rank owns: numel / world_size, rounded up."""
        return -(-self.numel // self.world_size)

    @property
    def padded(self) -> int:
        """Length of the flat vector: world_size equal shards."""
        return self.shard_numel * self.world_size

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One new flat vector of the layer's tensors (in `names` order), zero-padded."""
        flat = torch.zeros(self.padded, dtype=tensors[0].dtype, device=tensors[0].device)
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat[:self.numel])
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The layer's tensors as views into `flat` (no copy): writing into `flat` changes them."""
        return [piece.view(shape) for piece, shape in zip(flat[:self.numel].split(self.numels), self.shapes)]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s piece of `flat`, a view."""
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]


@dataclass
class Layer:
    """One unit of sharding: a module that owns parameters itself (each Linear of an MLP)."""

    name: str  # the module's name in the model, e.g. "0" or "blocks.2.mlp"
    module: nn.Module
    layout: FlatLayout

    def parameter_names(self) -> list[str]:
        """Full names, as in `model.named_parameters()`: "0.weight", "0.bias"."""
        return [f"{self.name}.{n}" if self.name else n for n in self.layout.names]


def layers_of(model: nn.Module, world_size: int) -> list[Layer]:
    """The model's units of sharding in forward (registration) order: every module owning
    parameters of its own, each with its flat layout."""
    return [Layer(name, m, FlatLayout.of(m, world_size)) for name, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False))]

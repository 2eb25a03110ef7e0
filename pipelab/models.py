"""Models used by the lessons. Small on purpose: a lesson must run in under a minute on 2 CPU cores.

Each model is seeded by its caller (`torch.manual_seed`) so that a parallel run and its
single-process reference start from the same weights.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(widths: list[int], activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """A stack of Linear layers with `activation` between them: widths [8, 16, 4] -> 8->16->4."""
    if len(widths) < 2:
        raise ValueError(f"mlp needs at least two widths (input and output), got {widths!r}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)

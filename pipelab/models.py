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


def alexnet_layers(num_classes: int = 10) -> list[nn.Module]:
    """AlexNet as a flat layer list (DeepSpeed pipeline example style), ready to cut into stages."""
    return [
        nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.AdaptiveAvgPool2d((6, 6)), nn.Flatten(1),
        nn.Dropout(), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
        nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, num_classes),
    ]

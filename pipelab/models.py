"""Models used by the lessons. Small on purpose: a lesson must run in under a minute on 2 CPU cores.

Each model is seeded by its caller (`torch.manual_seed`) so that a parallel run and its
single-process reference start from the same weights.
"""

from __future__ import annotations

import torch
from torch import nn


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter of `module` that gets a gradient, in registration order."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


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


class ToyModel(nn.Module):
    """The two-device toy model of the PyTorch tutorial: Linear 10->10, ReLU on device 0; Linear 10->5 on device 1."""

    def __init__(self) -> None:
        super().__init__()
        self.seq1 = nn.Sequential(nn.Linear(10, 10), nn.ReLU())
        self.seq2 = nn.Linear(10, 5)
        self.fc = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.seq2(self.seq1(x)))


class ResidualBlock(nn.Module):
    """A residual block: relu(x + conv(relu(conv(x)))), channels and image size unchanged."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class SplitResNet(nn.Module):
    """A small ResNet-style CNN in two halves: `seq1` (device 0), `seq2` and `fc` (device 1).

    `blocks_per_half` is a number of residual blocks for each half, or a pair (seq1's, seq2's)
    to make one half heavier than the other.

    `expansion` > 1 cuts the model in the wide middle of an inverted bottleneck (MobileNetV2,
    ConvNeXt, a transformer's MLP): `seq1` ends with a 1x1 convolution to expansion x channels,
    `seq2` starts with one back. The activation crossing devices is then `expansion` times bigger
    for little extra compute, as when a pipeline is cut where activations are wide."""

    def __init__(self, channels: int = 32, blocks_per_half: int | tuple[int, int] = 2, num_classes: int = 10,
                 expansion: int = 1) -> None:
        super().__init__()
        blocks1, blocks2 = (blocks_per_half, blocks_per_half) if isinstance(blocks_per_half, int) else blocks_per_half
        widen = [nn.Conv2d(channels, expansion * channels, 1), nn.ReLU()] if expansion > 1 else []
        narrow = [nn.Conv2d(expansion * channels, channels, 1), nn.ReLU()] if expansion > 1 else []
        self.seq1 = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(),
                                  *[ResidualBlock(channels) for _ in range(blocks1)], *widen)
        self.seq2 = nn.Sequential(*narrow, *[ResidualBlock(channels) for _ in range(blocks2)],
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.seq2(self.seq1(x)))


class SplitMLP(nn.Module):
    """An MLP in the two halves of the model-parallel lessons: `seq1` (device 0), `seq2` and `fc`
    (device 1). Each half is `layers_per_half` Linear layers of `width` x `width` with ReLUs; `fc`
    maps to `out_features`. `SplitMLP(10, 1, 5)` has the shape of the PyTorch tutorials' ToyModel
    (Linear 10->10, ReLU | Linear 10->5); wider and deeper, each device gets real work and each
    half megabytes of gradients (lesson 05: data parallelism over such replicas)."""

    def __init__(self, width: int = 10, layers_per_half: int = 1, out_features: int = 5) -> None:
        super().__init__()
        if layers_per_half < 1:
            raise ValueError(f"layers_per_half must be >= 1, got {layers_per_half!r}")
        self.seq1 = nn.Sequential(*[m for _ in range(layers_per_half) for m in (nn.Linear(width, width), nn.ReLU())])
        self.seq2 = nn.Sequential(*[m for _ in range(layers_per_half - 1) for m in (nn.Linear(width, width), nn.ReLU())])
        self.fc = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.seq2(self.seq1(x)))

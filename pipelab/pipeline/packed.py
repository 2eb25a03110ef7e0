"""Several values across a traced cut as one message, for pipelab's runtime (lesson 09)."""

from __future__ import annotations

import math

import torch
from torch import nn


class Packed(nn.Module):
    """A traced stage that takes and gives one tensor. pipelab's runtime sends one tensor per
    message, so where several values cross a cut (one that skips a stage, forwarded through it)
    they travel flattened side by side, one row per sample, and are unpacked on arrival."""

    def __init__(self, stage: nn.Module, shapes: list[tuple[int, ...]]):
        super().__init__()
        self.stage, self.shapes = stage, shapes  # each input's shape after the batch dimension

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = [math.prod(shape) for shape in self.shapes]
        inputs = [x] if len(sizes) == 1 else [t.reshape(-1, *shape) for t, shape in
                                               zip(x.split(sizes, dim=1), self.shapes)]
        out = self.stage(*inputs)
        return torch.cat([t.flatten(1) for t in out], dim=1) if isinstance(out, tuple) else out


def packed_stages(stages: list[nn.Module], mb: torch.Tensor) -> list[nn.Module]:
    """The traced `stages`, those that receive or send several values wrapped in `Packed` (the
    shapes from a run of micro-batch `mb` through them)."""
    out_stages, values = [], (mb,)
    with torch.no_grad():
        for stage in stages:
            out = stage(*values)
            several = len(values) > 1 or isinstance(out, tuple)
            out_stages.append(Packed(stage, [tuple(v.shape[1:]) for v in values]) if several else stage)
            values = out if isinstance(out, tuple) else (out,)
    return out_stages

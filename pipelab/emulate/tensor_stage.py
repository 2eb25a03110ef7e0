"""One pipeline stage whose matrices a tensor-parallel group shares, at the emulated size: what lesson
12's 3-D grid times a rank by. Each rank computes 1/t of every matrix product, so its F and B last the
stage's modelled seconds divided by t; its messages are timed at the emulated size too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipelab.emulate.cost import stage_seconds
from pipelab.emulate.table import stage_table


def time_tensor_parallel_stage(ctx: Any, stage: int, module: nn.Module, example: torch.Tensor, tensor: int,
                               message_scale: float, dtype: str = "bfloat16") -> None:
    """On an emulated rank, time `stage` as `module` (the stage at the emulated size, on meta) fed
    `example`, its work split over `tensor` ranks, and every message `message_scale` times larger;
    elsewhere nothing: the rank's own clock times it."""
    if ctx.emulator is None:
        return
    seconds = stage_seconds(module, example, ctx.emulator.node.device, dtype)
    ctx.emulator.scale_messages(message_scale, 1.0)
    ctx.emulator.use(stage_table({stage: {kind: s / tensor for kind, s in seconds.items()}}))

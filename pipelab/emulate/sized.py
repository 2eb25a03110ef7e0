"""Cost tables for lessons whose ranks compute a small model but are timed at a large one.

Lesson 13 cuts `layers` equal Linear + Tanh layers into stages; lesson 11 shards a model layer by
layer. The emulator counts the same layers at the emulated size on the meta device (shapes, no
memory) and hands back the table a rank's clock looks its spans up in (`table.CostTable`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pipelab.emulate.cost import forward_backward_counts, stage_seconds
from pipelab.emulate.table import CostTable, sharded_table, stage_table


def tanh_stages(stages: Iterable[int], layers: int, width: int, rows: int, device, dtype: str) -> CostTable:
    """Each of `stages` as `layers` Linear(width) + Tanh layers fed `rows` rows: its modelled F, B, I, W."""
    big = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh()))).to("meta")
    seconds = stage_seconds(big, torch.empty(rows, width, device="meta"), device, dtype)
    return stage_table({s: seconds for s in stages})


def sharded_layers(layers: list[tuple[str, nn.Module]], model: nn.Module, x: torch.Tensor, rows: int) -> CostTable:
    """Each named layer's forward and backward (FLOPs and bytes) for `rows` rows of what `model`
    feeds it on `x`: a sharded model's table at the emulated batch."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda _, args, n=name: inputs.setdefault(n, args[0])) for name, m in layers]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    costs = []
    for name, module in layers:
        example = torch.empty(rows, *inputs[name].shape[1:], dtype=inputs[name].dtype).requires_grad_()
        forward, backward_input, backward_weight = forward_backward_counts(module, example)
        costs.append((forward, backward_input + backward_weight))
    return sharded_table([name for name, _ in layers], costs)


def time_tanh_stages(ctx, stages: Iterable[int], layers: int, size) -> None:
    """On an emulated rank, time `stages` as `layers` Linear + Tanh layers each at `size` (its width,
    rows and dtype, e.g. a Config's `cfg.size`); elsewhere nothing: the rank's own clock times them."""
    if ctx.emulator is not None:
        ctx.emulator.use(tanh_stages(stages, layers, size.width, size.rows, ctx.emulator.node.device, size.dtype))


def untimed(ctx) -> None:
    """On an emulated rank, stop timing by the cost table: what runs next is checked, not timed."""
    if ctx.emulator is not None:
        ctx.emulator.use(None)


def time_sharded_layers(ctx, layers: list[tuple[str, nn.Module]], model: nn.Module, x: torch.Tensor, rows: int) -> None:
    """On an emulated rank, time each named layer's forward and backward at `rows` rows (`sharded_layers`)."""
    if ctx.emulator is not None:
        ctx.emulator.use(sharded_layers(layers, model, x, rows))

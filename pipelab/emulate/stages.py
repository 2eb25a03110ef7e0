"""A pipeline's stages at the emulated size: what an emulated node's ranks are timed by.

A lesson computes at a small size on this machine's CPU, but times each action as the same stages
would take at a GPU's size (`emulate.cost.stage_seconds`, counted on the meta device: shapes and no
memory) and tracks each rank's memory at that size (`emulate.memory`). `emulated_stages` counts every
stage once, in the parent; the ranks (their clocks' cost tables, `table.stage_table`) and the
simulator (`experiments.pipeline.Config.simulated_costs`) then use the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn



@dataclass(frozen=True)
class EmulatedStage:
    """One stage at the emulated size: `module` (on meta, the last stage with its loss) fed
    `example` (one micro-batch on meta); each kind's modelled `seconds`; the bytes one
    micro-batch's forward stashes (`stash_bytes`; its input alone, `input_bytes`, when
    checkpointed); its output's bytes (one message); and `held_bytes`, what the stage holds whatever
    runs (parameters, gradients, optimizer state)."""

    module: nn.Module = field(repr=False)
    example: torch.Tensor = field(repr=False)
    seconds: dict[str, float]
    stash_bytes: float
    input_bytes: float
    output_bytes: float
    held_bytes: float


class WithLoss(nn.Module):
    """The last stage and its loss as one module, so that counting it counts the loss too."""

    def __init__(self, stage: nn.Module, loss_fn: Callable, target: torch.Tensor):
        super().__init__()
        self.stage, self.loss_fn = stage, loss_fn
        self.register_buffer("target", target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.stage(x), self.target)


def emulated_stages(stages: Sequence[nn.Module], x: torch.Tensor, loss_fn: Callable, node, dtype: str,
                    optimizer: str) -> dict[int, EmulatedStage]:
    """Every stage at the emulated size, counted on the meta device: its F, I, W (B = I + W, as
    the simulator prices it) on `node`'s device, its stash and its fixed memory. Every rank and the
    simulator use these same figures."""
    from pipelab.emulate.cost import meta_inputs, meta_module, stage_seconds
    from pipelab.emulate.memory import input_bytes, stage_memory, stashed_bytes
    from pipelab.emulate.specs import torch_dtype

    cast = torch_dtype(dtype)
    out, h = {}, meta_inputs(x, cast)[0]
    for s, stage in enumerate(stages):
        module = meta_module(stage, cast)
        with torch.no_grad():
            y = module(h)
        counted = WithLoss(module, loss_fn, torch.empty_like(y)) if s == len(stages) - 1 else module
        t = stage_seconds(counted, h, node.device, dtype)
        fixed = stage_memory(counted, h, node.device, optimizer=optimizer, microbatches_in_flight=0, dtype=cast)
        out[s] = EmulatedStage(counted, h, {"F": t["F"], "I": t["I"], "W": t["W"], "B": t["I"] + t["W"]},
                               stashed_bytes(counted, h, cast), input_bytes(h), y.numel() * y.element_size(),
                               fixed.total)
        h = y
    return out

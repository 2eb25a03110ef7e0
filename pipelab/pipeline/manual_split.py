"""The torch example's pipeline split by hand: each process keeps its stage's share of the
Transformer's layers and deletes the rest (names unchanged), with example tensors that fix the
shapes `torch.distributed.pipelining.PipelineStage` sends and receives (lesson 09)."""

from __future__ import annotations

import copy

import torch

from pipelab.transformer import Transformer


def manual_stage(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """The example's split by hand: this stage's share of the layers (names unchanged), the embedding
    on the first stage only, the norm and output on the last only."""
    mod = copy.deepcopy(model)
    n = len(mod.layers)
    keep = range(stage * n // num_stages, (stage + 1) * n // num_stages)
    for i in range(n):
        if i not in keep:
            del mod.layers[str(i)]
    if stage > 0:
        mod.tok_embeddings = None
    if stage < num_stages - 1:
        mod.norm, mod.output = None, None
    return mod


def layer_split_points(model: Transformer, num_stages: int) -> list[str]:
    """The names of the layers that start stages 1, 2, ...: the layers shared out evenly."""
    n = len(model.layers)
    return [f"layers.{s * n // num_stages}" for s in range(1, num_stages)]


def example_io(model: Transformer, stage: int, num_stages: int, mb: torch.Tensor) -> tuple:
    """Example input and output of a manual stage on micro-batch `mb`. Given to `PipelineStage` they
    fix the shapes up front with contiguous buffers: inferred from a backward, a decoder layer's input
    gradient is not contiguous, and gloo refuses to receive into it."""
    h = mb
    with torch.no_grad():
        for s in range(stage + 1):
            inputs, h = h, manual_stage(model, s, num_stages)(h)
    # Floating-point tensors are marked as wanting gradients: torch sizes the gradient buffers after them.
    return tuple(t.contiguous().requires_grad_(t.is_floating_point()) for t in (inputs, h))

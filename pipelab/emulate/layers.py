"""A flat list of layers at the emulated size: each layer's modelled seconds, a stage's cost table.

Lesson 08's models are DeepSpeed-style layer lists (modules, `LayerSpec`s, plain functions). Each
layer is counted on the meta device, fed the previous layer's output, so any size costs no memory
and the same layers always get the same times; a stage's time is the sum of its layers' (the device
runs them one after another).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipelab.emulate.cost import meta_module, stage_seconds, to_meta
from pipelab.emulate.specs import torch_dtype
from pipelab.emulate.table import CostTable, stage_table


class Apply(nn.Module):
    """A plain function of one tensor (or a tied layer's `forward_fn`) as a module, so that it can
    be counted; `module`, if given, is what the function uses (its weights count)."""

    def __init__(self, fn, module: nn.Module | None = None):
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, x):
        return self.fn(x) if self.module is None else self.fn(self.module, x)


def counted_layer(layer) -> nn.Module:
    """A META copy of `layer` to count (a spec, anything with `build()`, built there; a function
    wrapped; the caller's layer untouched), in-place operators made out-of-place: they move the same
    bytes, and the counted input is a leaf, which autograd does not let an operator overwrite."""
    if hasattr(layer, "build") and not isinstance(layer, nn.Module):
        with torch.device("meta"):
            built = layer.build()
        forward_fn = getattr(layer, "forward_fn", None)
        module = built if forward_fn is None else Apply(forward_fn, built)
    elif isinstance(layer, nn.Module):
        module = copy.deepcopy(meta_module(layer))
    else:
        module = Apply(layer)
    for m in module.modules():
        if getattr(m, "inplace", False):
            m.inplace = False
    return module


def layer_seconds(layers: list, example: torch.Tensor, device, dtype="float32") -> list[dict[str, float]]:
    """Each layer's modelled F, B, I and W seconds on `device` (a `specs.Device`) in `dtype` for one
    micro-batch shaped like `example` (a META tensor will do), each layer fed the one before's output."""
    x, seconds = to_meta(example), []
    for layer in layers:
        module = counted_layer(layer)
        seconds.append(stage_seconds(module, x, device, dtype))
        with torch.no_grad():
            x = module(x)
    return seconds


def activation_bytes(layers: list, example: torch.Tensor, upto: int, dtype=None) -> int:
    """Bytes of what layer `upto` receives (what the first `upto` layers make of `example`), counted
    on the meta device, its floating values in `dtype` if given."""
    x = to_meta(example)
    with torch.no_grad():
        for layer in layers[:upto]:
            x = counted_layer(layer)(x)
    itemsize = torch_dtype(dtype).itemsize if dtype is not None and x.is_floating_point() else x.element_size()
    return x.numel() * itemsize


def layer_stage_table(layers: list, example: torch.Tensor, device, dtype: str, stage: int, lo: int, hi: int) -> CostTable:
    """The cost table of `stage`, layers `lo` to `hi` of `layers`: its F and B the sums of its layers'."""
    seconds = layer_seconds(layers[:hi], example, device, dtype)[lo:]
    return stage_table({stage: {kind: sum(s[kind] for s in seconds) for kind in ("F", "B")}})


def chained_flops(layers: list, example: torch.Tensor) -> float:
    """FLOPs of one forward and backward of `layers` one after another from `example`, on meta."""
    from pipelab.emulate.cost import forward_backward_counts

    x, flops = to_meta(example), 0.0
    for layer in layers:
        module = counted_layer(layer)
        flops += sum(c.flops for c in forward_backward_counts(module, x))
        with torch.no_grad():
            x = module(x)
    return flops


def time_stage(emulator, layers: list, example: torch.Tensor, dtype: str, real_layers: list,
               real_example: torch.Tensor, parts: list[int], stage: int) -> None:
    """Time `stage` (layers `parts[stage]` to `parts[stage + 1]`) of a rank on `emulator` by its
    layers' modelled F and B at the size of `layers` on `example`, and its messages (the activation
    it sends, or on the last stage receives) at that size over the real `real_layers`' on `real_example`."""
    last = stage == len(parts) - 2
    boundary = parts[stage] if last else parts[stage + 1]
    emulator.scale_messages(activation_bytes(layers, example, boundary, dtype),
                            activation_bytes(real_layers, real_example, boundary))
    emulator.use(layer_stage_table(layers, example, emulator.node.device, dtype, stage, parts[stage], parts[stage + 1]))

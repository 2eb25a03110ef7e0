"""DeepSpeed-style pipeline description: layer specs, tied layers, and a module cut into stages."""
from __future__ import annotations

from typing import Callable, Sequence

import torch.nn as nn

from pipelab.pipeline.partition import parameter_counts, partition_balanced, partition_layers


class LayerSpec:
    """A layer's class and arguments; the layer is built only on the stage that owns it."""

    def __init__(self, typename: type, *args, **kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec needs an nn.Module subclass, got {typename!r}; "
                             "pass the class itself, e.g. LayerSpec(nn.Linear, 8, 8)")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def parameter_count(self) -> int:
        # Built once on the side to count; the real copy is built by its owning stage.
        return parameter_counts([self.build()])[0]

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every stage that lists the same ``key`` (e.g. embedding and output head)."""

    def __init__(self, key: str, typename: type, *args, forward_fn: Callable | None = None, **kwargs):
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn = key, forward_fn


class PipelineModule:
    """A flat layer list cut into ``num_stages`` stages; ``build_stage`` makes one stage's layers."""

    def __init__(self, layers: Sequence, num_stages: int, partition_method: str = "parameters",
                 loss_fn: Callable | None = None, activation_checkpoint_interval: int = 0):
        if num_stages < 1:
            raise ValueError(f"num_stages={num_stages} must be at least 1")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise ValueError(f"layer {i} is {layer!r}: use an nn.Module, a LayerSpec or a function")
        self.layers, self.num_stages, self.loss_fn = list(layers), num_stages, loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        if partition_method.lower() == "parameters":
            counts = [l.parameter_count() if isinstance(l, LayerSpec) else parameter_counts([l])[0]
                      if isinstance(l, nn.Module) else 0 for l in self.layers]
            self.parts = partition_balanced(counts, num_stages)
        else:
            self.parts = partition_layers(self.layers, num_stages, partition_method)

    def stage_layers(self, stage_id: int) -> list[int]:
        return list(range(self.parts[stage_id], self.parts[stage_id + 1]))

    def build_stage(self, stage_id: int, tied: dict[str, nn.Module] | None = None) -> list:
        """This stage's layers, building specs now; tied specs with one key share one module."""
        tied = {} if tied is None else tied
        built = []
        for i in self.stage_layers(stage_id):
            layer = self.layers[i]
            if isinstance(layer, TiedLayerSpec):
                built.append(tied.setdefault(layer.key, layer.build()))
            elif isinstance(layer, LayerSpec):
                built.append(layer.build())
            else:
                built.append(layer)
        return built

    def stage_table(self) -> str:
        """The table DeepSpeed prints: per stage, its layers' index and name."""
        lines = []
        for s in range(self.num_stages):
            lines.append(f"stage={s} layers={self.parts[s + 1] - self.parts[s]}")
            for i in self.stage_layers(s):
                lines.append(f"    {i:2d}: {_name(self.layers[i])}")
        if self.loss_fn is not None:
            lines.append(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")
        return "\n".join(lines)


def _name(layer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", "function")

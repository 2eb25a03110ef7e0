"""DeepSpeed-style pipeline description: layer specs, tied layers, and a layer list cut into stages.

A ``PipelineModule`` is a flat list of layers (``LayerSpec``s, built modules or plain functions),
each feeding the next, plus a rule that cuts the list into stages. It is made once, in the
notebook; each rank then calls ``build_stage(stage_id)``, which builds only the layers that stage
owns. That is the point of a ``LayerSpec``: a model too big for one device is never built whole.
The names (``LayerSpec``, ``TiedLayerSpec``, ``partition_method``, ``partitions()``,
``stage_owner``, ``tied_weight_attr``) are DeepSpeed's, so code reads the same on both.
"""
from __future__ import annotations

import copy
from functools import partial
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pipelab.checks import whole_number
from pipelab.pipeline.partition import layer_name, partition_layers, profile_weights
from pipelab.pipeline.topology import ProcessTopology


class LayerSpec:
    """A layer's class and arguments; the layer is built only on the stage that owns it."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec needs an nn.Module subclass, got {typename!r}; "
                             "pass the class itself and its arguments, e.g. LayerSpec(nn.Linear, 8, 8)")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        """Make the layer now (with whatever random state the caller has set)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer that appears more than once in the list under one ``key`` and is ONE module.

    The classic case: the input embedding and the output projection share their weight. Each
    stage holding the key builds a copy; the copies' ``tied_weight_attr`` tensors start equal (a
    broadcast from the first such stage) and their gradients are summed across those stages
    before the optimizer step (``ReduceTiedGrads``), so they stay equal. ``forward_fn(module, x)``
    lets a later use call the module differently, e.g. ``x @ module.weight.T``."""

    def __init__(self, key: str, typename: type, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class StageModule(nn.Module):
    """The layers of one stage (or of all stages, for the single-process reference), run in order.

    Built layers are registered under their global index (``"3"``), tied modules under
    ``tied_modules.<key>``, as DeepSpeed names them, so a parameter has the same name on its
    stage as in the whole model."""

    def __init__(self, specs: Sequence, layer_ids: Sequence[int], seed_layers: bool = True,
                 base_seed: int = 1234, activation_checkpoint_interval: int = 0):
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.forward_funcs: list[Callable] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.activation_checkpoint_interval = activation_checkpoint_interval
        with torch.random.fork_rng(devices=[]):
            for idx in self.layer_ids:
                if seed_layers:  # a layer's weights depend on its index only, not on who builds it
                    torch.manual_seed(base_seed + idx)
                self.forward_funcs.append(self._build_layer(idx, specs[idx]))

    def _build_layer(self, idx: int, layer) -> Callable:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:  # the first use on this stage builds it
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            return module if layer.forward_fn is None else partial(layer.forward_fn, module)
        if isinstance(layer, LayerSpec):
            module = layer.build()
        elif isinstance(layer, nn.Module):
            module = copy.deepcopy(layer)  # this stage's own copy; the caller's layer stays as it was
        else:
            return layer  # a plain function, e.g. lambda x: x.flatten(1)
        self.add_module(str(idx), module)
        return module

    def forward(self, x):
        k = self.activation_checkpoint_interval
        if k == 0:
            return self._run(0, len(self.forward_funcs), x)
        for start in range(0, len(self.forward_funcs), k):
            stop = min(start + k, len(self.forward_funcs))
            if self._has_parameters(start, stop):
                # Keep only the chunk's input; recompute its insides during the backward.
                x = checkpoint(partial(self._run, start, stop), x, use_reentrant=False)
            else:
                x = self._run(start, stop, x)
        return x

    def _run(self, start: int, stop: int, x):
        for fn in self.forward_funcs[start:stop]:
            x = fn(x)
        return x

    def _has_parameters(self, start: int, stop: int) -> bool:
        return any(any(True for _ in fn.parameters()) for fn in self.forward_funcs[start:stop]
                   if isinstance(fn, nn.Module))

    def tied_weights(self) -> list[tuple[str, str, nn.Parameter]]:
        """(key, attribute, tensor) of every tied weight this stage holds, in key order."""
        out = []
        for key in sorted(self.tied_modules):
            for attr in self.tied_weight_attrs[key]:
                weight = self.tied_modules[key]
                for part in attr.split("."):  # e.g. "linear.weight"
                    weight = getattr(weight, part)
                out.append((key, attr, weight))
        return out


class PipelineModule:
    """A flat layer list cut into ``num_stages`` stages (``partitions()`` gives the boundaries).

    ``loss_fn(outputs, labels)`` runs after the last layer. ``seed_layers`` seeds the random
    generator with ``base_seed + layer index`` before building each layer, so every layer gets
    the same weights whichever rank builds it, and the single-process reference
    (``build_reference``) gets them too. (DeepSpeed has the same option, off by default; here it
    is on, because every run is checked against that reference.)"""

    def __init__(self, layers: Sequence, num_stages: int | None = None,
                 topology: ProcessTopology | None = None, loss_fn: Callable | None = None,
                 seed_layers: bool = True, base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, profile_input: torch.Tensor | None = None,
                 verbose: bool = True):
        self._layer_specs = _check_layers(layers)
        self._topo = topology
        self.num_stages = _check_stages(num_stages, topology, len(self._layer_specs))
        whole_number("activation_checkpoint_interval", activation_checkpoint_interval, minimum=0,
                     example="activation_checkpoint_interval=0 (checkpointing off)")
        self.loss_fn, self.seed_layers, self.base_seed = loss_fn, seed_layers, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.layer_times: list[float] | None = None  # seconds per layer, when partitioned by profile
        self.parts = partition_layers(self._layer_specs, self.num_stages, partition_method,
                                      profile=lambda: self._profile(profile_input))
        if verbose:
            print(self.stage_table())

    # ---- the partition ----------------------------------------------------------------------
    def partitions(self) -> list[int]:
        """Stage boundaries: stage s owns layers parts[s] .. parts[s+1]-1."""
        return list(self.parts)

    def stage_layers(self, stage_id: int) -> range:
        return range(self.parts[stage_id], self.parts[stage_id + 1])

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that owns layer ``layer_idx``."""
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise ValueError(f"layer {layer_idx} is not in 0..{len(self._layer_specs) - 1}")

    def tied_stages(self) -> dict[str, list[int]]:
        """For each tied key, the stages that hold a copy of its module."""
        stages: dict[str, set[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_owner(idx))
        return {key: sorted(s) for key, s in sorted(stages.items())}

    # ---- building ---------------------------------------------------------------------------
    def build_stage(self, stage_id: int) -> StageModule:
        """This stage's layers, built now; the other stages' layers are never built here."""
        if not 0 <= stage_id < self.num_stages:
            raise ValueError(f"stage_id={stage_id} is not in 0..{self.num_stages - 1}")
        return StageModule(self._layer_specs, self.stage_layers(stage_id), self.seed_layers,
                           self.base_seed, self.activation_checkpoint_interval)

    def build_reference(self) -> StageModule:
        """Every layer in one module, with the same weights the stages build: the reference."""
        return StageModule(self._layer_specs, range(len(self._layer_specs)), self.seed_layers,
                           self.base_seed, self.activation_checkpoint_interval)

    # ---- printing ---------------------------------------------------------------------------
    def stage_table(self) -> str:
        """The table DeepSpeed prints: per stage, its layers' index and name, then the loss."""
        lines = []
        for s in range(self.num_stages):
            lines.append(f"stage={s} layers={self.parts[s + 1] - self.parts[s]}")
            for i in self.stage_layers(s):
                lines.append(f"    {i:2d}: {layer_name(self._layer_specs[i]) or self._layer_specs[i]}")
        if self.loss_fn is not None:
            lines.append(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self._layer_specs)

    def _profile(self, sample: torch.Tensor | None) -> list[float]:
        """Build every layer here, once, and time its forward+backward on ``sample``."""
        if sample is None:
            raise ValueError("partition_method='profile' times every layer on a sample micro-batch; "
                             "pass one as profile_input=, e.g. profile_input=x[:8]")
        whole = self.build_reference()
        self.layer_times = profile_weights(whole.forward_funcs, sample)
        return self.layer_times


def _check_layers(layers: Sequence) -> list:
    layers = list(layers)
    if not layers:
        raise ValueError("a PipelineModule needs at least one layer; pass e.g. [LayerSpec(nn.Linear, 8, 8)]")
    for i, layer in enumerate(layers):
        if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
            raise ValueError(f"layer {i} is {layer!r} ({type(layer).__name__}): use an nn.Module, "
                             "a LayerSpec(nn.SomeModule, ...) or a function of one tensor")
    return layers


def _check_stages(num_stages, topology, num_layers: int) -> int:
    if topology is not None:
        if not isinstance(topology, ProcessTopology) or "pipe" not in topology.get_axis_names():
            raise ValueError(f"topology must be a ProcessTopology with a 'pipe' axis, got {topology!r}; "
                             "use e.g. PipeDataParallelTopology(num_pp=2, num_dp=2)")
        if topology.get_dim("model") > 1:
            raise ValueError("this pipeline runs pipe x data grids only; use a topology with model=1, "
                             "e.g. PipeDataParallelTopology(num_pp, num_dp)")
        if num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ValueError(f"num_stages={num_stages} but the topology has pipe={topology.get_dim('pipe')}; "
                             "give one of the two")
        num_stages = topology.get_dim("pipe")
    if num_stages is None:
        raise ValueError("give num_stages (e.g. num_stages=2) or a topology")
    whole_number("num_stages", num_stages, example="num_stages=2")
    if num_stages > num_layers:
        raise ValueError(f"num_stages={num_stages} exceeds the {num_layers} layers, so a stage would "
                         f"own no layer; use at most {num_layers} stages")
    return num_stages

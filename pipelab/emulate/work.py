"""A rank's work timed at another size: the cost tables of lessons 00 and 01, and installing one.

Lesson 00's step and lesson 01's replicas compute at a small size on this machine; on an emulated
node each piece of their work lasts what it would at the lesson's larger size. `layer_costs`
counts a data-parallel replica's layers that many times wider (on the meta device), and
`timed_as` installs a table on the rank's clock for the work inside it (elsewhere it does nothing).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from pipelab.emulate.cost import Counts, forward_backward_counts
from pipelab.emulate.table import CostTable, LayerCosts

if TYPE_CHECKING:
    from pipelab.worker import RankContext


@contextmanager
def timed_as(ctx: "RankContext", table: CostTable | None, bytes_scale: float = 1.0) -> Iterator[None]:
    """On an emulated rank: the work inside lasts what `table` gives, and every message and
    collective as if its tensor were `bytes_scale` times larger. Elsewhere: nothing changes."""
    if ctx.emulator is None:
        yield
        return
    ctx.emulator.use(table)
    ctx.emulator.scale_messages(bytes_scale, 1.0)
    try:
        yield
    finally:
        ctx.emulator.scale_messages(1, 1)  # later messages at their own size again
        ctx.emulator.use(None)


def scaled_layer(module: nn.Module, scale: int) -> nn.Module:
    """`module` `scale` times wider, on the meta device (no memory): a Linear layer with `scale`
    times its in and out features."""
    if isinstance(module, nn.Linear):
        return nn.Linear(module.in_features * scale, module.out_features * scale, bias=module.bias is not None,
                         device="meta", dtype=module.weight.dtype)
    raise ValueError(f"a modelled width scales Linear layers; {type(module).__name__} has parameters too: "
                     "leave the width at the model's own (scale 1)")


def layer_costs(model: nn.Module, x: torch.Tensor, scale: int, rows: int) -> LayerCosts:
    """Each layer's (module owning parameters) forward and backward `scale` times wider
    (`scaled_layer`) on `rows` rows of its input, counted on the meta device, and the gradient
    bytes at that size per real byte (`bytes_scale`).

    A layer fed the batch itself computes no input gradient in backward (the batch needs none), so
    its backward is its weights' gradients only. The element-wise activations between the layers
    are left out: at these widths their forward and backward move a few per cent of a layer's bytes."""
    owners = sorted({n.rpartition(".")[0] for n, p in model.named_parameters() if p.requires_grad} - {""})
    inputs: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda m, args, name=name: inputs.setdefault(name, args[0])) for name in owners]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    forward, backward, real, scaled = {}, {}, 0, 0
    for name, seen in inputs.items():
        layer = scaled_layer(model.get_submodule(name), scale)
        example = torch.empty(rows, *seen.shape[1:-1], seen.shape[-1] * scale, device="meta", dtype=seen.dtype)
        f, i, w = forward_backward_counts(layer, example)
        forward[name], backward[name] = f, w if seen is x else i + w
        real += sum(p.numel() for p in model.get_submodule(name).parameters())
        scaled += sum(p.numel() for p in layer.parameters())
    bytes_scale = scaled / real
    params = sum(p.numel() for p in model.parameters()) * x.element_size() * bytes_scale
    optimizer = Counts(2.0 * params / x.element_size(), 3.0 * params, len(list(model.parameters())))
    return LayerCosts(forward, backward, optimizer, bytes_scale)


def call_table(fn, *args) -> CostTable:
    """A table whose forward ("F") lasts what `fn(*args)` costs, counted on the meta device."""
    from pipelab.emulate.cost import count

    return CostTable({("F",): count(fn, *args)})

"""A small MLP run for real and timed as the same layers `scale` times wider on a batch `scale`
times larger: what lesson 05's grid runs on an emulated node.

Every activation and every weight then grows by scale^2, so one factor times every message and
all-reduce at that size too. `Widened` builds the wide model on the meta device (shapes, no
memory), puts a rank's stages on its clock (`table`, `use`), gives the one-device step the
layouts' predictions start from (`step_seconds`) and says the size in words (`describe`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn


def widen(model: nn.Sequential, scale: int) -> nn.Sequential:
    """`model`'s Linear layers `scale` times wider, on the meta device; layers without parameters kept."""
    layers = []
    for layer in model:
        if isinstance(layer, nn.Linear):
            layers.append(nn.Linear(layer.in_features * scale, layer.out_features * scale, bias=layer.bias is not None,
                                    device="meta"))
        elif not any(True for _ in layer.parameters()):
            layers.append(copy.deepcopy(layer))
        else:
            raise ValueError(f"an emulated node widens Linear layers, and the model has a {type(layer).__name__} "
                             "with parameters; use Linear layers and activations (pipelab.models.mlp), or emulate=None")
    return nn.Sequential(*layers)


def stage_inputs(stages: Sequence[nn.Module], rows: int, width: int) -> list[torch.Tensor]:
    """Each stage's input for a micro-batch of `rows` x `width`, as meta tensors."""
    x, inputs = torch.empty(rows, width, device="meta"), []
    with torch.no_grad():
        for stage in stages:
            inputs.append(x)
            x = stage(x)
    return inputs


@dataclass(frozen=True)
class Widened:
    """The model `scale` times wider and its batch `scale` times larger, in `dtype`, on `node`."""

    scale: int
    dtype: str
    node: Any = None

    @property
    def element_size(self) -> int:
        """Bytes of one number in `dtype`."""
        from pipelab.emulate.specs import torch_dtype

        return torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    def install(self, emulator: Any, wide_stages: Sequence[nn.Module], mine: Iterable[int], rows: int, width: int,
                real_element_size: int) -> Any:
        """A rank's cost table for its stages `mine` of `wide_stages` (widened, split), fed
        micro-batches of `rows` x `width` at the wide size; its messages timed at that size."""
        from pipelab.emulate.cost import stage_seconds
        from pipelab.emulate.table import stage_table

        inputs = stage_inputs(wide_stages, rows, width)
        emulator.scale_messages(self.scale ** 2 * self.element_size, real_element_size)
        return stage_table({s: stage_seconds(wide_stages[s], inputs[s], emulator.node.device, self.dtype) for s in mine})

    def table(self, ctx: Any, split: Callable[[nn.Sequential], Sequence[nn.Module]], model: nn.Sequential,
              mine: Iterable[int], x: torch.Tensor, num_microbatches: int) -> Any:
        """On an emulated rank, the cost table of its stages `mine` of `model` widened and cut by `split`,
        fed micro-batches of `x` widened (`install`); None on the machine's own clock."""
        if ctx.emulator is None:
            return None
        rows = x.shape[0] * self.scale // num_microbatches
        return self.install(ctx.emulator, split(widen(model, self.scale)), mine, rows, x.shape[1] * self.scale,
                            x.element_size())

    @staticmethod
    def use(ctx: Any, table: Any) -> None:
        """Time the rank's next work by `table` (one of several its clock takes turns with); None: no change."""
        if table is not None:
            ctx.emulator.use(table)

    def step_seconds(self, model: nn.Sequential, rows: int, width: int) -> float:
        """The widened model's forward and backward on `rows` x `width` (real sizes, widened here) at
        once, on one device of `node`."""
        from pipelab.emulate.cost import stage_seconds

        wide = widen(model, self.scale)
        [x] = stage_inputs([wide], rows * self.scale, width * self.scale)
        seconds = stage_seconds(wide, x, self.node.device, self.dtype)
        return seconds["F"] + seconds["B"]

    def describe(self, model: nn.Sequential, rows: int) -> str:
        """The emulated size in words (a lesson's first printed line says it)."""
        widths = sorted({m.out_features * self.scale for m in model if isinstance(m, nn.Linear)})
        layers = sum(isinstance(m, nn.Linear) for m in model)
        return (f"{layers} Linear layers of width {', '.join(map(str, widths))} on batches of {rows * self.scale} "
                f"rows in {self.dtype} ({self.scale} x this run's width and batch)")

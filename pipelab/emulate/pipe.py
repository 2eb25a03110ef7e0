"""A pipeline on an emulated node: its stages at the emulated size, counted once, and what a rank,
the simulator and the memory estimate read from them.

`EmulatedPipe.of(cfg.size, loss_fn, node, ...)` counts every stage of `Emulated(node, stages=...,
x=...)` on the meta device (`stages.emulated_stages`); `install` puts a rank's part on its clock
(its cost table, its memory meter, its messages at the emulated size); `stage_ms` and `message_ms`
are the simulator's costs; `memory` the estimate of one stage's peak before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from pipelab.emulate.stages import EmulatedStage, emulated_stages


@dataclass(frozen=True)
class EmulatedPipe:
    """Each stage at the emulated size on `node`, trained with `optimizer` in `dtype`."""

    stages: dict[int, EmulatedStage]
    node: Any
    dtype: str
    optimizer: str

    @classmethod
    def of(cls, size: Any, loss_fn: Callable, node: Any, expected: int, name: str | None = None) -> "EmulatedPipe":
        """Count `size.stages` (on meta; `expected` of them) fed micro-batches like `size.x` (on meta),
        in `size.dtype` with `size.optimizer`'s state, on `node`'s device (`name`: the node as the user named it)."""
        given = list(size.stages or [])
        if len(given) != expected or not all(isinstance(s, nn.Module) for s in given):
            raise ValueError(f"the emulated node {name} needs the {expected} stages at the emulated size, built on the "
                             "meta device: emulate=Emulated(node, stages=..., x=...), e.g. from "
                             f"pipelab.experiments.pipeline.emulated_mlp(node, layers=8, num_stages={expected}, width=8192, "
                             "rows=4096)")
        if not isinstance(size.x, torch.Tensor):
            raise ValueError(f"the emulated node {name} needs x=, one micro-batch at the emulated size on the meta "
                             f"device, e.g. torch.empty(4096, 8192, device='meta'); got x={size.x!r}")
        counted = emulated_stages(given, size.x, loss_fn, node, size.dtype, size.optimizer)
        return cls(counted, node, size.dtype, size.optimizer)

    def install(self, emulator: Any, mine: Iterable[int], checkpoint: bool, message: Any) -> Any:
        """On a rank: time its stages `mine` by their modelled seconds, start its memory meter with
        their parameters, gradients and optimizer state (returned: its `peak` is the rank's), and time
        each message (`message`: stage 0's output as sent here, a `p2p.TensorSpec`) at the emulated size."""
        from pipelab.emulate.memory import MemoryMeter
        from pipelab.emulate.table import stage_table

        held = {s: self.stages[s] for s in mine}
        table = stage_table({s: e.seconds for s, e in held.items()},
                            {s: (e.stash_bytes, e.input_bytes) for s, e in held.items()}, checkpoint)
        meter = MemoryMeter(self.node.device, sum(e.held_bytes for e in held.values()))
        emulator.use(table, meter)
        emulator.scale_messages(self.stages[0].output_bytes, message.dtype.itemsize * torch.Size(message.shape).numel())
        return meter

    def stage_ms(self) -> dict[int, tuple[float, float, float]]:
        """Each stage's modelled F, I and W (ms), as the simulator prices them."""
        return {s: (1e3 * e.seconds["F"], 1e3 * e.seconds["I"], 1e3 * e.seconds["W"]) for s, e in self.stages.items()}

    def message_ms(self) -> float:
        """One activation's modelled link time (ms)."""
        from pipelab.emulate.cost import message_seconds

        return 1e3 * message_seconds(self.stages[0].output_bytes, self.node.link)

    def memory(self, stage: int, microbatches_in_flight: int, checkpoint: bool = False):
        """What `stage` would hold at its peak with `microbatches_in_flight` stashes (`memory.stage_memory`)."""
        from pipelab.emulate.memory import stage_memory
        from pipelab.emulate.specs import torch_dtype

        e = self.stages[stage]
        return stage_memory(e.module, e.example, self.node.device, stage=stage, optimizer=self.optimizer,
                            microbatches_in_flight=microbatches_in_flight, checkpoint=checkpoint,
                            dtype=torch_dtype(self.dtype))

"""A pipeline on an emulated node: its stages at the emulated size, counted once, and what a rank,
the simulator and the memory estimate read from them.

`EmulatedPipe.of(stages, x, loss_fn, node, dtype, optimizer)` counts every stage on the meta device
(`stages.emulated_stages`); `install` puts a rank's part on its clock (its cost table, its memory
meter, its messages at the emulated size); `stage_ms` and `message_ms` are the simulator's costs;
`memory` the estimate of one stage's peak before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

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
    def of(cls, stages: Sequence[nn.Module] | None, x: torch.Tensor | None, loss_fn: Callable, node: Any, dtype: str,
           optimizer: str, expected: int, emulate: Any = None) -> "EmulatedPipe":
        """Count `stages` (on meta; `expected` of them) fed micro-batches like `x` (on meta) on the
        device of `node` (a node's name, e.g. "2xH100-nvlink", or a `specs.Node`)."""
        given = list(stages or [])
        if len(given) != expected or not all(isinstance(s, nn.Module) for s in given):
            raise ValueError(f"on an emulated node (emulate={emulate!r}) give emulated_stages: the {expected} stages "
                             "at the emulated size, built on the meta device, e.g. with torch.device('meta'): "
                             "split_model(models.mlp([8192] * 9), 2)")
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"on an emulated node give emulated_x, one micro-batch at the emulated size on the "
                             f"meta device, e.g. torch.empty(4096, 8192, device='meta'); got {x!r}")
        from pipelab.emulate import node_of

        node = node_of(node)  # a name such as "2xH100-nvlink", or a Node
        return cls(emulated_stages(given, x, loss_fn, node, dtype, optimizer), node, dtype, optimizer)

    def install(self, emulator: Any, mine: Iterable[int], checkpoint: bool, real_message_bytes: int) -> None:
        """On a rank: time its stages `mine` by their modelled seconds, start its memory meter with
        their parameters, gradients and optimizer state, and time each message (of
        `real_message_bytes` here) at the emulated size."""
        from pipelab.emulate.memory import MemoryMeter
        from pipelab.emulate.table import stage_table

        held = {s: self.stages[s] for s in mine}
        table = stage_table({s: e.seconds for s, e in held.items()},
                            {s: (e.stash_bytes, e.input_bytes) for s, e in held.items()}, checkpoint)
        emulator.use(table, MemoryMeter(self.node.device, sum(e.held_bytes for e in held.values())))
        emulator.scale_messages(self.stages[0].output_bytes, real_message_bytes)

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

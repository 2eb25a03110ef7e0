"""DeepSpeed's pipeline instruction stream: TrainSchedule and InferenceSchedule, step by step.

Each stage runs the same number of steps; at each step it executes a short list of instructions.
The stream (order, micro-batch ids and buffer ids) is the one ``deepspeed.runtime.pipe.schedule``
yields. Training alternates forward and backward steps, which gives 1F1B once the pipe is full.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Instruction:
    """One step of work; ``buffer_id`` names the activation buffer it reads or writes."""
    buffer_id: int | None = None

    @property
    def kwargs(self) -> dict:
        """The arguments its executor takes, as in DeepSpeed: ``{'buffer_id': 0}`` or ``{}``."""
        return {} if self.buffer_id is None else {"buffer_id": self.buffer_id}

    def __repr__(self) -> str:  # DeepSpeed's spelling, e.g. ForwardPass(buffer_id=0)
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{type(self).__name__}({args})"

    def __str__(self) -> str:  # the short form for tables, e.g. ForwardPass(0)
        return f"{type(self).__name__}({'' if self.buffer_id is None else self.buffer_id})"


class LoadMicroBatch(Instruction): """Read the next micro-batch (inputs on the first stage, labels on the last)."""
class ForwardPass(Instruction): """Run this stage's layers on a buffer."""
class BackwardPass(Instruction): """Back-propagate a buffer's output gradient through this stage."""
class SendActivation(Instruction): """Send a buffer's output to the next stage."""
class RecvActivation(Instruction): """Receive a buffer's input from the previous stage."""
class SendGrad(Instruction): """Send a buffer's input gradient to the previous stage."""
class RecvGrad(Instruction): """Receive a buffer's output gradient from the next stage."""
class ReduceTiedGrads(Instruction): """Sum gradients of tied modules across the stages that hold them."""
class ReduceGrads(Instruction): """All-reduce gradients across data-parallel replicas."""
class OptimizerStep(Instruction): """Apply the optimizer once the whole batch is done."""


class TrainSchedule:
    """Forward and backward steps alternating per stage, then the reductions and the optimizer step."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"need micro_batches >= 1 and 0 <= stage_id < stages, got "
                             f"micro_batches={micro_batches}, stages={stages}, stage_id={stage_id}")
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id

    def num_pipe_buffers(self) -> int:
        """A stage keeps at most as many micro-batches in flight as there are stages after it."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def steps(self) -> Iterator[list[Instruction]]:
        """Yield this stage's instructions step by step: 2 * (M + S - 1) steps, alternating a
        forward step and a backward step, each exchanging with the neighbours first."""
        total = 2 * (self.micro_batches + self.stages - 1)
        prev_mb = -1
        for step in range(total):
            mb, forward = self._step_to_micro_batch(step)
            cmds: list[Instruction] = []
            has_prev, has_next = self.stage_id > 0, self.stage_id < self.stages - 1
            if forward:
                if self._valid(prev_mb) and has_prev:
                    cmds.append(SendGrad(self._buf(prev_mb)))
                if self._valid(mb) and has_prev:
                    cmds.append(RecvActivation(self._buf(mb)))
            else:
                if self._valid(mb) and has_next:
                    cmds.append(RecvGrad(self._buf(mb)))
                if self._valid(prev_mb) and has_next:
                    cmds.append(SendActivation(self._buf(prev_mb)))
            if (not has_prev or not has_next) and forward and self._valid(mb):
                cmds.append(LoadMicroBatch(self._buf(mb)))
            if self._valid(mb):
                cmds.append(ForwardPass(self._buf(mb)) if forward else BackwardPass(self._buf(mb)))
            if step == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_mb = mb
            yield cmds

    def _step_to_micro_batch(self, step: int) -> tuple[int, bool]:
        # Even stages compute forward on even steps, odd stages on odd steps; backward otherwise.
        s, S = self.stage_id, self.stages
        forward = step % 2 == s % 2
        if forward:
            return (step // 2) - s // 2, True
        if step % 2 == 0:
            return step // 2 - S + (s + 1) // 2, False
        return (step - 1) // 2 - S + 1 + s // 2, False

    def _valid(self, mb: int) -> bool:
        return 0 <= mb < self.micro_batches

    def _buf(self, mb: int) -> int:
        return mb % self.num_pipe_buffers()


class InferenceSchedule(TrainSchedule):
    """Forward only: each stage receives, computes and sends, alternating two buffers."""

    def num_pipe_buffers(self) -> int:
        return 2

    def steps(self) -> Iterator[list[Instruction]]:
        s = self.stage_id
        has_prev, has_next = s > 0, s < self.stages - 1
        for step in range(self.micro_batches + self.stages - 1):
            mb = step - s
            recv_buf, send_buf = (step % 2, (step + 1) % 2) if s % 2 == 0 else ((step + 1) % 2, step % 2)
            cmds: list[Instruction] = []
            if (not has_prev or not has_next) and self._valid(mb):
                cmds.append(LoadMicroBatch(recv_buf))
            send = [SendActivation(send_buf)] if has_next and self._valid(mb - 1) else []
            recv = [RecvActivation(recv_buf)] if has_prev and self._valid(mb) else []
            # Even stages send first and odd stages receive first, so neighbours never both wait.
            cmds += send + recv if s % 2 == 0 else recv + send
            if self._valid(mb):
                cmds.append(ForwardPass(recv_buf))
            yield cmds


def instruction_table(schedule_cls, micro_batches: int, stages: int) -> list[list[str]]:
    """Rows of step -> instructions per stage, for printing the streams side by side."""
    streams = [list(schedule_cls(micro_batches, stages, s).steps()) for s in range(stages)]
    return [[", ".join(map(str, streams[s][step])) for s in range(stages)]
            for step in range(len(streams[0]))]


def format_instruction_table(schedule_cls, micro_batches: int, stages: int) -> str:
    """The instruction streams of every stage as an aligned text table, one row per step."""
    rows = [["step", *(f"stage {s}" for s in range(stages))]]
    rows += [[str(i), *(cells or "-" for cells in row)]
             for i, row in enumerate(instruction_table(schedule_cls, micro_batches, stages))]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

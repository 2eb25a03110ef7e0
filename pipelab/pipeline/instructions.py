"""DeepSpeed's pipeline instruction stream: TrainSchedule and InferenceSchedule, step by step.

Each stage runs the same number of steps; at each step it executes a short list of instructions.
The stream (order, micro-batch ids and buffer ids) is the one ``deepspeed.runtime.pipe.schedule``
yields. Training alternates forward and backward steps, which gives 1F1B once the pipe is full:
`to_actions` lowers the stream to the actions of `pipelab.pipeline.schedules`, so that it can be
validated, simulated and compared with `Schedule1F1B`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from pipelab.checks import whole_number
from pipelab.pipeline.schedules import B, F, Action, Schedule


@dataclass(frozen=True)
class Instruction:
    """One step of work; ``buffer_id`` names the activation buffer it reads or writes.

    A stage has only ``num_pipe_buffers()`` buffers and micro-batch ``mb`` uses buffer
    ``mb % num_pipe_buffers()``, so a buffer id is NOT a micro-batch: with two buffers, buffer 0
    holds micro-batch 0, then 2, ... ``micro_batch`` records which one, for tables; DeepSpeed's
    instructions carry only the buffer id, so it takes no part in comparisons or in ``repr``."""
    buffer_id: int | None = None
    micro_batch: int | None = field(default=None, compare=False)

    @property
    def kwargs(self) -> dict:
        """The arguments its executor takes, as in DeepSpeed: ``{'buffer_id': 0}`` or ``{}``."""
        return {} if self.buffer_id is None else {"buffer_id": self.buffer_id}

    def __repr__(self) -> str:  # DeepSpeed's spelling, e.g. ForwardPass(buffer_id=0)
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{type(self).__name__}({args})"

    def __str__(self) -> str:  # the short form for tables, e.g. ForwardPass(0)
        return f"{type(self).__name__}({'' if self.buffer_id is None else self.buffer_id})"

    def with_micro_batch(self) -> str:
        """The short form and the micro-batch its buffer holds, e.g. ``ForwardPass(0) mb2``."""
        return str(self) if self.micro_batch is None else f"{self} mb{self.micro_batch}"


class LoadMicroBatch(Instruction):
    """Read the next micro-batch (inputs on the first stage, labels on the last).

    roughly: `buffers.inputs[buffer_id], buffers.labels[buffer_id] = next(data_iter)`"""


class ForwardPass(Instruction):
    """Run this stage's layers on a buffer (and the loss on the last stage).

    roughly: `buffers.outputs[buffer_id] = stage(buffers.inputs[buffer_id])`"""


class BackwardPass(Instruction):
    """Back-propagate a buffer's output gradient through this stage: input and weight gradients.

    roughly: `torch.autograd.backward(buffers.outputs[buffer_id], buffers.grads[buffer_id])`
    (`loss.backward()` on the last stage)"""


class SendActivation(Instruction):
    """Send a buffer's output to the next stage.

    roughly: `dist.send(buffers.outputs[buffer_id], next stage)`"""


class RecvActivation(Instruction):
    """Receive a buffer's input from the previous stage.

    roughly: `dist.recv(buffers.inputs[buffer_id], previous stage); .requires_grad_()`"""


class SendGrad(Instruction):
    """Send the gradient of a buffer's input to the previous stage.

    roughly: `dist.send(buffers.inputs[buffer_id].grad, previous stage)`"""


class RecvGrad(Instruction):
    """Receive the gradient of a buffer's output from the next stage.

    roughly: `dist.recv(buffers.grads[buffer_id], next stage)`"""


class ReduceTiedGrads(Instruction):
    """Sum gradients of tied modules across the stages that hold them.

    roughly: `dist.all_reduce(tied_weight.grad, group=stages holding it)`"""


class ReduceGrads(Instruction):
    """Average gradients across data-parallel replicas.

    roughly: `for p in stage.parameters(): dist.all_reduce(p.grad, group=replicas); p.grad /= len(replicas)`"""


class OptimizerStep(Instruction):
    """Apply the optimizer once the whole batch is done.

    roughly: `optimizer.step(); optimizer.zero_grad()`"""


class TrainSchedule:
    """Forward and backward steps alternating per stage, then the reductions and the optimizer step."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        whole_number("micro_batches", micro_batches, example="micro_batches=4")
        whole_number("stages", stages, example="stages=2")
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or not 0 <= stage_id < stages:
            raise ValueError(f"need 0 <= stage_id < stages, got stages={stages}, stage_id={stage_id!r}; "
                             f"pass one of {list(range(stages))}")
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id

    def num_pipe_buffers(self) -> int:
        """Buffers of this stage: one per micro-batch it holds at once (1F1B: S - s, or M if fewer),
        and at least 2, since a forward step sends the gradient of one buffer while it receives
        the next activation into another."""
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
                    cmds.append(self._on(SendGrad, prev_mb))
                if self._valid(mb) and has_prev:
                    cmds.append(self._on(RecvActivation, mb))
            else:
                if self._valid(mb) and has_next:
                    cmds.append(self._on(RecvGrad, mb))
                if self._valid(prev_mb) and has_next:
                    cmds.append(self._on(SendActivation, prev_mb))
            if (not has_prev or not has_next) and forward and self._valid(mb):
                cmds.append(self._on(LoadMicroBatch, mb))
            if self._valid(mb):
                cmds.append(self._on(ForwardPass if forward else BackwardPass, mb))
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
        return mb % self.num_pipe_buffers()  # buffers are reused in turn

    def _on(self, kind: type, mb: int) -> Instruction:
        """Instruction ``kind`` on micro-batch ``mb``'s buffer (noting the micro-batch, for tables)."""
        return kind(self._buf(mb), micro_batch=mb)


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
                cmds.append(LoadMicroBatch(recv_buf, micro_batch=mb))
            send = [SendActivation(send_buf, micro_batch=mb - 1)] if has_next and self._valid(mb - 1) else []
            recv = [RecvActivation(recv_buf, micro_batch=mb)] if has_prev and self._valid(mb) else []
            # Even stages send first and odd stages receive first, so neighbours never both wait.
            cmds += send + recv if s % 2 == 0 else recv + send
            if self._valid(mb):
                cmds.append(ForwardPass(recv_buf, micro_batch=mb))
            yield cmds


def instruction_table(schedule_cls, micro_batches: int, stages: int,
                      show_micro_batches: bool = False) -> list[list[str]]:
    """Rows of step -> instructions per stage, for printing the streams side by side; with
    ``show_micro_batches`` each instruction also names the micro-batch its buffer holds."""
    streams = [list(schedule_cls(micro_batches, stages, s).steps()) for s in range(stages)]
    text = Instruction.with_micro_batch if show_micro_batches else str
    return [[", ".join(map(text, streams[s][step])) for s in range(stages)]
            for step in range(len(streams[0]))]


def format_instruction_table(schedule_cls, micro_batches: int, stages: int,
                             show_micro_batches: bool = False) -> str:
    """The instruction streams of every stage as an aligned text table, one row per step. The
    number in brackets is a buffer id; ``show_micro_batches`` adds ``mbN``, the micro-batch in it."""
    rows = [["step", *(f"stage {s}" for s in range(stages))]]
    rows += [[str(i), *(cells or "-" for cells in row)]
             for i, row in enumerate(instruction_table(schedule_cls, micro_batches, stages, show_micro_batches))]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_actions(micro_batches: int, stages: int, schedule_cls=TrainSchedule) -> Schedule:
    """DeepSpeed's stream lowered to actions, one stage per rank: each ForwardPass becomes an F and
    each BackwardPass a B; loads, sends, receives, reductions and the optimizer step are dropped.
    The result validates and simulates like any `Schedule` (an InferenceSchedule lowers to
    forwards only, which `validate` refuses: training needs a backward for every forward)."""
    actions = []
    for stage in range(stages):
        # Micro-batches enter a stage in order, each into a buffer it holds until its backward,
        # so the buffer id of a BackwardPass names its micro-batch.
        in_buffer: dict[int, int] = {}  # buffer id -> the micro-batch it holds
        stage_actions: list[Action] = []
        next_mb = 0
        for step in schedule_cls(micro_batches, stages, stage).steps():
            for cmd in step:
                if isinstance(cmd, ForwardPass):
                    in_buffer[cmd.buffer_id] = next_mb
                    stage_actions.append(F(stage, next_mb))
                    next_mb += 1
                elif isinstance(cmd, BackwardPass):
                    stage_actions.append(B(stage, in_buffer.pop(cmd.buffer_id)))
        actions.append(stage_actions)
    return Schedule(stages, micro_batches, actions=actions, name=f"DeepSpeed {schedule_cls.__name__}")

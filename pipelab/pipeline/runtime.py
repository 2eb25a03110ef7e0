"""Run a pipeline schedule for real: one process per rank, point-to-point sends between stages.

The whole pipeline, seen from one rank, is `run_step`: walk this rank's action list in order and
run each action. The order is the schedule (GPipe, 1F1B, ...); the waiting is done by the receives
(`p2p`); the work and the stash by the stage runner (`stage`). The lessons' worker, which times a
few steps of each schedule, is `pipelab.experiments.pipeline.worker`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pipelab.pipeline.p2p import P2P, TensorSpec
from pipelab.pipeline.schedules import Schedule
from pipelab.pipeline.stage import StageRunner, StashMeter

if TYPE_CHECKING:
    from pipelab.worker import RankContext


@dataclass
class Step:
    """What one rank's step leaves: each micro-batch's loss as the last stage computed it (what
    torch's `schedule.step(..., losses=[])` gives; empty on the other ranks), the stash it kept
    over the step, and the messages it sent."""

    losses: list[torch.Tensor]
    stash: StashMeter
    messages_sent: int
    bytes_sent: int


def run_step(ctx: RankContext, schedule: Schedule, modules: dict[int, nn.Module], loss_fn: Callable,
             x: torch.Tensor, y: torch.Tensor, specs: list[list[TensorSpec]],
             checkpoint: bool = False) -> Step:
    """One training step (no optimizer): run this rank's actions of `schedule` in order. `specs` are
    the messages' shapes and dtypes (`p2p.message_specs`); `checkpoint` recomputes each stage's
    forward in its backward instead of stashing its activations."""
    m = schedule.num_microbatches
    p2p = P2P(ctx, schedule, specs)
    runner = StageRunner(ctx, schedule, modules, loss_fn, p2p, list(x.chunk(m)), list(y.chunk(m)), checkpoint)
    for action in schedule.actions[ctx.rank]:
        runner.run(action)
    p2p.finish()
    # The runner divided each loss by `divisor` so that the m backwards add up to the batch's gradient.
    losses = [loss * runner.divisor for loss in runner.losses]
    return Step(losses, runner.meter, p2p.messages_sent, p2p.bytes_sent)

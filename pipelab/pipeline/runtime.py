"""Run a pipeline schedule for real: one process per rank, point-to-point sends between stages.

The whole pipeline, seen from one rank, is `run_step`: walk this rank's action list in order and
run each action. The order is the schedule (GPipe, 1F1B, ...); the waiting is done by the receives
(`p2p`); the work and the stash by the stage runner (`stage`). `pipeline_worker` is what every
process runs: a few timed steps of each schedule it is given, each with or without activation
checkpointing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from pipelab.measure import RankSteps, time_steps, timed_slice
from pipelab.pipeline.p2p import P2P, TensorSpec
from pipelab.pipeline.schedules import Schedule
from pipelab.pipeline.stage import StageRunner


def run_step(ctx, schedule: Schedule, modules: dict[int, nn.Module], loss_fn: Callable,
             x: torch.Tensor, y: torch.Tensor, specs: list[list[TensorSpec]],
             checkpoint: bool = False) -> StageRunner:
    """One training step (no optimizer): run this rank's actions of `schedule` in order. `specs` are
    the messages' shapes and dtypes (`p2p.message_specs`); `checkpoint` recomputes each stage's
    forward in its backward instead of stashing its activations."""
    m = schedule.num_microbatches
    p2p = P2P(ctx, schedule, specs)
    runner = StageRunner(ctx, schedule, modules, loss_fn, p2p, list(x.chunk(m)), list(y.chunk(m)), checkpoint)
    for action in schedule.actions[ctx.rank]:
        runner.run(action)
    p2p.finish()
    return runner


@dataclass
class RankResult:
    """What one rank brings back from `pipeline_worker` for one schedule."""

    rank: int
    stages: list[int]
    loss: float | None  # the last step's, on the rank holding the last stage
    grads: dict[int, dict[str, torch.Tensor]]  # stage -> parameter name -> gradient (last step)
    steps: RankSteps  # times and timelines of the timed steps
    stash_traces: list[list[tuple[float, int, int]]]  # one per timed step: (time, stashes, bytes)
    peak_stash: int
    peak_stash_bytes: int
    messages_sent: int
    bytes_sent: int


def pipeline_worker(ctx, stages: list[nn.Module], schedules: list[Schedule],
                    batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                    specs: list[list[list[TensorSpec]]], steps: int = 2,
                    checkpoint: bool | Sequence[bool] = False) -> list[RankResult]:
    """Worker: run each schedule on its (inputs, targets) batch for `steps` steps; report the
    timelines and times of all but the first (a warm-up), and the last step's gradients. `specs` holds
    each schedule's message specs; `checkpoint`, one flag for all schedules or one per schedule."""
    results = []
    flags = [checkpoint] * len(schedules) if isinstance(checkpoint, bool) else list(checkpoint)
    for schedule, (x, y), sched_specs, ckpt in zip(schedules, batches, specs, flags):
        x, y = x.to(ctx.device), y.to(ctx.device)
        modules = {s: copy.deepcopy(stages[s]).to(ctx.device) for s in schedule.stages_of(ctx.rank)}

        def zero_grad(_):
            for module in modules.values():
                module.zero_grad(set_to_none=True)

        measured = time_steps(ctx, lambda _: run_step(ctx, schedule, modules, loss_fn, x, y, sched_specs, ckpt),
                              steps, prepare=zero_grad)
        runner = measured.results[-1]
        traces = [r.meter.trace for r in measured.results[timed_slice(steps)]]
        loss = float(sum(runner.losses)) if runner.losses else None
        grads = {s: {n: None if p.grad is None else p.grad.detach().cpu() for n, p in mod.named_parameters()}
                 for s, mod in modules.items()}
        timed = RankSteps([], measured.seconds, measured.timelines)  # the runners stay here
        results.append(RankResult(ctx.rank, sorted(modules), loss, grads, timed, traces, runner.meter.peak,
                                  runner.meter.peak_bytes, runner.p2p.messages_sent, runner.p2p.bytes_sent))
    return results

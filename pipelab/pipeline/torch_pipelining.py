"""The same schedules run by `torch.distributed.pipelining`, for comparison with ours (lesson 07,
benchmarks): which of torch's schedule classes runs each of ours, and one rank's step through it
with torch's per-micro-batch stage calls timed on our timeline under torch's own kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pipelab.pipeline.schedules import Schedule

if TYPE_CHECKING:
    from pipelab.timeline import Recorder
    from pipelab.worker import RankContext

# The torch.distributed.pipelining class that runs each of our schedules.
TORCH_SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved 1F1B": "ScheduleInterleaved1F1B",
    "ZB-H1": "ScheduleInterleavedZeroBubble",  # with one stage per rank, its order is ZB-H1's
}


def check_torch(schedule: Schedule) -> None:
    """Refuse a schedule torch cannot run as ours, naming what it can."""
    if schedule.name not in TORCH_SCHEDULES:
        raise ValueError(f"torch has no counterpart of {schedule!r}; use one of {sorted(TORCH_SCHEDULES)}")
    if schedule.name == "1F1B" and schedule.num_microbatches < schedule.num_ranks:
        raise ValueError(f"torch's Schedule1F1B needs num_microbatches >= num_ranks, got "
                         f"m={schedule.num_microbatches} < p={schedule.num_ranks}; use m >= {schedule.num_ranks}")


def record_torch_stage(stage, rec: Recorder) -> None:
    """Time torch's per-micro-batch stage calls on our timeline, with torch's own kinds: F, B (a
    full backward), I (`full_backward=False`: the input gradient only) and W."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    index = stage.stage_index

    def forward_one_chunk(mb, *args, **kwargs):
        with rec.span("F", mb=mb, stage=index):
            return fwd(mb, *args, **kwargs)

    def backward_one_chunk(mb, *args, full_backward: bool = True, **kwargs):
        with rec.span("B" if full_backward else "I", mb=mb, stage=index):
            return bwd(mb, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(mb, *args, **kwargs):
        with rec.span("W", mb=mb, stage=index):
            return wgt(mb, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def torch_step(ctx: RankContext, schedule: Schedule, modules: dict[int, nn.Module],
               loss_fn: Callable) -> Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]:
    """This rank's step of `schedule` through torch's class for it, over the stages `modules`
    (stage -> module) it holds: a function of the batch returning each micro-batch's loss on the
    rank holding the last stage (empty elsewhere). torch infers the messages' shapes itself and
    divides the gradients by m (`scale_grads`), as our runtime divides the losses."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    check_torch(schedule)
    stages = [PipelineStage(mod, s, schedule.num_stages, ctx.device) for s, mod in modules.items()]
    for stage in stages:
        record_torch_stage(stage, ctx.rec)
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule.name])
    single = cls in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B)  # take one stage, not a list
    runner = cls(stages[0] if single else stages, schedule.num_microbatches, loss_fn=loss_fn, scale_grads=True)
    holds_first, holds_last = 0 in modules, schedule.num_stages - 1 in modules

    def step(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        losses: list = []
        runner.step(*([x] if holds_first else []), target=y if holds_last else None,
                    losses=losses if holds_last else None)
        return losses

    return step

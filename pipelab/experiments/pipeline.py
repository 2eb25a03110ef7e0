"""Running pipeline schedules from a notebook (lessons 06 and 07), and the same schedules through
`torch.distributed.pipelining` for comparison.

`run_pipelines` checks the input, starts one process per rank (each runs
`pipeline.runtime.pipeline_worker`) and gathers what the ranks measured into one `PipelineRun` per
schedule. A run carries `losses` and `grads` named as in `nn.Sequential(*stages)`, so
`reference.assert_same(run, reference_run(nn.Sequential(*stages), x, y, loss_fn, lr=None))` checks
it against one process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from pipelab.checks import divisors, whole_number
from pipelab.measure import Measured, TimedSteps, RankSteps, Steps, gather_steps, time_steps
from pipelab.pipeline.p2p import message_specs, trace
from pipelab.pipeline.runtime import RankResult, pipeline_worker
from pipelab.pipeline.schedules import Schedule, validate
from pipelab.pipeline.stage import loss_divisor
from pipelab.timeline import Timeline


@dataclass
class PipelineRun(TimedSteps):
    """One schedule's run, gathered from every rank: its loss and gradients, its timed steps and
    a typical step's timeline (the timed step of median length)."""

    schedule: Schedule
    loss: float
    grads: list[dict[str, torch.Tensor]]  # per stage; stage s's "0.weight" is named "s.0.weight"
    steps: Steps = field(repr=False)
    peak_stash: dict[int, int]  # rank -> stashed micro-batches at the peak
    peak_stash_bytes: dict[int, int]
    stash_traces: dict[int, list[tuple[float, int, int]]] = field(repr=False, default_factory=dict)
    messages_sent: int = 0
    bytes_sent: int = 0
    checkpoint: bool = False  # activation checkpointing: each backward recomputed its forward

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def losses(self) -> list[float]:
        """The step's loss (no optimizer step: every step computes the same one)."""
        return [self.loss]

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of the compute lane over the step, averaged over ranks."""
        return self.timeline.bubble_fraction("compute")

    @property
    def bubbles(self) -> Measured:
        """The bubble of every timed step, as repeats: median and spread."""
        return Measured.of(tl.bubble_fraction("compute") for tl in self.steps.timelines)

    def row(self) -> dict:
        """The figures as one table row."""
        return {"schedule": self.schedule.name, "p": self.schedule.num_ranks,
                "m": self.schedule.num_microbatches, "step_ms": round(self.step_time * 1e3, 2),
                "bubble": round(self.bubble_fraction, 3), "peak_stash": max(self.peak_stash.values()),
                "peak_stash_KiB": round(max(self.peak_stash_bytes.values()) / 1024, 1),
                "messages": self.messages_sent}


def check_pipeline(stages: list[nn.Module], schedule: Schedule, x: torch.Tensor, y: torch.Tensor,
                   loss_fn: Callable | None) -> None:
    """Refuse what cannot run, before any worker starts."""
    check_schedule(schedule)
    validate(schedule)
    for s, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            raise ValueError(f"stage {s} is {stage!r}, not an nn.Module: a stage is copied to its rank "
                             "and moved to its device; wrap a function in a module (e.g. nn.Flatten(), "
                             "or an nn.Module whose forward calls it)")
    if len(stages) != schedule.num_stages:
        raise ValueError(f"{schedule!r} runs {schedule.num_stages} stages "
                         f"({schedule.num_ranks} ranks x {schedule.stages_per_rank} per rank) but "
                         f"{len(stages)} were given; cut the model with "
                         f"split_model(model, {schedule.num_stages})")
    if loss_fn is None or not callable(loss_fn):
        raise ValueError(f"the last stage needs a loss function, got loss_fn={loss_fn!r}; "
                         "pass e.g. loss_fn=torch.nn.MSELoss()")
    for name, t in (("inputs", x), ("targets", y)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor with one row per sample, got {type(t).__name__}")
    batch, m = x.shape[0], schedule.num_microbatches
    if batch == 0:
        raise ValueError(f"the batch is empty (0 samples); pass at least num_microbatches={m} samples")
    if batch % m:
        raise ValueError(f"num_microbatches={m} does not divide the batch of {batch} samples; "
                         f"use one of {divisors(batch)}, or a batch that is a multiple of {m}")
    if y.shape[0] != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {y.shape[0]}; pass one target per input")


def check_schedule(schedule) -> None:
    """A schedule is a pipelab `Schedule`; given its name instead, say how to build one."""
    if not isinstance(schedule, Schedule):
        hint = f"make_schedule({schedule!r}, num_ranks, num_microbatches)" if isinstance(schedule, str) \
            else "make_schedule('gpipe', num_ranks, num_microbatches)"
        raise ValueError(f"schedule must be a pipelab Schedule, got {schedule!r}; build one with "
                         f"pipelab.pipeline.schedules.{hint}")


def check_loss(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> None:
    """The loss of one micro-batch `x`, `y` must be one number: its backward starts there."""
    loss = loss_fn(trace(stages, x)[-1], y)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
        raise ValueError(f"loss_fn must return one number per micro-batch (a 0-dim tensor), got {got}; "
                         "use a loss that reduces over the samples, e.g. torch.nn.MSELoss() "
                         "(reduction='mean') or reduction='sum'")


def prepare(stages: list[nn.Module], schedules: list[Schedule], x, y, loss_fn: Callable, steps: int):
    """Check everything; return the world size, a (inputs, targets) batch per schedule, and the
    messages' shapes and dtypes per schedule (`p2p.message_specs`)."""
    if isinstance(schedules, (str, Schedule)) or not schedules:
        raise ValueError(f"give a list of one or more schedules, got {schedules!r}; e.g. "
                         "[make_schedule('gpipe', 2, 4)] (run_pipeline takes a single one)")
    for schedule in schedules:
        check_schedule(schedule)
    ranks = {s.num_ranks for s in schedules}
    if len(ranks) != 1:
        raise ValueError(f"schedules run in one set of processes must share num_ranks, got {sorted(ranks)}; "
                         "run them in one call per number of ranks")
    xs = list(x) if isinstance(x, (list, tuple)) else [x] * len(schedules)
    ys = list(y) if isinstance(y, (list, tuple)) else [y] * len(schedules)
    if len(xs) != len(schedules) or len(ys) != len(schedules):
        raise ValueError(f"give one batch for all schedules or one per schedule: got {len(xs)} inputs "
                         f"and {len(ys)} targets for {len(schedules)} schedules")
    for schedule, xi, yi in zip(schedules, xs, ys):
        check_pipeline(stages, schedule, xi, yi, loss_fn)
    whole_number("steps", steps, example="steps=2")
    rows = xs[0].shape[0] // schedules[0].num_microbatches
    check_loss(stages, xs[0][:rows], ys[0][:rows], loss_fn)
    specs = [message_specs(stages, xi, s.num_microbatches) for s, xi in zip(schedules, xs)]
    return ranks.pop(), list(zip(xs, ys)), specs


def run_pipelines(stages: list[nn.Module], schedules: list[Schedule], x, y, loss_fn: Callable,
                  steps: int = 2, backend: str = "auto", timeout: float = 120.0,
                  checkpoint: bool | list[bool] = False) -> list[PipelineRun]:
    """Run each schedule (all on the same number of ranks) for real, in one set of processes.

    `x` and `y` are one batch for every schedule, or lists with one batch per schedule. The loss of
    each micro-batch is divided by m if `loss_fn` averages over its samples (`reduction="mean"`, and
    any function without a `reduction`), not if it sums them (`reduction="sum"`): either way the run's
    loss and gradients are those of the whole batch in one process. `checkpoint` (one flag, or one per
    schedule) turns on activation checkpointing: each backward recomputes its stage's forward."""
    from pipelab.launch import spawn

    world, batches, specs = prepare(stages, schedules, x, y, loss_fn, steps)
    flags = checkpoint_flags(checkpoint, len(schedules))
    per_rank = spawn(pipeline_worker, world, stages, schedules, batches, loss_fn, specs, steps, flags,
                     backend=backend, timeout=timeout)
    return [gather(schedule, [r[i] for r in per_rank], flags[i]) for i, schedule in enumerate(schedules)]


def checkpoint_flags(checkpoint, count: int) -> list[bool]:
    """One activation-checkpointing flag per schedule, from one flag for all or a list of them."""
    flags = [checkpoint] * count if isinstance(checkpoint, bool) else list(checkpoint)
    if len(flags) != count or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"checkpoint must be True, False or one of them per schedule ({count}), got "
                         f"{checkpoint!r}; e.g. checkpoint=[False, True] for two schedules")
    return flags


def run_pipeline(stages: list[nn.Module], schedule: Schedule, x: torch.Tensor, y: torch.Tensor,
                 loss_fn: Callable, steps: int = 2, backend: str = "auto",
                 timeout: float = 120.0, checkpoint: bool = False) -> PipelineRun:
    """Run `steps` steps of `schedule` on `schedule.num_ranks` real processes (the first warms up)."""
    return run_pipelines(stages, [schedule], x, y, loss_fn, steps, backend, timeout, checkpoint)[0]


def gather(schedule: Schedule, results: list[RankResult], checkpoint: bool = False) -> PipelineRun:
    """One schedule's results from every rank, as one run: gradients named as in the whole model,
    the slowest rank per step, and the stash traces of the typical step."""
    grads: list[dict] = [{} for _ in range(schedule.num_stages)]
    for r in results:
        for s, g in r.grads.items():
            grads[s] = {f"{s}.{name}": t for name, t in g.items()}
    loss = next(r.loss for r in results if r.loss is not None)
    steps = gather_steps([r.steps for r in results])
    typical = steps.typical_index
    return PipelineRun(
        schedule, loss, grads, steps,
        {r.rank: r.peak_stash for r in results}, {r.rank: r.peak_stash_bytes for r in results},
        {r.rank: r.stash_traces[typical] for r in results}, sum(r.messages_sent for r in results),
        sum(r.bytes_sent for r in results), checkpoint)


def recv_waits(timeline: Timeline) -> tuple[float, float]:
    """Split the time ranks spent in `recv` boxes (seconds, summed over ranks) in two: waiting for
    the sender, whose matching send had not started yet (it was still computing: the pipeline's
    ordinary fill and drain), and waiting for the message, sent but not yet arrived (what moving it
    costs). The k-th send from one rank to another on micro-batch mb pairs with the k-th recv."""
    sent: dict[tuple, list[float]] = {}
    for s in sorted(timeline.filter(kind="send", lane="comm"), key=lambda s: s.start):
        sent.setdefault((s.rank, s.meta["to"], s.mb), []).append(s.start)
    for_sender = for_message = 0.0
    for r in sorted(timeline.filter(kind="recv", lane="comm"), key=lambda s: s.start):
        cut = min(max(sent[r.meta["frm"], r.rank, r.mb].pop(0), r.start), r.end)
        for_sender += cut - r.start
        for_message += r.end - cut
    return for_sender, for_message


def simulated_bubbles(run: PipelineRun) -> Measured:
    """For every timed step of `run`, the bubble its schedule has on an ideal machine (free
    messages, no waiting for a core) with that step's measured per-stage costs: what the schedule
    itself costs at this run's sizes, as repeats like `run.bubbles`."""
    from pipelab.pipeline.simulate import Costs, simulate

    return Measured.of(simulate(run.schedule, Costs.from_timeline(tl, per_stage=True)).bubble_fraction
                       for tl in run.steps.timelines)

# ---------------------------------------------------------------------------------------------
# The same schedules through torch.distributed.pipelining
# ---------------------------------------------------------------------------------------------

TORCH_SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved 1F1B": "ScheduleInterleaved1F1B",
    "ZB-H1": "ScheduleInterleavedZeroBubble",  # with one stage per rank, its order is ZB-H1's
}


def record_torch_stage(stage, rec) -> None:
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


def torch_pipeline_worker(ctx, stages: list[nn.Module], schedules: list[Schedule],
                          batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                          steps: int = 2) -> list[RankResult]:
    """Worker: the same schedules, stages and data run by torch.distributed.pipelining."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    results = []
    for schedule, (x, y) in zip(schedules, batches):
        x, y = x.to(ctx.device), y.to(ctx.device)
        modules = {s: copy.deepcopy(stages[s]).to(ctx.device) for s in schedule.stages_of(ctx.rank)}
        pipe_stages = []
        for s, mod in modules.items():
            stage = PipelineStage(mod, s, schedule.num_stages, ctx.device)  # infers shapes itself
            record_torch_stage(stage, ctx.rec)
            pipe_stages.append(stage)
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule.name])
        single = cls in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B)
        divisor = loss_divisor(loss_fn, schedule.num_microbatches)  # torch's scale_grads: divide by m, or not
        runner = cls(pipe_stages[0] if single else pipe_stages, schedule.num_microbatches, loss_fn=loss_fn,
                     scale_grads=divisor > 1)
        holds_first, holds_last = 0 in modules, schedule.num_stages - 1 in modules

        def zero_grad(_):
            for module in modules.values():
                module.zero_grad(set_to_none=True)

        def step(_):
            losses: list = []
            runner.step(*([x] if holds_first else []), target=y if holds_last else None,
                        losses=losses if holds_last else None)
            return losses

        measured = time_steps(ctx, step, steps, prepare=zero_grad)
        losses = measured.results[-1]
        loss = float(sum(l.detach() for l in losses) / divisor) if holds_last else None
        grads = {s: {n: None if p.grad is None else p.grad.detach().cpu() for n, p in mod.named_parameters()}
                 for s, mod in modules.items()}
        timed = RankSteps([], measured.seconds, measured.timelines)
        results.append(RankResult(ctx.rank, sorted(modules), loss, grads, timed,
                                  [[] for _ in measured.seconds], 0, 0, 0, 0))
    return results


def run_torch_pipelines(stages: list[nn.Module], schedules: list[Schedule], x, y, loss_fn: Callable,
                        steps: int = 2, backend: str = "auto", timeout: float = 120.0) -> list[PipelineRun]:
    """Run each schedule through torch.distributed.pipelining (same stages, data and loss).

    The runs carry losses, gradients, step times and F/B/I/W spans; torch's stash is not counted."""
    from pipelab.launch import spawn

    world, batches, _ = prepare(stages, schedules, x, y, loss_fn, steps)
    for schedule in schedules:
        if schedule.name not in TORCH_SCHEDULES:
            raise ValueError(f"torch has no counterpart of {schedule!r}; use one of {sorted(TORCH_SCHEDULES)}")
        if schedule.name == "1F1B" and schedule.num_microbatches < schedule.num_ranks:
            raise ValueError(f"torch's Schedule1F1B needs num_microbatches >= num_ranks, got "
                             f"m={schedule.num_microbatches} < p={schedule.num_ranks}; use m >= {schedule.num_ranks}")
    per_rank = spawn(torch_pipeline_worker, world, stages, schedules, batches, loss_fn, steps,
                     backend=backend, timeout=timeout)
    return [gather(schedule, [r[i] for r in per_rank]) for i, schedule in enumerate(schedules)]

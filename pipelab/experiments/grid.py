"""Lesson 05 from a notebook, part 3-4: the pipe x data grid, and the same processes laid out as
one long pipeline or as pure data parallelism.

`run_layouts(model, x, y, layouts)` starts `world_size` processes once and runs every layout
(pipe x data) in them, in alternating rounds so that a busy machine slows them all alike. In each,
a process finds its place and groups with `hybrid.grid_place`, cuts its stages with
`split_model`, takes its replica's share of the batch and trains with `hybrid.run_grid_step`.
A `GridRun` names gradients and weights as the model does, so
`assert_same(run, reference_run(model, x, y, loss_fn, steps=len(run.losses), lr=lr))` checks it.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import nn

from pipelab.checks import divisors, positive_number, whole_number
from pipelab.experiments.hybrid import hidden_share, is_compute
from pipelab.hybrid import check_grid, grid_place, run_grid_step
from pipelab.launch import spawn
from pipelab.hardware import synchronize
from pipelab.measure import Measured, TimedSteps, RankSteps, Steps, alternate, best_of, gather_steps, time_steps
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, simulate
from pipelab.timeline import Span, Timeline


@dataclass(frozen=True)
class Layout:
    """`pipe x data` processes: `data` pipelines of `pipe` ranks, each on `microbatches` micro-batches."""

    pipe: int
    data: int
    microbatches: int = 1

    @property
    def name(self) -> str:
        if self.pipe == 1:
            return f"data parallel (1 x {self.data})"
        if self.data == 1:
            return f"one pipeline ({self.pipe} x 1)"
        return f"grid ({self.pipe} x {self.data})"


def layouts_of(world_size: int, pipe: int, data: int, microbatches: int) -> list[Layout]:
    """The three ways lesson 05 compares: one pipeline over every process (whole batch), the
    grid, and pure data parallelism (each process the whole model, one micro-batch)."""
    return [Layout(world_size, 1, microbatches), Layout(pipe, data, microbatches), Layout(1, world_size, 1)]


# ---------------------------------------------------------------------------------------------
# On each process
# ---------------------------------------------------------------------------------------------


class LayoutTrainer:
    """One layout on this process: its place in the grid, its stages, its share of the batch."""

    def __init__(self, ctx, layout: Layout, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 loss_fn: Callable, schedule: str, lr: float):
        self.ctx, self.loss_fn = ctx, loss_fn
        self.place = grid_place(ctx, check_grid(layout.pipe, layout.data, ctx.world_size))
        self.schedule = make_schedule(schedule if layout.pipe > 1 else "1f1b", layout.pipe, layout.microbatches)
        local = copy.deepcopy(model)  # every layout starts from the same weights
        self.names = {id(p): n for n, p in local.named_parameters()}  # names as in the whole model
        stages = split_model(local, self.schedule.num_stages)
        replica = ctx.rank % layout.data  # the grid's last axis (data) runs fastest
        self.x, self.y = x.chunk(layout.data)[replica], y.chunk(layout.data)[replica]
        self.specs = message_specs(stages, self.x, layout.microbatches)  # what each message carries
        self.modules = {s: stages[s].to(ctx.device) for s in self.schedule.stages_of(self.place.rank)}
        self.x, self.y = self.x.to(ctx.device), self.y.to(ctx.device)
        self.optimizer = torch.optim.SGD([p for m in self.modules.values() for p in m.parameters()], lr=lr)
        self.first_grads: dict | None = None

    def zero_grad(self, _=None) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, _=None) -> float | None:
        """One step: the grid's rank loop, then SGD; the loss where this process holds the last stage."""
        runner = run_grid_step(self.place, self.schedule, self.modules, self.loss_fn, self.x, self.y, self.specs)
        if self.first_grads is None:
            self.first_grads = self.tensors(grad=True)
        self.optimizer.step()
        return float(sum(runner.losses)) if runner.losses else None

    def tensors(self, grad: bool) -> dict[str, torch.Tensor]:
        """This process's gradients or weights, named as in the whole model."""
        return {self.names[id(p)]: (p.grad if grad else p).detach().cpu().clone()
                for m in self.modules.values() for p in m.parameters()}


def layouts_worker(ctx, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                   layouts: list[Layout], schedule: str, lr: float, steps: int, rounds: int) -> list[dict]:
    """Worker: every layout in `rounds` alternating rounds of `steps` timed steps; the first step
    of each layout is checked and warms up."""
    trainers = [LayoutTrainer(ctx, layout, model, x, y, loss_fn, schedule, lr) for layout in layouts]
    measured = [RankSteps([], [], []) for _ in layouts]

    def one_round(i: int) -> Callable[[], float]:
        def run() -> float:
            trainer, got = trainers[i], measured[i]
            warmup = 0 if got.results else 1  # a layout's very first step is checked, not timed
            this = time_steps(ctx, trainer.step, steps + warmup, prepare=trainer.zero_grad, warmup=warmup)
            got.results.extend(this.results)
            got.seconds.extend(this.seconds)
            got.timelines.extend(this.timelines)
            return statistics.median(this.seconds)
        return run

    alternate({i: one_round(i) for i in range(len(layouts))}, rounds, warmup=0)  # A B C A B C ...
    return [{"steps": got, "grads": t.first_grads, "weights": t.tensors(grad=False), "pipeline": t.place.ranks,
             "stages": sorted(t.modules)} for t, got in zip(trainers, measured)]


# ---------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------


@dataclass
class GridRun(TimedSteps):
    """One layout, gathered from every process; `assert_same(run, reference)` checks it."""

    layout: Layout
    schedule: str
    losses: list[float]  # per step: the mean over pipelines of the batch's loss
    grads: list[dict[str, torch.Tensor]]  # per process: its stages' gradients of the first step
    weights: list[dict[str, torch.Tensor]]  # per process: its stages' weights after the last step
    replica_spread: float  # largest difference between two copies of a weight after the last step
    steps: Steps = field(repr=False)
    pipelines: list[list[int]] = field(default_factory=list)  # the processes of each pipeline
    stages: list[list[int]] = field(default_factory=list)  # per process, the stages it holds
    rounds: int = 1  # the timed steps came in this many rounds, the layouts alternating

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def round_times(self) -> list[float]:
        """Per round, the median of its timed steps (s): what `measure.ratios` pairs between layouts
        that ran in the same rounds."""
        per = len(self.steps.seconds) // self.rounds
        return [statistics.median(self.steps.seconds[r * per:(r + 1) * per]) for r in range(self.rounds)]

    @property
    def hidden(self) -> Measured:
        """`hidden_behind_pipeline` of every timed step."""
        return Measured.of(hidden_behind_pipeline(tl) for tl in self.steps.timelines)

    def flights(self) -> dict[int, float]:
        """Per stage, its all-reduce's flight (`in_flight`, s): median over the timed steps of the
        mean over the stage's copies."""
        per_stage: dict[int, list[float]] = {}
        for tl in self.steps.timelines:
            for stage in {s.meta.get("stage") for s in tl.filter(kind="allreduce")}:
                mine = [s.duration for s in in_flight(tl) if s.meta.get("stage") == stage]
                per_stage.setdefault(stage, []).append(statistics.mean(mine))
        return {stage: statistics.median(d) for stage, d in sorted(per_stage.items())}

    def simulated_hidden(self) -> float:
        """The share `hidden` would be on independent devices: the schedule simulated with this
        run's measured per-stage costs, each stage's all-reduce launched when its gradients are
        final and taking its measured flight, hidden for as long as the pipeline still computes."""
        sched = make_schedule(self.schedule if self.layout.pipe > 1 else "1f1b", self.layout.pipe,
                              self.layout.microbatches)
        sim = simulate(sched, Costs.from_timeline(self.timeline, per_stage=True)).timeline
        end, hidden, total = max(s.end for s in sim), 0.0, 0.0
        for stage, flight in self.flights().items():
            final = max(s.end for s in sim if s.kind in ("B", "W") and s.meta["stage"] == stage)
            hidden, total = hidden + min(flight, end - final), total + flight
        return hidden / total if total > 0 else 0.0

    @property
    def typical_hidden(self) -> float:
        """`hidden_behind_pipeline` of the typical step (the one `timeline` is)."""
        return hidden_behind_pipeline(self.timeline)

    def launches(self) -> list[dict]:
        """For each process in the typical step: when its stage's all-reduce was launched and arrived,
        and when its pipeline's last compute ended (ms from the step's start)."""
        tl = self.timeline
        rows = []
        for s in tl.filter(kind="allreduce"):
            pipeline = next(p for p in self.pipelines if s.rank in p)
            done = max(c.end for c in tl.filter(rank=pipeline) if is_compute(c))
            rows.append({"process": s.rank, "stage": s.meta.get("stage"), "launched (ms)": round((s.start - tl.start) * 1e3, 1),
                         "its pipeline's compute ended (ms)": round((done - tl.start) * 1e3, 1),
                         "arrived (ms)": round((s.end - tl.start) * 1e3, 1)})
        return sorted(rows, key=lambda r: r["process"])


def in_flight(tl: Timeline) -> list[Span]:
    """Each data-parallel all-reduce from the moment the last copy of its stage launched it (before
    that, the early ones only wait for their peers) to its arrival on each process."""
    spans = tl.filter(kind="allreduce").spans
    last_launch: dict = {}
    for s in spans:
        last_launch[s.meta.get("stage")] = max(last_launch.get(s.meta.get("stage"), s.start), s.start)
    return [replace(s, start=min(last_launch[s.meta.get("stage")], s.end)) for s in spans]


def hidden_behind_pipeline(tl: Timeline) -> float:
    """Share of the data-parallel all-reduces' flight time (`in_flight`) during which some process
    still computed: what the pipeline's remaining work hid, 0.0 when every all-reduce ran after
    the last backward of the step."""
    flights = Timeline(in_flight(tl) + [s for s in tl if is_compute(s)])
    return hidden_share(flights, lambda s: s.kind == "allreduce", is_compute, any_rank=True)


def _spread(weights: list[dict[str, torch.Tensor]]) -> float:
    """Largest difference between two processes' copies of the same weight."""
    first: dict[str, torch.Tensor] = {}
    worst = 0.0
    for held in weights:
        for name, w in held.items():
            worst = max(worst, (w - first.setdefault(name, w)).abs().max().item())
    return worst


def gather_layout(layout: Layout, schedule: str, per_rank: list[dict], rounds: int = 1) -> GridRun:
    per_step = zip(*(r["steps"].results for r in per_rank))
    losses = [statistics.mean(loss for loss in step if loss is not None) for step in per_step]
    pipelines = sorted({tuple(r["pipeline"]) for r in per_rank})
    return GridRun(layout, schedule, losses, [r["grads"] for r in per_rank], [r["weights"] for r in per_rank],
                   _spread([r["weights"] for r in per_rank]), gather_steps([r["steps"] for r in per_rank]),
                   [list(p) for p in pipelines], [r["stages"] for r in per_rank], rounds)


def check_layouts(model: nn.Module, x: torch.Tensor, y: torch.Tensor, layouts: Sequence[Layout], world_size: int,
                  loss_fn: Callable, schedule: str, lr: float, steps: int, rounds: int) -> None:
    """Refuse what cannot run, before any process starts."""
    if getattr(loss_fn, "reduction", "mean") != "mean":
        raise ValueError(f"the replicas average their gradients, which is the whole batch's gradient only for a "
                         f"loss that averages over samples; got reduction={loss_fn.reduction!r}: use "
                         "reduction='mean'")
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"the grid cuts the model into stages, so pass an nn.Sequential, got {type(model).__name__} "
                         "(e.g. pipelab.models.mlp([64] * 9))")
    if not layouts:
        raise ValueError("give at least one layout, e.g. [Layout(pipe=2, data=2, microbatches=4)]")
    batch = x.shape[0]
    if y.shape[0] != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {y.shape[0]}; pass one target per input")
    for layout in layouts:
        check_grid(layout.pipe, layout.data, world_size)
        whole_number("microbatches", layout.microbatches, example="microbatches=4")
        sched = make_schedule(schedule if layout.pipe > 1 else "1f1b", layout.pipe, layout.microbatches)
        split_model(model, sched.num_stages)  # refuses more stages than layers
        parts = layout.data * layout.microbatches
        if batch % parts:
            fits = f", or microbatches in {divisors(batch // layout.data)}" if batch % layout.data == 0 else ""
            raise ValueError(f"a batch of {batch} samples does not split over data={layout.data} replicas x "
                             f"{layout.microbatches} micro-batches ({parts} equal parts); use a batch that is a "
                             f"multiple of {parts}{fits}")
    positive_number("lr", lr, example="lr=0.1")
    whole_number("steps", steps, example="steps=3")
    whole_number("rounds", rounds, example="rounds=2")


def run_layouts(model: nn.Module, x: torch.Tensor, y: torch.Tensor, layouts: Sequence[Layout],
                loss_fn: Callable | None = None, schedule: str = "1f1b", lr: float = 0.1, steps: int = 3,
                rounds: int = 1, world_size: int | None = None, backend: str = "auto",
                timeout: float = 300.0) -> list[GridRun]:
    """Train `model` (an nn.Sequential) in each layout on the same `world_size` processes (by
    default, the first layout's pipe x data): one checked warm-up step, then `rounds` x `steps`
    timed SGD steps per layout, rounds alternating."""
    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    if world_size is None:
        world_size = layouts[0].pipe * layouts[0].data if layouts else 1
    check_layouts(model, x, y, layouts, world_size, loss_fn, schedule, lr, steps, rounds)
    per_rank = spawn(layouts_worker, world_size, model, x, y, loss_fn, list(layouts), schedule, lr, steps, rounds,
                     backend=backend, timeout=timeout)
    return [gather_layout(layout, schedule, [r[i] for r in per_rank], rounds) for i, layout in enumerate(layouts)]


def run_grid(model: nn.Module, x: torch.Tensor, y: torch.Tensor, pipe: int = 2, data: int = 2,
             microbatches: int = 4, **kwargs) -> GridRun:
    """Train `model` on one pipe x data grid (see `run_layouts` for the other arguments)."""
    return run_layouts(model, x, y, [Layout(pipe, data, microbatches)], **kwargs)[0]


# ---------------------------------------------------------------------------------------------
# Predicted: what the layouts would take on independent devices
# ---------------------------------------------------------------------------------------------


def ideal_fraction(layout: Layout) -> float:
    """A layout's step on pipe x data independent devices, as a fraction of the whole model's
    forward and backward on the whole batch on one device, communication left out: each device
    does 1/(pipe x data) of the work, and a pipeline of p stages and m micro-batches takes
    m + p - 1 micro-batch slots for m slots of work (the bubble, lessons 06-07):
    (m + p - 1) / (m x p x data). Pure data parallelism (p = m = 1) gives 1/data."""
    m, p = layout.microbatches, layout.pipe
    return (m + p - 1) / (m * p * layout.data)


def predicted_seconds(layout: Layout, one_device: float, devices: int) -> float:
    """A layout's step (s) when its processes share `devices` devices (cores or GPUs), given the
    one-device step `one_device`: no faster than its ideal pipeline, and no faster than the whole
    work spread evenly over the devices there are. With fewer devices than processes, a bubble is
    no idle device: another process's work fills it."""
    return one_device * max(ideal_fraction(layout), 1 / min(devices, layout.pipe * layout.data))


def allreduce_bytes(layout: Layout, model: nn.Module) -> float:
    """Bytes each process sends per step in its data-parallel all-reduce (a ring sends 2 (d-1)/d
    times what it reduces): the gradients of its 1/pipe of the model."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return 2 * (layout.data - 1) / layout.data * grads / layout.pipe


def one_device_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None = None,
                       repeats: int = 3, device: str = "cpu") -> float:
    """Fastest of `repeats` forwards and backwards of the whole model on the whole batch, in this
    process on one thread (as each worker runs) or on one GPU: the unit of `predicted_seconds`."""
    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    model, x, y = copy.deepcopy(model).to(device), x.to(device), y.to(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def step() -> None:
            loss_fn(model(x), y).backward()
            synchronize(device)
        return best_of({"step": step}, repeats, prepare=lambda: model.zero_grad(set_to_none=True))["step"][0]
    finally:
        torch.set_num_threads(threads)

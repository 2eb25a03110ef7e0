"""Pipeline schedules run for real (lessons 06 and 07), in the one lesson shape:

    cfg = Config(world_size=2, stages=stages, schedules=["gpipe", "1f1b"], num_microbatches=4, x=x, y=y)
    runs = run(cfg)  # experiments.run(worker, cfg, gather): one PipelineRun per schedule

`Config` checks every input before a process starts and lists its `jobs` (a schedule on a batch
each, all in one set of processes); `worker` times each on every rank with pipelab's runtime or,
with `engine="torch"`, `torch.distributed.pipelining`; `gather` makes one `PipelineRun` per job,
which must match `reference(cfg)`. Lesson 06's verdicts are in `experiments.gpipe`, 07's in
`experiments.schedules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from pipelab import experiments
from pipelab.checks import divides, mean_loss, same_batch, whole_number
from pipelab.emulate import Emulated
from pipelab.emulate.pipe import EmulatedPipe
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, gather_steps, time_steps, timed_slice
from pipelab.models import mlp
from pipelab.pipeline.p2p import TensorSpec, message_specs, trace
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.runtime import run_step
from pipelab.pipeline.schedules import Schedule, make_schedule
from pipelab.pipeline.simulate import Costs, simulate
from pipelab.pipeline.stage_source import StageFiles, for_ranks, stage_for_rank, traceable
from pipelab.pipeline.torch_pipelining import check_torch, torch_step
from pipelab.reference import Reference, reference_run
from pipelab.worker import RankContext

ENGINES = ("pipelab", "torch")  # whose runtime runs the schedules


@dataclass(frozen=True)
class Job:
    """One schedule to run on one batch: what `Config.jobs` made of the inputs."""

    schedule: Schedule
    x: torch.Tensor = field(repr=False)
    y: torch.Tensor = field(repr=False)
    checkpoint: bool = False  # activation checkpointing: each backward recomputes its forward
    specs: list[list[TensorSpec]] | None = field(repr=False, default=None)  # p2p.message_specs


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """Pipeline schedules on `world_size` ranks, all in one set of processes.

    `schedules`: names ("gpipe", "1f1b", "interleaved", "zb-h1") or `Schedule`s built by hand;
    `num_microbatches`, `x`, `y` and `checkpoint`: one for all schedules or one per schedule. `steps`
    per schedule, the first a warm-up. `engine`: "pipelab" (our runtime) or "torch". `stages`:
    modules (real or on meta, sent one file per stage) or a `StageBuilder` each rank calls for its
    own stages (`pipeline.stage_source`)."""

    stages: Sequence[nn.Module] = field(repr=False)
    x: torch.Tensor | Sequence[torch.Tensor] = field(repr=False)
    y: torch.Tensor | Sequence[torch.Tensor] = field(repr=False)
    schedules: Sequence[str | Schedule] = ("gpipe",)
    num_microbatches: int | Sequence[int] = 4
    loss_fn: Callable = field(default_factory=nn.MSELoss)
    steps: int = 2
    checkpoint: bool | Sequence[bool] = False
    engine: str = "pipelab"
    # On an emulated node: the same stages at the emulated size and one micro-batch (both on meta;
    # `emulated_mlp` builds them), in `dtype`, the memory counting `optimizer`'s state.
    SIZE: ClassVar[Mapping[str, Any]] = {"stages": None, "x": None, "dtype": "bfloat16", "optimizer": "adam"}

    def check(self) -> None:
        super().check()
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.emulate is not None and self.engine == "torch":
            raise ValueError(f"engine='torch' runs on this machine's own clock, not on an emulated node; "
                             f"pass emulate=None (got a node, {self.node_name})")
        if callable(self.stages) and not isinstance(self.stages, (nn.Module, Sequence)):
            raise ValueError(f"stages={self.stages!r} is a function: wrap it as stages=StageBuilder(build_stage, "
                             "num_stages=N) (pipelab.pipeline.stage_source), so each rank builds its own stages")
        for s, stage in enumerate(traceable(self.stages)):  # a builder's stages are checked on meta
            if not isinstance(stage, nn.Module):
                raise ValueError(f"stage {s} is {stage!r}, not an nn.Module: a stage is copied to its rank "
                                 "and moved to its device; wrap a function in a module (e.g. nn.Flatten(), "
                                 "or an nn.Module whose forward calls it)")
        if self.loss_fn is None or not callable(self.loss_fn):
            raise ValueError(f"the last stage needs a loss function, got loss_fn={self.loss_fn!r}; "
                             "pass e.g. loss_fn=torch.nn.MSELoss()")
        mean_loss(self.loss_fn)
        whole_number("steps", self.steps, example="steps=2")
        self.emulated  # counts every stage at the emulated size now: a bad or missing stage fails here
        first = self.jobs[0]  # builds and checks every job
        # The loss of one micro-batch must be one number: its backward starts there.
        rows = first.x.shape[0] // first.schedule.num_microbatches
        out = trace(traceable(self.stages), first.x[:rows])[-1]  # a meta tensor where the stages are built on meta
        loss = self.loss_fn(out, first.y[:rows].to(out.device))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
            raise ValueError(f"loss_fn must return one number per micro-batch (a 0-dim tensor), got {got}; "
                             "use a loss that averages over the samples, e.g. torch.nn.MSELoss()")

    @cached_property
    def emulated(self) -> EmulatedPipe | None:
        """The stages at the emulated size, counted once on the meta device (None off an emulated node)."""
        return None if self.emulate is None else EmulatedPipe.of(self.size, self.loss_fn, self.node,
                                                                 len(self.stages), self.node_name)

    def simulated_costs(self, messages: bool = False) -> Costs:
        """The simulator's `Costs` (ms) on the emulated node; with `messages`, each message's link time."""
        if (pipe := self.emulated) is None:
            raise ValueError("simulated_costs needs an emulated node: pass emulate=emulated_mlp(node, ...)")
        return Costs(transfer=pipe.message_ms() if messages else 0.0, per_stage=pipe.stage_ms())

    @cached_property
    def jobs(self) -> list[Job]:
        """One checked job per schedule: the schedule built, its batch, its messages' specs."""
        if isinstance(self.schedules, (str, Schedule)) or not self.schedules:
            raise ValueError(f"give a list of one or more schedules, got {self.schedules!r}; "
                             "e.g. schedules=['gpipe']")
        n = len(self.schedules)
        ms = per_schedule("num_microbatches", self.num_microbatches, int, n)
        xs, ys = per_schedule("x", self.x, torch.Tensor, n), per_schedule("y", self.y, torch.Tensor, n)
        flags = per_schedule("checkpoint", self.checkpoint, bool, n)
        return [self.job(s, m, x, y, c) for s, m, x, y, c in zip(self.schedules, ms, xs, ys, flags)]

    def job(self, schedule: str | Schedule, m: int, x: torch.Tensor, y: torch.Tensor, checkpoint: bool) -> Job:
        """Build `schedule` (a name) or check it (a Schedule) and its batch; trace its messages."""
        if isinstance(schedule, str):
            schedule = make_schedule(schedule, self.world_size, m, max(1, len(self.stages) // self.world_size))
        elif not isinstance(schedule, Schedule):
            raise ValueError(f"a schedule is a name ('gpipe', '1f1b', 'interleaved', 'zb-h1') or a "
                             f"pipelab Schedule, got {schedule!r}")
        if schedule.num_ranks != self.world_size:
            raise ValueError(f"{schedule!r} runs on {schedule.num_ranks} ranks but world_size={self.world_size}; "
                             f"pass world_size={schedule.num_ranks}")
        if len(self.stages) != schedule.num_stages:
            raise ValueError(f"{schedule!r} runs {schedule.num_stages} stages ({schedule.num_ranks} ranks x "
                             f"{schedule.stages_per_rank} per rank) but {len(self.stages)} were given; cut the "
                             f"model with split_model(model, {schedule.num_stages})")
        divides("batch", same_batch(x, y), "num_microbatches", schedule.num_microbatches)
        if self.engine == "torch":
            check_torch(schedule)
            if checkpoint:
                raise ValueError("checkpoint=True runs with engine='pipelab' only; with torch's schedules put "
                                 "torch.utils.checkpoint inside the stages instead")
            return Job(schedule, x, y, checkpoint)
        return Job(schedule, x, y, checkpoint, message_specs(traceable(self.stages), x, schedule.num_microbatches))

    @cached_property
    def sent_stages(self) -> Sequence[nn.Module]:
        """The stages as the ranks receive them (`stage_source.for_ranks`): each rank reads its own only."""
        return for_ranks(self.stages)

    def __getstate__(self) -> dict:
        """What pickling sends a rank: every field, with the stages as `sent_stages`."""
        state = {k: v for k, v in self.__dict__.items() if k != "sent_stages"}
        return {**state, "stages": self.sent_stages}

    def remove_stage_files(self) -> None:
        """Delete the files real stages were sent in (after a run); a later run writes them again."""
        sent = self.__dict__.pop("sent_stages", None)
        if isinstance(sent, StageFiles) and sent is not self.stages:
            sent.remove()


def emulated_mlp(node: str | None, layers: int, num_stages: int, width: int, rows: int, dtype: str = "bfloat16"):
    """`emulate=` for an MLP of `layers` Linear layers of `width` cut into `num_stages` stages, fed
    `rows` rows per micro-batch in `dtype`, on `node` (None: nothing emulated); built on meta."""
    if node is None:
        return None
    with torch.device("meta"):
        stages = split_model(mlp([width] * (layers + 1)), num_stages)
        return Emulated(node, stages=stages, x=torch.empty(rows, width), dtype=dtype)


def per_schedule(name: str, value, kind: type, count: int) -> list:
    """One `value` for every schedule, or a list or tuple of one per schedule."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count or not all(isinstance(v, kind) and not (kind is int and isinstance(v, bool))
                                       for v in values):
        raise ValueError(f"{name} must be one {kind.__name__} for all {count} schedules or one per schedule, "
                         f"got {value!r}")
    return values


@dataclass
class Result:
    """What one rank brings back for one job."""

    rank: int
    stages: list[int]
    mb_losses: list[float]  # the last step's, on the rank holding the last stage (else empty)
    grads: dict[int, dict[str, torch.Tensor | None]]  # stage -> parameter name -> gradient (last step)
    steps: RankSteps  # times and timelines of the timed steps
    stash_traces: list[list[tuple[float, int, int]]]  # one per timed step: (time, stashes, bytes)
    peak_stash: int = 0
    peak_stash_bytes: int = 0
    messages_sent: int = 0
    peak_bytes: float = 0.0  # on an emulated node: its memory meter's peak (the emulated size)


def worker(ctx: RankContext, cfg: Config) -> list[Result]:
    """Every job of `cfg` on this rank, in order, each for `cfg.steps` timed steps."""
    run_job = torch_job if cfg.engine == "torch" else pipelab_job
    return [run_job(ctx, cfg, job) for job in cfg.jobs]


def rank_modules(ctx: RankContext, cfg: Config, schedule: Schedule) -> dict[int, nn.Module]:
    """This rank's own stages on its device, and no other (`pipeline.stage_source.stage_for_rank`)."""
    return {s: stage_for_rank(cfg.stages, s, ctx.rank, ctx.device) for s in schedule.stages_of(ctx.rank)}


def gradients_of(modules: dict[int, nn.Module]) -> dict[int, dict[str, torch.Tensor | None]]:
    """Every parameter's gradient of the last step, on the CPU, by stage."""
    return {s: {n: None if p.grad is None else p.grad.detach().cpu() for n, p in mod.named_parameters()}
            for s, mod in modules.items()}


def zero_grads(modules: dict[int, nn.Module]) -> Callable[[int], None]:
    """What runs before each step (untimed): every stage's gradients cleared."""
    return lambda _: [module.zero_grad(set_to_none=True) for module in modules.values()]


def pipelab_job(ctx: RankContext, cfg: Config, job: Job) -> Result:
    """`cfg.steps` steps of `job` with pipelab's runtime (`run_step`); the last one's losses and gradients."""
    x, y = job.x.to(ctx.device), job.y.to(ctx.device)
    modules = rank_modules(ctx, cfg, job.schedule)
    # On an emulated node this rank's stages and messages are timed at the emulated size.
    meter = cfg.emulated.install(ctx.emulator, modules, job.checkpoint, job.specs[0][0]) if cfg.emulated else None
    measured = time_steps(ctx, lambda _: run_step(ctx, job.schedule, modules, cfg.loss_fn, x, y, job.specs,
                                                  job.checkpoint),
                          cfg.steps, prepare=zero_grads(modules))
    last = measured.results[-1]
    traces = [step.stash.trace for step in measured.results[timed_slice(cfg.steps)]]
    timed = RankSteps([], measured.seconds, measured.timelines)  # the steps' tensors stay here
    return Result(ctx.rank, sorted(modules), [float(loss) for loss in last.losses], gradients_of(modules), timed,
                  traces, last.stash.peak, last.stash.peak_bytes, last.messages_sent,
                  meter.peak if meter else 0.0)


def torch_job(ctx: RankContext, cfg: Config, job: Job) -> Result:
    """The same job run by torch.distributed.pipelining (its stash is not counted)."""
    x, y = job.x.to(ctx.device), job.y.to(ctx.device)
    modules = rank_modules(ctx, cfg, job.schedule)
    step = torch_step(ctx, job.schedule, modules, cfg.loss_fn)
    measured = time_steps(ctx, lambda _: step(x, y), cfg.steps, prepare=zero_grads(modules))
    timed = RankSteps([], measured.seconds, measured.timelines)
    return Result(ctx.rank, sorted(modules), [float(loss.detach()) for loss in measured.results[-1]], gradients_of(modules),
                  timed, [[] for _ in measured.seconds])


@dataclass
class PipelineRun(TimedSteps):
    """One schedule's run, gathered from every rank: its losses and gradients, its timed steps
    (`step_time`, `bubble_fraction`: Measured over them) and a typical step's `timeline`."""

    schedule: Schedule
    mb_losses: list[float]  # each micro-batch's loss, as the last stage computed it
    grads: list[dict[str, torch.Tensor | None]]  # per stage; stage s's "0.weight" is named "s.0.weight"
    steps: Steps = field(repr=False)
    peak_stash: dict[int, int]  # rank -> stashed micro-batches at the peak
    peak_stash_bytes: dict[int, int]
    stash_traces: dict[int, list[tuple[float, int, int]]] = field(repr=False, default_factory=dict)
    messages_sent: int = 0
    checkpoint: bool = False  # activation checkpointing: each backward recomputed its forward
    node: str | None = None  # the emulated node that timed it; None: this machine's clock
    peak_bytes: dict[int, float] = field(default_factory=dict)  # on the node: rank -> its memory meter's peak

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def modelled(self) -> bool:
        """Whether the times are modelled (on an emulated node) rather than measured."""
        return self.node is not None

    @property
    def loss(self) -> float:
        """The batch's loss: the mean of its equal micro-batches' mean losses."""
        return sum(self.mb_losses) / len(self.mb_losses)

    @property
    def losses(self) -> list[float]:
        """The loss of each step (no optimizer step: every step computes the same one)."""
        return [self.loss]

    @property
    def bubble_fraction(self) -> Measured:
        """Idle fraction of the compute lane, averaged over ranks, of every timed step."""
        return Measured.of(tl.bubble_fraction("compute") for tl in self.steps.timelines)

    @cached_property
    def simulated_bubble(self) -> Measured:
        """Per timed step, the schedule's bubble on an ideal machine (free messages, no waiting for a
        core) with that step's per-stage costs: what the schedule itself costs at this run's sizes."""
        return Measured.of(simulate(self.schedule, Costs.from_timeline(tl, per_stage=True)).bubble_fraction
                           for tl in self.steps.timelines)

    @property
    def peak_stash_mib(self) -> dict[int, float]:
        return {rank: b / 2**20 for rank, b in self.peak_stash_bytes.items()}

    def row(self) -> dict:
        """The figures as one table row, at one size: on an emulated node the modelled step and the
        peak memory there, elsewhere the measured step and the real stash's bytes."""
        memory = ({"peak GB, emulated size": round(max(self.peak_bytes.values()) / 1e9, 2)} if self.modelled else
                  {"peak_stash_KiB": round(max(self.peak_stash_bytes.values()) / 1024, 1)})
        return {"schedule": self.schedule.name, "p": self.schedule.num_ranks, "m": self.schedule.num_microbatches,
                "step_ms, modelled" if self.modelled else "step_ms": f"{self.step_time.scaled(1e3):.1f}",
                "bubble": f"{self.bubble_fraction:.3f}", "simulated bubble": f"{self.simulated_bubble:.3f}",
                "peak_stash": max(self.peak_stash.values()), **memory, "messages": self.messages_sent}


def gather(cfg: Config, results: Sequence[list[Result]]) -> list[PipelineRun]:
    """One run per job from every rank's results (by rank): gradients named as in the whole model,
    the slowest rank per step, and the stash traces of the typical step."""
    runs = []
    for i, job in enumerate(cfg.jobs):
        mine = [r[i] for r in results]
        grads: list[dict] = [{} for _ in range(job.schedule.num_stages)]
        for r in mine:
            for s, g in r.grads.items():
                grads[s] = {f"{s}.{name}": t for name, t in g.items()}
        steps = gather_steps([r.steps for r in mine])
        runs.append(PipelineRun(
            job.schedule, next(r.mb_losses for r in mine if r.mb_losses), grads, steps,
            {r.rank: r.peak_stash for r in mine}, {r.rank: r.peak_stash_bytes for r in mine},
            {r.rank: r.stash_traces[steps.typical_index] for r in mine}, sum(r.messages_sent for r in mine),
            job.checkpoint, cfg.node_name,
            {r.rank: r.peak_bytes for r in mine if r.peak_bytes}))
    return runs


def run(cfg: Config) -> list[PipelineRun]:
    """Run `cfg` on real processes: `experiments.run(worker, cfg, gather)`."""
    try:
        return experiments.run(worker, cfg, gather)
    finally:
        cfg.remove_stage_files()


def reference(cfg: Config) -> list[Reference]:
    """One process's losses and gradients for each job of `cfg` (the whole model on the same batch,
    no update): what each run must match (`reference.assert_same`); a batch used twice is run once."""
    done: dict[tuple[int, int], Reference] = {}
    for job in cfg.jobs:
        key = (id(job.x), id(job.y))
        if key not in done:
            done[key] = reference_run(nn.Sequential(*cfg.stages), job.x, job.y, cfg.loss_fn, lr=None)
    return [done[id(job.x), id(job.y)] for job in cfg.jobs]


def pooled_bubble(runs: Sequence[PipelineRun]) -> Measured:
    """The bubble of every timed step of several runs of one schedule, as one set of repeats."""
    return Measured.of(v for r in runs for v in r.bubble_fraction.values)


def median_run(runs: Sequence[PipelineRun]) -> PipelineRun:
    """The run of typical (median) step time among repeats of one run."""
    return sorted(runs, key=lambda r: r.step_time.median)[len(runs) // 2]

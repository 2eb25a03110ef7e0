"""Lesson 05, parts 3-4: the pipe x data grid beside one long pipeline and pure data parallelism.

    cfg = grid.Config(model=models.mlp([512] * 9), x=x, y=y, layouts=grid.layouts_of(2, 2, 4))  # checked here
    runs = experiments.run(grid.worker, cfg, grid.gather)  # one GridRun per layout

The processes start once and run the layouts in alternating rounds, so a busy machine slows them all
alike. In each, a process finds its place (`hybrid.grid_place`), cuts its stages (`split_model`),
takes its replica's share of the batch and trains (`hybrid.run_grid_step`). On an emulated node its
clock times the same layers `scale` times wider (`emulate.widened`). Part 4, the layouts beside their
prediction and beside this machine's cores, is `experiments.layouts`, which the notebook reads.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from pipelab import experiments, hardware
from pipelab.build import materialize, name_modules
from pipelab.checks import divisors, mean_loss, positive_number, same_batch, whole_number
from pipelab.emulate.widened import Widened, widen
from pipelab.experiments.hybrid import REPLICA_VARIANTS, hidden_share, is_compute
from pipelab.hybrid import check_grid, grid_place, microbatch_losses, run_grid_step
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, alternate, compare, gather_steps, ratios, time_steps
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, simulate
from pipelab.pipeline.topology import ProcessTopology
from pipelab.reference import Reference, reference_run
from pipelab.timeline import Span, Timeline
from pipelab.worker import RankContext

Verdict = tuple[str, str, str, dict]  # (key, verdict, text, figures): a cell calls pipelab.conclude(*it)


@dataclass(frozen=True)
class Layout:
    """`pipe x data` processes: `data` pipelines of `pipe` ranks, each on `num_microbatches` micro-batches."""

    pipe: int
    data: int
    num_microbatches: int = 1

    @property
    def name(self) -> str:
        return (f"data parallel (1 x {self.data})" if self.pipe == 1 else f"one pipeline ({self.pipe} x 1)"
                if self.data == 1 else f"grid ({self.pipe} x {self.data})")

    def schedule(self, name: str):
        """The schedule each pipeline runs (one stage needs none: 1F1B of one rank)."""
        return make_schedule(name if self.pipe > 1 else "1f1b", self.pipe, self.num_microbatches)



def layouts_of(pipe: int, data: int, num_microbatches: int) -> tuple[Layout, ...]:
    """Lesson 05's three layouts of pipe x data processes: one pipeline, the grid, pure data parallelism."""
    return Layout(pipe * data, 1, num_microbatches), Layout(pipe, data, num_microbatches), Layout(1, pipe * data, 1)


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """`model` (an nn.Sequential) trained on (x, y) in each of `layouts` on the same `world_size` processes
    (pipe x data): a checked warm-up step, then `rounds` x `steps` timed SGD steps, layouts alternating."""

    model: nn.Sequential
    x: torch.Tensor
    y: torch.Tensor
    layouts: tuple[Layout, ...]
    loss_fn: Callable = field(default_factory=nn.MSELoss)
    schedule: str = "1f1b"
    lr: float = 0.1
    steps: int = 3
    rounds: int = 1
    timeout: float = 300.0
    world_size: int = field(init=False, default=0)  # the layouts' processes: pipe x data
    # the node times the same layers `scale` times wider on a batch `scale` times larger, in `dtype`
    SIZE: ClassVar[Mapping[str, Any]] = {"scale": 64, "dtype": "bfloat16"}

    def __post_init__(self) -> None:
        if not self.layouts or not all(isinstance(layout, Layout) for layout in self.layouts):
            raise ValueError(f"layouts must be one or more Layout(pipe, data, num_microbatches), got {self.layouts!r}; "
                             "e.g. layouts=(Layout(2, 2, 4),) or grid.layouts_of(2, 2, 4)")
        object.__setattr__(self, "world_size", self.layouts[0].pipe * self.layouts[0].data)
        check_grid(self.layouts[0].pipe, self.layouts[0].data)
        super().__post_init__()

    def check(self) -> None:
        super().check()
        mean_loss(self.loss_fn)
        if not isinstance(self.model, nn.Sequential):
            raise ValueError(f"the grid cuts the model into stages, so pass an nn.Sequential, got "
                             f"{type(self.model).__name__} (e.g. pipelab.models.mlp([64] * 9))")
        batch = same_batch(self.x, self.y)
        make_schedule(self.schedule, 2, 2)  # refuses a schedule name that does not exist
        for layout in self.layouts:
            check_grid(layout.pipe, layout.data, self.world_size)
            whole_number("num_microbatches", layout.num_microbatches, example="num_microbatches=4")
            split_model(self.model, layout.schedule(self.schedule).num_stages)  # refuses more stages than layers
            parts = layout.data * layout.num_microbatches
            if batch % parts:
                fits = f", or num_microbatches in {divisors(batch // layout.data)}" if batch % layout.data == 0 else ""
                raise ValueError(f"a batch of {batch} samples does not split over data={layout.data} replicas x "
                                 f"{layout.num_microbatches} micro-batches ({parts} equal parts); use a batch that "
                                 f"is a multiple of {parts}{fits}")
        positive_number("lr", self.lr, example="lr=0.1")
        whole_number("steps", self.steps, example="steps=3")
        whole_number("rounds", self.rounds, example="rounds=2")
        whole_number("scale", self.size.scale, example="scale=64")
        if self.node is not None:
            widen(self.model, self.size.scale)  # refuses layers it cannot widen

    @property
    def widened(self) -> Widened:
        """The size every span is timed at on the node (`emulate.widened`)."""
        return Widened(self.size.scale, self.size.dtype, self.node)


def reference(cfg: Config) -> Reference:
    """One process with the same model, batch, loss and SGD steps as each layout (warm-up and timed)."""
    return reference_run(cfg.model, cfg.x, cfg.y, cfg.loss_fn, steps=1 + cfg.rounds * cfg.steps, lr=cfg.lr)


# --- on each process --------------------------------------------------------------------------


@dataclass
class Result:
    """What one process brings back for one layout."""

    steps: RankSteps  # per step, this process's micro-batch losses if it holds a last stage (else None)
    grads: dict[str, torch.Tensor]  # its stages' gradients of the first step, named as in the model
    weights: dict[str, torch.Tensor]  # its stages' weights after the last step
    pipeline: list[int]  # the processes of its pipeline
    replica: int  # its data coordinate: which share of the batch its pipeline trains
    stages: list[int]  # the stages it holds


class LayoutTrainer:
    """One layout on this process: its place in the grid, its stages, its share of the batch."""

    def __init__(self, ctx: RankContext, cfg: Config, layout: Layout):
        self.ctx, self.cfg = ctx, cfg
        topology = check_grid(layout.pipe, layout.data, ctx.world_size)
        self.place = grid_place(ctx, topology)
        self.pipeline = next(ranks for ranks in topology.get_axis_comm_lists("pipe") if ctx.rank in ranks)
        self.replica = topology.get_coord(ctx.rank).data
        self.schedule = layout.schedule(cfg.schedule)
        local = name_modules(copy.deepcopy(cfg.model))  # every layout starts from the same weights
        stages = split_model(local, self.schedule.num_stages)
        x, y = cfg.x.chunk(layout.data)[self.replica], cfg.y.chunk(layout.data)[self.replica]
        self.specs = message_specs(stages, x, layout.num_microbatches)  # what each message carries
        # A model built on meta (pipelab.build) gets weights here for this process's stages only.
        self.modules = {s: materialize(stages[s], ctx.device) for s in self.schedule.stages_of(self.place.rank)}
        self.names = {id(p): n for n, p in local.named_parameters()}  # names as in the whole model
        self.x, self.y = x.to(ctx.device), y.to(ctx.device)
        self.optimizer = torch.optim.SGD([p for m in self.modules.values() for p in m.parameters()], lr=cfg.lr)
        self.table = cfg.widened.table(ctx, lambda wide: split_model(wide, self.schedule.num_stages), cfg.model,
                                       sorted(self.modules), x, layout.num_microbatches)
        self.first_grads: dict | None = None

    def zero_grad(self, _=None) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, _=None) -> list[float] | None:
        """One step (the grid's rank loop, then SGD): the micro-batch losses where this process holds the last stage."""
        self.cfg.widened.use(self.ctx, self.table)  # the layouts take turns on one rank's clock
        runner = run_grid_step(self.place, self.schedule, self.modules, self.cfg.loss_fn, self.x, self.y, self.specs)
        if self.first_grads is None:
            self.first_grads = self.tensors(grad=True)
        self.optimizer.step()
        return microbatch_losses(runner) or None

    def tensors(self, grad: bool) -> dict[str, torch.Tensor]:
        """This process's gradients or weights, named as in the whole model."""
        return {self.names[id(p)]: (p.grad if grad else p).detach().cpu().clone()
                for m in self.modules.values() for p in m.parameters()}


def worker(ctx: RankContext, cfg: Config) -> list[Result]:
    """Worker: every layout in `cfg.rounds` alternating rounds of `cfg.steps` timed steps (one `Result`
    per layout); each layout's very first step is checked and warms up."""
    trainers = [LayoutTrainer(ctx, cfg, layout) for layout in cfg.layouts]
    measured = [RankSteps([], [], []) for _ in trainers]

    def one_round(trainer: LayoutTrainer, got: RankSteps) -> Callable[[], float]:
        def run() -> float:
            warmup = 0 if got.results else 1
            this = time_steps(ctx, trainer.step, cfg.steps + warmup, prepare=trainer.zero_grad, warmup=warmup)
            for mine, new in ((got.results, this.results), (got.seconds, this.seconds), (got.timelines, this.timelines)):
                mine.extend(new)
            return statistics.median(this.seconds)
        return run

    alternate({i: one_round(t, m) for i, (t, m) in enumerate(zip(trainers, measured))}, cfg.rounds, warmup=0)  # A B C A B C
    return [Result(got, t.first_grads, t.tensors(grad=False), t.pipeline, t.replica, sorted(t.modules))
            for t, got in zip(trainers, measured)]


# --- the parent side --------------------------------------------------------------------------


@dataclass
class GridRun(TimedSteps):
    """One layout, gathered from every process; `assert_same(run, reference(cfg))` checks it."""

    layout: Layout
    schedule: str
    losses: list[float]  # per step: the batch's loss, the mean of its micro-batches' losses
    mb_losses: list[list[float]]  # per step: each micro-batch's loss as its last stage computed it, in batch order
    grads: list[dict[str, torch.Tensor]]  # per process: its stages' gradients of the first step
    weights: list[dict[str, torch.Tensor]]  # per process: its stages' weights after the last step
    replica_spread: float  # largest difference between two copies of a weight after the last step
    steps: Steps = field(repr=False)
    pipelines: list[list[int]] = field(default_factory=list)  # the processes of each pipeline
    stages: list[list[int]] = field(default_factory=list)  # per process, the stages it holds
    rounds: int = 1  # the timed steps came in this many rounds, the layouts alternating
    node: str | None = None  # the node whose model timed it (None: this machine's clock)

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def round_times(self) -> list[float]:
        """Per round, the median of its timed steps (s): what `measure.ratios` pairs between layouts."""
        per = len(self.steps.seconds) // self.rounds
        return [statistics.median(self.steps.seconds[r * per:(r + 1) * per]) for r in range(self.rounds)]

    @property
    def overlap(self) -> Measured:
        """Per timed step, the share of the all-reduces' flight hidden behind some process's compute."""
        return Measured.of(hidden_behind_pipeline(tl) for tl in self.steps.timelines)

    def flights(self) -> dict[int, float]:
        """Per stage, its all-reduce's flight (s): median over the timed steps of the mean over its copies."""
        per_stage: dict[int, list[float]] = {}
        for tl in self.steps.timelines:
            for stage in {s.meta.get("stage") for s in tl.filter(kind="allreduce")}:
                mine = [s.duration for s in in_flight(tl) if s.meta.get("stage") == stage]
                per_stage.setdefault(stage, []).append(statistics.mean(mine))
        return {stage: statistics.median(d) for stage, d in sorted(per_stage.items())}

    def simulated_overlap(self) -> float:
        """`overlap` on independent devices: the schedule simulated with this run's per-stage costs, each
        stage's all-reduce launched when its gradients are final, hidden while the pipeline computes."""
        sim = simulate(self.layout.schedule(self.schedule), Costs.from_timeline(self.timeline, per_stage=True)).timeline
        end, hidden, total = max(s.end for s in sim), 0.0, 0.0
        for stage, flight in self.flights().items():
            final = max(s.end for s in sim if s.kind in ("B", "W") and s.meta["stage"] == stage)
            hidden, total = hidden + min(flight, end - final), total + flight
        return hidden / total if total > 0 else 0.0

    def launches(self) -> list[dict]:
        """Per process in the typical step: when its stage's all-reduce was launched and arrived, and
        when its pipeline's last compute ended (ms from the step's start)."""
        tl, ms, rows = self.timeline, "ms, modelled" if self.node else "ms", []
        for s in tl.filter(kind="allreduce"):
            pipeline = next(p for p in self.pipelines if s.rank in p)
            done = max(c.end for c in tl.filter(rank=pipeline) if is_compute(c))
            rows.append({"process": s.rank, "stage": s.meta.get("stage"), f"launched ({ms})": round((s.start - tl.start) * 1e3, 1),
                         f"its pipeline's compute ended ({ms})": round((done - tl.start) * 1e3, 1),
                         f"arrived ({ms})": round((s.end - tl.start) * 1e3, 1)})
        return sorted(rows, key=lambda r: r["process"])


def in_flight(tl: Timeline) -> list[Span]:
    """Each all-reduce from the last launch among its stage's copies (the early ones only wait) to its arrival."""
    spans, last_launch = tl.filter(kind="allreduce").spans, {}
    for s in spans:
        last_launch[s.meta.get("stage")] = max(last_launch.get(s.meta.get("stage"), s.start), s.start)
    return [replace(s, start=min(last_launch[s.meta.get("stage")], s.end)) for s in spans]


def hidden_behind_pipeline(tl: Timeline) -> float:
    """Share of the all-reduces' flight (`in_flight`) during which some process still computed."""
    flights = Timeline(in_flight(tl) + [s for s in tl if is_compute(s)])
    return hidden_share(flights, lambda s: s.kind == "allreduce", is_compute, any_rank=True)


def launched_after_last_backward(run: GridRun) -> bool:
    """Whether, in every timed step, each stage's all-reduce started after that stage's last B or W there."""
    return all(a.start >= max(b.end for b in tl.filter(rank=a.rank, kind=("B", "W")) if b.meta.get("stage") == a.meta["stage"])
               for tl in run.steps.timelines for a in tl.filter(kind="allreduce"))


def gather(cfg: Config, results: Sequence[list[Result]]) -> list[GridRun]:
    """One `GridRun` per layout, in `cfg.layouts`' order, from every process's `Result`s (by rank)."""
    runs = []
    for i, layout in enumerate(cfg.layouts):
        mine = [r[i] for r in results]
        last = sorted((r for r in mine if r.steps.results[0] is not None), key=lambda r: r.replica)  # one per pipeline
        mb_losses = [[loss for r in last for loss in r.steps.results[k]] for k in range(len(last[0].steps.results))]
        first: dict[str, torch.Tensor] = {}  # each weight's first copy: how far the others are from it
        spread = max([(w - first.setdefault(n, w)).abs().max().item() for r in mine for n, w in r.weights.items()],
                     default=0.0)
        runs.append(GridRun(layout, cfg.schedule, [statistics.mean(step) for step in mb_losses], mb_losses,
                            [r.grads for r in mine], [r.weights for r in mine], spread,
                            gather_steps([r.steps for r in mine]), [list(p) for p in sorted({tuple(r.pipeline) for r in mine})],
                            [r.stages for r in mine], cfg.rounds, cfg.node_name))
    return runs


# --- verdicts ---------------------------------------------------------------------------------


def clock(run: GridRun) -> str:
    """How the run's times came about, for its sentences."""
    return " (modelled on the emulated node)" if run.node else " (measured)"


def groups_verdict(topology: ProcessTopology) -> Verdict:
    """Whether the topology's groups are the ones its numbering (data fastest) predicts."""
    pipe, data = topology.get_dim("pipe"), topology.get_dim("data")
    predicted = ([[p * data + d for d in range(data)] for p in range(pipe)],
                 [[p * data + d for p in range(pipe)] for d in range(data)])
    verdict = ("as predicted" if (topology.get_axis_comm_lists("data"), topology.get_axis_comm_lists("pipe")) == predicted
               else "not as predicted")
    return ("05.grid_groups", verdict, f"the data groups and pipelines are {verdict} by the data-fastest numbering.",
            dict(data_groups=str(predicted[0]), pipelines=str(predicted[1])))


def overlap_verdict(run: GridRun) -> Verdict:
    """How much all-reduce time hid behind compute, against the schedule simulated with this run's costs."""
    overlap, simulated, world = run.overlap, run.simulated_overlap(), run.layout.pipe * run.layout.data
    if run.node is not None:  # a logical clock: every step alike
        gap = overlap.median - simulated
        verdict = "as simulated" if abs(gap) <= 0.05 else "lower" if gap < 0 else "higher"
    elif hardware.gpu_count() < world and hardware.cpu_cores() < world:
        verdict = "too few cores"  # a process 'still computing' may have been waiting for a core
    else:
        verdict = compare(overlap, Measured.of([simulated]))
    return ("05.grid_hidden", verdict, f"{overlap.median:.0%} of the all-reduce time hid behind compute{clock(run)}; "
            f"the simulation with one device per process hides {simulated:.0%}: {verdict}.",
            dict(hidden=overlap, simulated=simulated, flights_s=str(run.flights())))


def round_verdict(per_round: Measured) -> str:
    """'lower' (or 'higher') when the grid was faster (slower) in every round, else 'within noise'."""
    return "lower" if per_round.high < 1 else "higher" if per_round.low > 1 else "within noise"


def grid_vs(runs: Sequence[GridRun], other: GridRun) -> Verdict:
    """How the grid's step compares with `other` layout's, round by round (the layouts alternated)."""
    per_round = ratios(runs[1].round_times, other.round_times)
    verdict = round_verdict(per_round)
    return ("05.grid_vs_one_pipeline" if other.layout.data == 1 else "05.grid_vs_data_parallel", verdict,
            f"the grid's step took {per_round.median:.2f} times as long as {other.name}'s{clock(runs[1])}: {verdict}, "
            f"over {len(per_round.values)} rounds.", dict(ratio=per_round, grid=runs[1].step_time, other=other.step_time))


# --- a profile's work, counted ----------------------------------------------------------------

# The parameters cell's defaults that `run_flops` reads.
DEFAULTS = dict(width=512, layers_per_half=2, batch=128, steps=5, grid_width=128, grid_layers=8, grid_batch=64,
                grid_steps=1, rounds=2)


def run_flops(params: dict) -> float:
    """FLOPs of lesson 05 at the notebook parameters `params` (missing names: `DEFAULTS`), counted on the meta
    device: parts 1-2's two-half MLP (2 wrappers, with and without splits, and the reference) and parts 3-4's
    three layouts (runs and references, warm-up included, and the prediction's 3 steps)."""
    from pipelab.emulate.cost import step_flops
    from pipelab.models import SplitMLP, mlp

    p = {**DEFAULTS, **params}
    with torch.device("meta"):
        replica = SplitMLP(p["width"], p["layers_per_half"], p["width"])
        layers = mlp([p["grid_width"]] * (p["grid_layers"] + 1))
    replica_steps = p["steps"] * len(REPLICA_VARIANTS) * 2 + p["steps"]
    layout_steps = 2 * len(layouts_of(2, 2, 1)) * (p["rounds"] * p["grid_steps"] + 1) + 3
    return (step_flops(replica, torch.empty(p["batch"], p["width"], device="meta")) * replica_steps
            + step_flops(layers, torch.empty(p["grid_batch"], p["grid_width"], device="meta")) * layout_steps)

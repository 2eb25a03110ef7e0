"""Lesson 05 from a notebook, parts 3-4: the pipe x data grid, and the same processes laid out as
one long pipeline or as pure data parallelism.

    cfg = grid.Config(model=models.mlp([512] * 9), x=x, y=y, layouts=grid.layouts_of(2, 2, 4))  # checked here
    runs = experiments.run(grid.worker, cfg, grid.gather)  # one GridRun per layout

The processes start once and run every layout (pipe x data) in alternating rounds, so that a busy
machine slows them all alike. In each, a process finds its place with `hybrid.grid_place` (a
`RankContext` of its own pipeline, its pipe and data groups in `ctx.groups`), cuts its stages with
`split_model`, takes its replica's share of the batch and trains with `hybrid.run_grid_step`.
A `GridRun` names gradients and weights as the model does, so
`assert_same(run, grid.reference(cfg, steps=len(run.losses)))` checks it; its `mb_losses` are each
micro-batch's loss as the last stage computed it. The predictions and verdict functions below turn
the runs into the lesson's conclusions.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import nn

from pipelab import experiments, hardware
from pipelab.checks import divisors, mean_loss, positive_number, same_batch, whole_number
from pipelab.display import conclude, human_bytes
from pipelab.experiments.hybrid import hidden_share, is_compute
from pipelab.hardware import synchronize
from pipelab.hybrid import check_grid, grid_place, microbatch_losses, run_grid_step
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, alternate, best_of, compare, gather_steps, \
    ratios, time_steps
from pipelab.models import trainable_parameters
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, simulate
from pipelab.pipeline.topology import ProcessTopology
from pipelab.reference import Reference, reference_run
from pipelab.timeline import Span, Timeline
from pipelab.worker import RankContext


@dataclass(frozen=True)
class Layout:
    """`pipe x data` processes: `data` pipelines of `pipe` ranks, each on `num_microbatches` micro-batches."""

    pipe: int
    data: int
    num_microbatches: int = 1

    @property
    def name(self) -> str:
        if self.pipe == 1:
            return f"data parallel (1 x {self.data})"
        if self.data == 1:
            return f"one pipeline ({self.pipe} x 1)"
        return f"grid ({self.pipe} x {self.data})"

    def schedule(self, name: str):
        """The schedule each pipeline of this layout runs (one stage needs no schedule: 1F1B of one rank)."""
        return make_schedule(name if self.pipe > 1 else "1f1b", self.pipe, self.num_microbatches)


def layouts_of(pipe: int, data: int, num_microbatches: int) -> tuple[Layout, ...]:
    """The three ways lesson 05 compares on pipe x data processes: one pipeline over every process
    (whole batch), the grid, and pure data parallelism (each process the whole model, one micro-batch)."""
    return Layout(pipe * data, 1, num_microbatches), Layout(pipe, data, num_microbatches), Layout(1, pipe * data, 1)


# ---------------------------------------------------------------------------------------------
# What a run is: checked when built
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """`model` (an nn.Sequential) trained on (x, y) in each of `layouts`, all on the same processes
    (so `world_size` is the first layout's pipe x data): one checked warm-up step, then `rounds` x
    `steps` timed SGD steps per layout, the layouts alternating round by round. The pipelines run
    `schedule` (lesson 07)."""

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

    def __post_init__(self) -> None:
        if not self.layouts or not all(isinstance(layout, Layout) for layout in self.layouts):
            raise ValueError(f"layouts must be one or more Layout(pipe, data, num_microbatches), got {self.layouts!r}; "
                             "e.g. layouts=(Layout(2, 2, 4),) or grid.layouts_of(2, 2, 4)")
        first = self.layouts[0]
        check_grid(first.pipe, first.data)
        object.__setattr__(self, "world_size", first.pipe * first.data)
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


def reference(cfg: Config, steps: int) -> Reference:
    """What one process computes with the same model, batch, loss and `steps` SGD steps."""
    return reference_run(cfg.model, cfg.x, cfg.y, cfg.loss_fn, steps=steps, lr=cfg.lr)


# ---------------------------------------------------------------------------------------------
# On each process
# ---------------------------------------------------------------------------------------------


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
        self.cfg = cfg
        topology = check_grid(layout.pipe, layout.data, ctx.world_size)
        self.place = grid_place(ctx, topology)
        self.pipeline = next(ranks for ranks in topology.get_axis_comm_lists("pipe") if ctx.rank in ranks)
        self.replica = topology.get_coord(ctx.rank).data
        self.schedule = layout.schedule(cfg.schedule)
        local = copy.deepcopy(cfg.model)  # every layout starts from the same weights
        self.names = {id(p): n for n, p in local.named_parameters()}  # names as in the whole model
        stages = split_model(local, self.schedule.num_stages)
        x, y = cfg.x.chunk(layout.data)[self.replica], cfg.y.chunk(layout.data)[self.replica]
        self.specs = message_specs(stages, x, layout.num_microbatches)  # what each message carries
        self.modules = {s: stages[s].to(ctx.device) for s in self.schedule.stages_of(self.place.rank)}
        self.x, self.y = x.to(ctx.device), y.to(ctx.device)
        self.optimizer = torch.optim.SGD([p for m in self.modules.values() for p in m.parameters()], lr=cfg.lr)
        self.first_grads: dict | None = None

    def zero_grad(self, _=None) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, _=None) -> list[float] | None:
        """One step: the grid's rank loop, then SGD; the micro-batch losses where this process
        holds the last stage."""
        runner = run_grid_step(self.place, self.schedule, self.modules, self.cfg.loss_fn, self.x, self.y, self.specs)
        if self.first_grads is None:
            self.first_grads = self.tensors(grad=True)
        self.optimizer.step()
        return microbatch_losses(runner) or None

    def tensors(self, grad: bool) -> dict[str, torch.Tensor]:
        """This process's gradients or weights, named as in the whole model."""
        return {self.names[id(p)]: (p.grad if grad else p).detach().cpu().clone()
                for m in self.modules.values() for p in m.parameters()}

    def result(self, steps: RankSteps) -> Result:
        return Result(steps, self.first_grads, self.tensors(grad=False), self.pipeline, self.replica,
                      sorted(self.modules))


def worker(ctx: RankContext, cfg: Config) -> list[Result]:
    """Worker: every layout in `cfg.rounds` alternating rounds of `cfg.steps` timed steps (one
    `Result` per layout); the first step of each layout is checked and warms up."""
    trainers = [LayoutTrainer(ctx, cfg, layout) for layout in cfg.layouts]
    measured = [RankSteps([], [], []) for _ in trainers]

    def one_round(i: int) -> Callable[[], float]:
        def run() -> float:
            trainer, got = trainers[i], measured[i]
            warmup = 0 if got.results else 1  # a layout's very first step is checked, not timed
            this = time_steps(ctx, trainer.step, cfg.steps + warmup, prepare=trainer.zero_grad, warmup=warmup)
            got.results.extend(this.results)
            got.seconds.extend(this.seconds)
            got.timelines.extend(this.timelines)
            return statistics.median(this.seconds)
        return run

    alternate({i: one_round(i) for i in range(len(trainers))}, cfg.rounds, warmup=0)  # A B C A B C ...
    return [trainer.result(got) for trainer, got in zip(trainers, measured)]


# ---------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------


@dataclass
class GridRun(TimedSteps):
    """One layout, gathered from every process; `assert_same(run, reference)` checks it."""

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
    def overlap(self) -> Measured:
        """Per timed step, the share of the data-parallel all-reduces' flight hidden behind some
        process's compute (`hidden_behind_pipeline`)."""
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

    def simulated_overlap(self) -> float:
        """The share `overlap` would be on independent devices: the schedule simulated with this
        run's measured per-stage costs, each stage's all-reduce launched when its gradients are
        final and taking its measured flight, hidden for as long as the pipeline still computes."""
        sim = simulate(self.layout.schedule(self.schedule), Costs.from_timeline(self.timeline, per_stage=True)).timeline
        end, hidden, total = max(s.end for s in sim), 0.0, 0.0
        for stage, flight in self.flights().items():
            final = max(s.end for s in sim if s.kind in ("B", "W") and s.meta["stage"] == stage)
            hidden, total = hidden + min(flight, end - final), total + flight
        return hidden / total if total > 0 else 0.0

    def launches(self) -> list[dict]:
        """Table rows, one per process in the typical step: when its stage's all-reduce was launched
        and arrived, and when its pipeline's last compute ended (ms from the step's start)."""
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


def launched_after_last_backward(run: GridRun) -> bool:
    """Whether, in every timed step, each stage's all-reduce started only once that stage's
    gradients were final (after its last B or W on that process)."""
    return all(a.start >= max(b.end for b in tl.filter(rank=a.rank, kind=("B", "W")) if b.meta.get("stage") == a.meta["stage"])
               for tl in run.steps.timelines for a in tl.filter(kind="allreduce"))


def _spread(weights: list[dict[str, torch.Tensor]]) -> float:
    """Largest difference between two processes' copies of the same weight."""
    first: dict[str, torch.Tensor] = {}
    worst = 0.0
    for held in weights:
        for name, w in held.items():
            worst = max(worst, (w - first.setdefault(name, w)).abs().max().item())
    return worst


def gather_layout(cfg: Config, layout: Layout, mine: Sequence[Result]) -> GridRun:
    """One layout's `GridRun` from every process's `Result` (by rank)."""
    last = sorted((r for r in mine if r.steps.results[0] is not None), key=lambda r: r.replica)  # one per pipeline
    mb_losses = [[loss for r in last for loss in r.steps.results[i]] for i in range(len(last[0].steps.results))]
    pipelines = sorted({tuple(r.pipeline) for r in mine})
    weights = [r.weights for r in mine]
    return GridRun(layout, cfg.schedule, [statistics.mean(step) for step in mb_losses], mb_losses,
                   [r.grads for r in mine], weights, _spread(weights), gather_steps([r.steps for r in mine]),
                   [list(p) for p in pipelines], [r.stages for r in mine], cfg.rounds)


def gather(cfg: Config, results: Sequence[list[Result]]) -> list[GridRun]:
    """One `GridRun` per layout, in `cfg.layouts`' order."""
    return [gather_layout(cfg, layout, [r[i] for r in results]) for i, layout in enumerate(cfg.layouts)]


# ---------------------------------------------------------------------------------------------
# Predicted: what the layouts would take on independent devices
# ---------------------------------------------------------------------------------------------


def ideal_fraction(layout: Layout) -> float:
    """A layout's step on pipe x data independent devices, as a fraction of the whole model's
    forward and backward on the whole batch on one device, communication left out: each device
    does 1/(pipe x data) of the work, and a pipeline of p stages and m micro-batches takes
    m + p - 1 micro-batch slots for m slots of work (the bubble, lessons 06-07):
    (m + p - 1) / (m x p x data). Pure data parallelism (p = m = 1) gives 1/data."""
    m, p = layout.num_microbatches, layout.pipe
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
    grads = sum(p.numel() * p.element_size() for _, p in trainable_parameters(model))
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


@dataclass
class Prediction:
    """The layouts' compute-only steps, from one measured step of the whole model."""

    one_device: float  # s: the whole model's forward and backward on the whole batch, one thread or one GPU
    device: str  # "cpu" or "cuda"
    here: int  # the devices this machine's processes share: its GPUs, or its cores
    world: int  # the processes

    def seconds(self, layout: Layout, devices: int | None = None) -> float:
        """The layout's predicted step (s) on `devices` devices (default: this machine's)."""
        return predicted_seconds(layout, self.one_device, devices or self.here)

    @property
    def few_cores(self) -> bool:
        """More processes than cores: a process waiting in a bubble leaves its core to another."""
        return self.device == "cpu" and self.world > self.here

    def ms(self, runs: Sequence[GridRun]) -> dict[str, dict[str, float]]:
        """Both predictions, by label, then by layout name (ms): on this machine, and on one GPU per process."""
        here = f"predicted, {self.here} {'GPUs' if self.device == 'cuda' else 'cores'} (this machine)"
        return {here: {r.name: self.seconds(r.layout) * 1e3 for r in runs},
                f"predicted, {self.world} GPUs": {r.name: self.seconds(r.layout, self.world) * 1e3 for r in runs}}


def predict(cfg: Config) -> Prediction:
    """Time the whole model's step here (one GPU if every process has one, else one CPU thread)."""
    device = "cuda" if hardware.gpu_count() >= cfg.world_size else "cpu"
    one = one_device_seconds(cfg.model, cfg.x, cfg.y, cfg.loss_fn, device=device)
    return Prediction(one, device, cfg.world_size if device == "cuda" else hardware.cpu_cores(), cfg.world_size)


def layouts_table(cfg: Config, runs: Sequence[GridRun], prediction: Prediction) -> list[dict]:
    """One row per layout: its bubble, its all-reduce bytes, both predictions and the measured step."""
    predicted = prediction.ms(runs)
    return [{"layout": r.name, "bubble (p-1)/(m+p-1)": round((r.layout.pipe - 1) / (r.layout.num_microbatches + r.layout.pipe - 1), 3),
             "all-reduce per process": human_bytes(allreduce_bytes(r.layout, cfg.model)),
             **{label: round(per[r.name], 1) for label, per in predicted.items()},
             "measured (ms)": f"{r.step_time.scaled(1e3):.1f}"} for r in runs]


# ---------------------------------------------------------------------------------------------
# Verdicts: what the notebook concludes, computed from the runs
# ---------------------------------------------------------------------------------------------


def groups_verdict(topology: ProcessTopology) -> str:
    """Conclude whether the topology's groups are the ones its numbering (data fastest) predicts."""
    pipe, data = topology.get_dim("pipe"), topology.get_dim("data")
    predicted_data = [[p * data + d for d in range(data)] for p in range(pipe)]
    predicted_pipe = [[p * data + d for p in range(pipe)] for d in range(data)]
    got_data, got_pipe = topology.get_axis_comm_lists("data"), topology.get_axis_comm_lists("pipe")
    as_predicted = got_data == predicted_data and got_pipe == predicted_pipe
    verdict = "as predicted" if as_predicted else "not as predicted"
    conclude("05.grid_groups", verdict,
             f"the topology's data groups {got_data} and pipelines {got_pipe} " + ("are" if as_predicted else "are not")
             + f" the ones the numbering predicts ({predicted_data} and {predicted_pipe}).")
    return verdict


def overlap_verdict(run: GridRun) -> str:
    """Conclude how much of the grid's data-parallel all-reduce time hid behind the pipeline's
    compute, beside what the schedule would hide on one device per process."""
    overlap, simulated = run.overlap, run.simulated_overlap()
    world = run.layout.pipe * run.layout.data
    cores = world if hardware.gpu_count() >= world else hardware.cpu_cores()
    text = (f"{overlap.scaled(100):.0f} % of the data-parallel all-reduce time (from the last copy's launch to arrival) "
            f"had some process still computing (median (lowest-highest) of {len(overlap.values)} timed steps); "
            f"{run.schedule} simulated with this run's measured costs and all-reduce times, one device per process, "
            f"hides {simulated:.0%}. ")
    if cores < world:
        verdict = "within noise"
        text += (f"Here {world} processes share {cores} cores: a process 'still computing' may have been waiting for "
                 "a core, so the measured share counts time-slicing as much as hiding. Too few cores for the effect: "
                 "the simulated share is what one device per process would hide.")
    else:
        verdict = compare(overlap, Measured.of([simulated]))
        text += {"lower": "Every timed step hid less than the simulation.",
                 "higher": "Every timed step hid more than the simulation.",
                 "within noise": "The simulated share lies within the measured range."}[verdict]
    conclude("05.grid_hidden", verdict, text, hidden=overlap, simulated=simulated, flights_s=str(run.flights()))
    return verdict


def layout_verdicts(runs: Sequence[GridRun], prediction: Prediction) -> dict[str, str]:
    """Conclude how the grid's step compares with one pipeline's and with pure data parallelism's
    (`runs` in `layouts_of`' order), and how every layout compares with its prediction."""
    one_pipe, grid_run, dp = runs
    gpu = prediction.ms(runs)[f"predicted, {prediction.world} GPUs"]
    verdicts = {}
    for other, key in ((one_pipe, "05.grid_vs_one_pipeline"), (dp, "05.grid_vs_data_parallel")):
        per_round = ratios(grid_run.round_times, other.round_times)  # the layouts alternated round by round
        text = (f"the grid's step / {other.name}'s: {per_round:.2f} (median (lowest-highest) of "
                f"{len(per_round.values)} rounds); grid {grid_run.step_time.scaled(1e3):.1f} ms against "
                f"{other.step_time.scaled(1e3):.1f} ms over the timed steps. ")
        if prediction.few_cores:
            verdict = "within noise"
            text += (f"{prediction.world} processes share {prediction.here} cores: a process waiting in a bubble leaves "
                     f"its core to another, so all three compute-only predictions meet at "
                     f"{prediction.one_device / prediction.here * 1e3:.1f} ms, and the layouts differ here only by their "
                     "messages, all-reduces and overheads. Too few cores for the layouts' bubbles to show: with one GPU "
                     f"per process the prediction is {gpu[grid_run.name]:.1f} ms for the grid against "
                     f"{gpu[other.name]:.1f} ms.")
        else:
            verdict = compare(grid_run.step_time, other.step_time)
            text += {"lower": "Every timed step of the grid was faster than any of the other.",
                     "higher": "Every timed step of the grid was slower than any of the other.",
                     "within noise": "The ranges overlap: this run cannot tell the two apart."}[verdict]
        conclude(key, verdict, text, ratio=per_round, grid=grid_run.step_time, other=other.step_time)
        verdicts[key] = verdict

    over = {r.name: r.step_time.scaled(1 / prediction.seconds(r.layout)) for r in runs}
    slower = all(compare(r.step_time, Measured.of([prediction.seconds(r.layout)])) == "higher" for r in runs)
    verdicts["05.layouts_vs_prediction"] = verdict = "slower than predicted" if slower else "not all slower"
    conclude("05.layouts_vs_prediction", verdict,
             "measured / predicted on this machine: " + ", ".join(f"{n} {v:.1f}" for n, v in over.items()) + ". "
             + ("Every timed step of every layout took longer than its compute-only prediction: the prediction "
                "leaves out the messages, the all-reduces and the overhead of each action and micro-batch."
                if slower else "Some timed step came within its compute-only prediction, so the messages, "
                "all-reduces and overheads it leaves out cost little here."),
             **{n.split(" (")[0].replace(" ", "_"): v for n, v in over.items()})
    return verdicts


def gpu_outlook(runs: Sequence[GridRun], prediction: Prediction) -> str:
    """The compute-only predictions on one GPU per process, and which layout they put first."""
    gpu = prediction.ms(runs)[f"predicted, {prediction.world} GPUs"]
    return ("On a node with one GPU per process the compute-only predictions are "
            + ", ".join(f"{n} {v:.1f} ms" for n, v in gpu.items())
            + f" (scaled from this machine's one-thread step): {min(gpu, key=gpu.get)} first, "
            "and the all-reduce bytes per process above are what it pays for that.")

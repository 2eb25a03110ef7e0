"""Lesson 05 from a notebook, parts 3-4: the pipe x data grid, and the same processes laid out as
one long pipeline or as pure data parallelism.

    cfg = grid.Config(model=models.mlp([512] * 9), x=x, y=y, layouts=grid.layouts_of(2, 2, 4))  # checked here
    runs = experiments.run(grid.worker, cfg, grid.gather)  # one GridRun per layout

The processes start once and run every layout (pipe x data) in alternating rounds, so that a busy
machine slows them all alike. On an emulated node (`cfg.emulate`) every step is timed by the
device and link models at `cfg.emulated_scale` times the width and the batch (`emulated_table`),
so the rounds agree exactly. In each, a process finds its place with `hybrid.grid_place` (a
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
from pipelab.build import materialize, name_modules
from pipelab.checks import divisors, mean_loss, positive_number, same_batch, whole_number
from pipelab.display import conclude, human_bytes
from pipelab.experiments.hybrid import REPLICA_VARIANTS, hidden_share, is_compute
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
    # On an emulated node each stage's F and B last what the device model gives for the same layers
    # `emulated_scale` times wider on a batch `emulated_scale` times larger, in `emulated_dtype`;
    # then every activation and every weight grows by emulated_scale^2, so one scale times every
    # message and all-reduce at that size too.
    emulated_scale: int = 64
    emulated_dtype: str = "bfloat16"
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
        whole_number("emulated_scale", self.emulated_scale, example="emulated_scale=64")
        if self.emulate is not None:
            emulated_model(self.model, self.emulated_scale)  # refuses layers it cannot widen

    @property
    def emulated_batch(self) -> int:
        """Rows of the whole batch on the emulated node."""
        return self.x.shape[0] * self.emulated_scale

    def size(self) -> str:
        """The emulated size, in words (the first printed line says it)."""
        widths = sorted({m.out_features * self.emulated_scale for m in self.model if isinstance(m, nn.Linear)})
        layers = sum(isinstance(m, nn.Linear) for m in self.model)
        return (f"{layers} Linear layers of width {', '.join(map(str, widths))} on batches of {self.emulated_batch} "
                f"rows in {self.emulated_dtype} ({self.emulated_scale} x this run's width and batch)")


def emulated_model(model: nn.Sequential, scale: int) -> nn.Sequential:
    """`model`'s layers `scale` times wider, on the meta device (shapes only, no memory): what the
    emulated node computes. Linear layers are widened; layers without parameters are kept."""
    layers = []
    for layer in model:
        if isinstance(layer, nn.Linear):
            layers.append(nn.Linear(layer.in_features * scale, layer.out_features * scale, bias=layer.bias is not None,
                                    device="meta"))
        elif not any(True for _ in layer.parameters()):
            layers.append(copy.deepcopy(layer))
        else:
            raise ValueError(f"an emulated node widens Linear layers, and the model has a {type(layer).__name__} "
                             "with parameters; use Linear layers and activations (pipelab.models.mlp), or emulate=None")
    return nn.Sequential(*layers)


def stage_inputs(stages: Sequence[nn.Module], rows: int, width: int) -> list[torch.Tensor]:
    """Each stage's input for a micro-batch of `rows` x `width`, as META tensors (shapes only)."""
    x, inputs = torch.empty(rows, width, device="meta"), []
    with torch.no_grad():
        for stage in stages:
            inputs.append(x)
            x = stage(x)
    return inputs


def emulated_table(ctx: RankContext, cfg: Config, layout: Layout, stages: Sequence[int]):
    """On an emulated node, the cost table of this process's `stages` of
    `layout`: the same layers `cfg.emulated_scale` times wider on micro-batches as many times
    larger, counted on the meta device: their modelled F, B, I and W seconds. Its messages and
    all-reduces are timed at that size too. None elsewhere (the spans last what the machine takes)."""
    if ctx.emulator is None:
        return None
    from pipelab.emulate.cost import stage_seconds
    from pipelab.emulate.specs import torch_dtype
    from pipelab.emulate.table import stage_table

    schedule = layout.schedule(cfg.schedule)
    big = split_model(emulated_model(cfg.model, cfg.emulated_scale), schedule.num_stages)
    rows = cfg.emulated_batch // (layout.data * layout.num_microbatches)
    inputs = stage_inputs(big, rows, cfg.x.shape[1] * cfg.emulated_scale)
    emulated_bytes = torch.empty((), dtype=torch_dtype(cfg.emulated_dtype)).element_size()
    ctx.emulator.scale_messages(cfg.emulated_scale ** 2 * emulated_bytes, cfg.x.element_size())
    return stage_table({s: stage_seconds(big[s], inputs[s], ctx.emulator.node.device, cfg.emulated_dtype) for s in stages})


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
        local = name_modules(copy.deepcopy(cfg.model))  # every layout starts from the same weights
        stages = split_model(local, self.schedule.num_stages)
        x, y = cfg.x.chunk(layout.data)[self.replica], cfg.y.chunk(layout.data)[self.replica]
        self.specs = message_specs(stages, x, layout.num_microbatches)  # what each message carries
        # A model built on meta (pipelab.build) gets weights here for this process's stages only.
        self.modules = {s: materialize(stages[s], ctx.device) for s in self.schedule.stages_of(self.place.rank)}
        self.names = {id(p): n for n, p in local.named_parameters()}  # names as in the whole model
        self.x, self.y = x.to(ctx.device), y.to(ctx.device)
        self.optimizer = torch.optim.SGD([p for m in self.modules.values() for p in m.parameters()], lr=cfg.lr)
        self.ctx, self.table = ctx, emulated_table(ctx, cfg, layout, sorted(self.modules))  # None unless emulated
        self.first_grads: dict | None = None

    def zero_grad(self, _=None) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, _=None) -> list[float] | None:
        """One step: the grid's rank loop, then SGD; the micro-batch losses where this process
        holds the last stage."""
        if self.table is not None:  # the layouts take turns on one emulated rank
            self.ctx.emulator.use(self.table)
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
    emulate: str | None = None  # the emulated node whose models timed it (None: this machine's clock)

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
                   [list(p) for p in pipelines], [r.stages for r in mine], cfg.rounds, cfg.emulate)


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


def allreduce_bytes(layout: Layout, model: nn.Module, element_size: int | None = None) -> float:
    """Bytes each process sends per step in its data-parallel all-reduce (a ring sends 2 (d-1)/d
    times what it reduces): the gradients of its 1/pipe of the model (`element_size` bytes per
    value, default the parameters' own)."""
    grads = sum(p.numel() * (element_size or p.element_size()) for _, p in trainable_parameters(model))
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
    """The layouts' compute-only steps, from one step of the whole model: measured here, or given
    by the device model on an emulated node."""

    one_device: float  # s: the whole model's forward and backward on the whole batch, one thread or one GPU
    device: str  # "cpu", "cuda", or the emulated device's name (e.g. "H100 SXM")
    here: int  # the devices this machine's processes share: its GPUs, or its cores (emulated: one per process)
    world: int  # the processes
    emulated: bool = False  # one_device came from the cost model of an emulated node

    def seconds(self, layout: Layout, devices: int | None = None) -> float:
        """The layout's predicted step (s) on `devices` devices (default: this machine's)."""
        return predicted_seconds(layout, self.one_device, devices or self.here)

    @property
    def few_cores(self) -> bool:
        """More processes than cores: a process waiting in a bubble leaves its core to another."""
        return self.device == "cpu" and self.world > self.here

    @property
    def gpu_label(self) -> str:
        """The label of the prediction with one device per process."""
        return (f"predicted, {self.world} x {self.device} (device model)" if self.emulated
                else f"predicted, {self.world} GPUs")

    def ms(self, runs: Sequence[GridRun]) -> dict[str, dict[str, float]]:
        """The predictions, by label, then by layout name (ms): on this machine's cores or GPUs and
        on one GPU per process; on an emulated node only the latter (it has one per process)."""
        gpu = {self.gpu_label: {r.name: self.seconds(r.layout, self.world) * 1e3 for r in runs}}
        if self.emulated:
            return gpu
        here = f"predicted, {self.here} {'GPUs' if self.device == 'cuda' else 'cores'} (this machine)"
        return {here: {r.name: self.seconds(r.layout) * 1e3 for r in runs}, **gpu}


def predict(cfg: Config) -> Prediction:
    """The whole model's step on one device: on an emulated node the device model's F + B at the
    emulated size (counted on the meta device); else timed here, on one GPU if every process has
    one, else on one CPU thread."""
    if cfg.emulate is not None:
        from pipelab.emulate.cost import stage_seconds

        node = cfg.node
        big = emulated_model(cfg.model, cfg.emulated_scale)
        [x] = stage_inputs([big], cfg.emulated_batch, cfg.x.shape[1] * cfg.emulated_scale)
        seconds = stage_seconds(big, x, node.device, cfg.emulated_dtype)
        return Prediction(seconds["F"] + seconds["B"], node.device.name, cfg.world_size, cfg.world_size, emulated=True)
    device = "cuda" if hardware.gpu_count() >= cfg.world_size else "cpu"
    one = one_device_seconds(cfg.model, cfg.x, cfg.y, cfg.loss_fn, device=device)
    return Prediction(one, device, cfg.world_size if device == "cuda" else hardware.cpu_cores(), cfg.world_size)


def layouts_table(cfg: Config, runs: Sequence[GridRun], prediction: Prediction) -> list[dict]:
    """One row per layout: its bubble, its all-reduce bytes, both predictions and the measured step."""
    predicted = prediction.ms(runs)
    model, size = cfg.model, None
    if cfg.emulate is not None:  # the bytes the emulated node's all-reduces carry
        from pipelab.emulate.specs import torch_dtype

        model = emulated_model(cfg.model, cfg.emulated_scale)
        size = torch.empty((), dtype=torch_dtype(cfg.emulated_dtype)).element_size()
    return [{"layout": r.name, "bubble (p-1)/(m+p-1)": round((r.layout.pipe - 1) / (r.layout.num_microbatches + r.layout.pipe - 1), 3),
             "all-reduce per process": human_bytes(allreduce_bytes(r.layout, model, size)),
             **{label: round(per[r.name], 1) for label, per in predicted.items()},
             "step (ms)": f"{r.step_time.scaled(1e3):.1f}"} for r in runs]


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


def devices_per_process(run: GridRun) -> bool:
    """Whether each process of `run` had a device of its own: an emulated node, or a GPU each."""
    world = run.layout.pipe * run.layout.data
    return run.emulate is not None or hardware.gpu_count() >= world


def overlap_verdict(run: GridRun) -> str:
    """Conclude how much of the grid's data-parallel all-reduce time hid behind the pipeline's
    compute, beside what the schedule would hide on one device per process."""
    overlap, simulated = run.overlap, run.simulated_overlap()
    world = run.layout.pipe * run.layout.data
    where = f"on the emulated node ({run.emulate})" if run.emulate else "on this machine"
    text = (f"{where}, {overlap.scaled(100):.0f} % of the data-parallel all-reduce time (from the last copy's launch "
            f"to arrival) had some process still computing (median (lowest-highest) of {len(overlap.values)} timed "
            f"steps); {run.schedule} simulated with this run's costs and all-reduce times, one device per process, "
            f"hides {simulated:.0%}. ")
    if not devices_per_process(run) and hardware.cpu_cores() < world:
        verdict = "too few cores"
        text += (f"Here {world} processes share {hardware.cpu_cores()} cores: a process 'still computing' may have been "
                 "waiting for a core, so the measured share counts time-slicing as much as hiding. Too few cores for the "
                 "effect: the simulated share is what one device per process would hide.")
    elif run.emulate is not None:  # a logical clock: every step alike, so compare the figures themselves
        gap = overlap.median - simulated
        verdict = "as simulated" if abs(gap) <= 0.05 else "lower" if gap < 0 else "higher"
        text += {"as simulated": "The run hid what the simulation hides, within 5 points: the runtime's messages and "
                                 "waits for the other copy of a stage cost the overlap little.",
                 "lower": "The run hid less than the simulation: its messages and the waits for the other copy of a "
                          "stage (an all-reduce starts only when both have launched it) cut into the overlap.",
                 "higher": "The run hid more than the simulation: the runtime's messages stretched the pipeline's "
                           "remaining work, and the all-reduces travelled under it."}[verdict]
    else:
        verdict = compare(overlap, Measured.of([simulated]))
        text += {"lower": "Every timed step hid less than the simulation.",
                 "higher": "Every timed step hid more than the simulation.",
                 "within noise": "The simulated share lies within the measured range."}[verdict]
    conclude("05.grid_hidden", verdict, text, hidden=overlap, simulated=simulated, flights_s=str(run.flights()))
    return verdict


def round_verdict(per_round: Measured) -> str:
    """'lower' when the grid was faster in every round (every ratio below 1), 'higher' when slower
    in every round, else 'within noise'."""
    return "lower" if per_round.high < 1 else "higher" if per_round.low > 1 else "within noise"


def layout_verdicts(runs: Sequence[GridRun], prediction: Prediction) -> dict[str, str]:
    """Conclude how the grid's step compares with one pipeline's and with pure data parallelism's
    (`runs` in `layouts_of`' order), round by round, and how every layout compares with its prediction."""
    one_pipe, grid_run, dp = runs
    gpu = prediction.ms(runs)[prediction.gpu_label]
    verdicts = {}
    for other, key in ((one_pipe, "05.grid_vs_one_pipeline"), (dp, "05.grid_vs_data_parallel")):
        per_round = ratios(grid_run.round_times, other.round_times)  # the layouts alternated round by round
        verdict = round_verdict(per_round)
        text = (f"the grid's step / {other.name}'s: {per_round:.2f} (median (lowest-highest) of "
                f"{len(per_round.values)} rounds); grid {grid_run.step_time.scaled(1e3):.1f} ms against "
                f"{other.step_time.scaled(1e3):.1f} ms over the timed steps. ")
        text += {"lower": "The grid was faster in every round",
                 "higher": "The grid was slower in every round",
                 "within noise": "The rounds disagree, or the two tie: this run cannot tell them apart"}[verdict]
        text += (f"; compute alone predicts {gpu[grid_run.name]:.1f} ms for the grid against {gpu[other.name]:.1f} ms "
                 f"on {prediction.world} devices. ")
        if prediction.emulated:
            text += ("The clock is the emulated node's (logical), so every round gives the same step: the difference "
                     "is the layouts', not the machine's load.")
        elif prediction.few_cores:
            text += (f"Here {prediction.world} processes share {prediction.here} cores: a process waiting in a bubble "
                     f"leaves its core to another, so all three compute-only predictions meet at "
                     f"{prediction.one_device / prediction.here * 1e3:.1f} ms, and the layouts differ here only by their "
                     "messages, all-reduces and overheads.")
        conclude(key, verdict, text, ratio=per_round, grid=grid_run.step_time, other=other.step_time)
        verdicts[key] = verdict

    over = {r.name: r.step_time.scaled(1 / prediction.seconds(r.layout)) for r in runs}
    slower = all(compare(r.step_time, Measured.of([prediction.seconds(r.layout)])) == "higher" for r in runs)
    verdicts["05.layouts_vs_prediction"] = verdict = "slower than predicted" if slower else "not all slower"
    conclude("05.layouts_vs_prediction", verdict,
             "measured / predicted (compute only): " + ", ".join(f"{n} {v:.2f}" for n, v in over.items()) + ". "
             + ("Every timed step of every layout took longer than its compute-only prediction: the prediction "
                "leaves out the messages, the all-reduces and the overhead of each action and micro-batch."
                if slower else "Some timed step came within its compute-only prediction, so the messages, "
                "all-reduces and overheads it leaves out cost little here."),
             **{n.split(" (")[0].replace(" ", "_"): v for n, v in over.items()})
    return verdicts


def gpu_outlook(runs: Sequence[GridRun], prediction: Prediction) -> str:
    """The compute-only predictions on one device per process, which layout they put first, and
    which layout the run put first."""
    gpu = prediction.ms(runs)[prediction.gpu_label]
    measured = min(runs, key=lambda r: r.step_time.median)
    source = ("the device model at the emulated size" if prediction.emulated
              else "scaled from this machine's one-thread step" if prediction.device == "cpu" else "one GPU's step")
    first = min(gpu, key=gpu.get)
    return (f"On {prediction.world} devices, one per process, the compute-only predictions are "
            + ", ".join(f"{n} {v:.1f} ms" for n, v in gpu.items()) + f" ({source}): {first} first. "
            + f"Measured, with every message and all-reduce: {measured.name} first"
            + (" as well." if measured.name == first else
               f", because {first}'s all-reduces (the bytes per process above) cost more than the bubble it saves."
               if gpu[measured.name] > gpu[first] else "."))


def order(runs: Sequence[GridRun]) -> list[str]:
    """The layouts' names, fastest median step first."""
    return [r.name for r in sorted(runs, key=lambda r: r.step_time.median)]


def cores_contrast(on_cores: Sequence[GridRun], emulated: Sequence[GridRun], cores: int | None = None) -> str:
    """Conclude what changes when the same layouts run on this machine's own cores instead of the
    emulated node: the layouts' order, the steps' spread, and why (`on_cores` ran with emulate=None)."""
    cores = cores or hardware.cpu_cores()
    world = on_cores[0].layout.pipe * on_cores[0].layout.data
    shared = world > cores
    same = order(on_cores) == order(emulated)
    spread = {label: max(r.step_time.relative_spread for r in runs) for label, runs in
              (("cores", on_cores), ("emulated", emulated))}

    def listed(runs: Sequence[GridRun]) -> str:
        return ", ".join(f"{r.name} {r.step_time.scaled(1e3):.1f} ms" for r in runs)

    text = (f"on the emulated node ({emulated[0].emulate}): {listed(emulated)}, fastest first "
            f"{' < '.join(order(emulated))}; every step alike (spread {spread['emulated']:.0%}). On this machine's "
            f"{cores} cores, the same processes, math and messages at the small size: {listed(on_cores)}, fastest first "
            f"{' < '.join(order(on_cores))} ({'the same order' if same else 'another order'}), the steps spread by up "
            f"to {spread['cores']:.0%} around their medians. ")
    if shared:
        verdict = "cores shared"
        text += (f"Here {world} processes share {cores} cores: while one waits in its pipeline's bubble or for an "
                 "all-reduce, another computes on its core, so the bubbles and the hidden all-reduces that separate the "
                 f"layouts on {world} devices are not what orders them here: the messages, the overheads and the "
                 "machine's load are, and the load moves every step. On the node each process has a device of its own, "
                 "idle in its bubble, and a clock no load can move.")
    else:
        verdict = "same order" if same else "different order"
        text += (f"Each of the {world} processes had a core of its own, as on the node, but a CPU core computes far "
                 "slower against its memory and loopback messages than a GPU against NVLink, so compute weighs more "
                 "here and the all-reduces less.")
    conclude("05.cores_contrast", verdict, text, cores_spread=spread["cores"], emulated_spread=spread["emulated"])
    return verdict


# ---------------------------------------------------------------------------------------------
# A profile's work, counted
# ---------------------------------------------------------------------------------------------


def run_flops(width: int, layers_per_half: int, batch: int, steps: int, grid_width: int, grid_layers: int,
              grid_batch: int, grid_steps: int, rounds: int) -> float:
    """FLOPs of lesson 05 at a profile's size on a node with a GPU per process (nothing emulated),
    counted on the meta device: parts 1-2 train the two-half MLP `steps` steps per wrapper, with
    and without splits, plus the one-process reference; parts 3-4 train each of the three layouts
    `rounds` x `grid_steps` steps and a warm-up, each checked by a one-process reference of as
    many steps, plus the one-device prediction's three steps. (The tutorial's toy model is
    negligible.) Each step is the whole model's forward and backward on the whole batch."""
    from pipelab.emulate.cost import step_flops
    from pipelab.models import SplitMLP, mlp

    def step(model: nn.Module, rows: int, width: int) -> float:
        return step_flops(model, torch.empty(rows, width, device="meta"))

    with torch.device("meta"):
        replica, layers = SplitMLP(width, layers_per_half, width), mlp([grid_width] * (grid_layers + 1))
    replica_steps = steps * len(REPLICA_VARIANTS) * 2 + steps  # 2 wrappers x (naive, splits) + reference
    layout_steps = 2 * len(layouts_of(2, 2, 1)) * (rounds * grid_steps + 1) + 3  # runs and references, prediction
    return step(replica, batch, width) * replica_steps + step(layers, grid_batch, grid_width) * layout_steps

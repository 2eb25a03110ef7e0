"""Lesson 13 from a notebook: 1F1B and ZB-H1 beside ZB-V and DualPipeV, on real ranks, simulated,
and against the DualPipe repository's formulas.

One model of `layers` equal layers is cut into p stages (1F1B, ZB-H1: one per rank) or 2p stages
(ZB-V, DualPipeV: two per rank, on a V), so every schedule trains the same model on the same batch.
Each rank runs every schedule's step `steps` times (`pipeline.runtime.run_step`), and, for ZB-V and
DualPipeV, torch's own schedule class on the same stages. `gather` checks losses and gradients
against one process, measures bubbles and stashes, and simulates each schedule with the costs
measured in its own run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from pipelab import experiments
from pipelab.checks import divides, whole_number
from pipelab.measure import Measured, time_steps
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.runtime import run_step
from pipelab.pipeline.schedules import Schedule, Schedule1F1B, ScheduleZeroBubble
from pipelab.pipeline.simulate import Costs, SimResult, simulate
from pipelab.pipeline.v_shape import ScheduleDualPipeV, ScheduleZBV, VSchedule
from pipelab.timeline import Timeline
from pipelab.worker import RankContext

SCHEDULES = {"1F1B": Schedule1F1B, "ZB-H1": ScheduleZeroBubble, "ZB-V": ScheduleZBV, "DualPipeV": ScheduleDualPipeV}
TORCH_CLASSES = {"ZB-V": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """`layers` layers of `width` (Linear + Tanh), a batch of `batch` rows in `num_microbatches`
    micro-batches, over `world_size` ranks; `steps` steps per schedule (the first warms up)."""

    num_microbatches: int = 8
    width: int = 64
    layers: int = 8
    batch: int = 32
    steps: int = 3
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    with_torch: bool = True

    def check(self) -> None:
        super().check()
        for name in ("num_microbatches", "width", "layers", "batch", "steps"):
            whole_number(name, getattr(self, name))
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ValueError(f"schedules must be some of {list(SCHEDULES)}, got {list(self.schedules)!r}")
        p = self.world_size
        if p < 2:
            raise ValueError(f"a pipeline needs at least 2 ranks, got world_size={p}; use world_size=2 or 4")
        divides("layers", self.layers, "2 x world_size (the V's stages)", 2 * p)
        divides("batch", self.batch, "num_microbatches", self.num_microbatches)
        for name in self.schedules:
            self.schedule(name)  # each schedule refuses what it cannot run (e.g. DualPipeV with m < 2p)

    def schedule(self, name: str) -> Schedule:
        """The schedule as planned, DualPipeV's overlapped pairs included."""
        return SCHEDULES[name](self.world_size, self.num_microbatches)

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(layer for _ in range(self.layers) for layer in (nn.Linear(self.width, self.width),
                                                                              nn.Tanh())))

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(self.batch, self.width, generator=g), torch.randn(self.batch, self.width, generator=g)

    def stages(self, num_stages: int) -> list[nn.Sequential]:
        """The model cut into `num_stages` stages of equal layers."""
        layers = list(self.model())
        per = len(layers) // num_stages
        return [nn.Sequential(*layers[i * per:(i + 1) * per]) for i in range(num_stages)]


def runnable(schedule: Schedule) -> Schedule:
    """What the runtime walks: DualPipeV's overlapped pairs run one after the other here (on a GPU,
    one's compute would hide the other's communication; on one CPU core there is nothing to hide)."""
    if isinstance(schedule, VSchedule):
        return type(schedule)(schedule.num_ranks, schedule.num_microbatches, actions=schedule.expanded())
    return schedule


# ---------------------------------------------------------------------------------------------
# On each rank
# ---------------------------------------------------------------------------------------------


@dataclass
class ScheduleResult:
    losses: list[float]  # the first step's per-micro-batch losses (last stage's rank only)
    grads: dict[int, list[torch.Tensor]]  # stage -> its parameters' gradients after the first step
    stash_peak: int  # micro-batches' stashes alive at once, this rank
    stash_peak_bytes: int
    seconds: list[float]
    timelines: list[Timeline] = field(repr=False)
    torch_losses: list[float] | None = None


@dataclass
class Result:
    rank: int
    schedules: dict[str, ScheduleResult]


def worker(ctx: RankContext, cfg: Config) -> Result:
    x, y = cfg.data()
    out = {}
    for name in cfg.schedules:
        schedule = runnable(cfg.schedule(name))
        stages = cfg.stages(schedule.num_stages)
        modules = {s: stages[s] for s in schedule.stages_of(ctx.rank)}
        specs = message_specs(stages, x, schedule.num_microbatches)
        first: dict = {}

        def step(i: int, schedule=schedule, modules=modules, specs=specs, first=first) -> None:
            done = run_step(ctx, schedule, modules, nn.MSELoss(), x, y, specs)
            if i == 0:
                first["losses"] = [float(l) for l in done.losses]
                first["grads"] = {s: [p.grad.clone() for p in m.parameters()] for s, m in modules.items()}
                first["stash"] = done.stash
            return done

        timed = time_steps(ctx, step, cfg.steps,
                           prepare=lambda i, modules=modules: [m.zero_grad(set_to_none=True) for m in modules.values()])
        torch_losses = _torch_losses(ctx, cfg, name, schedule, x, y) if cfg.with_torch and name in TORCH_CLASSES else None
        out[name] = ScheduleResult(first["losses"], first["grads"], first["stash"].peak, first["stash"].peak_bytes,
                                   timed.seconds, timed.timelines, torch_losses)
    return Result(ctx.rank, out)


def _torch_losses(ctx: RankContext, cfg: Config, name: str, schedule: Schedule, x, y) -> list[float]:
    """One step of torch's own class for the schedule, on fresh copies of the same stages."""
    from pipelab.pipeline import torch_pipelining

    stages = cfg.stages(schedule.num_stages)
    modules = {s: stages[s] for s in sorted(schedule.stages_of(ctx.rank))}
    torch_pipelining.TORCH_SCHEDULES.setdefault(name, TORCH_CLASSES[name])
    step = torch_pipelining.torch_step(ctx, schedule, modules, nn.MSELoss())
    return [float(l.detach()) for l in step(x, y)]


# ---------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------


@dataclass
class ScheduleRun:
    name: str
    schedule: Schedule  # as planned (overlapped pairs included)
    loss_difference: float  # against one process, per micro-batch
    grad_difference: float
    torch_loss_difference: float | None  # torch's class on the same stages, against ours
    step_time: Measured
    bubble_fraction: Measured  # measured, per timed step
    stash_peak: dict[int, int]  # rank -> micro-batch stashes alive at once
    stash_peak_bytes: dict[int, int]
    timeline: Timeline = field(repr=False)  # the typical step
    simulated: SimResult | None = field(default=None, repr=False)


@dataclass
class VRun:
    cfg: Config
    schedules: dict[str, ScheduleRun]

    def __getitem__(self, name: str) -> ScheduleRun:
        return self.schedules[name]


def run(cfg: Config) -> VRun:
    return experiments.run(worker, cfg, gather)


def reference(cfg: Config) -> tuple[list[float], dict[int, list[torch.Tensor]], int]:
    """One process: per-micro-batch losses, and each layer's gradients (by layer index)."""
    model = cfg.model()
    x, y = cfg.data()
    m = cfg.num_microbatches
    losses = [nn.MSELoss()(model(xs), ys).item() for xs, ys in zip(x.chunk(m), y.chunk(m))]
    nn.MSELoss()(model(x), y).backward()
    return losses, {i: [p.grad for p in layer.parameters()] for i, layer in enumerate(model)}


def gather(cfg: Config, results: list[Result]) -> VRun:
    ref_losses, ref_grads = reference(cfg)
    runs = {}
    for name in cfg.schedules:
        planned = cfg.schedule(name)
        per_rank = [r.schedules[name] for r in results]
        last = planned.rank_of(planned.num_stages - 1)
        losses = per_rank[last].losses
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        grads = {s: g for r in per_rank for s, g in r.grads.items()}
        grad_diff = _grad_difference(cfg, planned.num_stages, grads, ref_grads)
        theirs = per_rank[last].torch_losses
        torch_diff = max(abs(a - b) for a, b in zip(theirs, losses)) if theirs else None
        seconds = [max(s) for s in zip(*(r.seconds for r in per_rank))]
        timelines = [Timeline.merge(tls) for tls in zip(*(r.timelines for r in per_rank))]
        typical = sorted(timelines, key=lambda t: t.makespan)[(len(timelines) - 1) // 2]
        sched_run = ScheduleRun(name, planned, loss_diff, grad_diff, torch_diff, Measured.of(seconds),
                                Measured.of(t.bubble_fraction() for t in timelines),
                                {r: per_rank[r].stash_peak for r in range(cfg.world_size)},
                                {r: per_rank[r].stash_peak_bytes for r in range(cfg.world_size)}, typical)
        sched_run.simulated = simulate(runnable(planned), Costs.from_timeline(typical))
        runs[name] = sched_run
    return VRun(cfg, runs)


def _grad_difference(cfg: Config, num_stages: int, grads, ref_grads) -> float:
    """Largest difference between each stage's gradients and the same layers' in one process."""
    layers_per_stage = 2 * cfg.layers // num_stages  # Linear + Tanh per layer
    worst = 0.0
    for s in range(num_stages):
        ref = [g for i in range(s * layers_per_stage, (s + 1) * layers_per_stage) for g in ref_grads[i]]
        worst = max([worst, *((a - b).abs().max().item() for a, b in zip(grads[s], ref))])
    return worst


# ---------------------------------------------------------------------------------------------
# The DualPipe repository's table, and ours beside it
# ---------------------------------------------------------------------------------------------


def dualpipe_formulas(p: int, F: float, B: float, W: float, FB: float | None = None) -> dict[str, dict]:
    """The DualPipe README's comparison (deepseek-ai/DualPipe): bubble in time units of a chunk's
    F, B (full backward), W (weight backward) and F&B (an overlapped forward and backward; F + B
    when nothing overlaps), activation memory per device in micro-batches of one 1F1B stage, and
    parameter copies per device. PP is the number of ranks p; a V chunk is half a 1F1B stage."""
    FB = F + B if FB is None else FB
    return {
        "1F1B": {"bubble": (p - 1) * (F + B), "activations": p, "parameters": 1},
        "ZB-H1": {"bubble": (p - 1) * (F + B - 2 * W), "activations": p, "parameters": 1},
        "DualPipeV": {"bubble": (p / 2 - 1) * (FB + B - 3 * W), "activations": p + 1, "parameters": 2},
    }


def table(run: VRun) -> list[dict]:
    """Per schedule: bubble simulated and measured, peak stash per rank in micro-batches of one
    1F1B stage (a V stage holds half the layers, so its stash counts half), measured bytes."""
    rows = []
    for name, r in run.schedules.items():
        half = 0.5 if isinstance(r.schedule, VSchedule) else 1.0
        rows.append({"schedule": name, "bubble simulated": round(r.simulated.bubble_fraction, 3),
                     "bubble measured": f"{r.bubble_fraction:.3f}",
                     "peak stash (1F1B stages)": max(r.stash_peak.values()) * half,
                     "simulated peak stash": max(r.simulated.peak_stash.values()) * half,
                     "peak stash bytes": max(r.stash_peak_bytes.values())})
    return rows


TOLERANCE = 1e-5


def same_as_one_process(run: VRun) -> tuple[str, str, str, dict]:
    worst = max(max(r.loss_difference, r.grad_difference) for r in run.schedules.values())
    torch_worst = max((r.torch_loss_difference for r in run.schedules.values()
                       if r.torch_loss_difference is not None), default=None)
    verdict = "same" if worst <= TOLERANCE and (torch_worst is None or torch_worst <= TOLERANCE) else "different"
    text = (f"every schedule ({', '.join(run.schedules)}) gave one process's per-micro-batch losses and "
            f"gradients on {run.cfg.world_size} ranks (largest difference {worst:.1e})")
    if torch_worst is not None:
        text += f"; torch's own ZB-V and DualPipeV gave ours within {torch_worst:.1e}"
    return "13.same_as_one_process", verdict, text, {"largest_difference": worst, "torch": torch_worst}


def stash_verdict(run: VRun, a: str = "ZB-H1", b: str = "1F1B") -> tuple[str, str, str, dict]:
    """Whether `a` kept at most what `b` kept, in peak stash bytes on any rank."""
    pa, pb = max(run[a].stash_peak_bytes.values()), max(run[b].stash_peak_bytes.values())
    verdict = "at or below" if pa <= pb else "above"
    text = f"{a} kept at most {pa:,} stash bytes on a rank, {pa / pb:.2f}x {b}'s {pb:,} ({verdict} it)"
    return f"13.stash_{a}_vs_{b}", verdict, text, {a: pa, b: pb}

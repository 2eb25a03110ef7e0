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
from pipelab.pipeline.stage import StageRunner  # noqa: F401 - lesson 13 shows what W keeps
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
    # On an emulated node each stage's F, B, I and W last what the device model gives for the same
    # layers at this size: `emulated_width` wide, `emulated_microbatch` rows, in `emulated_dtype`.
    emulated_width: int = 8192
    emulated_microbatch: int = 4096
    emulated_dtype: str = "bfloat16"

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
        emulate_stages(ctx, cfg, schedule.num_stages, modules)

        def step(i: int, schedule=schedule, modules=modules, specs=specs, first=first) -> None:
            done = run_step(ctx, schedule, modules, nn.MSELoss(), x, y, specs)
            if i == 0:
                first["losses"] = [float(l) for l in done.losses]
                first["grads"] = {s: [p.grad.clone() for p in m.parameters()] for s, m in modules.items()}
                first["stash"] = done.stash
            return done

        timed = time_steps(ctx, step, cfg.steps,
                           prepare=lambda i, modules=modules: [m.zero_grad(set_to_none=True) for m in modules.values()])
        if ctx.emulator is not None:
            ctx.emulator.use(None)  # torch's own step below is checked, not timed
        torch_losses = _torch_losses(ctx, cfg, name, schedule, x, y) if cfg.with_torch and name in TORCH_CLASSES else None
        out[name] = ScheduleResult(first["losses"], first["grads"], first["stash"].peak, first["stash"].peak_bytes,
                                   timed.seconds, timed.timelines, torch_losses)
    return Result(ctx.rank, out)


def emulate_stages(ctx: RankContext, cfg: Config, num_stages: int, modules) -> None:
    """On an emulated node, time this rank's stages by their modelled F, B, I and W seconds for the
    same layers at the emulated size (counted on the meta device, so the size costs no memory)."""
    if ctx.emulator is None:
        return
    from pipelab.emulate.cost import stage_seconds
    from pipelab.emulate.table import stage_table

    layers = cfg.layers // num_stages
    big = nn.Sequential(*(layer for _ in range(layers) for layer in (nn.Linear(cfg.emulated_width, cfg.emulated_width),
                                                                        nn.Tanh()))).to("meta")
    example = torch.empty(cfg.emulated_microbatch, cfg.emulated_width, device="meta")
    seconds = stage_seconds(big, example, ctx.emulator.node.device, cfg.emulated_dtype)
    ctx.emulator.use(stage_table({s: seconds for s in modules}))


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
    """The DualPipe README's comparison (deepseek-ai/DualPipe, README "Pipeline Bubbles and Memory
    Usage Comparison"), for one model on p devices. The README counts in PP stages ("chunks", PP
    even) with F, B (full backward), W (weight backward) and F&B (an overlapped forward and backward)
    the times of one chunk: 1F1B and ZB1P put PP = p chunks on p devices, DualPipeV PP = 2p chunks
    on PP/2 = p devices, each half the size. Here F, B and W are the times of one *1F1B stage*, so a
    DualPipeV chunk takes half of each; F&B defaults to F + B (nothing overlaps). Activations per
    device are in micro-batches of one 1F1B stage: the README's PP + 1 chunks are p + 1/2 stages.
    Parameters per device: the README's "2x" is against devices that hold one chunk each; with the
    same model on the same p devices every schedule holds the same bytes."""
    half = (F / 2, B / 2, W / 2)
    fb = sum(half[:2]) if FB is None else FB / 2
    return {
        "1F1B": {"bubble": (p - 1) * (F + B), "activations": p},
        "ZB-H1": {"bubble": (p - 1) * (F + B - 2 * W), "activations": p},
        "DualPipeV": {"bubble": (2 * p / 2 - 1) * (fb + half[1] - 3 * half[2]), "activations": (2 * p + 1) / 2},
    }


def table(run: VRun) -> list[dict]:
    """Per schedule: bubble simulated and measured, peak stash per rank in micro-batches of one
    1F1B stage (a V stage holds half the layers, so its stash counts half), measured bytes."""
    rows = []
    for name, r in run.schedules.items():
        half = 0.5 if isinstance(r.schedule, VSchedule) else 1.0
        rows.append({"schedule": name, "bubble simulated": round(r.simulated.bubble_fraction, 3),
                     "bubble of the run": f"{r.bubble_fraction:.3f}",
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
    """Whether `a` kept at most what `b` kept, in peak stash bytes on any rank, and in micro-batches."""
    pa, pb = max(run[a].stash_peak_bytes.values()), max(run[b].stash_peak_bytes.values())
    half = lambda name: 0.5 if isinstance(run[name].schedule, VSchedule) else 1.0  # noqa: E731
    na, nb = max(run[a].stash_peak.values()) * half(a), max(run[b].stash_peak.values()) * half(b)
    verdict = "at or below" if pa <= pb else "above"
    text = (f"{a} kept at most {pa:,} stash bytes on a rank, {pa / pb:.2f}x {b}'s {pb:,} ({verdict} it), "
            f"while holding {na:g} micro-batches of one 1F1B stage against {b}'s {nb:g}")
    if verdict == "above" and na <= nb:
        text += ": as many micro-batches, more bytes each, for what waits between a micro-batch's I and its W"
    return f"13.stash_{a}_vs_{b}", verdict, text, {a: pa, b: pb}


def work_per_rank(run: VRun, name: str) -> float:
    """Seconds of compute each rank has to do in one step (every rank does the same here: equal
    layers, and a V rank's two chunks are one 1F1B stage's worth)."""
    tl = run[name].timeline
    return max(tl.busy_time(rank) for rank in tl.ranks)


def bubble_times(run: VRun) -> list[dict]:
    """Per schedule, the bubble as time (a step's length minus one rank's work): the DualPipe
    README's formula with this run's costs, the simulator, and the run, in milliseconds."""
    c = run["1F1B"].simulated.costs if "1F1B" in run.schedules else next(iter(run.schedules.values())).simulated.costs
    F, W = c.forward, c.backward_weight
    B = c.backward_input + c.backward_weight
    if "ZB-V" in run.schedules and "1F1B" not in run.schedules:  # costs of a half stage: double them
        F, B, W = 2 * F, 2 * B, 2 * W
    formulas = dualpipe_formulas(run.cfg.world_size, F, B, W)
    rows = []
    for name, r in run.schedules.items():
        work_ms = 1e3 * work_per_rank(run, name)
        rows.append({"schedule": name,
                     "formula (ms)": round(formulas[name]["bubble"], 3) if name in formulas else "-",
                     "simulated (ms)": round(r.simulated.makespan_ms - work_ms, 3),
                     "run (ms)": round(1e3 * r.step_time.median - work_ms, 3),
                     "activations, formula (1F1B stages)": formulas[name]["activations"] if name in formulas else "-",
                     "activations, run": max(r.stash_peak.values()) * (0.5 if isinstance(r.schedule, VSchedule) else 1)})
    return rows


def bubble_verdict(run: VRun) -> tuple[str, str, str, dict]:
    """Which schedule left the least idle time on this run, and how the run compares with the
    simulator playing the same costs (what the runtime adds: waits and messages)."""
    rows = {r["schedule"]: r for r in bubble_times(run)}
    order = sorted(rows, key=lambda n: rows[n]["run (ms)"])
    ranking = order[0]
    for before, name in zip(order, order[1:]):  # within 5 %: a tie, not an order
        ranking += (" = " if rows[name]["run (ms)"] <= 1.05 * rows[before]["run (ms)"] else " < ") + name
    added = max(rows[n]["run (ms)"] - rows[n]["simulated (ms)"] for n in rows)
    where = f"on an emulated node ({run.cfg.emulate})" if run.cfg.emulate else "on this machine's CPU cores"
    text = (f"{where}, the bubbles: {ranking} (" + ", ".join(f"{n} {rows[n]['run (ms)']:.2f} ms" for n in order)
            + f"); the run exceeds the simulator by at most {added:.3f} ms per step (messages and waits the "
            "simulator leaves out)")
    return f"13.bubble_order_p{run.cfg.world_size}", ranking, text, {n: rows[n]["run (ms)"] for n in order}


def run_flops(width: int, layers: int, batch: int, steps: int, larger_layers: int = 0) -> float:
    """FLOPs of lesson 13's runs at a profile's size, counted on the meta device: `steps` steps of
    every schedule on the whole batch, one step of torch's ZB-V and DualPipeV, the one-process
    reference; with `larger_layers`, the same schedules (no torch) on that deeper model."""
    from pipelab.emulate.cost import step_flops

    def model_step(n: int) -> float:
        model = nn.Sequential(*(m for _ in range(n) for m in (nn.Linear(width, width), nn.Tanh()))).to("meta")
        return step_flops(model, torch.empty(batch, width, device="meta"))

    total = model_step(layers) * (steps * len(SCHEDULES) + len(TORCH_CLASSES) + 1)
    return total + (model_step(larger_layers) * (steps * len(SCHEDULES) + 1) if larger_layers else 0.0)

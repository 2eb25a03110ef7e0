"""Lesson 13 from a notebook: 1F1B and ZB-H1 beside ZB-V, DualPipeV and looped BFS, on real ranks,
simulated, and against the DualPipe repository's formulas.

One model of `layers` equal layers is cut into p stages (1F1B, ZB-H1: one per rank) or 2p stages
(ZB-V, DualPipeV on a V, looped BFS on a loop: two per rank), so every schedule trains the same
model on the same batch. Each rank runs every schedule's step `steps` times
(`pipeline.runtime.run_step`), and, for ZB-V and DualPipeV, torch's own class on the same stages.
`gather` checks losses and gradients against `reference(cfg)` and simulates each schedule with the
costs of its own run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from pipelab import experiments
from pipelab.checks import divides, whole_number
from pipelab.emulate import anchors, cost, sized
from pipelab.experiments.pipeline import zero_grads
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, gather_steps, time_steps
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.runtime import run_step
from pipelab.pipeline.schedules import Schedule, Schedule1F1B, ScheduleZeroBubble
from pipelab.pipeline.simulate import Costs, SimResult, simulate
from pipelab.pipeline.v_shape import ScheduleDualPipeV, ScheduleLoopedBFS, ScheduleZBV, VSchedule, dualpipe_formulas
from pipelab.worker import RankContext

SCHEDULES = {"1F1B": Schedule1F1B, "ZB-H1": ScheduleZeroBubble, "ZB-V": ScheduleZBV, "DualPipeV": ScheduleDualPipeV}
PLANS = {**SCHEDULES, "Looped BFS": lambda p, m: ScheduleLoopedBFS(p, m, 2)}  # every schedule a run may name
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
    # on an emulated node each layer is timed this wide, on micro-batches of `rows` rows, in `dtype`
    SIZE: ClassVar[Mapping[str, Any]] = {"width": 8192, "rows": 4096, "dtype": "bfloat16"}

    def check(self) -> None:
        super().check()
        for name in ("num_microbatches", "width", "layers", "batch", "steps"):
            whole_number(name, getattr(self, name))
        for name in ("width", "rows"):  # the emulated size
            whole_number(f"the emulated {name}", getattr(self.size, name), example=f"Emulated(node, {name}=4096)")
        bad = [s for s in self.schedules if s not in PLANS]
        if bad or not self.schedules:
            raise ValueError(f"schedules must be some of {list(PLANS)}, got {list(self.schedules)!r}")
        p = self.world_size
        if p < 2:
            raise ValueError(f"a pipeline needs at least 2 ranks, got world_size={p}; use world_size=2 or 4")
        divides("layers", self.layers, "2 x world_size (the V's stages)", 2 * p)
        divides("batch", self.batch, "num_microbatches", self.num_microbatches)
        for name in self.schedules:
            self.schedule(name)  # each schedule refuses what it cannot run (e.g. DualPipeV with m < 2p)

    def schedule(self, name: str) -> Schedule:
        """The schedule as planned, DualPipeV's overlapped pairs included."""
        return PLANS[name](self.world_size, self.num_microbatches)

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        return tanh_layers(self.width, self.layers)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(self.batch, self.width, generator=g), torch.randn(self.batch, self.width, generator=g)

    def stages(self, num_stages: int) -> list[nn.Sequential]:
        """The model cut into `num_stages` stages of equal layers."""
        layers = list(self.model())
        per = len(layers) // num_stages
        return [nn.Sequential(*layers[i * per:(i + 1) * per]) for i in range(num_stages)]


def tanh_layers(width: int, layers: int) -> nn.Sequential:
    """`layers` equal layers: Linear(width, width) then Tanh, each."""
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())))


def runnable(schedule: Schedule) -> Schedule:
    """What the runtime walks: DualPipeV's overlapped pairs run one after the other here (on a GPU,
    one's compute would hide the other's communication; on one CPU core there is nothing to hide)."""
    if isinstance(schedule, VSchedule):
        return type(schedule)(schedule.num_ranks, schedule.num_microbatches, actions=schedule.expanded())
    return schedule


def stage_share(schedule: Schedule) -> float:
    """One of the schedule's stages as a share of a 1F1B stage (1, or 1/2 with two stages per rank)."""
    return schedule.num_ranks / schedule.num_stages


# On each rank


@dataclass
class ScheduleResult:
    losses: list[float]  # the last step's per-micro-batch losses (last stage's rank only)
    grads: dict[int, list[torch.Tensor]]  # stage -> its parameters' gradients after the last step
    stash_peak: int  # micro-batches' stashes alive at once, this rank
    stash_peak_bytes: int
    steps: RankSteps  # times and timelines of the timed steps
    torch_losses: list[float] | None = None


def worker(ctx: RankContext, cfg: Config) -> dict[str, ScheduleResult]:
    x, y = cfg.data()
    out = {}
    for name in cfg.schedules:
        schedule = runnable(cfg.schedule(name))
        stages = cfg.stages(schedule.num_stages)
        modules = {s: stages[s] for s in schedule.stages_of(ctx.rank)}
        specs = message_specs(stages, x, schedule.num_microbatches)
        sized.time_tanh_stages(ctx, modules, cfg.layers // schedule.num_stages, cfg.size)
        timed = time_steps(ctx, lambda _: run_step(ctx, schedule, modules, nn.MSELoss(), x, y, specs), cfg.steps,
                           prepare=zero_grads(modules))
        last = timed.results[-1]
        grads = {s: [p.grad.clone() for p in m.parameters()] for s, m in modules.items()}
        sized.untimed(ctx)  # torch's own step below is checked, not timed
        torch_losses = _torch_losses(ctx, cfg, name, schedule, x, y) if cfg.with_torch and name in TORCH_CLASSES else None
        out[name] = ScheduleResult([float(l) for l in last.losses], grads, last.stash.peak, last.stash.peak_bytes,
                                   RankSteps([], timed.seconds, timed.timelines), torch_losses)
    return out


def _torch_losses(ctx: RankContext, cfg: Config, name: str, schedule: Schedule, x, y) -> list[float]:
    """One step of torch's own class for the schedule, on fresh copies of the same stages."""
    from pipelab.pipeline import torch_pipelining

    stages = cfg.stages(schedule.num_stages)
    modules = {s: stages[s] for s in sorted(schedule.stages_of(ctx.rank))}
    torch_pipelining.TORCH_SCHEDULES.setdefault(name, TORCH_CLASSES[name])
    step = torch_pipelining.torch_step(ctx, schedule, modules, nn.MSELoss())
    return [float(l.detach()) for l in step(x, y)]


# The parent side


@dataclass
class ScheduleRun(TimedSteps):
    name: str
    schedule: Schedule  # as planned (overlapped pairs included)
    loss_difference: float  # against one process, per micro-batch
    grad_difference: float
    torch_loss_difference: float | None  # torch's class on the same stages, against ours
    steps: Steps = field(repr=False)  # `step_time` and the typical step's `timeline` come from these
    stash_peak: dict[int, int]  # rank -> micro-batch stashes alive at once
    stash_peak_bytes: dict[int, int]
    simulated: SimResult | None = field(default=None, repr=False)

    @property
    def bubble_fraction(self) -> Measured:
        """Idle fraction of every timed step."""
        return Measured.of(t.bubble_fraction() for t in self.steps.timelines)


@dataclass
class VRun:
    cfg: Config
    schedules: dict[str, ScheduleRun]

    def __getitem__(self, name: str) -> ScheduleRun:
        return self.schedules[name]


def run(cfg: Config) -> VRun:
    return experiments.run(worker, cfg, gather)


def reference(cfg: Config) -> tuple[list[float], dict[int, list[torch.Tensor]]]:
    """One process: per-micro-batch losses, and each layer's gradients (by layer index)."""
    model = cfg.model()
    x, y = cfg.data()
    m = cfg.num_microbatches
    losses = [nn.MSELoss()(model(xs), ys).item() for xs, ys in zip(x.chunk(m), y.chunk(m))]
    nn.MSELoss()(model(x), y).backward()
    return losses, {i: [p.grad for p in layer.parameters()] for i, layer in enumerate(model)}


def gather(cfg: Config, results: list[dict[str, ScheduleResult]]) -> VRun:
    ref_losses, ref_grads = reference(cfg)
    runs = {}
    for name in cfg.schedules:
        planned = cfg.schedule(name)
        per_rank = [r[name] for r in results]
        last = per_rank[planned.rank_of(planned.num_stages - 1)]
        grads = {s: g for r in per_rank for s, g in r.grads.items()}
        steps = gather_steps([r.steps for r in per_rank])
        runs[name] = ScheduleRun(
            name, planned, max(abs(a - b) for a, b in zip(last.losses, ref_losses)),
            _grad_difference(cfg, planned.num_stages, grads, ref_grads),
            max(abs(a - b) for a, b in zip(last.torch_losses, last.losses)) if last.torch_losses else None, steps,
            {r: per_rank[r].stash_peak for r in range(cfg.world_size)},
            {r: per_rank[r].stash_peak_bytes for r in range(cfg.world_size)},
            simulate(runnable(planned), Costs.from_timeline(steps.typical)))
    return VRun(cfg, runs)


def _grad_difference(cfg: Config, num_stages: int, grads, ref_grads) -> float:
    """Largest difference between each stage's gradients and the same layers' in one process."""
    per = 2 * cfg.layers // num_stages  # Linear + Tanh per layer
    return max((a - b).abs().max().item() for s in range(num_stages)
               for a, b in zip(grads[s], (g for i in range(s * per, (s + 1) * per) for g in ref_grads[i])))


# The DualPipe repository's table, and ours beside it


def stage_costs(run: VRun) -> tuple[float, float, float]:
    """F, B and W (ms) of one 1F1B stage in this run: the simulator's costs, doubled for a half stage."""
    r = next(iter(run.schedules.values()))
    c, scale = r.simulated.costs, 1 / stage_share(r.schedule)
    return scale * c.forward, scale * (c.backward_input + c.backward_weight), scale * c.backward_weight


def work_ms(run: VRun, name: str) -> float:
    """Milliseconds of compute each rank does in one step (equal layers: every rank the same)."""
    tl = run[name].timeline
    return 1e3 * max(tl.busy_time(rank) for rank in tl.ranks)


def bubble_times(run: VRun) -> list[dict]:
    """Per schedule, the bubble as time (a step's length minus one rank's work): the published
    formula (DeepSeek-V3's Table 2, the DualPipe README: `anchors.FORMULAS`) as printed there and
    evaluated with this run's costs, the simulator, and the run, in ms."""
    formulas = dualpipe_formulas(run.cfg.world_size, *stage_costs(run))
    rows = []
    for name, r in run.schedules.items():
        formula = formulas.get(name, {"bubble": "-", "activations": "-"})
        published = anchors.FORMULAS.get(name)
        text = f"{published.published_name}: {published.bubble}" if published else "-"
        rows.append({"schedule": name, "published": text,
                     "formula (ms)": formula["bubble"] if formula["bubble"] == "-" else
                     round(formula["bubble"], 3), "simulated (ms)": round(r.simulated.makespan_ms - work_ms(run, name), 3),
                     "run (ms)": round(1e3 * r.step_time.median - work_ms(run, name), 3),
                     "activations, formula (1F1B stages)": formula["activations"],
                     "activations, run": max(r.stash_peak.values()) * stage_share(r.schedule)})
    return rows


def table(run: VRun) -> list[dict]:
    """Per schedule: bubble fraction simulated and of the run, peak stash per rank in micro-batches
    of one 1F1B stage (a half-size stage counts half), and its bytes."""
    return [{"schedule": name, "bubble simulated": round(r.simulated.bubble_fraction, 3),
             "bubble of the run": f"{r.bubble_fraction:.3f}",
             "peak stash (1F1B stages)": max(r.stash_peak.values()) * stage_share(r.schedule),
             "simulated peak stash": max(r.simulated.peak_stash.values()) * stage_share(r.schedule),
             "peak stash bytes": max(r.stash_peak_bytes.values())} for name, r in run.schedules.items()]


def idle_parts(run: VRun, name: str) -> list[dict]:
    """Where the simulator's idle time lies, rank by rank: before the rank's first action, between
    its actions, after its last (modelled ms); their sum is the bubble in time on every rank."""
    tl = run[name].simulated.timeline.filter(lane="compute")
    start, end = tl.start, tl.end
    rows = []
    for rank in tl.ranks:
        spans = sorted(tl.filter(rank=rank), key=lambda s: s.start)
        first, last = spans[0].start - start, end - spans[-1].end
        total = end - start - tl.busy_time(rank)
        rows.append({"rank": rank, "idle before its first action (ms)": round(1e3 * first, 3),
                     "between actions (ms)": round(1e3 * (total - first - last), 3),
                     "after its last (ms)": round(1e3 * last, 3), "idle in all (ms)": round(1e3 * total, 3)})
    return rows


def startup_verdict(run: VRun, name: str = "DualPipeV") -> tuple[str, str, str, dict]:
    """Whether the simulator's idle time of `name` is all start-up and drain (no gap between
    actions), how many chunk forwards (F/2 of a 1F1B stage) it lasts, and the README's formula."""
    rows = idle_parts(run, name)
    idle = max(r["idle in all (ms)"] for r in rows)
    gaps = max(r["between actions (ms)"] for r in rows) > 1e-3 * idle
    chunks = idle / (stage_costs(run)[0] / 2)
    formula = {r["schedule"]: r for r in bubble_times(run)}[name]["formula (ms)"]
    verdict = "gaps between actions too" if gaps else "start-up and drain only"
    whole = round(chunks) if abs(chunks - round(chunks)) < 0.01 else None
    count = ("one chunk forward" if whole == 1 else f"{whole} chunk forwards" if whole else "no whole number of chunk forwards")
    return (f"13.startup_{name}_p{run.cfg.world_size}", verdict,
            f"{name}'s simulated idle, {idle:.3f} ms per rank, is {count}, " + ("partly between actions" if gaps else
            "all before a rank's first action or after its last") + f"; the README's formula counts {formula} ms",
            {"idle_ms": idle, "chunk_forwards": chunks, "formula_ms": formula})


TOLERANCE = 1e-5


def same_as_one_process(run: VRun) -> tuple[str, str, str, dict]:
    worst = max(max(r.loss_difference, r.grad_difference) for r in run.schedules.values())
    torch_worst = max((r.torch_loss_difference for r in run.schedules.values()
                       if r.torch_loss_difference is not None), default=None)
    verdict = "same" if worst <= TOLERANCE and (torch_worst is None or torch_worst <= TOLERANCE) else "different"
    text = f"all {len(run.schedules)} schedules gave one process's losses and gradients (largest difference {worst:.1e})"
    if torch_worst is not None:
        text += f", and torch's own ZB-V and DualPipeV matched ours within {torch_worst:.1e}"
    return "13.same_as_one_process", verdict, text, {"largest_difference": worst, "torch": torch_worst}


def stash_verdict(run: VRun, a: str = "ZB-H1", b: str = "1F1B") -> tuple[str, str, str, dict]:
    """Whether `a` kept at most what `b` kept, in peak stash bytes on any rank, and in micro-batches."""
    pa, pb = max(run[a].stash_peak_bytes.values()), max(run[b].stash_peak_bytes.values())
    na, nb = (max(run[n].stash_peak.values()) * stage_share(run[n].schedule) for n in (a, b))
    verdict = "at or below" if pa <= pb else "above"
    same = "as many" if na == nb else ("fewer" if na < nb else "more")
    return (f"13.stash_{a}_vs_{b}", verdict,
            f"{a} kept {pa / pb:.2f}x {b}'s peak stash bytes on a rank, with {same} micro-batches of a 1F1B stage",
            {a: pa, b: pb, f"{a} micro-batches": na, f"{b} micro-batches": nb})


def bubble_verdict(run: VRun) -> tuple[str, str, str, dict]:
    """The schedules ordered by the idle time the run left (within 5 %: a tie), and how far the run
    is from the simulator playing the same costs (what the runtime adds: waits and messages)."""
    rows = {r["schedule"]: r for r in bubble_times(run)}
    order = sorted(rows, key=lambda n: rows[n]["run (ms)"])
    ranking = order[0]
    for before, name in zip(order, order[1:]):
        ranking += (" = " if rows[name]["run (ms)"] <= 1.05 * rows[before]["run (ms)"] else " < ") + name
    added = max(rows[n]["run (ms)"] - rows[n]["simulated (ms)"] for n in rows)
    where = "modelled" if run.cfg.emulate else "measured"
    return (f"13.bubble_order_p{run.cfg.world_size}", ranking,
            f"{where} bubbles in time: {ranking}; the run exceeds the simulator by at most {added:.3f} ms",
            {n: rows[n]["run (ms)"] for n in order})


def published_verdict(run: VRun, name: str = "DualPipeV") -> tuple[str, str, str, dict]:
    """The bubble `name` left in the run beside its published formula evaluated with this run's F, B
    and W (`bubble_times`); the formula has no hardware, so the run's node is the only one."""
    row = {r["schedule"]: r for r in bubble_times(run)}[name]
    ratio = row["run (ms)"] / row["formula (ms)"]
    where = "modelled" if run.cfg.emulate else "measured"
    verdict = "within 10 % of the formula" if abs(ratio - 1) <= 0.1 else ("above" if ratio > 1 else "below") + " the formula"
    return (f"13.published_{name}_p{run.cfg.world_size}", verdict,
            f"{name}'s {where} bubble, {row['run (ms)']:.3f} ms, was {ratio:.2f}x its published "
            f"{anchors.formula(name).bubble} with this run's F, B and W",
            {"run_ms": row["run (ms)"], "formula_ms": row["formula (ms)"], "ratio": ratio})


def run_flops(params: dict) -> float:
    """FLOPs of lesson 13 at the notebook parameters `params` (missing names take the defaults),
    counted on the meta device: `steps` steps of every schedule, torch's ZB-V and DualPipeV once,
    the reference; with `larger_world_size`, the same schedules (no torch) on `larger_layers`."""
    p = {"width": 64, "layers": 8, "batch": 32, "steps": 3, "larger_world_size": 4, "larger_layers": 16, **params}
    schedules = len(PLANS)

    def model_step(n: int) -> float:
        with torch.device("meta"):
            return cost.step_flops(tanh_layers(p["width"], n), torch.empty(p["batch"], p["width"]))

    total = model_step(p["layers"]) * (p["steps"] * schedules + len(TORCH_CLASSES) + 1)
    if p["larger_world_size"]:
        total += model_step(p["larger_layers"]) * (p["steps"] * schedules + 1)
    return total

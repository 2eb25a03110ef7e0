"""Lesson 01's bucket-size sweep: our BucketedDDP at every bucket size, torch's DDP beside it, all
in one set of processes, and what the sweep says.

    cfg = bucket_sweep.Config(model=model, x=x, y=y, caps_mb=[0.001, 1, 2, 4, 8])  # refuses bad input here
    points = experiments.run(bucket_sweep.worker, cfg, bucket_sweep.gather)       # one SweepPoint per size
    pipelab.conclude(*bucket_sweep.sweep_verdict(points))
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Sequence

import torch

from pipelab.checks import whole_number
from pipelab.ddp import check_bucket_cap
from pipelab.experiments.ddp import TORCH_OWN_CORES, Training, Verdict, modelled, overlaps, shard, train_step, wrap
from pipelab.measure import Measured, RankSteps, alternate, compare, compare_medians, gather_steps, ratios, time_steps
from pipelab.timeline import Timeline
from pipelab.worker import RankContext


@dataclass(frozen=True, kw_only=True)
class Config(Training):
    """BucketedDDP (and torch's DDP beside it, `with_torch`) at each bucket size of `caps_mb`, in
    one set of processes: `steps` timed steps per size, wrapper and round, for `rounds` rounds."""

    caps_mb: Sequence[float]
    rounds: int = 2
    with_torch: bool = True
    lr: float = 0.01
    timeout: float = 300.0

    def check(self) -> None:
        super().check()
        if isinstance(self.caps_mb, (str, int, float)) or not self.caps_mb or len(set(self.caps_mb)) != len(self.caps_mb):
            raise ValueError(f"give one or more different bucket sizes, got caps_mb={self.caps_mb!r}; "
                             "e.g. caps_mb=[0.25, 1, 4, 25]")
        for cap in self.caps_mb:
            check_bucket_cap(cap)
        whole_number("rounds", self.rounds, example="rounds=2")
        if self.node is not None and self.with_torch:
            raise ValueError(TORCH_OWN_CORES + "; pass with_torch=False, and torch_on_own_cores(cfg, cap)")


def torch_on_own_cores(cfg: Config, cap_mb: float, rounds: int | None = None, steps: int | None = None) -> Config:
    """Ours and torch's DDP at one bucket size on this machine's own cores, in turn round after round."""
    return replace(cfg, caps_mb=[cap_mb], with_torch=True, emulate=None, rounds=rounds or cfg.rounds,
                   steps=steps or cfg.steps)


@dataclass
class SweepResult:
    """What one rank measured in the sweep, by (bucket size, "bucketed" or "torch")."""

    steps: dict[tuple[float, str], RankSteps]  # every timed step of every round
    rounds: dict[tuple[float, str], list[float]]  # the median step of each round
    buckets: dict[float, int]  # how many buckets BucketedDDP made at each size


def worker(ctx: RankContext, cfg: Config) -> SweepResult:
    """Each bucket size's BucketedDDP (and torch's DDP) on the same weights, `cfg.steps` timed steps
    each, in turn for `cfg.rounds` rounds (`measure.alternate`): a busy machine slows all alike.
    Each wrapper's first step warms up (torch's DDP rebuilds its buckets after it), not kept."""
    xs = shard(cfg.x, ctx.rank, ctx.world_size).to(ctx.device)
    ys = shard(cfg.y, ctx.rank, ctx.world_size).to(ctx.device)
    kinds = ["bucketed", "torch"] if cfg.with_torch else ["bucketed"]
    with modelled(ctx, cfg):
        wrappers = {}
        for cap in cfg.caps_mb:
            for kind in kinds:
                wrapped = wrap(kind, copy.deepcopy(cfg.model).to(ctx.device), cap, ctx.rec, device=ctx.device)
                wrappers[cap, kind] = (wrapped, torch.optim.SGD(wrapped.parameters(), lr=cfg.lr))
        measured = {key: RankSteps([], [], []) for key in wrappers}

        def run(key, count: int) -> RankSteps:
            wrapped, optimizer = wrappers[key]
            return time_steps(ctx, lambda i: train_step(ctx, wrapped, optimizer, xs, ys, cfg.loss_fn), count,
                              prepare=lambda i: optimizer.zero_grad(set_to_none=True), warmup=0)

        def one_round(key) -> float:
            got = run(key, cfg.steps)
            measured[key].results.extend(got.results)
            measured[key].seconds.extend(got.seconds)
            measured[key].timelines.extend(got.timelines)
            return statistics.median(got.seconds)

        for key in wrappers:  # the warm-up step of each wrapper, not kept
            run(key, 1)
        per_round = alternate({key: partial(one_round, key) for key in wrappers}, cfg.rounds, warmup=0)
    return SweepResult(measured, per_round, {cap: len(wrappers[cap, "bucketed"][0].buckets) for cap in cfg.caps_mb})


@dataclass
class SweepPoint:
    """BucketedDDP (and torch's DDP) at one bucket size: every timed step of every round."""

    bucket_cap_mb: float
    num_buckets: int
    step_time: Measured  # seconds, ours (the slowest rank's)
    overlap: Measured  # ours: per timed step, the fraction of all-reduce time hidden behind compute
    timeline: Timeline = field(repr=False)  # ours, a typical step
    torch_step_time: Measured | None = None  # seconds, torch's DDP with the same bucket_cap_mb
    ratio: Measured | None = None  # ours / torch, round by round (each round runs both in turn)
    node: object = None  # the node that timed it, or None: this machine


def gather(cfg: Config, results: Sequence[SweepResult]) -> list[SweepPoint]:
    """One `SweepPoint` per bucket size, in the order of `cfg.caps_mb`."""
    points = []
    for cap in cfg.caps_mb:
        ours = gather_steps([r.steps[cap, "bucketed"] for r in results])
        point = SweepPoint(cap, results[0].buckets[cap], Measured.of(ours.seconds), overlaps(ours.timelines),
                           ours.typical, node=cfg.node)
        if cfg.with_torch:
            point.torch_step_time = Measured.of(gather_steps([r.steps[cap, "torch"] for r in results]).seconds)
            point.ratio = ratios(_slowest_per_round(results, (cap, "bucketed")),
                                 _slowest_per_round(results, (cap, "torch")))
        points.append(point)
    return points


def _slowest_per_round(results: Sequence[SweepResult], key) -> list[float]:
    """Per round, the slowest rank's median step of one wrapper."""
    return [max(rounds) for rounds in zip(*(r.rounds[key] for r in results))]


SWEEP_ENDS = ("one bucket per parameter", "one bucket for the model")


def sweep_verdict(points: Sequence[SweepPoint]) -> Verdict:
    """Whether each end of the sweep lost to its fastest size: beyond a whole run's noise on this
    machine, by more than 1 % in modelled time (which repeats exactly)."""
    best = min(points, key=lambda p: p.step_time.median)
    margin = {"margin": 0.01} if points[0].node is not None else {}  # modelled: no noise beyond rounding
    slower = {name: compare_medians(p.step_time, best.step_time, **margin) == "higher"
              for name, p in zip(SWEEP_ENDS, (points[0], points[-1]))}
    verdict = "; ".join(f"{name}: {'slower' if s else 'within noise'}" for name, s in slower.items())
    losers = [name for name, s in slower.items() if s]
    ends = ("both ends were slower" if len(losers) == 2 else f"only {losers[0]} was slower" if losers else
            "neither end was slower" + (" by 1 %" if margin else " beyond the noise"))
    text = (f"the fastest median step was bucket_cap_mb={best.bucket_cap_mb:g} ({best.num_buckets} buckets"
            + (", modelled" if margin else "") + f"), and {ends}.")
    return "01.bucket_sweep", verdict, text, {
        "best_cap_mb": best.bucket_cap_mb, "best_ms": best.step_time.scaled(1e3),
        "smallest_ms": points[0].step_time.scaled(1e3), "largest_ms": points[-1].step_time.scaled(1e3)}


def torch_verdict(points: Sequence[SweepPoint], bucket_cap_mb: float) -> Verdict:
    """Ours against torch's DDP, round by round, at `bucket_cap_mb` (else at the fastest size)."""
    ours = next((p for p in points if p.bucket_cap_mb == bucket_cap_mb), None) or \
        min(points, key=lambda p: p.step_time.median)
    # a direction only if every round lies beyond 10 % on one side: on 2 busy cores a round moves that much
    verdict = {"higher": "ours slower", "lower": "ours faster", "within noise": "within noise"}[
        compare(ours.ratio, Measured.of([0.9, 1.1]))]
    text = (f"at bucket_cap_mb={ours.bucket_cap_mb:g}, ours took {ours.ratio.median:.2f}x torch's step time: "
            + {"ours slower": "slower in every round, by more than a round moves by itself.",
               "ours faster": "faster in every round, by more than a round moves by itself.",
               "within noise": "the rounds disagree, so this run does not say which is faster."}[verdict])
    return "01.ours_vs_torch", verdict, text, {
        "ratio": ours.ratio, "ours_ms": ours.step_time.scaled(1e3), "torch_ms": ours.torch_step_time.scaled(1e3)}

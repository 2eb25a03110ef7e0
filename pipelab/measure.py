"""One way to time training steps on a rank, and one way to gather the ranks' times.

A step's time is read on every rank from just after a barrier (all ranks start together) to the
end of the step, GPU work included (`hardware.synchronize`). The first step warms up (allocator,
caches, lazy initialisation) and is dropped from the times when there are more. A step of the
whole job ends when its slowest rank is done, so the gathered time of a step is the slowest rank's,
and the typical step is the median over the timed steps: a typical step, not a lucky one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from pipelab.hardware import synchronize
from pipelab.timeline import Timeline, now

if TYPE_CHECKING:
    from pipelab.worker import RankContext


@dataclass
class RankSteps:
    """What one rank measured: every step's result, and the times and timelines of the timed ones."""

    results: list[Any]  # what `step` returned, every step (warm-up included)
    seconds: list[float]  # timed steps only
    timelines: list[Timeline] = field(repr=False)  # timed steps only, this rank's spans


def timed_slice(steps: int, warmup: int = 1) -> slice:
    """Which of `steps` steps are timed: all but the first `warmup`, unless that leaves none."""
    return slice(warmup, None) if steps > warmup else slice(None)


def time_steps(ctx: "RankContext", step: Callable[[int], Any], steps: int, prepare: Callable[[int], None] | None = None,
               warmup: int = 1) -> RankSteps:
    """Run `step(i)` for i in range(steps) on this rank and time each one.

    Each step: `prepare(i)` (e.g. zero the gradients; not timed), a barrier, a fresh timeline,
    the clock, the step, the GPU drained, the clock. The clock is the rank's (`ctx.now`): the
    logical clock on an emulated node, where a step lasts what the models give."""
    clock = getattr(ctx, "now", now)
    results, seconds, timelines = [], [], []
    for i in range(steps):
        if prepare is not None:
            prepare(i)
        ctx.barrier()  # every rank starts the step together, so a step time is the step's
        ctx.rec.clear()
        start = clock()
        results.append(step(i))
        synchronize(ctx.device)
        seconds.append(clock() - start)
        timelines.append(ctx.rec.timeline())
    timed = timed_slice(steps, warmup)
    return RankSteps(results, seconds[timed], timelines[timed])


@dataclass
class Steps:
    """The timed steps of all ranks, gathered."""

    seconds: list[float]  # per timed step: the slowest rank's time
    timelines: list[Timeline] = field(repr=False)  # per timed step: every rank's spans merged

    @property
    def step_time(self) -> "Measured":
        """Seconds of every timed step (the slowest rank's), as repeats: median and spread."""
        return Measured.of(self.seconds)

    @property
    def spread(self) -> tuple[float, float]:
        """(fastest, slowest) of the timed steps, seconds."""
        return min(self.seconds), max(self.seconds)

    @property
    def typical_index(self) -> int:
        """Index of the step whose merged timeline has the median makespan."""
        order = sorted(range(len(self.timelines)), key=lambda i: self.timelines[i].makespan)
        return order[(len(order) - 1) // 2]

    @property
    def typical(self) -> Timeline:
        """The timed step of median makespan, all ranks."""
        return self.timelines[self.typical_index]


class TimedSteps:
    """What every run made of timed steps (a `steps: Steps` field) shows: its step time as repeats
    (median and spread) and the typical step's timeline. Lesson run classes inherit it."""

    steps: Steps

    @property
    def step_time(self) -> "Measured":
        """Seconds of every timed step (the slowest rank's), as repeats: median and spread."""
        return self.steps.step_time

    @property
    def timeline(self) -> Timeline:
        """The typical timed step (median makespan), all ranks."""
        return self.steps.typical


def gather_steps(per_rank: Sequence[RankSteps]) -> Steps:
    """Line up the ranks' timed steps: slowest rank per step, merged timeline per step."""
    seconds = [max(step) for step in zip(*(r.seconds for r in per_rank))]
    timelines = [Timeline.merge(tls) for tls in zip(*(r.timelines for r in per_rank))]
    return Steps(seconds, timelines)


def median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of repeated measurements: a figure and how much it moved."""
    return statistics.median(values), min(values), max(values)


def best_of(runs: Mapping[Any, Callable[[], Any]], repeats: int, prepare: Callable[[], None] | None = None,
            warmup: int = 1) -> dict[Any, tuple[float, Any]]:
    """Time one-process runs in rounds; for each run its fastest time (s) and what that call returned.

    A run is a call that returns only once its work is done (worker threads and GPU included).
    `warmup` untimed rounds first (thread start, allocator); then each of `repeats` rounds calls
    every run once, after `prepare()` (not timed). On a machine whose load drifts, every run then
    sees the same drift, not just the one measured last; and the fastest of a run's repeats is the
    one least disturbed by whatever else the machine was doing."""
    for _ in range(warmup):
        for run in runs.values():
            if prepare is not None:
                prepare()
            run()
    best = {key: (float("inf"), None) for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            if prepare is not None:
                prepare()
            start = now()
            result = run()
            seconds = now() - start
            if seconds < best[key][0]:
                best[key] = (seconds, result)
    return best


@dataclass(frozen=True)
class Measured:
    """A figure measured several times: its median and how far the repeats spread (min to max).

    Lessons draw conclusions from the median and show the spread beside it, so one disturbed
    repeat on a busy machine moves neither the figure nor the sentence written from it."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values) -> "Measured":
        values = tuple(float(v) for v in values)
        if not values:
            raise ValueError("Measured.of needs at least one value; run the measurement at least once")
        return cls(values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def relative_spread(self) -> float:
        """(max - min) / median: 0.1 means the repeats moved 10 % around their median."""
        return (self.high - self.low) / abs(self.median) if self.median else float("inf")

    def scaled(self, factor: float) -> "Measured":
        """The same repeats in another unit (e.g. seconds to milliseconds)."""
        return Measured(tuple(v * factor for v in self.values))

    def __format__(self, spec: str) -> str:
        spec = spec or ".3g"
        low, high = format(self.low, spec), format(self.high, spec)
        if low == high:  # one repeat, or repeats that cannot vary (modelled time): one number
            return format(self.median, spec)
        return f"{self.median:{spec}} ({low}-{high})"

    def __str__(self) -> str:
        return format(self, "")


def spread_words(m: Measured, over: str = "the timed steps") -> str:
    """How a figure was summarised, for a sentence: "median, min-max over ..." where its repeats
    moved, "the same in each of ..." where they could not (modelled time)."""
    return f"median, min-max over {over}" if format(m, ".3g") != format(m.median, ".3g") else f"the same in each of {over}"


def compare(a: Measured, b: Measured) -> str:
    """'lower', 'higher' or 'within noise': how `a` stands against `b` on this run.

    A direction is claimed only when the two ranges of repeats do not overlap (every repeat of one
    beat every repeat of the other); otherwise the machine's noise is as large as the effect."""
    if a.high < b.low:
        return "lower"
    if a.low > b.high:
        return "higher"
    return "within noise"


# How far the median of a figure moved between whole runs of the course on a shared 2-core machine
# (`benchmarks/conclusions.py`: up to about 25 %). A difference of medians smaller than this is
# not one the next run would repeat.
RUN_TO_RUN_NOISE = 0.3


def compare_medians(a: Measured, b: Measured, margin: float = RUN_TO_RUN_NOISE) -> str:
    """'lower', 'higher' or 'within noise': how `a`'s median stands against `b`'s.

    A direction is claimed only when the medians differ by more than `margin` (a fraction of b's
    median). Use it where single repeats are too noisy for `compare` (a disturbed step widens a
    range) but the typical step shows an effect larger than the run-to-run noise."""
    if a.median < b.median * (1 - margin):
        return "lower"
    if a.median > b.median * (1 + margin):
        return "higher"
    return "within noise"


def ratios(a: Sequence[float], b: Sequence[float]) -> Measured:
    """Round-by-round ratios a[i] / b[i] of two measurements taken in alternation."""
    if len(a) != len(b):
        raise ValueError(f"ratios needs as many repeats of each side, got {len(a)} and {len(b)}")
    return Measured.of(x / y for x, y in zip(a, b))


def alternate(runs: Mapping[Any, Callable[[], float]], repeats: int, warmup: int = 1) -> dict[Any, list[float]]:
    """Call each run once per round, in turn (A B A B ...), for `repeats` rounds; each run returns
    its own figure (e.g. a step time). Returns every run's figures, one per round.

    A load that comes and goes on the machine then hits every side alike, so the per-round ratio
    (`ratios`) is steadier than a ratio of two figures measured minutes apart."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    figures: dict[Any, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            figures[key].append(float(run()))
    return figures

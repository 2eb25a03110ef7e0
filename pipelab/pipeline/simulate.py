"""The ideal timeline of a schedule under a cost model: no noise, no launch overheads.

Every rank runs its action list in order; an action starts when the rank is free and its inputs
exist (an input made on another rank arrives `transfer` later). The order comes from
`schedules.play`, the same sweep `validate` uses to rule out deadlocks. The result is the timeline
a perfect machine would draw, its makespan, its bubble, and how many micro-batches' activations
each rank keeps alive at once. With equal costs and free transfers GPipe's bubble is (p-1)/(m+p-1).
With activation checkpointing (`Costs.recompute`) every backward first runs its forward again: an
`R` span before each B (or I). Its pictures are in `pipelab.plots.schedules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipelab.checks import whole_number
from pipelab.pipeline.schedules import Action, Schedule, play, validate
from pipelab.timeline import Span, Timeline


@dataclass(frozen=True)
class Costs:
    """Cost units per action of one stage on one micro-batch (milliseconds when fitted to a run).

    A full backward B costs `backward_input + backward_weight`; a split one costs `backward_input`
    for its I and `backward_weight` for its W. With activation checkpointing, B (or I) first
    recomputes the forward, `recompute` more. `per_stage` may give some stages their own
    (forward, backward_input, backward_weight[, recompute]), e.g. a last stage that also computes
    the loss."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    transfer: float = 0.0  # from the end of an action to its result being usable on the next rank
    per_stage: dict[int, tuple[float, ...]] = field(default_factory=dict, compare=False)
    recompute: float = 0.0  # the forward a checkpointed backward runs again first (0: no checkpointing)

    def of(self, action: Action) -> float:
        """The cost of one action (its recompute included)."""
        return sum(cost for _, cost in self.parts(action))

    def parts(self, action: Action) -> list[tuple[str, float]]:
        """The (kind, cost) pieces an action runs, in order: a checkpointed B is R then B."""
        default = (self.forward, self.backward_input, self.backward_weight)
        fwd, b_in, b_w, *rest = self.per_stage.get(action.stage, default)
        recompute = rest[0] if rest else self.recompute
        cost = {"F": fwd, "B": b_in + b_w, "I": b_in, "W": b_w}[action.kind]
        if action.kind in ("B", "I") and recompute > 0:
            return [("R", recompute), (action.kind, cost)]
        return [(action.kind, cost)]

    def with_recompute(self) -> "Costs":
        """These costs with activation checkpointing: each backward first runs its forward again,
        costing what the forward costs."""
        stages = {s: (c[0], c[1], c[2], c[0]) for s, c in self.per_stage.items()}
        return replace(self, per_stage=stages, recompute=self.forward)

    @classmethod
    def from_timeline(cls, timeline: Timeline, per_stage: bool = False) -> "Costs":
        """Mean measured costs of a run's compute spans, for simulating it (transfers free); with
        `per_stage`, each stage gets its own means, so unequal stages show up too.

        The backward's two parts come from the I and W spans where the run has them; from a run
        with only full B's, B's cost is shared half and half, so that a B costs what it measured.
        A run with activation checkpointing has R spans: their mean is the recompute cost."""
        def means(spans: Timeline) -> tuple[float, ...]:
            def mean_ms(kind: str) -> float:
                d = [s.duration for s in spans.filter(kind=kind, lane="compute")]
                return 1e3 * sum(d) / len(d) if d else 0.0

            recompute = (mean_ms("R"),) if spans.filter(kind="R", lane="compute").spans else ()
            if spans.filter(kind="I", lane="compute").spans:
                return mean_ms("F"), mean_ms("I"), mean_ms("W"), *recompute
            return mean_ms("F"), mean_ms("B") / 2, mean_ms("B") / 2, *recompute

        stages = {}
        if per_stage:
            for stage in sorted({s.meta.get("stage") for s in timeline.filter(lane="compute")} - {None}):
                stages[stage] = means(Timeline([s for s in timeline if s.meta.get("stage") == stage]))
        forward, backward_input, backward_weight, *recompute = means(timeline)
        return cls(forward, backward_input, backward_weight, 0.0, stages, *recompute)


@dataclass
class SimResult:
    """What `simulate` found: the ideal timeline (seconds, like a measured one) and its figures."""

    schedule: Schedule
    costs: Costs
    timeline: Timeline
    makespan_ms: float
    bubble_fraction: float
    peak_stash: dict[int, int] = field(default_factory=dict)  # per rank: micro-batches stashed at once

    def row(self) -> dict:
        """The figures as one table row."""
        return {"schedule": self.schedule.name, "p": self.schedule.num_ranks,
                "m": self.schedule.num_microbatches, "makespan_ms": round(self.makespan_ms, 3),
                "bubble": round(self.bubble_fraction, 3), "peak_stash": max(self.peak_stash.values())}


def gpipe_bubble(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a fill-drain pipeline with equal stages: (p-1)/(v*m + p-1)."""
    p = whole_number("num_ranks", num_ranks, example="num_ranks=2")
    m = whole_number("num_microbatches", num_microbatches, example="num_microbatches=4")
    v = whole_number("stages_per_rank", stages_per_rank, example="stages_per_rank=1")
    return (p - 1) / (v * m + p - 1)


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Play `schedule` on an ideal machine with `costs`; return its timeline and figures."""
    costs = costs or Costs()
    validate(schedule)
    finish = finish_times(schedule, costs)
    spans = []
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            start = finish[a] - costs.of(a)
            for kind, cost in costs.parts(a):  # one span, or R then B for a checkpointed backward
                spans.append(Span(rank, "compute", kind, start / 1e3, (start + cost) / 1e3, a.mb, {"stage": a.stage}))
                start += cost
    timeline = Timeline(sorted(spans, key=lambda s: (s.start, s.rank)))
    return SimResult(schedule, costs, timeline, timeline.makespan * 1e3, timeline.bubble_fraction(),
                     peak_stash(schedule, timeline))


def finish_times(schedule: Schedule, costs: Costs) -> dict[Action, float]:
    """When each action ends (cost units): `play` the schedule; an action starts when its rank is free and
    its inputs have arrived (`transfer` later when they were made on another rank)."""
    finish: dict[Action, float] = {}
    free = [0.0] * schedule.num_ranks
    for rank, a, deps in play(schedule):
        arrived = [finish[d] + (costs.transfer if schedule.rank_of(d.stage) != rank else 0.0) for d in deps]
        finish[a] = max([free[rank], *arrived]) + costs.of(a)
        free[rank] = finish[a]
    return finish


def peak_stash(schedule: Schedule, timeline: Timeline) -> dict[int, int]:
    """Per rank, the most (stage, micro-batch) activations alive at once: from the start of its F
    to the end of the action that frees them (its B, or its W when the backward is split)."""
    peaks = {}
    for rank in range(schedule.num_ranks):
        events = []
        for s in timeline.filter(rank=rank):
            if s.kind == "F":
                events.append((s.start, 1))
            elif s.kind in ("B", "W"):
                events.append((s.end, -1))
        live = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # frees before allocs at a tie
            live += delta
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks

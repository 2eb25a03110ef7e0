"""The ideal timeline of a schedule under a cost model: no noise, no launch overheads.

Every rank runs its action list in order; an action starts when the rank is free and its inputs
exist (an input made on another rank arrives `transfer` later). The result is the timeline a
perfect machine would draw, its makespan, its bubble, and how many micro-batches' activations each
rank keeps alive at once. With equal costs and free transfers GPipe's bubble is (p-1)/(m+p-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelab.pipeline.schedules import Action, Schedule, dependencies, validate
from pipelab.timeline import Span, Timeline


@dataclass(frozen=True)
class Costs:
    """Milliseconds per action of one stage on one micro-batch.

    A schedule that does not split the backward runs B as one piece costing
    `backward_input + backward_weight`. `per_stage` may give some stages their own
    (forward, backward_input, backward_weight), e.g. a last stage that also computes the loss."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    transfer: float = 0.0  # from the end of an action to its result being usable on the next rank
    per_stage: dict[int, tuple[float, float, float]] = field(default_factory=dict, compare=False)

    def of(self, action: Action, split_backward: bool) -> float:
        """The cost of one action, in milliseconds."""
        fwd, b_in, b_w = self.per_stage.get(action.stage, (self.forward, self.backward_input, self.backward_weight))
        if action.kind == "F":
            return fwd
        if action.kind == "W":
            return b_w
        return b_in if split_backward else b_in + b_w

    @classmethod
    def from_timeline(cls, timeline: Timeline, split_backward: bool = False,
                      per_stage: bool = False) -> "Costs":
        """Mean measured costs of a run's F, B and W spans, for simulating it (transfers free);
        with `per_stage`, each stage gets its own means, so unequal stages show up too.

        From a run whose backward is not split, B's cost is shared half and half between
        `backward_input` and `backward_weight`, so that an unsplit B costs what it measured."""
        def means(spans: Timeline) -> tuple[float, float, float]:
            def mean_ms(kind: str) -> float:
                d = [s.duration for s in spans.filter(kind=kind, lane="compute")]
                return 1e3 * sum(d) / len(d) if d else 0.0

            fwd, bwd = mean_ms("F"), mean_ms("B")
            return (fwd, bwd, mean_ms("W")) if split_backward else (fwd, bwd / 2, bwd / 2)

        stages = {}
        if per_stage:
            for stage in sorted({s.meta.get("stage") for s in timeline.filter(lane="compute")} - {None}):
                stages[stage] = means(Timeline([s for s in timeline if s.meta.get("stage") == stage]))
        return cls(*means(timeline), 0.0, stages)


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
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Play `schedule` on an ideal machine with `costs`; return its timeline and figures."""
    costs = costs or Costs()
    validate(schedule)
    finish = _finish_times(schedule, costs)
    spans = []
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            end = finish[a]
            start = end - costs.of(a, schedule.split_backward)
            spans.append(Span(rank, "compute", a.kind, start / 1e3, end / 1e3, a.mb, {"stage": a.stage}))
    timeline = Timeline(sorted(spans, key=lambda s: (s.start, s.rank)))
    return SimResult(schedule, costs, timeline, timeline.makespan * 1e3, timeline.bubble_fraction(),
                     peak_stash(schedule, timeline))


def _finish_times(schedule: Schedule, costs: Costs) -> dict[Action, float]:
    """When each action ends: each rank in order, starting when free and when its inputs arrived."""
    finish: dict[Action, float] = {}
    free = [0.0] * schedule.num_ranks
    position = [0] * schedule.num_ranks
    pending = sum(len(a) for a in schedule.actions)
    while pending:  # sweep the ranks, advancing each as far as its inputs allow (validate: no deadlock)
        for rank, actions in enumerate(schedule.actions):
            while position[rank] < len(actions):
                a = actions[position[rank]]
                deps = dependencies(a, schedule.num_stages)
                if any(d not in finish for d in deps):
                    break
                ready = max([free[rank]] + [finish[d] + (costs.transfer if schedule.rank_of(d.stage) != rank else 0.0)
                                            for d in deps])
                finish[a] = ready + costs.of(a, schedule.split_backward)
                free[rank] = finish[a]
                position[rank] += 1
                pending -= 1
    return finish


def peak_stash(schedule: Schedule, timeline: Timeline) -> dict[int, int]:
    """Per rank, the most (stage, micro-batch) activations alive at once: from the start of F to
    the end of the backward that frees them (W when the backward is split, else B)."""
    frees = "W" if schedule.split_backward else "B"
    peaks = {}
    for rank in range(schedule.num_ranks):
        events = []
        for s in timeline.filter(rank=rank):
            if s.kind == "F":
                events.append((s.start, 1))
            elif s.kind == frees:
                events.append((s.end, -1))
        live = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # frees before allocs at a tie
            live += delta
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks


# ---------------------------------------------------------------------------------------------
# Showing results
# ---------------------------------------------------------------------------------------------

def format_table(rows: list[dict]) -> str:
    """Rows of figures (dicts with the same keys) as an aligned text table."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[str(k) for k in keys]] + [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def plot_measured_vs_simulated(measured: Timeline, simulated: SimResult, title: str = ""):
    """The measured timeline above the simulated one (costs fitted to the measurement), on one
    time axis, so the bubbles can be compared by eye."""
    import matplotlib.pyplot as plt

    from pipelab import plots

    rows = len(measured.rows()) + len(simulated.timeline.rows())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 1.0 + 0.45 * rows), sharex=True,
                                      height_ratios=[len(measured.rows()), len(simulated.timeline.rows())])
    plots.gantt(measured, ax=top, title=f"{title} measured: {measured.makespan * 1e3:.1f} ms, "
                f"bubble {measured.bubble_fraction():.2f}")
    plots.gantt(simulated.timeline, ax=bottom, title=f"{title} simulated: {simulated.makespan_ms:.1f} ms, "
                f"bubble {simulated.bubble_fraction:.2f}")
    top.set_xlabel("")
    fig.tight_layout()
    return fig


def draw_schedule(name: str = "1f1b", num_ranks: int = 4, num_microbatches: int = 8,
                  stages_per_rank: int = 2, backward_ratio: float = 2.0, weight_share: float = 0.5,
                  transfer_ratio: float = 0.0, ax=None):
    """Simulate a named schedule and draw it: the picture the schedule explorer redraws live.

    Costs are relative to a forward of the whole per-rank model (1 ms): the backward takes
    `backward_ratio` times that, `weight_share` of it being the weight gradient W, and a transfer
    `transfer_ratio` times a forward. An interleaved schedule's stages each do 1/v of the work."""
    from pipelab import plots
    from pipelab.pipeline.schedules import make_schedule

    schedule = make_schedule(name, num_ranks, num_microbatches, stages_per_rank)
    v = schedule.stages_per_rank
    backward = backward_ratio / v
    costs = Costs(forward=1.0 / v, backward_input=backward * (1 - weight_share),
                  backward_weight=backward * weight_share, transfer=transfer_ratio)
    sim = simulate(schedule, costs)
    title = (f"{schedule.name}, p={num_ranks}, m={num_microbatches}"
             + (f", v={v}" if v > 1 else "")
             + f": makespan {sim.makespan_ms:.1f} ms, bubble {sim.bubble_fraction:.2f}, "
             f"peak stash {max(sim.peak_stash.values())} micro-batch-stages")
    ax = plots.gantt(sim.timeline, ax=ax, title=title)
    return sim, ax

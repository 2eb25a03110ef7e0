"""Pictures of pipeline schedules (lesson 07, and lesson 06's measured-against-simulated view):
a schedule's ideal timeline from the simulator, a measured run above its simulation, two runs of
the same schedule on one time axis, and the bubbles of several schedules with their spread."""

from __future__ import annotations

from typing import Mapping

import matplotlib.pyplot as plt

from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, SimResult, simulate
from pipelab.plots import gantt, median_of
from pipelab.timeline import Timeline


def plot_measured_vs_simulated(measured: Timeline, simulated: SimResult, title: str = "", clock: str = "measured"):
    """The run's timeline above the simulated one (costs fitted to the run, in ms), on one time
    axis, so the bubbles can be compared by eye; `clock` says what timed the run ("modelled" on
    an emulated node)."""
    rows = len(measured.rows()) + len(simulated.timeline.rows())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 1.0 + 0.45 * rows), sharex=True,
                                      height_ratios=[len(measured.rows()), len(simulated.timeline.rows())])
    gantt(measured, ax=top, title=f"{title}, the run ({clock}): {measured.makespan * 1e3:.1f} ms, "
          f"bubble {measured.bubble_fraction():.2f}")
    top.set_xlabel("")
    gantt(simulated.timeline, ax=bottom, title=f"{title} simulated with the run's costs, free messages: "
          f"{simulated.makespan_ms:.1f} ms, bubble {simulated.bubble_fraction:.2f}", unit=f"ms, {clock} costs")
    fig.tight_layout()
    return fig


def plot_on_one_axis(timelines: Mapping[str, Timeline], unit: str = "ms"):
    """Timelines one above the other on one time axis (each from its own first span), e.g. ours
    and torch's run of one schedule: equal lengths in the picture are equal times."""
    heights = [max(1, len(tl.rows())) for tl in timelines.values()]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.2 * len(timelines) + 0.45 * sum(heights)),
                             sharex=True, height_ratios=heights, squeeze=False)
    for ax, (title, tl) in zip(axes[:, 0], timelines.items()):
        gantt(tl, ax=ax, title=f"{title}: {tl.makespan * 1e3:.1f} {unit}", unit=unit)
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    fig.tight_layout()
    return fig


def plot_bubbles(measured: Mapping, simulated: Mapping, ideal: Mapping[str, float] | None = None, ax=None,
                 title: str = "Bubble per schedule", clock: str = "measured"):
    """Per schedule: the measured bubble (median, bar from min to max of the repeats) beside the
    bubble simulated with this run's measured costs and, if given, the ideal one (equal costs).
    Values are `measure.Measured` or plain numbers."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    series = {clock: measured, f"simulated, {clock} costs": simulated}
    if ideal is not None:
        series["ideal (equal costs)"] = ideal
    names = list(measured)
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(names))]
        mid = [median_of(values[n]) for n in names]
        low = [m - getattr(values[n], "low", m) for n, m in zip(names, mid)]
        high = [getattr(values[n], "high", m) - m for n, m in zip(names, mid)]
        ax.bar(xs, mid, width=width, label=label, yerr=[low, high], capsize=3)
        top = max([top, *(m + h for m, h in zip(mid, high))]) if i else max(m + h for m, h in zip(mid, high))
    ax.set_ylim(0, 1.35 * top if top > 0 else 1)  # head room for the legend above the bars
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("schedule")
    ax.set_ylabel("bubble (idle fraction of compute)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", title="bars: median, min-max of repeats" if clock == "measured" else None,
              title_fontsize="small",
              loc="upper center", ncol=len(series))
    return ax


def draw_schedule(name: str = "1f1b", num_ranks: int = 4, num_microbatches: int = 8,
                  stages_per_rank: int = 2, backward_ratio: float = 2.0, weight_share: float = 0.5,
                  transfer_ratio: float = 0.0, ax=None):
    """Simulate a named schedule and draw it: the picture the schedule explorer redraws live.

    Costs are in cost units, relative to a forward of the whole per-rank model (1 unit): a full
    backward B takes `backward_ratio` times that, `weight_share` of it being the weight gradient W
    (the rest, I, is the input gradient), and a transfer `transfer_ratio` times a forward. An
    interleaved schedule's stages each do 1/v of the work. Returns the `SimResult` and the Axes."""
    schedule = make_schedule(name, num_ranks, num_microbatches, stages_per_rank)
    v = schedule.stages_per_rank
    backward = backward_ratio / v
    costs = Costs(forward=1.0 / v, backward_input=backward * (1 - weight_share),
                  backward_weight=backward * weight_share, transfer=transfer_ratio)
    sim = simulate(schedule, costs)
    title = (f"{schedule.name}, p={num_ranks}, m={num_microbatches}"
             + (f", v={v}" if v > 1 else "")
             + f": makespan {sim.makespan_ms:.1f} cost units, bubble {sim.bubble_fraction:.2f}, "
             f"peak stash {max(sim.peak_stash.values())} micro-batch-stages")
    ax = gantt(sim.timeline, ax=ax, title=title, unit="cost units")
    return sim, ax

"""Pictures of pipeline schedules (lesson 07, and lesson 06's measured-against-simulated view):
a schedule's ideal timeline from the simulator, and a measured run above its simulation."""

from __future__ import annotations

import matplotlib.pyplot as plt

from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, SimResult, simulate
from pipelab.plots import gantt
from pipelab.timeline import Timeline


def plot_measured_vs_simulated(measured: Timeline, simulated: SimResult, title: str = ""):
    """The measured timeline above the simulated one (costs fitted to the measurement), on one
    time axis, so the bubbles can be compared by eye."""
    rows = len(measured.rows()) + len(simulated.timeline.rows())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 1.0 + 0.45 * rows), sharex=True,
                                      height_ratios=[len(measured.rows()), len(simulated.timeline.rows())])
    gantt(measured, ax=top, title=f"{title} measured: {measured.makespan * 1e3:.1f} ms, "
          f"bubble {measured.bubble_fraction():.2f}")
    gantt(simulated.timeline, ax=bottom, title=f"{title} simulated: {simulated.makespan_ms:.1f} ms, "
          f"bubble {simulated.bubble_fraction:.2f}")
    top.set_xlabel("")
    fig.tight_layout()
    return fig


def draw_schedule(name: str = "1f1b", num_ranks: int = 4, num_microbatches: int = 8,
                  stages_per_rank: int = 2, backward_ratio: float = 2.0, weight_share: float = 0.5,
                  transfer_ratio: float = 0.0, ax=None):
    """Simulate a named schedule and draw it: the picture the schedule explorer redraws live.

    Costs are relative to a forward of the whole per-rank model (1 ms): a full backward B takes
    `backward_ratio` times that, `weight_share` of it being the weight gradient W (the rest, I, is
    the input gradient), and a transfer `transfer_ratio` times a forward. An interleaved schedule's
    stages each do 1/v of the work. Returns the `SimResult` and the Axes."""
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
    ax = gantt(sim.timeline, ax=ax, title=title)
    return sim, ax

"""Lesson 05's pictures: replicas that each span two devices, the three overlaps, and the step time
of each way to lay out the same processes (the grid itself is `plots.pipeline.draw_topology`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from pipelab.plots import gantt, kind_color

if TYPE_CHECKING:  # only for the annotations: plots do not import the experiments
    from pipelab.experiments.grid import GridRun
    from pipelab.experiments.hybrid import ReplicaRun
    from pipelab.measure import Measured


def draw_replicas(world_size: int = 2, ax=None):
    """Data parallelism over two-device replicas: each process holds seq1 on its device 0 and
    seq2, fc on its device 1; activations cross from device 0 to device 1 inside a process, and
    each half's gradients are averaged with the same half of every other process."""
    if ax is None:
        _, ax = plt.subplots(figsize=(3.2 * world_size + 2.5, 3.6))
    for r in range(world_size):
        x0 = r * 3.2
        ax.add_patch(Rectangle((x0 - 0.15, -0.2), 2.9, 2.9, fill=False, linestyle="--", edgecolor="grey"))
        ax.text(x0 + 1.3, 2.85, f"process {r}: batch slice {r}", ha="center", fontsize=9)
        for d, (y, what) in enumerate([(1.5, "seq1"), (0.1, "seq2, fc")]):
            ax.add_patch(Rectangle((x0, y), 2.6, 0.9, facecolor=kind_color("F"), alpha=0.85))
            ax.text(x0 + 1.3, y + 0.45, f"device {d}: {what}", ha="center", va="center", color="white", fontsize=9)
        ax.add_patch(FancyArrowPatch((x0 + 1.3, 1.5), (x0 + 1.3, 1.0), arrowstyle="->", mutation_scale=12))
        ax.text(x0 + 1.4, 1.22, "activations", fontsize=7, va="center")
        if r + 1 < world_size:  # this half's gradients, averaged with the next process's same half
            for y in (1.95, 0.55):
                ax.add_patch(FancyArrowPatch((x0 + 2.6, y), (x0 + 3.2, y), arrowstyle="<->", mutation_scale=12,
                                             color=kind_color("allreduce"), linewidth=3))
    span = 3.2 * (world_size - 1) + 2.6
    ax.set_xlim(-0.4, span + 0.3)
    ax.set_ylim(-0.4, 3.2)
    ax.axis("off")
    ax.set_title("Data parallelism over two-device replicas")
    ax.legend(handles=[Patch(facecolor=kind_color("F"), label="a half of the replica"),
                       Patch(facecolor=kind_color("allreduce"), label="all-reduce of that half's gradients")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return ax


def plot_replica_step(run: ReplicaRun, ax=None, title: str | None = None, longest_ms: float | None = None):
    """A typical step of every process: both devices' compute lanes and the all-reduce lane."""
    tl, k = run.timeline, run.steps.typical_index
    shown = f"timed step {k + 1} of {len(run.steps.seconds)}, {run.steps.seconds[k] * 1e3:.1f} ms"
    ax = gantt(tl, ax=ax, title=title or f"{run.name}: {shown} (median step {run.step_time.median * 1e3:.1f} ms)")
    if longest_ms is not None:
        ax.set_xlim(0, longest_ms * 1.02)
    return ax


def plot_overlaps(runs: Mapping[str, Mapping[str, Measured]], ax=None):
    """The lesson's shares of one kind of work hidden under another (run label -> what overlaps
    what -> share), one group of bars per kind, one bar per run: the median share over the timed
    steps, with the lowest and highest as the error bar."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(runs)
    kinds = list(next(iter(runs.values())))
    for i, (label, shares) in enumerate(runs.items()):
        figures = [shares[k] for k in kinds]
        xs = [k + (i - (len(runs) - 1) / 2) * width for k in range(len(kinds))]
        med = [100 * f.median for f in figures]
        err = [[100 * (f.median - f.low) for f in figures], [100 * (f.high - f.median) for f in figures]]
        ax.bar(xs, med, width=width, yerr=err, capsize=3, label=label)
    ax.set_xticks(range(len(kinds)), list(kinds))
    ax.set_ylim(0, 105)
    ax.set_xlabel("what overlaps what")
    ax.set_ylabel("share of the first hidden under the second (%)")
    ax.set_title("Three overlaps, median of the timed steps (bars: lowest to highest)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_layouts(runs: Sequence[GridRun], predicted_ms: dict[str, dict[str, float]] | None = None, ax=None):
    """Step time of each layout of the same processes: the median of the timed steps, the fastest
    and slowest as the error bar, and each prediction (name -> layout name -> ms) as a marker."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    names = [r.name for r in runs]
    times = [r.step_time.scaled(1e3) for r in runs]
    med = [t.median for t in times]
    err = [[t.median - t.low for t in times], [t.high - t.median for t in times]]
    clock = "modelled on the emulated node" if runs[0].node else "measured"
    ax.bar(range(len(runs)), med, yerr=None if runs[0].node else err, capsize=4, color=kind_color("compute"), alpha=0.8,
           label=clock)  # modelled time cannot vary: no error bar
    for (label, per_layout), marker in zip((predicted_ms or {}).items(), "D^sv"):
        ax.scatter(range(len(runs)), [per_layout[n] for n in names], marker=marker, zorder=3, s=45, label=label)
    ax.set_xticks(range(len(runs)), names, fontsize=8)
    ax.set_xlabel("layout of the processes (pipe x data)")
    ax.set_ylabel(f"step time (ms), {clock.split()[0]}")
    ax.set_title("Same processes, same batch: three layouts")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_grid_step(run: GridRun, ax=None):
    """A typical step of the grid, every process: its stages' F and B, its messages, and each
    stage's all-reduce over its data-parallel group on the comm lane."""
    tl = run.timeline
    clock = ", modelled" if run.node else ""
    title = (f"{run.name}, {run.schedule}: the median-length step, {tl.makespan * 1e3:.1f} ms{clock};\n"
             f"all-reduces' flight under some stage's compute: {run.overlap.scaled(100):.0f} %")
    return gantt(tl, ax=ax, title=title)

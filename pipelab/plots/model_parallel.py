"""Lessons 02-04's pictures: measured curves against split size (medians with min-max error
bars), the speedup against its bound, and a dual-stream timeline with its read-after-write
hazards outlined."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from pipelab.model_parallel import ideal_speedup
from pipelab.plots import gantt
from pipelab.timeline import Timeline

MARKERS = ("o", "s", "^", "D")  # one per line, so lines that meet stay apart


def _points(ax, xs: list, values: list, label: str, marker: str, **style):
    """Plain numbers as a line; `Measured` ones as their medians with min-max error bars."""
    if not all(hasattr(v, "median") for v in values):
        return ax.plot(xs, values, marker=marker, label=label, **style)
    med = [v.median for v in values]
    err = [[m - v.low for v, m in zip(values, med)], [v.high - m for v, m in zip(values, med)]]
    return ax.errorbar(xs, med, yerr=err, marker=marker, capsize=3, label=f"{label} (median, min-max)", **style)


def measured_curves(curves: dict, ax=None, xlabel: str = "split size (samples)", ylabel: str = "",
                    title: str = ""):
    """One line per entry of `curves` (label -> {x: Measured or number}): medians with error bars
    from the fastest to the slowest repeat. Markers differ and each further line is nudged
    sideways a little, so no line hides another where they meet."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for i, (label, points) in enumerate(curves.items()):
        xs = sorted(points)
        nudge = 1.0 + 0.04 * i  # log-x axes: a small factor
        _points(ax, [x * nudge for x in xs], [points[x] for x in xs], label, MARKERS[i % len(MARKERS)])
    ax.set_xscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    return ax


def speedup_curve(curves: dict, ax=None, this_run: tuple | None = None, batch: int | None = None):
    """Speedup over one device against split size: one line per entry of `curves` (label ->
    {split size: Measured}), or the curve of one variant of a split sweep (a `SplitSweep`).
    `this_run` (split size, speedup) marks one more measurement. With `batch`, the bound 2k/(k+1)
    of k = batch / split size splits on 2 devices is drawn dashed, and one device's 1x as a grey line."""
    if hasattr(curves, "speedup"):  # one variant of experiments.split_pipelining.split_sweep
        curves = {curves.variant: curves.speedup}
    ax = measured_curves(curves, ax, ylabel="speedup over one device (x)", title="speedup against split size")
    if batch is not None:
        sizes = sorted({s for points in curves.values() for s in points})
        ax.plot(sizes, [ideal_speedup(-(-batch // s)) for s in sizes], "k--", linewidth=1,
                label="bound 2k/(k+1), k splits")
        ax.axhline(1.0, color="grey", linewidth=0.8)
    if this_run is not None:
        _points(ax, [this_run[0]], [this_run[1]], "this run", "*", color="red", markersize=14, linestyle="none")
    ax.legend(fontsize="small")
    return ax


def hazard_gantt(timeline: Timeline, rank: int | str, hazards: Sequence[int], ax=None, title: str | None = None):
    """The timeline, with `rank`'s compute boxes of the splits in `hazards` outlined in red: the
    reads that started before their copy had landed (`model_parallel.raw_hazards`)."""
    ax = gantt(timeline, ax=ax, title=title)
    row = timeline.rows().index((rank, "compute"))
    for s in timeline.filter(rank=rank, lane="compute", kind="F"):
        if s.mb in hazards:
            ax.barh(row, s.duration * 1e3, left=(s.start - timeline.start) * 1e3, height=0.8, fill=False,
                    edgecolor="red", linewidth=2)
    kinds = ax.get_legend()
    handles = [*kinds.legend_handles, Patch(fill=False, edgecolor="red", linewidth=2)]
    labels = [*(t.get_text() for t in kinds.get_texts()), "read before its copy landed"]
    ax.legend(handles, labels, title="kind", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return ax


def forward_time_curves(run, modelled: bool = False, ax=None):
    """Lesson 04: forward time against split size with the copies in device 1's compute stream
    (lesson 03) and on a copy stream of their own (a `split_pipelining.SweepRun`), each curve's
    best split starred. Modelled times repeat exactly: drawn as plain numbers, not as ranges."""
    sweeps = {"lesson 03": run["pipelined"], "copy stream": run["dual_stream"]}
    labels = {"lesson 03": "copy in the compute stream (lesson 03)", "copy stream": "copy stream (lesson 04)"}
    clock = ", modelled" if modelled else ""
    ax = measured_curves({labels[k]: {s: m.median * 1e3 if modelled else m.scaled(1e3) for s, m in sweep.seconds.items()}
                          for k, sweep in sweeps.items()}, ax, ylabel=f"forward time (ms{clock})",
                         title="forward time against split size" + (" on the emulated node" if modelled else ""))
    for i, (name, sweep) in enumerate(sweeps.items()):
        best = sweep.best_split
        ms = sweep.seconds[best].median * 1e3
        ax.plot(best * (1.0 + 0.04 * i), ms, "*", color=f"C{i}", markeredgecolor="black", markersize=14, zorder=5,
                label=f"best, {name}: split {best} ({ms:.1f} ms{clock})")
    ax.set_xticks(run.split_sizes, [str(s) for s in run.split_sizes], minor=False)
    ax.minorticks_off()
    ax.legend(fontsize="small")
    return ax

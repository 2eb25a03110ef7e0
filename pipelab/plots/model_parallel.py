"""Lessons 02-04's pictures: the speedup of a split size against the sweep, and a dual-stream
timeline with its read-after-write hazards outlined."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from pipelab.plots import gantt
from pipelab.timeline import Timeline


def speedup_curve(sweep: dict, ax=None, this_run: tuple[int, float] | None = None):
    """Speedup over one device against split size, from a `split_sweep` result; `this_run`
    (split size, speedup) marks one more measurement on the curve."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.2))
    sizes = sorted(sweep["speedup"])
    ax.plot(sizes, [sweep["speedup"][s] for s in sizes], "o-", label="sweep")
    if this_run is not None:
        ax.plot([this_run[0]], [this_run[1]], "r*", markersize=14, label="this run")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="split size (samples)", ylabel="speedup over one device (x)",
           title="speedup against split size")
    ax.legend()
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

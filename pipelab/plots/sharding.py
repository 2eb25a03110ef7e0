"""Lesson 11's pictures: the bytes per rank of each ZeRO stage against the number of ranks
(measured beside the formula), and a ZeRO-3 step with prefetch on and off."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pipelab.plots import gantt

if TYPE_CHECKING:
    from pipelab.experiments.sharding import Run

PARTS = (("parameters", "#4C72B0"), ("gradients", "#55A868"), ("optimizer_state", "#DD8452"))


def plot_memory(runs: Sequence["Run"], variants: Sequence[str] = ("dp", "zero1", "zero2", "zero3"), ax=None):
    """Bytes per rank (the fullest rank) of each variant for each number of ranks: stacked bars of
    parameters, gradients and optimizer state as measured, a black tick at the formula's total."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(runs)
    for g, variant in enumerate(variants):
        for k, run in enumerate(runs):
            held = max(run[variant].held, key=lambda h: h.total)
            x, bottom = g + (k - (len(runs) - 1) / 2) * width, 0.0
            for part, color in PARTS:
                value = getattr(held, part) / 2**20
                ax.bar(x, value, width * 0.9, bottom=bottom, color=color, edgecolor="black", linewidth=0.4)
                bottom += value
            ax.plot([x - width * 0.45, x + width * 0.45], [run.formula(variant).total / 2**20] * 2, color="black", lw=2)
            ax.text(x, bottom, f"N={run.world_size}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels([runs[0][v].label for v in variants])
    ax.set_ylabel("bytes per rank (MiB)")
    ax.set_title("What each rank holds: measured (bars) and the formula (black tick)")
    handles = [Patch(facecolor=c, edgecolor="black", label=p.replace("_", " ")) for p, c in PARTS]
    handles.append(Line2D([], [], color="black", lw=2, label="formula"))
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    return ax


def plot_prefetch(run: "Run", axes=None, unit: str = "ms", ranks: Sequence[int] = (0, 1)):
    """A typical ZeRO-3 step with prefetch (top) and without (bottom), on one time scale: F and B
    per layer on the compute lane, all-gathers and reduce-scatters on the comm lane; `ranks` only."""
    steps = {"zero3": "prefetch on", "zero3_no_prefetch": "prefetch off"}
    timelines = {v: run[v].timeline.filter(rank=list(ranks)) for v in steps}
    if axes is None:
        rows = sum(len(tl.rows()) for tl in timelines.values())
        _, axes = plt.subplots(2, 1, figsize=(11, 0.55 * rows + 2.5), sharex=True)
    longest = max(tl.makespan for tl in timelines.values()) * 1e3
    where = f"emulated {run.node}" if run.node else "this machine"
    for ax, (variant, name) in zip(axes, steps.items()):
        tl = timelines[variant]
        gantt(tl, ax=ax, label_mb=False, unit=unit, title=f"ZeRO-3 on {run.world_size} ranks ({where}), {name}: "
                                                          f"a typical step, {tl.makespan * 1e3:.3g} {unit}")
        ax.set_xlim(0, longest * 1.02)
    return axes

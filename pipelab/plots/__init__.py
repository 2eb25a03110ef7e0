"""Pictures of timelines: Gantt charts, utilization bars, and simple x-y sweeps.

Every function draws on a matplotlib Axes (a new figure when none is given) and returns it, so a
notebook can put two timelines side by side with `fig, (a, b) = plt.subplots(1, 2)`.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from pipelab.timeline import Timeline

# Fixed colours for the kinds the course uses, so F is the same blue in every lesson.
KIND_COLORS = {
    "F": "#4C72B0", "B": "#55A868", "I": "#9BD3A4", "W": "#8172B2", "loss": "#CCB974",
    "allreduce": "#DD8452", "broadcast": "#C44E52", "send": "#937860", "recv": "#DA8BC3",
    "copy": "#EBC85E", "compute": "#4C72B0", "optimizer": "#64B5CD", "idle": "#DDDDDD",
    "held": "#BBBBBB",  # a device held back on purpose (lesson 04's race demonstration)
}
_EXTRA_COLORS = plt.get_cmap("tab20").colors


def kind_color(kind: str, _assigned: dict = {}) -> str:  # noqa: B006 - a deliberate memo
    """The colour of a kind: fixed for known kinds, stable per process for the others."""
    if kind in KIND_COLORS:
        return KIND_COLORS[kind]
    if kind not in _assigned:
        _assigned[kind] = _EXTRA_COLORS[len(_assigned) % len(_EXTRA_COLORS)]
    return _assigned[kind]


def row_label(rank, lane: str) -> str:
    who = f"rank {rank}" if isinstance(rank, int) else str(rank)
    return f"{who} · {lane}"


def gantt(timeline: Timeline, ax=None, title: str | None = None, origin: float | None = None,
          label_mb: bool = True, legend: bool = True):
    """A row per (rank, lane), a box per span coloured by kind, micro-batch numbers in the boxes.

    Time runs in milliseconds from `origin` (default: the timeline's first span), so two charts
    drawn with the same origin share an axis."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * max(2, len(timeline.rows())) + 1.2))
    origin = timeline.start if origin is None else origin
    rows = timeline.rows()
    y_of = {row: i for i, row in enumerate(rows)}
    for s in timeline:
        y = y_of[(s.rank, s.lane)]
        x0, width = (s.start - origin) * 1e3, s.duration * 1e3
        ax.barh(y, width, left=x0, height=0.8, color=kind_color(s.kind), edgecolor="black", linewidth=0.4)
        if label_mb and s.mb is not None:
            _label_box(ax, x0, width, y, str(s.mb), timeline.makespan * 1e3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row_label(r, l) for r, l in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first rank on top
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"Timeline: {timeline.makespan * 1e3:.1f} ms")
    if legend:
        kinds = sorted({s.kind for s in timeline}, key=lambda k: (k not in KIND_COLORS, list(KIND_COLORS).index(k) if k in KIND_COLORS else 0, k))
        handles = [Patch(facecolor=kind_color(k), edgecolor="black", label=k) for k in kinds]
        ax.legend(handles=handles, title="kind", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.grid(axis="x", alpha=0.3)
    return ax


def _label_box(ax, x0: float, width: float, y: float, text: str, total_ms: float) -> None:
    # Only label boxes wide enough to hold the number; a crowded chart stays readable.
    if total_ms > 0 and width / total_ms > 0.012 * len(text):
        ax.text(x0 + width / 2, y, text, ha="center", va="center", fontsize=7, color="white")


def utilization_bars(timeline: Timeline, lane: str = "compute", ax=None, title: str | None = None):
    """A bar per rank: the fraction of the step it was busy on `lane`, with the mean marked."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    util = timeline.utilization(lane)
    names = [f"rank {r}" if isinstance(r, int) else str(r) for r in util]
    ax.bar(names, [100 * u for u in util.values()], color=KIND_COLORS["compute"], label=f"busy on {lane}")
    if util:
        mean = 100 * sum(util.values()) / len(util)
        ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.0f}%")
    ax.set_ylim(0, 100)
    ax.set_ylabel("utilization (% of step)")
    ax.set_xlabel("rank / device")
    ax.set_title(title or f"Utilization of the {lane} lane")
    ax.legend(loc="lower right", fontsize="small")
    return ax


def sweep(x: Sequence[float], ys: dict[str, Sequence[float]], xlabel: str, ylabel: str, title: str,
          ax=None, logx: bool = False, logy: bool = False, mark_best: str | None = None,
          best: str = "min"):
    """Lines of y against x, one per entry of `ys`; optionally mark the best point of one line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for name, y in ys.items():
        ax.plot(x, y, marker="o", label=name)
    if mark_best is not None:
        y = list(ys[mark_best])
        i = y.index(min(y) if best == "min" else max(y))
        ax.scatter([x[i]], [y[i]], s=160, facecolors="none", edgecolors="red", linewidths=2, zorder=5,
                   label=f"best {mark_best}: {y[i]:.3g} at {x[i]:g}")
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax

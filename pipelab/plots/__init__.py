"""Pictures of timelines: Gantt charts, utilization bars, and simple x-y sweeps.

Every function draws on a matplotlib Axes (a new figure when none is given) and returns it, so a
notebook can put two timelines side by side with `fig, (a, b) = plt.subplots(1, 2)`.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from pipelab.timeline import Span, Timeline, complement, union

# Fixed colours for the kinds the course uses, so F is the same blue in every lesson.
KIND_COLORS = {
    "F": "#4C72B0", "B": "#55A868", "I": "#9BD3A4", "W": "#8172B2", "loss": "#CCB974",
    "allreduce": "#DD8452", "broadcast": "#C44E52", "send": "#937860", "recv": "#DA8BC3",
    "copy": "#EBC85E", "compute": "#4C72B0", "optimizer": "#64B5CD", "idle": "#DDDDDD",
    "held": "#BBBBBB",  # a device held back on purpose (lesson 04's race demonstration)
    "R": "#A1C9F4",  # a recomputed forward (activation checkpointing)
    "tied-allreduce": "#8B1A1A",  # lesson 08's ReduceTiedGrads, apart from F's blue and allreduce's orange
    "allgather": "#B07AA1", "reducescatter": "#E15759",  # lesson 11's halves of an all-reduce
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
          label_mb: bool = True, legend: bool = True, unit: str = "ms", label_stage: bool | None = None,
          mark_exposed: bool = True):
    """A row per (rank, lane), a box per span coloured by kind, micro-batch numbers in the boxes.

    Time runs from `origin` (default: the timeline's first span), so two charts drawn with the same
    origin share an axis. The timeline's seconds are drawn x1000: milliseconds for a measured run;
    a simulated one says `unit="cost units"`. `label_stage` writes each box as stage, kind,
    micro-batch ("2F0"), the default where a rank runs several stages (interleaved schedules).
    `mark_exposed` hatches the communication no compute of its rank hides (`exposed_spans`)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * max(2, len(timeline.rows())) + 1.2))
    origin = timeline.start if origin is None else origin
    rows = timeline.rows()
    y_of = {row: i for i, row in enumerate(rows)}
    if label_stage is None:
        label_stage = several_stages_per_rank(timeline)
    for s in timeline:
        y = y_of[(s.rank, s.lane)]
        x0, width = (s.start - origin) * 1e3, s.duration * 1e3
        ax.barh(y, width, left=x0, height=0.8, color=kind_color(s.kind), edgecolor="black", linewidth=0.4)
        if label_mb and s.mb is not None:
            text = f"{s.meta['stage']}{s.kind}{s.mb}" if label_stage and "stage" in s.meta else str(s.mb)
            _label_box(ax, x0, width, y, text, timeline.makespan * 1e3)
    exposed = exposed_spans(timeline) if mark_exposed else []
    for s in exposed:
        ax.barh(y_of[(s.rank, s.lane)], s.duration * 1e3, left=(s.start - origin) * 1e3, height=0.8,
                color="none", edgecolor=EXPOSED_STYLE["edgecolor"], hatch=EXPOSED_STYLE["hatch"], linewidth=0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row_label(r, l) for r, l in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first rank on top
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"Timeline: {timeline.makespan * 1e3:.1f} {unit}")
    if legend:
        kinds = sorted({s.kind for s in timeline}, key=lambda k: (k not in KIND_COLORS, list(KIND_COLORS).index(k) if k in KIND_COLORS else 0, k))
        handles = [Patch(facecolor=kind_color(k), edgecolor="black", label=k) for k in kinds]
        if exposed:
            handles.append(Patch(facecolor="white", label="exposed: no compute hides it", **EXPOSED_STYLE))
        heading = "kind (box: stage, kind, mb)" if label_stage and label_mb else "kind"
        ax.legend(handles=handles, title=heading, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.grid(axis="x", alpha=0.3)
    return ax


EXPOSED_STYLE = {"edgecolor": "#C00000", "hatch": "////"}


def several_stages_per_rank(timeline: Timeline) -> bool:
    """Whether some rank runs spans of more than one pipeline stage (an interleaved schedule)."""
    stages: dict = {}
    for s in timeline:
        if "stage" in s.meta:
            stages.setdefault(s.rank, set()).add(s.meta["stage"])
    return any(len(v) > 1 for v in stages.values())


def exposed_spans(timeline: Timeline, compute_lane: str = "compute") -> list[Span]:
    """The parts of every non-compute span (messages, all-reduces, copies) during which its rank
    computes nothing: the communication the step pays for in full, not hidden behind work.
    Ranks without a compute lane are left out (there is nothing to hide behind)."""
    busy = {r: union((s.start, s.end) for s in timeline.filter(rank=r, lane=compute_lane))
            for r in {s.rank for s in timeline.filter(lane=compute_lane)}}
    return [Span(s.rank, s.lane, s.kind, start, end, s.mb, s.meta)
            for s in timeline if s.lane != compute_lane and s.rank in busy
            for start, end in complement(busy[s.rank], [(s.start, s.end)])]


def _label_box(ax, x0: float, width: float, y: float, text: str, total_ms: float) -> None:
    # Only label boxes wide enough to hold the text; a crowded chart stays readable.
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


# Each line of a sweep gets its own marker and dash, drawn thinner and smaller than the one
# before it, so a line that lies on another still shows.
LINE_STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", (0, (5, 1, 1, 1)))]


def sweep(x: Sequence[float], ys: dict[str, Sequence], xlabel: str, ylabel: str, title: str,
          ax=None, logx: bool = False, logy: bool = False, mark_best: str | None = None,
          best: str = "min"):
    """Lines of y against x, one per entry of `ys`; optionally mark the best point of one line.

    A y value may be a `measure.Measured` (repeats of one point): the line goes through the
    medians and an error bar spans the repeats' min to max; the best point is the best median."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, y) in enumerate(ys.items()):
        marker, dash = LINE_STYLES[i % len(LINE_STYLES)]
        look = dict(marker=marker, linestyle=dash, label=name, linewidth=2.0 / (1 + 0.35 * i),
                    markersize=7.0 / (1 + 0.2 * i), zorder=3 + i)
        medians = [median_of(v) for v in y]
        if any(hasattr(v, "low") for v in y):
            low = [m - getattr(v, "low", m) for v, m in zip(y, medians)]
            high = [getattr(v, "high", m) - m for v, m in zip(y, medians)]
            ax.errorbar(x, medians, yerr=[low, high], capsize=3, **look)
        else:
            ax.plot(x, medians, **look)
    if mark_best is not None:
        y = [median_of(v) for v in ys[mark_best]]
        i = y.index(min(y) if best == "min" else max(y))
        ax.scatter([x[i]], [y[i]], s=160, facecolors="none", edgecolors="red", linewidths=2, zorder=20,
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


def median_of(value) -> float:
    """A plain number, or the median of a `Measured`."""
    return float(value.median) if hasattr(value, "median") else float(value)

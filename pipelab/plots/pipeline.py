"""Pictures of the pipeline lessons (06 to 08): the slots of a fill-drain picture, the stash over
a step, memory against time with and without activation checkpointing, stage costs per partition
method, and DeepSpeed's pipe x data process grid."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pipelab.pipeline.topology import ProcessTopology

if TYPE_CHECKING:  # only for the annotations: plots do not import the experiments
    from pipelab.experiments.pipeline import PipelineRun
    from pipelab.measure import Measured
    from pipelab.pipeline.schedules import Schedule
    from pipelab.pipeline.simulate import Costs


def mark_slots(ax, schedule: Schedule, costs: Costs) -> int:
    """Number the time slots on a simulated fill-drain (GPipe) picture with equal stages: m+p-1
    slots one forward long, then m+p-1 one backward long. Each rank works in m of each and idles
    in the other p-1: the bubble (p-1)/(m+p-1). Returns the number of slots per phase."""
    n = schedule.num_microbatches + schedule.num_ranks - 1
    forward, backward = costs.forward, costs.backward_input + costs.backward_weight
    edges = [i * forward for i in range(n + 1)] + [n * forward + i * backward for i in range(1, n + 1)]
    top = ax.get_xaxis_transform()  # x in the data's units, y as a fraction of the axes' height
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        if i % 2 == 0:
            ax.axvspan(lo, hi, color="grey", alpha=0.15, zorder=0, linewidth=0)
        ax.text((lo + hi) / 2, 1.01, str(i % n + 1), transform=top, ha="center", va="bottom", fontsize=8)
    ax.text(edges[0], 1.09, f"forward slots 1-{n}", transform=top, fontsize=8)
    ax.text(edges[n], 1.09, f"backward slots 1-{n}  (m+p-1 = {n} each)", transform=top, fontsize=8)
    ax.set_title(ax.get_title(), pad=26)
    return n


def plot_stash(run: PipelineRun, ax=None, in_bytes: bool = False, title: str | None = None):
    """Live stashed activations of each rank over the step (a count, or KiB), as measured."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    origin = run.timeline.start
    for rank, trace in sorted(run.stash_traces.items()):
        t = [(when - origin) * 1e3 for when, _, _ in trace]
        v = [b / 1024 if in_bytes else n for _, n, b in trace]
        ax.step(t, v, where="post", label=f"rank {rank} (peak {max(v):.0f})")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("stashed activations (KiB)" if in_bytes else "stashed micro-batches")
    how = ", recomputed in backward" if run.checkpoint else ""
    ax.set_title(title or f"{run.schedule.name}{how}, p={run.schedule.num_ranks}, m={run.schedule.num_microbatches}: "
                          "activations kept for backward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_stage_bars(per_method: dict[str, Sequence], ylabel: str, title: str, ax=None):
    """Grouped bars: for each stage, one bar per partition method (e.g. parameters or seconds).

    A value may be a `measure.Measured`: the bar is then its median and the error bar spans its
    repeats, min to max."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    num_stages = max(len(v) for v in per_method.values())
    width = 0.8 / len(per_method)
    for i, (method, values) in enumerate(per_method.items()):
        xs = [s + (i - (len(per_method) - 1) / 2) * width for s in range(len(values))]
        heights, errors = _medians_and_errors(values)
        ax.bar(xs, heights, width=width, label=method, yerr=errors, capsize=2 if errors else 0)
    ax.set_xticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    top = max(max(_high(v) for v in values) for values in per_method.values())
    ax.set_ylim(0, 1.45 * top if top > 0 else 1)  # head room for the legend above the bars
    ax.legend(title="partition method", fontsize="small", loc="upper center", ncol=2)
    return ax


# Colours of layer types in the per-layer bars: the two kinds whose weights behave differently.
LAYER_COLORS = {"Conv2d": "#C44E52", "Linear": "#4C72B0"}
OTHER_LAYER_COLOR = "#AAAAAA"


def plot_layer_bars(names: Sequence[str], values: Sequence, ylabel: str, title: str, ax=None):
    """A bar per layer coloured by its type (`Conv2d`, `Linear`, anything else), with a legend;
    `Measured` values get min-max error bars."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    colors = [LAYER_COLORS.get(name, OTHER_LAYER_COLOR) for name in names]
    heights, errors = _medians_and_errors(values)
    ax.bar(range(len(names)), heights, color=colors, yerr=errors, capsize=2 if errors else 0)
    ax.set_xticks(range(len(names)), [f"{i} {n}" for i, n in enumerate(names)], rotation=90, fontsize=7)
    ax.set(title=title, xlabel="layer", ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    kinds = [*LAYER_COLORS, "other"]
    ax.legend(handles=[Patch(color=LAYER_COLORS.get(k, OTHER_LAYER_COLOR), label=k) for k in kinds],
              fontsize="small", title="layer type")
    return ax


def _medians_and_errors(values: Sequence):
    """Bar heights, and for `Measured` values the distances down to the min and up to the max."""
    if not any(hasattr(v, "median") for v in values):
        return list(values), None
    medians = [getattr(v, "median", v) for v in values]
    down = [m - getattr(v, "low", m) for m, v in zip(medians, values)]
    up = [_high(v) - m for m, v in zip(medians, values)]
    return medians, [down, up]


def _high(value) -> float:
    return getattr(value, "high", value)


def draw_topology(topo: ProcessTopology, ax=None, title: str | None = None):
    """Draw a pipe x data grid: a box per rank (stage down, replica across), the pipe groups
    (activations and gradients flow down a column) and the data groups (gradients are averaged
    along a row)."""
    if topo.get_axis_names()[:2] != ["pipe", "data"]:
        raise ValueError(f"draw_topology draws pipe x data grids, got axes {topo.get_axis_names()}")
    P, D = topo.get_dim("pipe"), topo.get_dim("data")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.8 * D + 2.5, 1.3 * P + 1.2))
    for ranks in topo.get_axis_comm_lists("data"):
        if len(ranks) > 1:  # one row: the replicas of one stage
            y = topo.get_coord(ranks[0]).pipe
            ax.plot([0, D - 1], [y, y], color="#DD8452", linewidth=6, alpha=0.5, zorder=1)
    for ranks in topo.get_axis_comm_lists("pipe"):
        if len(ranks) > 1:  # one column: the stages of one replica
            x = topo.get_coord(ranks[0]).data
            ax.annotate("", xy=(x, P - 1), xytext=(x, 0), zorder=1,
                        arrowprops=dict(arrowstyle="->", color="#4C72B0", linewidth=2))
    for rank in range(topo.world_size()):
        c = topo.get_coord(rank)
        ax.text(c.data, c.pipe, f"rank {rank}\npipe={c.pipe} data={c.data}", ha="center", va="center",
                fontsize=9, zorder=2, bbox=dict(boxstyle="round", facecolor="white", edgecolor="black"))
    ax.set_xticks(range(D), [f"replica {d}" for d in range(D)])
    ax.set_yticks(range(P), [f"stage {p}" for p in range(P)])
    ax.set_xlim(-0.6, D - 0.4)
    ax.set_ylim(P - 0.5, -0.5)  # stage 0 on top
    ax.set_xlabel("data-parallel axis (replica index)")
    ax.set_ylabel("pipe axis (stage index)")
    ax.set_title(title or f"Process grid: pipe={P} x data={D} ({topo.world_size()} ranks, last axis fastest)")
    ax.legend(handles=[Line2D([], [], color="#4C72B0", linewidth=2, label="pipe group: send/recv"),
                       Line2D([], [], color="#DD8452", linewidth=6, alpha=0.5, label="data group: all-reduce")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return ax


def plot_memory_time_trade(points: dict[str, tuple[Measured, dict[int, float]]],
                           simulated_ms: dict[str, float] | None = None, ax=None, title: str | None = None,
                           xlabel: str | None = None, ylabel: str | None = None):
    """Peak stash against step time, one marker per way of running (e.g. activations stored or
    recomputed) and rank: `points[name] = (step time in ms as a Measured, {rank: peak stash in MiB})`.
    A bar spans the repeats' fastest to slowest step; a dotted line joins a rank's points.
    `simulated_ms` marks the simulator's step time of each way as a dashed vertical line; `xlabel`
    and `ylabel` say what the figures are where they are not measured (e.g. modelled)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    markers = "os^Dv"
    ranks = sorted({r for _, stash in points.values() for r in stash})
    for rank in ranks:
        xs = [time.median for time, stash in points.values() if rank in stash]
        ax.plot(xs, [stash[rank] for _, stash in points.values() if rank in stash], ":", color=f"C{rank}")
    for i, (name, (time, stash)) in enumerate(points.items()):
        for rank in sorted(stash):
            ax.errorbar([time.median], [stash[rank]], xerr=[[time.median - time.low], [time.high - time.median]],
                        fmt=markers[i % len(markers)], color=f"C{rank}", capsize=4, markersize=8,
                        label=f"{name}, rank {rank}")
    for i, (name, ms) in enumerate((simulated_ms or {}).items()):
        ax.axvline(ms, color="grey", linestyle="--", linewidth=1)
        ax.text(ms, 0.03, f"simulated, {name} ", transform=ax.get_xaxis_transform(), rotation=90,
                ha="right", va="bottom", fontsize=8, color="dimgrey")  # inside the axes, clear of the legend
    ax.set_xlabel(xlabel or "step time (ms): median, bar from fastest to slowest repeat")
    ax.set_ylabel(ylabel or "peak stashed activations (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Memory against time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax

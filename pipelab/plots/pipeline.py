"""Pictures of the pipeline lessons (06 to 08): the stash over a step, stage costs per partition
method, and DeepSpeed's pipe x data process grid."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from pipelab.pipeline.topology import ProcessTopology

if TYPE_CHECKING:  # only for the annotation: plots do not import the experiments
    from pipelab.experiments.pipeline import PipelineRun


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
    ax.set_title(title or f"{run.schedule.name}, p={run.schedule.num_ranks}, m={run.schedule.num_microbatches}: "
                          "activations kept for backward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_stage_bars(per_method: dict[str, Sequence[float]], ylabel: str, title: str, ax=None):
    """Grouped bars: for each stage, one bar per partition method (e.g. parameters or seconds)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    num_stages = max(len(v) for v in per_method.values())
    width = 0.8 / len(per_method)
    for i, (method, values) in enumerate(per_method.items()):
        xs = [s + (i - (len(per_method) - 1) / 2) * width for s in range(len(values))]
        ax.bar(xs, values, width=width, label=method)
    ax.set_xticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    top = max(max(v) for v in per_method.values())
    ax.set_ylim(0, 1.45 * top if top > 0 else 1)  # head room for the legend above the bars
    ax.legend(title="partition method", fontsize="small", loc="upper center", ncol=2)
    return ax


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

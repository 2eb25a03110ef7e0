"""Lesson 12's pictures: activation memory per rank against the formulas."""

from __future__ import annotations

import matplotlib.pyplot as plt


def plot_activation_memory(rows: list[dict], ax=None):
    """Bars per variant: activation bytes kept per rank (per s*b*h elements), measured beside our
    prediction (R + S/t, or (R + S)/t) and beside Korthikanti et al.'s 16-bit formula."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.6))
    series = ["measured (bytes/sbh)", "predicted (bytes/sbh)", "Korthikanti, 16-bit (bytes/sbh)"]
    width = 0.8 / len(series)
    for i, key in enumerate(series):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label=key.replace(" (bytes/sbh)", ""),
               hatch="//" if "Korthikanti" in key else None, alpha=0.9)
    ax.set_xticks(range(len(rows)), [r["variant"] for r in rows], rotation=15)
    ax.set_ylabel("bytes kept per s*b*h")
    ax.set_title("Activation memory per rank, one GPT block")
    ax.legend(fontsize="small")
    return ax


def draw_grid3d(groups: dict[str, list[list[int]]], ax=None):
    """The pipe x data x tensor processes: a row per pipeline stage, a column per (data replica,
    tensor shard); each tensor-parallel group boxed, each data-parallel group joined by a line,
    each pipeline (a column) joined by arrows from stage to stage."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    pipes, models = groups["pipe"], groups["model"]
    stages = len(pipes[0])
    columns = pipes  # each pipeline is one column: its processes by stage
    where = {rank: (c, s) for c, column in enumerate(columns) for s, rank in enumerate(column)}
    if ax is None:
        _, ax = plt.subplots(figsize=(1.5 * len(columns) + 2.5, 1.2 * stages + 1.6))
    for rank, (c, s) in where.items():
        ax.add_patch(Rectangle((c, -s), 0.8, 0.6, facecolor="#dbe9f6", edgecolor="black"))
        ax.text(c + 0.4, -s + 0.3, f"rank {rank}", ha="center", va="center", fontsize=8)
    for column in columns:
        for a, b in zip(column, column[1:]):
            (c, s), (_, t) = where[a], where[b]
            ax.add_patch(FancyArrowPatch((c + 0.4, -s), (c + 0.4, -t + 0.6), arrowstyle="->", mutation_scale=10))
    for group in models:  # tensor-parallel groups: neighbours in a row
        cs = sorted(where[r][0] for r in group)
        s = where[group[0]][1]
        ax.add_patch(Rectangle((cs[0] - 0.08, -s - 0.08), cs[-1] - cs[0] + 0.96, 0.76, fill=False,
                               edgecolor="tab:red", linewidth=2))
    shard_of = {r: i for group in models for i, r in enumerate(group)}
    for group in groups["data"]:  # one line per shard, above the row, each at its own height
        (c0, s), (c1, _) = where[group[0]], where[group[-1]]
        y = -s + 0.75 + 0.1 * shard_of[group[0]]
        ax.plot([c0 + 0.4, c1 + 0.4], [y, y], color="tab:green", linewidth=2, alpha=0.8)
        for c in (c0, c1):
            ax.plot([c + 0.4, c + 0.4], [-s + 0.6, y], color="tab:green", linewidth=1, alpha=0.8)
    for s in range(stages):
        ax.text(-0.15, -s + 0.3, f"stage {s}", ha="right", va="center", fontsize=9)
    ax.plot([], [], color="tab:red", linewidth=2, label="tensor group: shares every matrix (all-reduce per layer)")
    ax.plot([], [], color="tab:green", linewidth=2, label="data group: averages the stage's gradients")
    ax.plot([], [], color="black", marker=">", label="pipeline: activations down, gradients up")
    ax.set_xlim(-1.0, len(columns) + 0.1)
    ax.set_ylim(-stages + 0.5, 2.2)
    ax.axis("off")
    ax.set_title("pipe x data x tensor: which processes talk in which group")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 1.02), fontsize="small", ncol=1, frameon=False)
    return ax

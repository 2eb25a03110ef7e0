"""Lesson 01's pictures: the idea of data parallelism and buckets, the timelines of a typical step
of each wrapper, each bucket's all-reduce against the cost model, and the bucket-size sweep."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from pipelab.display import human_bytes
from pipelab.plots import gantt, kind_color, sweep
from pipelab.plots.collectives import plain_log_ticks

if TYPE_CHECKING:
    from pipelab.experiments.bucket_sweep import SweepPoint
    from pipelab.experiments.ddp import DDPRun


def draw_idea(world_size: int = 2, axes=None):
    """The lesson in one picture: replicas that all-reduce their gradients (left), and why
    buckets help (right: naive sends after backward, bucketed sends during it)."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [1, 1.4]})
    left, right = axes
    for r in range(world_size):
        x0 = r * 3.0
        left.add_patch(Rectangle((x0, 1.6), 2.4, 1.0, facecolor="#4C72B0", alpha=0.85))
        left.text(x0 + 1.2, 2.1, f"rank {r}\nreplica of the model", ha="center", va="center", color="white", fontsize=9)
        left.text(x0 + 1.2, 3.0, f"batch slice {r}", ha="center", va="center", fontsize=9)
        left.add_patch(FancyArrowPatch((x0 + 1.2, 2.85), (x0 + 1.2, 2.65), arrowstyle="->", mutation_scale=12))
        left.add_patch(Rectangle((x0 + 0.3, 0.4), 1.8, 0.6, facecolor=kind_color("B")))
        left.text(x0 + 1.2, 0.7, f"gradients g{r}", ha="center", va="center", fontsize=9)
        left.add_patch(FancyArrowPatch((x0 + 1.2, 1.6), (x0 + 1.2, 1.0), arrowstyle="->", mutation_scale=12))
    span = 3.0 * (world_size - 1) + 2.4
    left.add_patch(Rectangle((0, -0.6), span, 0.5, facecolor=kind_color("allreduce")))
    total = " + ".join(f"g{r}" for r in range(world_size)) if world_size <= 3 else f"g0 + ... + g{world_size - 1}"
    left.text(span / 2, -0.35, f"all-reduce: every rank gets ({total}) / {world_size}", ha="center",
              va="center", fontsize=9)
    for r in range(world_size):
        left.add_patch(FancyArrowPatch((r * 3.0 + 1.2, 0.4), (r * 3.0 + 1.2, -0.1), arrowstyle="<->",
                                       mutation_scale=12))
    left.set_xlim(-0.3, span + 0.3)
    left.set_ylim(-0.9, 3.4)
    left.axis("off")
    left.set_title("Data parallelism: same model, different data, averaged gradients")
    _draw_schedule_sketch(right)
    right.legend(handles=[Patch(facecolor=kind_color(k), label=lbl) for k, lbl in
                          [("F", "forward"), ("B", "backward of one layer"), ("allreduce", "all-reduce")]],
                 loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return axes


def _draw_schedule_sketch(ax) -> None:
    """Naive vs bucketed on one rank, with made-up unit costs: 4 layers, 2 buckets."""
    layers, b, comm = 4, 1.0, 1.6
    rows = {"naive · compute": 0, "naive · comm": 1, "bucketed · compute": 2.6, "bucketed · comm": 3.6}
    for who in ("naive", "bucketed"):
        ax.barh(rows[f"{who} · compute"], 2, left=0, color=kind_color("F"), edgecolor="black")
        for i in range(layers):
            ax.barh(rows[f"{who} · compute"], b, left=2 + i * b, color=kind_color("B"), edgecolor="black")
    end = 2 + layers * b
    ax.barh(rows["naive · comm"], 2 * comm, left=end, color=kind_color("allreduce"), edgecolor="black")
    ax.barh(rows["bucketed · comm"], comm, left=2 + 2 * b, color=kind_color("allreduce"), edgecolor="black")
    ax.barh(rows["bucketed · comm"], comm, left=max(end, 2 + 2 * b + comm), color=kind_color("allreduce"),
            edgecolor="black")
    ax.text(end + 2 * comm + 0.1, rows["naive · comm"], "step ends", va="center", fontsize=8)
    ax.text(max(end, 2 + 2 * b + comm) + comm + 0.1, rows["bucketed · comm"], "step ends", va="center", fontsize=8)
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels(list(rows))
    ax.set_ylim(4.2, -0.6)
    ax.set_xlim(0, end + 2 * comm + 1.6)
    ax.set_xlabel("time (arbitrary units)")
    ax.set_title("Why buckets: send the last layers' gradients while backward goes on")
    ax.grid(axis="x", alpha=0.3)


def plot_timelines(runs: dict[str, DDPRun], variants: Sequence[str] = ("naive", "bucketed"), axes=None):
    """Gantt charts of a typical step of each variant, side by side, on one time scale."""
    if axes is None:
        _, axes = plt.subplots(1, len(variants), figsize=(7 * len(variants), 3.6), squeeze=False)
        axes = axes[0]
    longest = max(runs[v].timeline.makespan for v in variants) * 1e3
    for ax, v in zip(axes, variants):
        run = runs[v]
        clock = ", modelled" if getattr(run, "node", None) else ""
        title = (f"{v}: a typical step, {run.timeline.makespan * 1e3:.1f} ms{clock}\n"
                 f"median over steps: {run.overlap.median:.0%} of all-reduce time hidden behind compute")
        gantt(run.timeline, ax=ax, title=title, legend=ax is axes[-1])
        ax.set_xlim(0, longest * 1.02)
    return axes


def plot_sweep(points: list[SweepPoint], axes=None):
    """Step time (ours and torch's) and overlap against bucket size: medians over every timed step
    with min-max error bars, the fastest median marked."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 3.8))
    caps = [p.bucket_cap_mb for p in points]
    times = {"BucketedDDP (ours)": [p.step_time.scaled(1e3) for p in points]}
    if all(p.torch_step_time is not None for p in points):
        times["torch DistributedDataParallel"] = [p.torch_step_time.scaled(1e3) for p in points]
    modelled = getattr(points[0], "node", None) is not None
    sweep(caps, times, "bucket_cap_mb (MiB of the small model's gradients, log scale)",
          "step time (ms, modelled)" if modelled else "step time (ms; median, min-max)",
          "Step time against bucket size" + (" on the emulated node" if modelled else ""), ax=axes[0], logx=True,
          mark_best="BucketedDDP (ours)")
    sweep(caps, {"BucketedDDP (ours)": [p.overlap.scaled(100) for p in points]},
          "bucket_cap_mb (MiB of the small model's gradients, log scale)",
          "all-reduce time hidden behind compute (%)", "Overlap against bucket size", ax=axes[1], logx=True)
    axes[1].set_ylim(0, 100)
    for ax in axes:
        top = ax.secondary_xaxis("top", functions=(lambda v: v, lambda v: v))
        top.set_xticks(caps)
        top.set_xticklabels([str(p.num_buckets) for p in points], fontsize=7)
        top.set_xlabel("number of buckets", fontsize=8)
    return axes


def plot_bucket_times(buckets, predicted: Sequence[float], measured: Sequence, ax=None, bytes_scale: float = 1.0,
                      modelled: bool = False):
    """Each bucket's all-reduce: the ring cost model's time beside the launch-to-arrival spans
    (median, min-max over steps and ranks), log scale. On an emulated node (`modelled`) the spans
    are modelled and each bucket is labelled with both sizes: modelled (`bytes_scale` times) and real."""
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(buckets) + 2), 4.2))
    x = np.arange(len(buckets))
    ax.bar(x - 0.2, [p * 1e3 for p in predicted], width=0.4, color="white", edgecolor="black", hatch="..",
           label="predicted: ring cost model (lesson 00) with this run's latency and bandwidth")
    mid = np.array([m.median for m in measured]) * 1e3
    low, high = np.array([m.low for m in measured]) * 1e3, np.array([m.high for m in measured]) * 1e3
    ax.bar(x + 0.2, mid, width=0.4, color=kind_color("allreduce"), edgecolor="black",
           yerr=[mid - low, high - mid], capsize=3, label="modelled on the emulated node: launch to arrival" if modelled
           else "measured: launch to arrival (median, min-max)")
    ax.set_xticks(x)
    sizes = [human_bytes(b.nbytes * bytes_scale) + (f" modelled\n({human_bytes(b.nbytes)} real)" if bytes_scale != 1
                                                     else "") for b in buckets]
    ax.set_xticklabels([f"bucket {b.index}\n{size}" for b, size in zip(buckets, sizes)], fontsize="small")
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(predicted) * 1e3 / 2, top=max(high.max(), max(predicted) * 1e3) * 4)
    ax.set_ylabel("all-reduce time (ms, log scale)")
    ax.set_title("Each bucket's all-reduce: predicted and " + ("modelled" if modelled else "measured"))
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize="small", loc="upper center")
    plain_log_ticks(ax)
    return ax

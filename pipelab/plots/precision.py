"""Lesson 16's pictures: the training curves of fp32, bf16 and fp16 side by side (with fp16's loss
scale), the small-gradient model, bytes per parameter by ZeRO stage, and FP8's scaling over steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from pipelab.experiments.precision import Curve


def plot_curves(runs: dict[str, "Curve"], title: str = "Loss by step: fp32, bf16 and fp16 from the same weights"):
    """Left: every recipe's loss by step. Right: fp16's loss scale by step, skipped steps marked."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    styles = ["-", "--", ":", "-.", (0, (1, 3))]
    for (recipe, curve), style in zip(runs.items(), styles):
        left.plot(range(len(curve.losses)), curve.losses, linestyle=style, lw=2, label=recipe)
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("loss (MSE, log scale)")
    left.set_title(title)
    left.legend()
    scaled = {r: c for r, c in runs.items() if c.scales}
    for (recipe, curve), style in zip(scaled.items(), ["-", "--"]):
        right.plot(range(len(curve.scales)), curve.scales, linestyle=style, lw=2, label=recipe)
        right.scatter(curve.skipped, [curve.scales[s] for s in curve.skipped], marker="x", s=60,
                      label=f"{recipe}: step skipped (inf/nan)")
    right.set_yscale("log", base=2)
    right.set_xlabel("step")
    right.set_ylabel("loss scale")
    right.set_title("fp16's dynamic loss scale: halved on overflow, doubled after good steps")
    if scaled:
        right.legend(fontsize=8)
    return fig


def plot_zero_memory(rows: list[dict]):
    """Bytes per parameter per rank (the fullest rank) by ZeRO stage in mixed precision, counted
    (bars) and the formula (black tick), for each number of ranks."""
    fig, ax = plt.subplots(figsize=(9, 4))
    sizes = sorted({r["ranks"] for r in rows})
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    width = 0.8 / len(sizes)
    for k, n in enumerate(sizes):
        mine = [r for r in rows if r["ranks"] == n]
        xs = [g + (k - (len(sizes) - 1) / 2) * width for g in range(len(stages))]
        ax.bar(xs, [r["counted B/param"] for r in mine], width * 0.9, label=f"counted, N={n}", edgecolor="black")
        for x, r in zip(xs, mine):
            ax.plot([x - width * 0.45, x + width * 0.45], [r["formula B/param"]] * 2, color="black", lw=2)
    ax.set_xticks(range(len(stages)))
    ax.set_xticklabels(stages)
    ax.set_ylabel("bytes per parameter, per rank")
    ax.set_title("Mixed precision (bf16 + fp32 master + Adam): counted from storages (bars), 2 + 2 + 12 formula (tick)")
    ax.legend()
    return fig


def plot_fp8_scaling(rows: list[dict]):
    """Per step: the tensor's amax (left) and its FP8 round trip's error with current and delayed
    scaling (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6))
    steps = [r["step"] for r in rows]
    left.plot(steps, [r["amax"] for r in rows], marker="o")
    left.set_xlabel("step")
    left.set_ylabel("amax (largest |value|)")
    left.set_title("The tensor's amax, step by step")
    for name, style in (("current", "-"), ("delayed", "--")):
        right.plot(steps, [r[f"{name} error"] for r in rows], linestyle=style, marker="o", label=f"{name} scaling")
    right.set_yscale("log")
    right.set_xlabel("step")
    right.set_ylabel("relative error of the e4m3 round trip")
    right.set_title("Current vs delayed per-tensor scaling")
    right.legend()
    return fig

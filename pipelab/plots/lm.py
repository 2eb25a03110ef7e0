"""Lesson 10's pictures: the perplexity over training, and the loss at two learning rates against
ln(vocab), guessing evenly."""

from __future__ import annotations

import math
from typing import Sequence

import matplotlib.pyplot as plt


def perplexity_curve(curve: Sequence[tuple[int, float, float]], vocab_size: int, title: str, ax=None):
    """Train and valid perplexity at each log line (`LMRun.curve`), beside guessing uniformly."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    steps, train_ppl, valid_ppl = zip(*curve)
    ax.plot(steps, train_ppl, "o-", label="train (mean over the interval)")
    ax.plot(steps, valid_ppl, "s-", label="valid (whole validation split)")
    ax.axhline(vocab_size, color="grey", ls="--", label=f"guessing uniformly ({vocab_size:,} words)")
    ax.set(yscale="log", xlabel="training step", ylabel="perplexity", title=title)
    ax.legend()
    return ax


def lr_curves(by_rate: dict[float, list[float]], vocab_size: int, title: str, ax=None):
    """The training loss per step at each rate, the last half of the steps (what the verdict reads)
    shaded, and ln(vocab); the legend beside the axes, so it covers no line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    steps = max(len(losses) for losses in by_rate.values())
    ax.axvspan(steps // 2 + 0.5, steps + 0.5, color="0.93", label="the steps the conclusion reads")
    for rate, losses in by_rate.items():
        ax.plot(range(1, len(losses) + 1), losses, "o-", label=f"lr {rate}")
    guess = math.log(vocab_size)
    ax.axhline(guess, color="grey", ls="--", label=f"ln(vocab) = {guess:.2f}: guessing evenly")
    ax.set(xlabel="step", ylabel="training loss (nats per token)", title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.figure.tight_layout()
    return ax

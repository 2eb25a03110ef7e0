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

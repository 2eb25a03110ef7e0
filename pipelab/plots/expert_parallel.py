"""Lesson 15's pictures: tokens per expert, and the capacity factor's trade."""

from __future__ import annotations

import matplotlib.pyplot as plt


def plot_load(loads: dict[str, list], ax=None):
    """Bars per expert: tokens routed to it, for each named load (e.g. before / after training)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    names = list(loads)
    experts = len(next(iter(loads.values())))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [e + (i - (len(names) - 1) / 2) * width for e in range(experts)]
        ax.bar(xs, [int(v) for v in loads[name]], width, label=name)
    mean = sum(int(v) for v in loads[names[0]]) / experts
    ax.axhline(mean, color="black", linestyle=":", linewidth=1, label="even load")
    ax.set_xticks(range(experts), [f"expert {e}" for e in range(experts)])
    ax.set_ylabel("tokens routed (all ranks)")
    ax.set_title("Tokens per expert")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # beside: covers no bar
    return ax


def plot_capacity_sweep(rows: list[dict], ax=None):
    """Dropped assignments (left axis) and the modelled step (right axis) against the capacity factor."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    factors = [r["capacity factor"] for r in rows]
    ax.plot(factors, [r["dropped (%)"] for r in rows], "o-", color="tab:red", label="dropped assignments")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("dropped assignments (%)", color="tab:red")
    right = ax.twinx()
    right.plot(factors, [r["modelled step (ms)"] for r in rows], "s--", color="tab:blue", label="modelled step")
    right.set_ylabel("modelled step on the emulated node (ms)", color="tab:blue")
    ax.set_title("Capacity: dropped tokens against step time (modelled)")
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize="small", loc="center right")
    return ax

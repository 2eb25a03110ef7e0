"""Lesson 14's pictures: a causal ring pass with contiguous and zig-zag shards, and the modelled
ring step (attention beside K/V passing) as the ring grows."""

from __future__ import annotations

import matplotlib.pyplot as plt

from pipelab.plots import gantt


def layout_timelines(run, axes=None):
    """The last timed causal forward+backward, contiguous above zig-zag, on one time axis (measured)."""
    if axes is None:
        rows = len(run.timelines["contiguous"].rows())
        _, axes = plt.subplots(2, 1, figsize=(10, 1.2 * rows + 2.5), sharex=True)
    for ax, name in zip(axes, ("contiguous", "zigzag")):
        tl = run.timelines[name]
        gantt(tl.shifted(), ax=ax, label_mb=False,
              title=f"causal ring pass, {name} shards (measured; slowest rank's pass {run.step_time[name].median * 1e3:.0f} ms median)")
    return axes


def overlap_bars(rows: list[dict], ax=None):
    """Per ring size: modelled attention per ring step beside the K/V passing it must hide (log scale)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["attention fwd+bwd (ms)"] for r in rows], 0.4, label="attention (compute)")
    ax.bar([x + 0.2 for x in xs], [r["K/V passing fwd+bwd (ms)"] for r in rows], 0.4, label="K/V passing (comm)",
           hatch="//")
    ax.set_xticks(list(xs), [f"n={r['ranks']}\n{r['link']}" for r in rows], fontsize="small")
    ax.set_yscale("log")
    ax.set_ylabel("ms per ring step (modelled)")
    ax.set_title("One ring step of a 7B-sized attention layer at 128K tokens, H100s (modelled)")
    ax.legend(fontsize="small")
    return ax

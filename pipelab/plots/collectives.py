"""Lesson 00's pictures: latency and bandwidth against message size, the ring all-reduce step by
step, and the all-reduce's measured time beside its cost model."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, NullFormatter

from pipelab.collectives import AllReduceTime, MessageTime, ring_all_reduce_time, ring_schedule
from pipelab.plots import sweep


def plot_ping_pong(rows: list[MessageTime], latency: float, bandwidth: float, axes=None, modelled: bool = False):
    """One-way time and bandwidth against message size (log-log; median and min-max over rounds),
    with the fitted model `latency + bytes / bandwidth` drawn through them."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    sizes = [r.bytes for r in rows]
    smooth = np.geomspace(min(sizes), max(sizes), 100)
    model = latency + smooth / bandwidth
    left, right = axes
    sweep(sizes, {("modelled on the emulated node" if modelled else "measured (median, min-max over rounds)"):
               [r.one_way.scaled(1e6) for r in rows]},
          "message size (bytes, log scale)", "one-way time (µs, log scale)", "Time of one message",
          ax=left, logx=True, logy=True)
    left.plot(smooth, model * 1e6, "--", color="black",
              label=f"model: {latency * 1e6:.2f} µs + bytes / {bandwidth / 1e9:.3g} GB/s")
    sweep(sizes, {f"{'modelled' if modelled else 'measured'}: bytes / one-way time": [r.bandwidth.scaled(1e-6) for r in rows]},
          "message size (bytes, log scale)", "bandwidth (MB/s, log scale)", "Bandwidth of one message",
          ax=right, logx=True, logy=True)
    right.plot(smooth, smooth / model / 1e6, "--", color="black", label="model")
    right.axhline(bandwidth / 1e6, color="grey", linewidth=0.8, label=f"fitted bandwidth {bandwidth / 1e9:.3g} GB/s")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
        plain_log_ticks(ax)
    return axes


def plain_log_ticks(ax) -> None:
    """A log y axis labelled in plain numbers ("4", "20", not "4×10⁰"): within a decade or so the
    minor ticks carry the labels, over wider ranges only the decades do."""
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    low, high = ax.get_ylim()
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}") if high / low < 20 else NullFormatter())


def ring_states(world_size: int) -> list[tuple[str, list[list[set]], list[int] | None]]:
    """Replay `ring_schedule`: at the start and after each step, (title, held, received) where
    held[rank][chunk] is the set of ranks whose values that chunk holds, and received[rank] the
    chunk the rank just got from its left neighbour."""
    n = world_size
    held = [[{r} for _ in range(n)] for r in range(n)]
    states = [("start: each rank its own tensor", [[set(c) for c in row] for row in held], None)]
    for step, plan in enumerate(ring_schedule(n)):
        reducing = step < n - 1
        sent = [set(held[r][send]) for r, (send, _) in enumerate(plan)]
        for r, (_, recv) in enumerate(plan):
            incoming = sent[(r - 1) % n]
            held[r][recv] = held[r][recv] | incoming if reducing else incoming  # add, or replace
        title = f"step {step + 1} ({'reduce-scatter' if reducing else 'all-gather'})"
        states.append((title, [[set(c) for c in row] for row in held], [recv for _, recv in plan]))
    return states


def draw_ring(world_size: int = 4, ax=None):
    """The ring all-reduce on `world_size` ranks, step by step (`ring_states`): a row per rank, a
    cell per chunk, labelled with the ranks whose values it holds (Σ: all), darker the more it
    holds; the chunk just received is outlined (green: added, blue: copied)."""
    n = world_size
    states = ring_states(n)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.6 * n * len(states) + 1, 0.5 * n + 1.6))
    for col, (title, held, received) in enumerate(states):
        x0 = col * (n + 1)
        for r in range(n):
            for c in range(n):
                shade = plt.cm.Oranges(0.15 + 0.75 * len(held[r][c]) / n)
                ax.add_patch(Rectangle((x0 + c, r), 1, 1, facecolor=shade, edgecolor="white"))
                label = "Σ" if len(held[r][c]) == n else "+".join(str(i) for i in sorted(held[r][c]))
                ax.text(x0 + c + 0.5, r + 0.5, label, ha="center", va="center", fontsize=7,
                        color="white" if len(held[r][c]) > n / 2 else "black")
            if received is not None:
                added = col <= n - 1
                ax.add_patch(Rectangle((x0 + received[r], r), 1, 1, fill=False, linewidth=2,
                                       edgecolor="green" if added else "royalblue"))
        ax.text(x0 + n / 2, -0.3, title, ha="center", va="bottom", fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(n)])
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xticks([])
    ax.set_xlim(-0.2, len(states) * (n + 1) - 0.8)
    ax.set_ylim(n, -1.0)
    ax.set_frame_on(False)
    ax.set_title(f"Ring all-reduce on {n} ranks: cells are chunks, labels say whose values each holds "
                 "(Σ: all of them); outlined: the chunk just received from the left neighbour", fontsize=9)
    return ax


def plot_all_reduce(rows: list[AllReduceTime], world_size: int, latency: float, bandwidth: float, ax=None,
                    modelled: bool = False):
    """Measured all-reduce times (torch's and our ring; median, min-max over rounds) beside the
    ring's cost model with the ping-pong's latency and bandwidth (log-log)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    sizes = [r.bytes for r in rows]
    smooth = np.geomspace(min(sizes), max(sizes), 100)
    clock = "modelled on the emulated node" if modelled else "measured"
    measured = {(f"{clock}: dist.all_reduce" + ("" if modelled else " (median, min-max over rounds)")): [r.torch.scaled(1e6) for r in rows],
                "our ring_all_reduce": [r.ring.scaled(1e6) for r in rows]}
    sweep(sizes, measured, "tensor size (bytes, log scale)", "time of one all-reduce (µs, log scale)",
          f"All-reduce on {world_size} ranks: predicted and {clock}", ax=ax,
          logx=True, logy=True)
    predicted = [ring_all_reduce_time(s, world_size, bandwidth, latency) * 1e6 for s in smooth]
    ax.plot(smooth, predicted, ":", color="black", linewidth=2,
            label="predicted: ring cost model with the ping-pong's latency and bandwidth")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    plain_log_ticks(ax)
    return ax

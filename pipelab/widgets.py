"""ipywidgets explorers: move a slider, the lesson re-runs and redraws."""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from torch import nn

from pipelab import model_parallel as mp
from pipelab import plots
from pipelab.streams import Device


def split_size_explorer(model: nn.Module, x: torch.Tensor, devs: list[Device], sweep: dict) -> widgets.VBox:
    """A split-size slider: each move re-runs the pipelined forward, redraws its timeline and
    marks its measured speedup on the sweep curve from `mp.split_sweep`."""
    sizes = sorted(sweep["speedup"])
    slider = widgets.SelectionSlider(options=sizes, value=sweep["best_split"], description="split_size")
    out = widgets.Output()

    def redraw(split_size: int) -> None:
        seconds, tl = mp.time_forward(model, x, devs, "pipelined", split_size, repeats=1)
        speedup = sweep["one_device_s"] / seconds
        with out:
            out.clear_output(wait=True)
            fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 3.2), gridspec_kw={"width_ratios": [2, 1]})
            plots.gantt(tl, ax=ax_t, title=f"pipelined forward, split_size={split_size}")
            ax_s.plot(sizes, [sweep["speedup"][s] for s in sizes], "o-", label="sweep")
            ax_s.plot([split_size], [speedup], "r*", markersize=14, label="this run")
            ax_s.set_xscale("log", base=2)
            ax_s.set(xlabel="split size (samples)", ylabel="speedup over one device (x)",
                     title="speedup against split size")
            ax_s.legend()
            plt.show()

    slider.observe(lambda change: redraw(change["new"]), names="value")
    redraw(slider.value)
    return widgets.VBox([slider, out])

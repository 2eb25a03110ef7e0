"""ipywidgets explorers: move a slider, the lesson re-runs and redraws."""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from torch import nn

from pipelab import plots
from pipelab.experiments.model_parallel import time_forward
from pipelab.plots.model_parallel import speedup_curve
from pipelab.streams import Device


def split_size_explorer(model: nn.Module, x: torch.Tensor, devs: list[Device], sweep: dict) -> widgets.VBox:
    """A split-size slider: each move re-runs the pipelined forward, redraws its timeline and
    marks its measured speedup on the sweep curve from `experiments.model_parallel.split_sweep`."""
    sizes = sorted(sweep["speedup"])
    slider = widgets.SelectionSlider(options=sizes, value=sweep["best_split"], description="split_size")
    out = widgets.Output()

    def redraw(split_size: int) -> None:
        seconds, tl = time_forward(model, x, devs, "pipelined", split_size, repeats=1)
        with out:
            out.clear_output(wait=True)
            fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 3.2), gridspec_kw={"width_ratios": [2, 1]})
            plots.gantt(tl, ax=ax_t, title=f"pipelined forward, split_size={split_size}")
            speedup_curve(sweep, ax=ax_s, this_run=(split_size, sweep["one_device_s"] / seconds))
            plt.show()

    slider.observe(lambda change: redraw(change["new"]), names="value")
    redraw(slider.value)
    return widgets.VBox([slider, out])


def schedule_explorer(schedule: str = "1f1b", ranks: int = 4, microbatches: int = 8):
    """A widget: pick a pipeline schedule, ranks, micro-batches and cost ratios; see its simulated
    timeline redrawn by `draw_schedule` on every change (makespan, bubble and peak stash in the
    title). Display the returned box (the last expression of a notebook cell)."""
    from pipelab.pipeline.schedules import SCHEDULES
    from pipelab.plots.schedules import draw_schedule

    controls = dict(
        name=widgets.Dropdown(options=sorted(SCHEDULES), value=schedule, description="schedule"),
        num_ranks=widgets.IntSlider(value=ranks, min=1, max=8, description="ranks p"),
        num_microbatches=widgets.IntSlider(value=microbatches, min=1, max=32, description="micro-batches m"),
        stages_per_rank=widgets.IntSlider(value=2, min=1, max=4, description="v (interleaved)"),
        backward_ratio=widgets.FloatSlider(value=2.0, min=0.5, max=4.0, step=0.25, description="B / F"),
        weight_share=widgets.FloatSlider(value=0.5, min=0.0, max=0.9, step=0.05, description="W share of B"),
        transfer_ratio=widgets.FloatSlider(value=0.0, min=0.0, max=2.0, step=0.05, description="transfer / F"),
    )
    out = widgets.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            try:
                fig, ax = plt.subplots(figsize=(11, 0.5 * controls["num_ranks"].value + 1.5))
                draw_schedule(ax=ax, **{k: w.value for k, w in controls.items()})
                fig.tight_layout()
                plt.show()
            except ValueError as e:  # e.g. an interleaved schedule that cannot take this m
                plt.close("all")
                print(f"cannot draw this one: {e}")

    for w in controls.values():
        w.observe(redraw, names="value")
    redraw()
    box = widgets.VBox([widgets.HBox(list(controls.values())[:4], layout=widgets.Layout(flex_flow="row wrap")),
                        widgets.HBox(list(controls.values())[4:], layout=widgets.Layout(flex_flow="row wrap")), out])
    return box

"""ipywidgets explorers: move a slider, the lesson re-runs and redraws.

Each explorer writes its figure and text into its `Output` widget's state (`show_in`), never by
capturing output with `with out:`. A capture makes a headless runner (nbclient, under papermill)
play the front end: it sends the widget's new state back to the kernel on the shell socket while
it waits on that socket for the cell's reply, and a reply that lands during that send can go
unnoticed, leaving the run waiting on an idle kernel for ever.
"""

from __future__ import annotations

import io

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import Image

from pipelab import plots
from pipelab.experiments.model_parallel import Config, Forward, speedup, time_forwards
from pipelab.experiments.split_pipelining import SweepRun
from pipelab.plots.model_parallel import speedup_curve


def show_in(out: widgets.Output, fig=None, text: str = "") -> None:
    """Replace what `out` shows with `fig` (as a PNG; the figure is closed) and `text`, by setting
    the widget's outputs from the kernel: no output capture (see the module's docstring)."""
    out.outputs = ()
    if fig is not None:
        png = io.BytesIO()
        fig.savefig(png, format="png", bbox_inches="tight")
        plt.close(fig)
        out.append_display_data(Image(png.getvalue()))
    if text:
        out.append_stdout(text + "\n")


def split_size_explorer(cfg: Config, run: SweepRun, variant: str = "pipelined") -> widgets.VBox:
    """A split-size slider: each move re-runs `variant` (`cfg.repeats` rounds, alternating with
    the one-device forward), redraws the timeline of its median run and marks its speedup
    (median, min-max of the round-by-round ratios) on that variant's curve in `run`
    (`experiments.split_pipelining.split_sweep`)."""
    sweep = run[variant]
    slider = widgets.SelectionSlider(options=run.split_sizes, value=sweep.best_split, description="split_size")
    out = widgets.Output()

    def redraw(split_size: int) -> None:
        runs = time_forwards(cfg, {"one": Forward("one_device"), "split": Forward(variant, split_size)})
        gain = speedup(runs["one"], runs["split"])
        fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 3.2), gridspec_kw={"width_ratios": [2, 1]})
        plots.gantt(runs["split"].timeline, ax=ax_t,
                    title=f"{variant} forward, split_size={split_size}: median of {cfg.repeats} runs")
        speedup_curve(sweep, ax=ax_s, batch=cfg.batch, this_run=(split_size, gain))
        show_in(out, fig, f"split_size={split_size}: speedup {gain:.2f}x (median, min-max of {cfg.repeats} runs)")

    slider.observe(lambda change: redraw(change["new"]), names="value")
    redraw(slider.value)
    return widgets.VBox([slider, out])


def schedule_explorer(name: str = "1f1b", num_ranks: int = 4, num_microbatches: int = 8):
    """A widget: pick a pipeline schedule, ranks, micro-batches and cost ratios; see its simulated
    timeline redrawn by `draw_schedule` on every change (makespan, bubble and peak stash in the
    title). Display the returned box (the last expression of a notebook cell)."""
    from pipelab.pipeline.schedules import SCHEDULES
    from pipelab.plots.schedules import draw_schedule

    controls = dict(
        name=widgets.Dropdown(options=sorted(SCHEDULES), value=name, description="schedule"),
        num_ranks=widgets.IntSlider(value=num_ranks, min=1, max=8, description="ranks p"),
        num_microbatches=widgets.IntSlider(value=num_microbatches, min=1, max=32, description="micro-batches m"),
        stages_per_rank=widgets.IntSlider(value=2, min=1, max=4, description="v (interleaved)"),
        backward_ratio=widgets.FloatSlider(value=2.0, min=0.5, max=4.0, step=0.25, description="B / F"),
        weight_share=widgets.FloatSlider(value=0.5, min=0.0, max=0.9, step=0.05, description="W share of B"),
        transfer_ratio=widgets.FloatSlider(value=0.0, min=0.0, max=2.0, step=0.05, description="transfer / F"),
    )
    out = widgets.Output()

    def redraw(*_):
        fig, ax = plt.subplots(figsize=(11, 0.5 * controls["num_ranks"].value + 1.5))
        try:
            draw_schedule(ax=ax, **{k: w.value for k, w in controls.items()})
        except ValueError as e:  # e.g. an interleaved schedule that cannot take this m
            plt.close(fig)
            show_in(out, text=f"cannot draw this one: {e}")
            return
        fig.tight_layout()
        show_in(out, fig)

    for w in controls.values():
        w.observe(redraw, names="value")
    redraw()
    box = widgets.VBox([widgets.HBox(list(controls.values())[:4], layout=widgets.Layout(flex_flow="row wrap")),
                        widgets.HBox(list(controls.values())[4:], layout=widgets.Layout(flex_flow="row wrap")), out])
    return box

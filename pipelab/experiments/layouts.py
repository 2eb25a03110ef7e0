"""Lesson 05, part 4: the grid's layouts beside their compute-only prediction, and beside this machine's cores.

`predict(cfg)` gives the whole model's step on one device (the node's device model, or timed here);
a layout of p stages, d pipelines and m micro-batches then takes (m + p - 1) / (m p d) of it on
independent devices. The verdicts set each `grid.GridRun` against that and against the same layouts
timed on this machine's own cores. The notebook reads these, and the grid's run, through this module (its `lesson_parts`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from pipelab import hardware
from pipelab.display import human_bytes
from pipelab.emulate.widened import widen
from pipelab.hardware import synchronize
from pipelab.measure import Measured, best_of, compare
from pipelab.models import trainable_parameters
from pipelab.pipeline.simulate import gpipe_bubble

from pipelab.experiments.grid import Config, GridRun, Layout, Verdict, clock
from pipelab.experiments.grid import (gather, grid_vs, groups_verdict, launched_after_last_backward,  # noqa: F401
                                      layouts_of, overlap_verdict, reference, worker)  # the notebook's lesson_parts

def ideal_fraction(layout: Layout) -> float:
    """A layout's step on p x d devices over the whole step on one, messages left out: each does 1/(p d)
    of the work, and m micro-batches take m + p - 1 slots for m slots of work: (m + p - 1) / (m p d)."""
    m, p = layout.num_microbatches, layout.pipe
    return (m + p - 1) / (m * p * layout.data)


def predicted_seconds(layout: Layout, one_device: float, devices: int) -> float:
    """A layout's step (s) on `devices` shared devices: no faster than its ideal pipeline, nor than the
    whole work spread over the devices there are (a bubble is then another process's work)."""
    return one_device * max(ideal_fraction(layout), 1 / min(devices, layout.pipe * layout.data))


def allreduce_bytes(layout: Layout, model: nn.Module, element_size: int | None = None) -> float:
    """Bytes each process sends per step in its all-reduce: a ring sends 2 (d-1)/d times its 1/pipe of the gradients."""
    grads = sum(p.numel() * (element_size or p.element_size()) for _, p in trainable_parameters(model))
    return 2 * (layout.data - 1) / layout.data * grads / layout.pipe


def one_device_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None = None,
                       repeats: int = 3, device: str = "cpu") -> float:
    """Fastest of `repeats` forwards and backwards of the whole model and batch on one thread (as a worker runs) or GPU."""
    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    model, x, y = copy.deepcopy(model).to(device), x.to(device), y.to(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def step() -> None:
            loss_fn(model(x), y).backward()
            synchronize(device)
        return best_of({"step": step}, repeats, prepare=lambda: model.zero_grad(set_to_none=True))["step"][0]
    finally:
        torch.set_num_threads(threads)


@dataclass
class Prediction:
    """The layouts' compute-only steps from one step of the whole model on one device (`one_device`, s):
    timed here, or the device model's on the node (`modelled`)."""

    one_device: float
    device: str  # "cpu", "cuda", or the node's device (e.g. "H100 SXM")
    here: int  # the devices this machine's processes share (on a node: one per process)
    world: int  # the processes
    modelled: bool = False

    def seconds(self, layout: Layout, devices: int | None = None) -> float:
        return predicted_seconds(layout, self.one_device, devices or self.here)

    @property
    def gpu_label(self) -> str:
        return f"predicted, {self.world} x {self.device} (device model)" if self.modelled else f"predicted, {self.world} GPUs"

    def ms(self, runs: Sequence[GridRun]) -> dict[str, dict[str, float]]:
        """The predictions (ms) by label, then layout: one GPU per process and (off a node) this machine's devices."""
        gpu = {self.gpu_label: {r.name: self.seconds(r.layout, self.world) * 1e3 for r in runs}}
        if self.modelled:
            return gpu
        here = f"predicted, {self.here} {'GPUs' if self.device == 'cuda' else 'cores'} (this machine)"
        return {here: {r.name: self.seconds(r.layout) * 1e3 for r in runs}, **gpu}


def predict(cfg: Config) -> Prediction:
    """The whole model's step on one device: the node's device model at the widened size, or timed here."""
    if cfg.node is not None:
        return Prediction(cfg.widened.step_seconds(cfg.model, *cfg.x.shape), cfg.node.device.name, cfg.world_size,
                          cfg.world_size, modelled=True)
    device = "cuda" if hardware.gpu_count() >= cfg.world_size else "cpu"
    one = one_device_seconds(cfg.model, cfg.x, cfg.y, cfg.loss_fn, device=device)
    return Prediction(one, device, cfg.world_size if device == "cuda" else hardware.cpu_cores(), cfg.world_size)


def layouts_table(cfg: Config, runs: Sequence[GridRun], prediction: Prediction) -> list[dict]:
    """One row per layout: its bubble, its all-reduce bytes, both predictions and the step it took."""
    model, size = (widen(cfg.model, cfg.size.scale), cfg.widened.element_size) if cfg.node else (cfg.model, None)
    return [{"layout": r.name, "bubble (p-1)/(m+p-1)": round(gpipe_bubble(r.layout.pipe, r.layout.num_microbatches), 3),
             "all-reduce per process": human_bytes(allreduce_bytes(r.layout, model, size)),
             **{label: round(per[r.name], 1) for label, per in prediction.ms(runs).items()},
             "step (ms), modelled" if r.node else "step (ms)": f"{r.step_time.scaled(1e3):.1f}"} for r in runs]


# --- verdicts ---------------------------------------------------------------------------------


def layouts_vs_prediction(runs: Sequence[GridRun], prediction: Prediction) -> Verdict:
    """Whether every layout's every timed step took longer than its compute-only prediction."""
    over = {r.name: r.step_time.median / prediction.seconds(r.layout) for r in runs}
    slower = all(compare(r.step_time, Measured.of([prediction.seconds(r.layout)])) == "higher" for r in runs)
    return ("05.layouts_vs_prediction", "slower than predicted" if slower else "not all slower",
            f"every layout ran at least {min(over.values()):.2f} times its compute-only prediction: "
            + ("messages, all-reduces and overheads cost the rest." if slower else "some came within it."),
            {n.split(" (")[0].replace(" ", "_"): v for n, v in over.items()})


def gpu_outlook(runs: Sequence[GridRun], prediction: Prediction) -> str:
    """Which layout the compute-only predictions put first, and which the run put first."""
    gpu = prediction.ms(runs)[prediction.gpu_label]
    return (f"Compute alone puts {min(gpu, key=gpu.get)} first on {prediction.world} devices; with every message and "
            f"all-reduce {order(runs)[0]} came first{clock(runs[0])}.")


def order(runs: Sequence[GridRun]) -> list[str]:
    """The layouts' names, fastest median step first."""
    return [r.name for r in sorted(runs, key=lambda r: r.step_time.median)]


def cores_rows(on_cores: Sequence[GridRun], modelled: Sequence[GridRun]) -> list[dict]:
    """Each layout's median step on the node and on this machine's cores, side by side."""
    return [{"layout": e.name, f"step ms, modelled ({e.node}, widened size)": round(e.step_time.median * 1e3, 1),
             "step ms, measured (this machine's cores, small size)": f"{c.step_time.scaled(1e3):.1f}"}
            for e, c in zip(modelled, on_cores)]


def cores_contrast(on_cores: Sequence[GridRun], modelled: Sequence[GridRun], cores: int | None = None) -> Verdict:
    """Whether this machine's own cores order the layouts as the node does, and why not."""
    cores, world = cores or hardware.cpu_cores(), on_cores[0].layout.pipe * on_cores[0].layout.data
    same = order(on_cores) == order(modelled)
    if world > cores:
        return ("05.cores_contrast", "cores shared", f"here {world} processes share {cores} cores, so a process's "
                "bubble is another's compute: messages, overheads and load order the layouts, not the bubbles.",
                dict(same_order=same, cores=cores))
    return ("05.cores_contrast", "same order" if same else "different order", "each process had a core of its own, "
            f"and the layouts came in {'the same order as' if same else 'another order than'} on the modelled node.",
            dict(same_order=same, cores=cores))

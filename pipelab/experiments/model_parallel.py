"""Running lessons 02-04: time the model-parallel forwards, sweep the split size, check a training
step against the one-device model, and stage the dual-stream race where it can be seen.

The forwards themselves are in `pipelab.model_parallel`; timing goes through `measure.best_of`,
the check through `reference.reference_run` and `assert_same`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from pipelab import model_parallel as mp
from pipelab.checks import whole_number
from pipelab.measure import best_of
from pipelab.reference import assert_same, reference_run
from pipelab.streams import Device, timeline
from pipelab.timeline import Timeline

VARIANTS = ("one_device", "naive", "pipelined", "dual_stream")


def forward(model: nn.Module, x: torch.Tensor, devs: list[Device], variant: str,
            split_size: int | None = None) -> torch.Tensor:
    """The forward of `variant` (one_device, naive, pipelined, dual_stream); a split size of None
    is the whole batch (0 is refused, not read as "none")."""
    if split_size is None:
        split_size = x.shape[0]
    mp.check_split_size(split_size, x.shape[0])
    if variant == "one_device":
        return mp.forward_one_device(model, x, devs[0])
    if variant == "naive":
        return mp.forward_naive(model, x, devs)
    if variant == "pipelined":
        return mp.forward_pipelined(model, x, devs, split_size)
    if variant == "dual_stream":
        return mp.forward_dual_stream(model, x, devs, split_size)
    raise ValueError(f"variant={variant!r}: use one of {', '.join(VARIANTS)}")


def fresh_start(devs: list[Device]) -> None:
    """Wait for the devices' queued work and clear their recorders: what follows is one run's."""
    for d in devs:
        d.synchronize()
        d.rec.clear()


def _runnable(model: nn.Module, devs: list[Device], variant: str) -> nn.Module:
    """The model as `variant` runs it: on CUDA the one-device reference needs all of it on GPU 0."""
    if variant == "one_device" and devs[0].is_cuda:
        return copy.deepcopy(model).to(devs[0].torch_device)
    return model


def _forward_run(model: nn.Module, x: torch.Tensor, devs: list[Device], variant: str, split_size: int | None):
    """One forward of `variant` that returns once every stream is done, with its timeline (on
    CUDA the forward itself only queues kernels)."""
    def run() -> Timeline:
        forward(model, x, devs, variant, split_size)
        return timeline(devs)
    return run


def time_forward(model: nn.Module, x: torch.Tensor, devs: list[Device], variant: str,
                 split_size: int | None = None, repeats: int = 3) -> tuple[float, Timeline]:
    """Best-of-`repeats` wall time (s) of one forward of `variant`, and that fastest run's
    timeline (the one least disturbed by whatever else the machine was doing).

    Only the forward is timed: on virtual devices autograd runs the backward on the calling
    thread, so it would not show the devices working in parallel."""
    whole_number("repeats", repeats, example="repeats=3")
    run = _forward_run(_runnable(model, devs, variant), x, devs, variant, split_size)
    with torch.no_grad():
        return best_of({variant: run}, repeats, prepare=lambda: fresh_start(devs))[variant]


def split_sweeps(model: nn.Module, x: torch.Tensor, devs: list[Device], split_sizes: list[int],
                 variants: tuple[str, ...] = ("pipelined", "dual_stream"), repeats: int = 3) -> dict:
    """`split_sweep` of several variants, keyed by variant, against one one-device baseline.

    Timed in rounds (`measure.best_of`): each round runs the one-device forward and every
    (variant, split size) once; each figure is the best of `repeats` rounds. On a machine whose
    load drifts during the sweep, all of them then see the same drift."""
    for v in variants:
        if v not in ("pipelined", "dual_stream"):
            raise ValueError(f"variant={v!r}: a split sweep runs pipelined or dual_stream")
    for s in split_sizes:
        mp.check_split_size(s, x.shape[0])
    whole_number("repeats", repeats, example="repeats=3")
    runs = {("one_device", None): _forward_run(_runnable(model, devs, "one_device"), x, devs, "one_device", None)}
    runs.update({(v, s): _forward_run(model, x, devs, v, s) for v in variants for s in split_sizes})
    with torch.no_grad():
        best = best_of(runs, repeats, prepare=lambda: fresh_start(devs))
    base = best[("one_device", None)][0]
    sweeps = {}
    for v in variants:
        seconds = {s: best[(v, s)][0] for s in split_sizes}
        speedups = {s: base / t for s, t in seconds.items()}
        sweeps[v] = {"variant": v, "one_device_s": base, "seconds": seconds, "speedup": speedups,
                     "best_split": max(speedups, key=speedups.get)}
    return sweeps


def split_sweep(model: nn.Module, x: torch.Tensor, devs: list[Device], split_sizes: list[int],
                repeats: int = 3, variant: str = "pipelined") -> dict:
    """Forward time of `variant` (pipelined or dual_stream) for each split size, its speedup
    over the one-device forward measured in the same sweep, and the best split size."""
    return split_sweeps(model, x, devs, split_sizes, (variant,), repeats)[variant]


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, devs: list[Device],
               variant: str = "naive", split_size: int | None = None) -> tuple[torch.Tensor, Timeline]:
    """One forward and backward of `variant` (one_device, naive, pipelined, dual_stream);
    returns the loss and the timeline of the forward's kernels and copies."""
    fresh_start(devs)  # this step's spans only
    out = forward(model, x, devs, variant, split_size)
    loss = nn.functional.cross_entropy(out, y.to(out.device))
    loss.backward()
    return loss.detach(), timeline(devs)


@dataclass
class ModelParallelRun:
    """One training step's loss and gradients, as `reference.assert_same` reads them."""

    name: str
    losses: list[float]
    grads: dict[str, torch.Tensor | None]


def check_against_one_device(model: nn.Module, x: torch.Tensor, y: torch.Tensor, devs: list[Device],
                             variant: str, split_size: int | None = None, tol: float = 1e-5) -> float:
    """Run one step of `variant` and of a one-device copy of the model (same weights, same data);
    assert the losses and every gradient match; return the loss."""
    host_copy = copy.deepcopy(model).cpu()  # the halves may sit on two GPUs
    ref = reference_run(host_copy, x.cpu(), y.cpu(), nn.functional.cross_entropy, lr=None)
    model.zero_grad()
    loss, _ = train_step(model, x, y, devs, variant, split_size)
    run = ModelParallelRun(f"{variant} (split_size={split_size})", [loss.item()],
                           {name: p.grad for name, p in model.named_parameters()})
    assert_same(run, ref, atol=tol, rtol=tol)
    return float(loss)


def hazard_report(model: nn.Module, x: torch.Tensor, devs: list[Device], split_size: int,
                  use_events: bool, late_producer: bool = False) -> dict:
    """Run the dual-stream forward once, with or without events, and check it two ways: the
    splits whose output differs from the one-device model's, and the splits whose compute
    started before their copy landed (`model_parallel.raw_hazards`, read from the timeline).

    `late_producer` holds device 0 until device 1 has run every split, as if device 0 were
    still busy with earlier work: without events every read then comes before its copy, by
    construction rather than by chance."""
    if late_producer and use_events:
        raise ValueError("late_producer=True with use_events=True: device 1 would wait for device 0, "
                         "which waits for device 1; hold device 0 only with use_events=False")
    with torch.no_grad():
        ref = copy.deepcopy(model).cpu()(x.cpu())
        fresh_start(devs)
        release = devs[0].stream("compute").hold() if late_producer else (lambda: None)
        try:
            out = mp.forward_dual_stream(model, x, devs, split_size, use_events=use_events).cpu()
        finally:
            release()
        tl = timeline(devs)  # waits for copies still in flight
    wrong = [i for i, (o, r) in enumerate(zip(out.split(split_size), ref.split(split_size)))
             if not torch.allclose(o, r, rtol=1e-4, atol=1e-5)]
    return {"splits": len(ref.split(split_size)), "wrong_splits": wrong,
            "raw_hazards": mp.raw_hazards(devs[1].timeline(), devs[1].label), "output": out,
            "reference": ref, "timeline": tl}

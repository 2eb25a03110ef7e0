"""Running lessons 02-04: time the model-parallel forwards, sweep the split size, check a training
step against the one-device model, and stage the dual-stream race where it can be seen.

The forwards themselves are in `pipelab.model_parallel`; timing goes through `measure.alternate`
(every compared forward once per round, so a load that comes and goes hits all alike), the check
through `reference.reference_run` and `assert_same`.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field

import torch
from torch import nn

from pipelab import model_parallel as mp
from pipelab.checks import whole_number
from pipelab.measure import Measured, alternate, ratios
from pipelab.reference import assert_same, reference_run
from pipelab.streams import Device, timeline
from pipelab.timeline import Timeline, now

VARIANTS = ("one_device", "split_by_split", "naive", "pipelined", "dual_stream")
SPLIT_VARIANTS = ("split_by_split", "pipelined", "dual_stream")  # the ones a split sweep runs


def forward(model: nn.Module, x: torch.Tensor, devs: list[Device], variant: str,
            split_size: int | None = None) -> torch.Tensor:
    """The forward of `variant` (one_device, split_by_split, naive, pipelined, dual_stream); a
    split size of None is the whole batch (0 is refused, not read as "none")."""
    if split_size is None:
        split_size = x.shape[0]
    mp.check_split_size(split_size, x.shape[0])
    if variant == "one_device":
        return mp.forward_one_device(model, x, devs[0])
    if variant == "split_by_split":
        return mp.forward_split_by_split(model, x, devs[0], split_size)
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
    """The model as `variant` runs it: on CUDA the one-device runs need all of it on GPU 0."""
    if variant in ("one_device", "split_by_split") and devs[0].is_cuda:
        return copy.deepcopy(model).to(devs[0].torch_device)
    return model


@dataclass
class Timed:
    """Repeats of one forward: each round's wall time (s) and timeline."""

    seconds: list[float]
    timelines: list[Timeline] = field(repr=False)

    @property
    def measured(self) -> Measured:
        """The times as one measurement: median and min-max over the rounds."""
        return Measured.of(self.seconds)

    @property
    def typical_index(self) -> int:
        """The round of median time (the lower middle one for an even count)."""
        order = sorted(range(len(self.seconds)), key=self.seconds.__getitem__)
        return order[(len(order) - 1) // 2]

    @property
    def typical(self) -> Timeline:
        """The timeline of the median-time round: the run the median describes."""
        return self.timelines[self.typical_index]


def time_forwards(model: nn.Module, x: torch.Tensor, devs: list[Device], cases: dict,
                  repeats: int = 3) -> dict:
    """Time forwards in alternation: `cases` maps a key to (variant, split size); each of
    `repeats` rounds runs every case once, in turn, after one warm-up round (`measure.alternate`).
    Returns key -> `Timed`, whose i-th figures all come from round i, so the ratio of two cases
    round by round (`measure.ratios`) sees the same machine load on both sides.

    Only the forward is timed: on virtual devices autograd runs the backward on the calling
    thread, so it would not show the devices working in parallel."""
    whole_number("repeats", repeats, example="repeats=3")
    for variant, split_size in cases.values():
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: use one of {', '.join(VARIANTS)}")
        if split_size is not None:
            mp.check_split_size(split_size, x.shape[0])
    timelines: dict = {key: [] for key in cases}

    def timed(key, variant: str, split_size: int | None):
        runnable = _runnable(model, devs, variant)

        def run() -> float:  # one forward, returning once every stream is done
            fresh_start(devs)
            start = now()
            forward(runnable, x, devs, variant, split_size)
            tl = timeline(devs)  # waits for the devices (on CUDA the forward only queues kernels)
            seconds = now() - start
            timelines[key].append(tl)
            return seconds
        return run

    with torch.no_grad():
        seconds = alternate({key: timed(key, *case) for key, case in cases.items()}, repeats)
    return {key: Timed(seconds[key], timelines[key][-repeats:]) for key in cases}  # warm-up dropped


def time_forward(model: nn.Module, x: torch.Tensor, devs: list[Device], variant: str,
                 split_size: int | None = None, repeats: int = 3) -> Timed:
    """`repeats` timed forwards of `variant` after a warm-up: times and timelines (`Timed`)."""
    return time_forwards(model, x, devs, {variant: (variant, split_size)}, repeats)[variant]


def split_sweeps(model: nn.Module, x: torch.Tensor, devs: list[Device], split_sizes: list[int],
                 variants: tuple[str, ...] = ("pipelined", "dual_stream"), repeats: int = 3) -> dict:
    """Forward times of several split variants over split sizes, keyed by variant, against one
    one-device baseline (the whole batch at once), all timed in the same alternating rounds.

    Per variant: `timed` (split size -> `Timed`), `seconds` and `speedup` over one device
    (split size -> `Measured`, the speedup's repeats being round-by-round ratios), and
    `best_split`, the split size of highest median speedup."""
    for v in variants:
        if v not in SPLIT_VARIANTS:
            raise ValueError(f"variant={v!r}: a split sweep runs {', '.join(SPLIT_VARIANTS)}")
    for s in split_sizes:
        mp.check_split_size(s, x.shape[0])
    cases = {("one_device", None): ("one_device", None)}
    cases.update({(v, s): (v, s) for s in split_sizes for v in variants})  # a split size's variants back to back
    timed = time_forwards(model, x, devs, cases, repeats)
    base = timed[("one_device", None)]
    sweeps = {}
    for v in variants:
        runs = {s: timed[(v, s)] for s in split_sizes}
        speedups = {s: ratios(base.seconds, t.seconds) for s, t in runs.items()}
        sweeps[v] = {"variant": v, "one_device": base, "one_device_s": base.measured, "timed": runs,
                     "seconds": {s: t.measured for s, t in runs.items()}, "speedup": speedups,
                     "best_split": max(speedups, key=lambda s: speedups[s].median)}
    return sweeps


def split_sweep(model: nn.Module, x: torch.Tensor, devs: list[Device], split_sizes: list[int],
                repeats: int = 3, variant: str = "pipelined") -> dict:
    """Forward time of `variant` for each split size, its speedup over the one-device forward
    measured in the same rounds, and the best split size (see `split_sweeps`)."""
    return split_sweeps(model, x, devs, split_sizes, (variant,), repeats)[variant]


def speed_verdict(speedup: Measured) -> str:
    """'faster', 'slower' or 'within noise': the direction of a speedup (old time / new time),
    claimed only when every round agrees, i.e. its whole min-max range lies above or below 1."""
    if speedup.low > 1.0:
        return "faster"
    if speedup.high < 1.0:
        return "slower"
    return "within noise"


def split_costs(tl: Timeline, devs: list[Device]) -> dict[str, float]:
    """Per-split costs (s) read off one pipelined or dual-stream run: the median duration of
    device 0's forward boxes, of the copies to device 1, and of device 1's forward boxes."""
    d0, d1 = devs[0].label, devs[1].label

    def median_duration(spans) -> float:
        return statistics.median(s.duration for s in spans) if len(spans) else 0.0
    return {"device 0": median_duration(tl.filter(rank=d0, lane="compute", kind="F")),
            "copy": median_duration(tl.filter(rank=d1, kind="copy")),
            "device 1": median_duration(tl.filter(rank=d1, lane="compute", kind="F"))}


def simulated_forwards(costs: dict[str, float], splits: int) -> dict[str, float]:
    """The forward times (s) that `model_parallel.pipeline_time` predicts from per-split `costs`
    when every stream has hardware of its own (a GPU's copy engine): pipelined, the copy is a
    stage of device 1's compute; dual stream, it is a stage of its own."""
    a, c, b = costs["device 0"], costs["copy"], costs["device 1"]
    return {"pipelined": mp.pipeline_time([a, c + b], splits), "dual_stream": mp.pipeline_time([a, c, b], splits)}


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

"""Lessons 03 and 04 from a notebook: the split sweep, the verdicts on it, and 04's race.

    run = split_pipelining.split_sweep(cfg, split_sizes=(1, 4, 16, 64), variants=("pipelined",))
    pipelab.conclude(*split_pipelining.curve_verdict(run))

`cfg` is `experiments.model_parallel`'s Config; every forward of a sweep is timed in the same
alternating rounds against one one-device baseline, so speedups are round-by-round ratios.
"""

from __future__ import annotations

import copy
import os
import statistics
from dataclasses import dataclass, field
from typing import Sequence

import torch

from pipelab import hardware
from pipelab import model_parallel as mp
from pipelab.emulate import anchors, resnet50, specs
from pipelab.experiments.model_parallel import (SPLIT_VARIANTS, TUTORIAL_SPLITS, Config, Forward, ResNet50Pace, Timed,
                                                Verdict, fresh_start, pace_of, speed_verdict, speedup, time_forwards,
                                                where)
from pipelab.measure import Measured, compare_medians
from pipelab.reference import exact_fp32
from pipelab.streams import timeline
from pipelab.timeline import Timeline


@dataclass
class SplitSweep:
    """One variant over the split sizes: each size's `Timed`, its speedup over one device (round by
    round), and the split size of highest median speedup."""

    variant: str
    timed: dict[int, Timed]
    speedup: dict[int, Measured]
    best_split: int

    @property
    def seconds(self) -> dict[int, Measured]:
        """Forward time per split size."""
        return {s: t.step_time for s, t in self.timed.items()}


@dataclass
class SweepRun:
    """Split variants over split sizes against one one-device baseline; `run[variant]` is a `SplitSweep`."""

    one_device: Timed
    sweeps: dict[str, SplitSweep]
    batch: int
    where: str = "these devices"  # the devices it ran on, in words
    pace: ResNet50Pace | None = None  # the modelled node's, or None

    def __getitem__(self, variant: str) -> SplitSweep:
        return self.sweeps[variant]

    @property
    def split_sizes(self) -> list[int]:
        return sorted(next(iter(self.sweeps.values())).timed)

    @property
    def repeats(self) -> int:
        return len(self.one_device.step_time.values)

    def splits(self, split_size: int) -> int:
        """How many splits `split_size` cuts the batch into (the last may be smaller)."""
        return -(-self.batch // split_size)

    def bound(self, split_size: int) -> float:
        """The most pipelining this many splits over 2 devices can gain: 2k/(k+1)."""
        return mp.ideal_speedup(self.splits(split_size))

    def overlap_gain(self, split_size: int) -> Measured:
        """What the overlap itself bought: one device split by split over pipelined, round by round."""
        return speedup(self["split_by_split"].timed[split_size], self["pipelined"].timed[split_size])


def split_sweep(cfg: Config, split_sizes: Sequence[int],
                variants: Sequence[str] = ("pipelined", "dual_stream")) -> SweepRun:
    """Forward times of the split `variants` over `split_sizes` against one one-device baseline, all
    in the same alternating rounds (`time_forwards`). Split by split with one split IS the baseline:
    that entry is the baseline's own rounds, not a second measurement of the same forward."""
    bad = [v for v in variants if v not in SPLIT_VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants={list(variants)!r}: a split sweep runs some of {', '.join(SPLIT_VARIANTS)}")
    if not split_sizes:
        raise ValueError("split_sizes is empty; pass e.g. split_sizes=(1, 4, 16)")
    forwards = {("one_device", None): Forward("one_device")}
    forwards.update({(v, s): Forward(v, s) for s in split_sizes for v in variants  # a size's variants back to back
                     if not (v == "split_by_split" and s >= cfg.batch)})
    timed = time_forwards(cfg, forwards)
    base = timed[("one_device", None)]
    timed.update({("split_by_split", s): base for s in split_sizes if s >= cfg.batch and "split_by_split" in variants})
    sweeps = {}
    for v in variants:
        runs = {s: timed[(v, s)] for s in split_sizes}
        speedups = {s: speedup(base, t) for s, t in runs.items()}
        sweeps[v] = SplitSweep(v, runs, speedups, max(speedups, key=lambda s: speedups[s].median))
    return SweepRun(base, sweeps, cfg.batch, where(cfg.devs), pace_of(cfg.devs))


def curve_verdict(run: SweepRun, variant: str = "pipelined") -> Verdict:
    """Lesson 03: the curve's shape; an end lost to the best split only if slower in every round."""
    sweep, sizes = run[variant], run.split_sizes
    best, small, large = sweep.best_split, sizes[0], sizes[-1]

    def lost_to_best(s: int) -> bool:
        return speedup(sweep.timed[s], sweep.timed[best]).low > 1.0  # slower in every round
    small_loses, large_loses = lost_to_best(small), lost_to_best(large)
    shape = {(True, True): "rises then falls", (True, False): "tiny splits lose",
             (False, True): "one split loses", (False, False): "flat within noise"}[(small_loses, large_loses)]
    text = (f"the speedup curve on {run.where}: {shape}; the best, split_size={best}, reached "
            f"{sweep.speedup[best].median:.2f}x.")
    return ("03.curve_shape", shape, text, {"best_split": best, "best": sweep.speedup[best],
                                            "interior": best not in (small, large),
                                            "smallest": sweep.speedup[small], "largest": sweep.speedup[large]})


def bound_verdict(run: SweepRun) -> Verdict:
    """Lesson 03: what the overlap itself bought (pipelined over split by split) against the bound
    2k/(k+1), where it beat the bound in every round, else at the best split."""
    piped, by_split = run["pipelined"], run["split_by_split"]
    gain_above = [s for s in run.split_sizes if run.overlap_gain(s).low > run.bound(s)]  # in every round
    s = max(gain_above, key=lambda s: run.overlap_gain(s).median) if gain_above else piped.best_split
    gain, bound = run.overlap_gain(s), run.bound(s)
    verdict = "overlap above the bound" if gain_above else "overlap within the bound"
    text = (f"the overlap itself (pipelined over split by split) {'beat' if gain_above else 'stayed within'} the "
            f"bound 2k/(k+1): {gain.median:.2f}x against {bound:.2f} at split_size={s}.")
    return ("03.bound", verdict, text, {"split_size": s, "bound": bound, "speedup": piped.speedup[s],
                                        "split_by_split": by_split.speedup[s], "overlap_gain": gain,
                                        "above_in_every_round": gain_above})


def anchor_rows(run: SweepRun, slower_node: str = "2xT4") -> list[dict]:
    """The tutorial's published speedups beside this run's; on a modelled node also the launches'
    share of a split of 12 and the best split the same formulas give on a slower card. Each column
    names its hardware: the tutorial does not name its GPUs, so only the lesson's node runs it."""
    piped, here = run["pipelined"], f"here ({run.where})"
    published = f"tutorial ({anchors.published_hardware('tutorial_pipeline_split12_speedup')})"
    rows = []
    for split, key in ((20, "tutorial_pipeline_split20_speedup"), (12, "tutorial_pipeline_split12_speedup")):
        got = piped.speedup.get(split)
        rows.append({"figure": f"pipelined speedup, split size {split}", published: f"{anchors.anchor(key).value:.2f}x",
                     here: "not run" if got is None else f"{got.median:.2f}x"})
    best = piped.best_split
    published_best = anchors.anchor("tutorial_pipeline_split12_speedup").value
    rows.append({"figure": "best split size (speedup)", published: f"12 ({published_best:.2f}x)",
                 here: f"{best} ({piped.speedup[best].median:.2f}x)"})
    if run.pace is not None:
        rows.append({"figure": "kernel launches' share of a split of 12", published: "-",
                     here: f"{run.pace.launch_share(12):.0%}"})
        slow = resnet50.modelled_speedups(slower_node, run.pace.cut, TUTORIAL_SPLITS)
        slow_best = max(slow, key=slow.get)
        rows.append({"figure": f"best split on {specs.parse_node(slower_node)}, same formulas", published: "-",
                     here: f"{slow_best} ({slow[slow_best]:.2f}x)"})
    return rows


def anchor_verdict(run: SweepRun) -> Verdict:
    """Lesson 03: the sweep's best split beside the tutorial's (12); `anchor_rows` says why they may differ."""
    piped, published_best = run["pipelined"], 12
    best = piped.best_split
    verdict = "same best split" if best == published_best else "other best split"
    text = (f"the best split here was {best}, " + ("the same as" if best == published_best else "not")
            + f" the tutorial's best of {published_best}.")
    here = {f"speedup_{s}": piped.speedup[s].median for s in (20, 12) if s in piped.speedup}
    return "03.anchor", verdict, text, {"best_split": best, "published_best_split": published_best, **here}


def cores_rows(modelled: SweepRun, cores: SweepRun) -> list[dict]:
    """The sweep on this machine's cores, size by size, beside the main sweep's pipelined speedup
    (modelled on the emulated node, or measured on the GPU)."""
    return [{"split size": s, "pipelined": f"{cores['pipelined'].speedup[s]:.2f}",
             "split by split": f"{cores['split_by_split'].speedup[s]:.2f}",
             "pipelined over split by split": f"{cores.overlap_gain(s):.2f}",
             "pipelined, " + ("modelled" if modelled.pace is not None else "GPU, measured"):
             f"{modelled['pipelined'].speedup[s].median:.2f}"
             if s in modelled["pipelined"].speedup else "-"} for s in cores.split_sizes]


def load() -> str:
    """The machine's load while this ran: what the cores' figures move with."""
    return f"load average {os.getloadavg()[0]:.1f} on {hardware.cpu_cores()} cores"


def cores_verdict(modelled: SweepRun, cores: SweepRun) -> Verdict:
    """Lesson 03: the best split on this machine's own cores beside the modelled one."""
    e, c = modelled["pipelined"], cores["pipelined"]
    verdict = "same best split" if c.best_split == e.best_split else "other best split"
    there = "the modelled GPUs" if modelled.pace is not None else modelled.where
    text = f"the best split was {c.best_split} on this machine's cores and {e.best_split} on {there}."
    return ("03.cores", verdict, text, {"best_cores": c.best_split, "best_modelled": e.best_split,
                                        "shared_sizes": [s for s in cores.split_sizes if s in e.speedup],
                                        "overlap_gain": cores.overlap_gain(c.best_split)})


def copy_stream_speedup(run: SweepRun) -> Measured:
    """Lesson 04: the copy stream's best split over lesson 03's best split, round by round."""
    before, after = run["pipelined"], run["dual_stream"]
    return speedup(before.timed[before.best_split], after.timed[after.best_split])


def split_costs(timed: Timed) -> dict[str, float]:
    """Per-split seconds read off the median round: the median of device 0's forward boxes, of the
    copies to device 1, and of device 1's forward boxes."""
    tl, (d0, d1) = timed.timeline, timed.devices

    def median_duration(spans) -> float:
        return statistics.median(s.duration for s in spans) if len(spans) else 0.0
    return {"device 0": median_duration(tl.filter(rank=d0, lane="compute", kind="F")),
            "copy": median_duration(tl.filter(rank=d1, kind="copy")),
            "device 1": median_duration(tl.filter(rank=d1, lane="compute", kind="F"))}


def simulated_forwards(costs: dict[str, float], splits: int) -> dict[str, float]:
    """The forward seconds `model_parallel.pipeline_time` predicts from per-split `costs` when every
    stream has hardware of its own: pipelined, the copy is part of device 1's stage; dual stream,
    a stage of its own."""
    a, c, b = costs["device 0"], costs["copy"], costs["device 1"]
    return {"pipelined": mp.pipeline_time([a, c + b], splits), "dual_stream": mp.pipeline_time([a, c, b], splits)}


def copy_stream_rows(run: SweepRun) -> list[dict]:
    """Lesson 03's best split's per-split costs and the forwards the pipeline formulas give from them."""
    best03 = run["pipelined"].best_split
    costs = split_costs(run["pipelined"].timed[best03])
    sim = simulated_forwards(costs, run.splits(best03))
    return ([{"at split_size": best03, "figure": f"{name} per split (ms)", "value": f"{t * 1e3:.2f}"}
             for name, t in costs.items()]
            + [{"at split_size": best03, "figure": f"formula, {name} (ms)", "value": f"{t * 1e3:.1f}"}
               for name, t in sim.items()])


def copy_stream_verdict(run: SweepRun) -> Verdict:
    """Lesson 04: was the copy stream faster than lesson 03's best split? A direction only when every
    round agrees and (on a real clock) the median is beyond a whole run's noise (`compare_medians`)."""
    gain = copy_stream_speedup(run)
    every_round = speed_verdict(gain)
    agree = {"faster": "higher", "slower": "lower"}.get(every_round) == compare_medians(gain, Measured.of([1.0]))
    verdict = every_round if agree or run.pace is not None else "within noise"
    best03 = run["pipelined"].best_split
    sim = simulated_forwards(split_costs(run["pipelined"].timed[best03]), run.splits(best03))
    said = {"faster": "faster than", "slower": "slower than", "within noise": "within noise of"}[verdict]
    text = (f"on {run.where}, the copy stream was {said} lesson 03's best split: {gain.median:.2f}x, where the "
            f"pipeline formulas give {sim['pipelined'] / sim['dual_stream']:.2f}x.")
    return ("04.copy_stream", verdict, text, {"speedup": gain, "split_03": best03, "split_04": run["dual_stream"].best_split,
                                              "every_round": every_round,
                                              "simulated_speedup": sim["pipelined"] / sim["dual_stream"]})


@dataclass
class HazardRun:
    """One dual-stream forward checked two ways: splits whose output differs from one device's, and
    splits whose compute started before their copy landed."""

    splits: int
    wrong_splits: list[int]
    raw_hazards: list[int]
    output: torch.Tensor = field(repr=False)
    reference: torch.Tensor = field(repr=False)
    timeline: Timeline = field(repr=False)

    @property
    def nan_rows(self) -> int:
        """Output rows with a NaN: samples computed from a buffer before its copy landed."""
        return int(self.output.isnan().flatten(1).any(dim=1).sum())


def hazard_report(cfg: Config, split_size: int, use_events: bool = True, late_producer: bool = False) -> HazardRun:
    """Run the dual-stream forward once, with or without events, and check it against one device
    and on the timeline (`raw_hazards`). `late_producer` holds device 0 until device 1 has run every
    split: without events every read then comes before its copy, by construction, not by chance."""
    cfg.fits(Forward("dual_stream", split_size))
    if late_producer and use_events:
        raise ValueError("late_producer=True with use_events=True: device 1 would wait for device 0, "
                         "which waits for device 1; hold device 0 only with use_events=False")
    devs = list(cfg.devs)
    # TF32 off: on a GPU, cuDNN's TF32 convolutions alone put every split beyond 1e-4 of the CPU's
    with torch.no_grad(), exact_fp32():
        ref = copy.deepcopy(cfg.model).cpu()(cfg.x.cpu())
        fresh_start(devs)
        release = devs[0].stream("compute").hold() if late_producer else (lambda: None)
        try:
            out = mp.forward_dual_stream(cfg.model, cfg.x_first, devs, split_size, use_events=use_events).cpu()
        finally:
            release()
        tl = timeline(devs)  # waits for copies still in flight
    wrong = [i for i, (o, r) in enumerate(zip(out.split(split_size), ref.split(split_size)))
             if not torch.allclose(o, r, rtol=1e-4, atol=1e-5)]
    return HazardRun(len(ref.split(split_size)), wrong, mp.raw_hazards(devs[1].timeline(), devs[1].label),
                     out, ref, tl)

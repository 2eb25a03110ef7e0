"""Lessons 02-04 from a notebook: one process drives two devices, so there are no ranks to spawn.

    cfg = model_parallel.Config.resnet(devs, channels=64, blocks=2, batch=64, size=16)  # refuses bad input here
    run = model_parallel.split_sweep(cfg, split_sizes=(1, 4, 16, 64), variants=("pipelined",))
    pipelab.conclude(*model_parallel.curve_verdict(run))

A `Config` is the lesson's setup (the model placed on its two devices, a batch, how many rounds
each timing runs), checked when built. A `Forward` names one forward (a variant and its split
size) and checks itself. The entry points take the Config: `check_against_one_device` (a training
step against the one-device model), `naive_run` (lesson 02), `split_sweep` (lessons 03 and 04),
`hazard_report` (04's race), and `time_forwards` under them all. Each returns a typed result whose
timings are `Measured` (one value per round); the verdict functions turn those into the lessons'
conclusions.

The forwards themselves are in `pipelab.model_parallel`; timing goes through `measure.alternate`
(every compared forward once per round, so a load that comes and goes hits all alike), the check
through `reference.reference_run` and `assert_same`.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence, TypeVar

import torch
from torch import nn

from pipelab import hardware
from pipelab import model_parallel as mp
from pipelab.checks import same_batch, whole_number
from pipelab.measure import Measured, alternate, compare_medians, ratios
from pipelab.models import SplitResNet
from pipelab.reference import assert_same, reference_run
from pipelab.streams import Device, timeline
from pipelab.timeline import Timeline, now

VARIANTS = ("one_device", "split_by_split", "naive", "pipelined", "dual_stream")
SPLIT_VARIANTS = ("split_by_split", "pipelined", "dual_stream")  # the ones a split sweep runs
ON_DEVICE_0 = ("one_device", "split_by_split")  # the whole model on device 0

K = TypeVar("K", bound=Hashable)

# ---------------------------------------------------------------------------------------------
# What to run: checked when built
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Forward:
    """One forward: a `variant` of `VARIANTS` and its split size (None: the whole batch at once;
    0 is refused, not read as "none")."""

    variant: str
    split_size: int | None = None

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r}: use one of {', '.join(VARIANTS)}")
        if self.split_size is not None:
            whole_number("split_size", self.split_size, example="split_size=8")

    def __str__(self) -> str:
        return self.variant if self.split_size is None else f"{self.variant} (split_size={self.split_size})"


@dataclass(frozen=True, kw_only=True, eq=False)
class Config:
    """What lessons 02-04 run on: `model` (halves seq1 | seq2, fc) placed on the two `devs`, the
    batch (x, y), and how many alternating rounds each timing runs (after one warm-up round)."""

    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    devs: Sequence[Device]
    repeats: int = 3

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise a ValueError naming the bad value and the fix, before anything runs."""
        mp.check_halves(self.model)
        mp.check_devices(list(self.devs))
        same_batch(self.x, self.y)
        whole_number("repeats", self.repeats, example="repeats=3")

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    def fits(self, forward: Forward) -> Forward:
        """`forward`, if its split size cuts this batch."""
        if forward.split_size is not None:
            mp.check_split_size(forward.split_size, self.batch)
        return forward

    @classmethod
    def resnet(cls, devs: Sequence[Device], *, channels: int, blocks: int | tuple[int, int], batch: int,
               size: int, expansion: int = 1, repeats: int = 3, seed: int = 0) -> "Config":
        """The lessons' `SplitResNet(channels, blocks, expansion=expansion)`, seeded with `seed` and
        placed on `devs`, with `batch` random images of `size` x `size` and their labels."""
        whole_number("channels", channels, example="channels=64")
        pair = (blocks, blocks) if isinstance(blocks, int) and not isinstance(blocks, bool) else blocks
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"blocks must be a number of residual blocks per half or a pair (device 0's, "
                             f"device 1's), got {blocks!r}; pass e.g. blocks=2 or blocks=(1, 2)")
        for b in pair:
            whole_number("blocks", b, example="blocks=2 or blocks=(1, 2)")
        whole_number("expansion", expansion, example="expansion=8")
        whole_number("batch", batch, example="batch=64")
        whole_number("size", size, example="size=16")
        whole_number("seed", seed, minimum=0, example="seed=0")
        torch.manual_seed(seed)
        model = mp.place(SplitResNet(channels, tuple(pair), expansion=expansion), list(devs))
        x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
        return cls(model=model, x=x, y=y, devs=devs, repeats=repeats)


# ---------------------------------------------------------------------------------------------
# One forward, one training step, checked against the one-device model
# ---------------------------------------------------------------------------------------------


def forward(cfg: Config, f: Forward, model: nn.Module | None = None) -> torch.Tensor:
    """The forward `f` of `model` (default: the Config's) on the Config's batch and devices."""
    model, x, devs = cfg.model if model is None else model, cfg.x, list(cfg.devs)
    split_size = f.split_size or cfg.batch
    if f.variant == "one_device":
        return mp.forward_one_device(model, x, devs[0])
    if f.variant == "split_by_split":
        return mp.forward_split_by_split(model, x, devs[0], split_size)
    if f.variant == "naive":
        return mp.forward_naive(model, x, devs)
    if f.variant == "pipelined":
        return mp.forward_pipelined(model, x, devs, split_size)
    return mp.forward_dual_stream(model, x, devs, split_size)


def fresh_start(devs: Sequence[Device]) -> None:
    """Wait for the devices' queued work and clear their recorders: what follows is one run's."""
    for d in devs:
        d.synchronize()
        d.rec.clear()


def train_step(cfg: Config, f: Forward = Forward("naive")) -> tuple[torch.Tensor, Timeline]:
    """One forward and backward of `f`; returns the loss and the timeline of the forward's kernels
    and copies (the gradients are in the model's parameters)."""
    cfg.fits(f)
    fresh_start(cfg.devs)  # this step's spans only
    out = forward(cfg, f)
    loss = nn.functional.cross_entropy(out, cfg.y.to(out.device))
    loss.backward()
    return loss.detach(), timeline(cfg.devs)


@dataclass
class ModelParallelRun:
    """One training step's loss and gradients, as `reference.assert_same` reads them."""

    name: str
    losses: list[float]
    grads: dict[str, torch.Tensor | None]


def check_against_one_device(cfg: Config, f: Forward, tol: float = 1e-5) -> float:
    """Run one step of `f` and of a one-device copy of the model (same weights, same data);
    assert the losses and every gradient match; return the loss."""
    cfg.fits(f)
    host_copy = copy.deepcopy(cfg.model).cpu()  # the halves may sit on two GPUs
    ref = reference_run(host_copy, cfg.x.cpu(), cfg.y.cpu(), nn.functional.cross_entropy, lr=None)
    cfg.model.zero_grad()
    loss, _ = train_step(cfg, f)
    run = ModelParallelRun(str(f), [loss.item()], {name: p.grad for name, p in cfg.model.named_parameters()})
    assert_same(run, ref, atol=tol, rtol=tol)
    return float(loss)


# ---------------------------------------------------------------------------------------------
# Timing forwards in alternating rounds
# ---------------------------------------------------------------------------------------------


@dataclass
class Timed:
    """Repeats of one forward: its time in each round and that round's timeline. `devices` are the
    labels of device 0 and device 1 (the one the copies land on)."""

    seconds: Measured
    timelines: list[Timeline] = field(repr=False)
    devices: tuple[str, str]

    @property
    def typical_index(self) -> int:
        """The round of median time (the lower middle one for an even count)."""
        values = self.seconds.values
        order = sorted(range(len(values)), key=values.__getitem__)
        return order[(len(order) - 1) // 2]

    @property
    def typical(self) -> Timeline:
        """The timeline of the median-time round: the run the median describes."""
        return self.timelines[self.typical_index]

    @property
    def copy_share(self) -> Measured:
        """Per round: the share of device 1's compute stream that its copies took (a copy in the
        compute stream, as when pipelined; 0 with a copy stream of its own)."""
        d1 = self.devices[1]
        return Measured.of(tl.filter(kind="copy").busy_time(d1, "compute") / (tl.busy_time(d1, "compute") or 1.0)
                           for tl in self.timelines)

    @property
    def overlap(self) -> Measured:
        """Per round: the fraction of the copy time hidden behind computation on device 1."""
        return Measured.of(tl.overlap("compute", "copy", rank=self.devices[1]) for tl in self.timelines)


def speedup(before: Timed, after: Timed) -> Measured:
    """How many times faster `after` ran than `before`: round-by-round ratios of their times."""
    return ratios(before.seconds.values, after.seconds.values)


def time_forwards(cfg: Config, forwards: Mapping[K, Forward]) -> dict[K, Timed]:
    """Time forwards in alternation: each of `cfg.repeats` rounds runs every forward once, in
    turn, after one warm-up round (`measure.alternate`). The i-th figures of every `Timed` come
    from round i, so the ratio of two forwards round by round (`speedup`) sees the same machine
    load on both sides.

    Only the forward is timed: on virtual devices autograd runs the backward on the calling
    thread, so it would not show the devices working in parallel."""
    for f in forwards.values():
        cfg.fits(f)
    devs = list(cfg.devs)
    timelines: dict = {key: [] for key in forwards}

    def timed(key: K, f: Forward):
        model = cfg.model
        if f.variant in ON_DEVICE_0 and any(p.device != devs[0].torch_device for p in model.parameters()):
            model = copy.deepcopy(model).to(devs[0].torch_device)  # on two GPUs: all of it on GPU 0

        def run() -> float:  # one forward, returning once every stream is done
            fresh_start(devs)
            start = now()
            forward(cfg, f, model)
            tl = timeline(devs)  # waits for the devices (on CUDA the forward only queues kernels)
            seconds = now() - start
            timelines[key].append(tl)
            return seconds
        return run

    with torch.no_grad():
        seconds = alternate({key: timed(key, f) for key, f in forwards.items()}, cfg.repeats)
    labels = (devs[0].label, devs[1].label)
    return {key: Timed(Measured.of(seconds[key]), timelines[key][-cfg.repeats:], labels)  # warm-up dropped
            for key in forwards}


# ---------------------------------------------------------------------------------------------
# Lesson 02: naive model parallel against one device
# ---------------------------------------------------------------------------------------------


@dataclass
class NaiveRun:
    """The naive two-device forward and the one-device forward, timed in the same rounds."""

    one_device: Timed
    naive: Timed

    @property
    def speedup(self) -> Measured:
        """Naive over one device, round by round."""
        return speedup(self.one_device, self.naive)


def naive_run(cfg: Config) -> NaiveRun:
    """Lesson 02's measurement: one device and naive model parallel, `cfg.repeats` rounds."""
    runs = time_forwards(cfg, {"one device": Forward("one_device"), "naive": Forward("naive")})
    return NaiveRun(runs["one device"], runs["naive"])


def speed_verdict(ratio: Measured) -> str:
    """'faster', 'slower' or 'within noise': the direction of a speedup (old time / new time),
    claimed only when every round agrees, i.e. its whole min-max range lies above or below 1."""
    if ratio.low > 1.0:
        return "faster"
    if ratio.high < 1.0:
        return "slower"
    return "within noise"


def naive_verdict(run: NaiveRun) -> tuple[str, str, str, dict]:
    """Lesson 02's conclusion: was naive model parallelism faster than one device in every round?"""
    s, repeats = run.speedup, len(run.naive.seconds.values)
    if speed_verdict(s) != "faster":
        return ("02.naive_speedup", "no faster",
                f"naive model parallelism was no faster than one device: speedup {s:.2f}x (median, min-max of "
                f"{repeats} rounds), as predicted (at most 1x: the halves take turns).",
                {"speedup": s, "repeats": repeats})
    return ("02.naive_speedup", "faster",
            f"naive model parallelism came out faster than one device in every round ({s:.2f}x), although the "
            f"devices took turns (utilization above). That is not parallelism: on a CPU each half ran on a core of "
            f"its own, with a smaller working set in that core's cache than the whole model on one core. The "
            f"theory's answer stays at most 1x; on GPUs naive is not faster.",
            {"speedup": s, "repeats": repeats})


# ---------------------------------------------------------------------------------------------
# Lessons 03 and 04: split sweeps
# ---------------------------------------------------------------------------------------------


@dataclass
class SplitSweep:
    """One variant over the split sizes: each size's `Timed`, its speedup over the one-device
    forward on the whole batch (round by round), and the split size of highest median speedup."""

    variant: str
    timed: dict[int, Timed]
    speedup: dict[int, Measured]
    best_split: int

    @property
    def seconds(self) -> dict[int, Measured]:
        """Forward time per split size."""
        return {s: t.seconds for s, t in self.timed.items()}


@dataclass
class SweepRun:
    """Split variants over split sizes, all timed in the same alternating rounds against one
    one-device baseline. `sweep_run[variant]` is that variant's `SplitSweep`."""

    one_device: Timed
    sweeps: dict[str, SplitSweep]
    batch: int
    sample_bytes: int  # one sample's activation crossing from device 0 to device 1

    def __getitem__(self, variant: str) -> SplitSweep:
        return self.sweeps[variant]

    @property
    def split_sizes(self) -> list[int]:
        return sorted(next(iter(self.sweeps.values())).timed)

    @property
    def repeats(self) -> int:
        return len(self.one_device.seconds.values)

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
    """Forward times of the split `variants` over `split_sizes` against one one-device baseline
    (the whole batch at once), all timed in the same alternating rounds (`time_forwards`)."""
    bad = [v for v in variants if v not in SPLIT_VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants={list(variants)!r}: a split sweep runs some of {', '.join(SPLIT_VARIANTS)}")
    if not split_sizes:
        raise ValueError("split_sizes is empty; pass e.g. split_sizes=(1, 4, 16)")
    forwards = {("one_device", None): Forward("one_device")}
    forwards.update({(v, s): Forward(v, s) for s in split_sizes for v in variants})  # a size's variants back to back
    timed = time_forwards(cfg, forwards)
    base = timed[("one_device", None)]
    sweeps = {}
    for v in variants:
        runs = {s: timed[(v, s)] for s in split_sizes}
        speedups = {s: speedup(base, t) for s, t in runs.items()}
        sweeps[v] = SplitSweep(v, runs, speedups, max(speedups, key=lambda s: speedups[s].median))
    sample = mp.cut_shape(cfg.model, cfg.x[:1])
    return SweepRun(base, sweeps, cfg.batch, math.prod(sample) * cfg.x.element_size())


def _load() -> str:
    """The machine's load while this ran, for a sentence about overlap that did not pay."""
    return f"load average {os.getloadavg()[0]:.1f} on {hardware.cpu_cores()} cores"


def curve_verdict(run: SweepRun, variant: str = "pipelined") -> tuple[str, str, str, dict]:
    """Lesson 03: the shape of the speedup curve. An end of the curve lost to the best split only
    where it was slower than the best split in every round."""
    sweep, sizes = run[variant], run.split_sizes
    best, small, large = sweep.best_split, sizes[0], sizes[-1]

    def lost_to_best(s: int) -> bool:
        return speedup(sweep.timed[s], sweep.timed[best]).low > 1.0  # slower in every round
    small_loses, large_loses = lost_to_best(small), lost_to_best(large)
    shape = {(True, True): "rises then falls", (True, False): "tiny splits lose",
             (False, True): "one split loses", (False, False): "flat within noise"}[(small_loses, large_loses)]
    ends = [f"split_size={s}{' (one split: the naive forward)' if s == run.batch else ''} reached "
            f"{sweep.speedup[s]:.2f}x, {'' if loses else 'not '}slower than the best in every round"
            for s, loses in ((small, small_loses), (large, large_loses)) if s != best]
    text = (f"the speedup curve: {shape}. The best split_size={best} reached {sweep.speedup[best]:.2f}x; "
            + "; ".join(ends) + ".")
    return ("03.curve_shape", shape, text, {"best_split": best, "best": sweep.speedup[best],
                                            "smallest": sweep.speedup[small], "largest": sweep.speedup[large]})


def bound_verdict(run: SweepRun) -> tuple[str, str, str, dict]:
    """Lesson 03: each measured speedup against its bound 2k/(k+1); where one beats it, by how much
    and why (one device alone faster on splits than on the batch, and what the overlap bought)."""
    piped, by_split = run["pipelined"], run["split_by_split"]
    sizes = run.split_sizes
    above = [s for s in sizes if piped.speedup[s].low > run.bound(s)]  # above the bound in every round
    gain_above = [s for s in sizes if run.overlap_gain(s).low > run.bound(s)]
    s = max(above, key=lambda s: piped.speedup[s].median) if above else piped.best_split
    k, bound = run.splits(s), run.bound(s)
    if above:
        parts = [f"at split_size={s} (k={k}) the speedup {piped.speedup[s]:.2f}x beat the bound {bound:.2f} "
                 "in every round."]
    else:
        parts = [f"no split beat its bound 2k/(k+1) in every round; at the best, split_size={s} (k={k}): "
                 f"{piped.speedup[s]:.2f}x against {bound:.2f}."]
    if speed_verdict(by_split.speedup[s]) == "faster":
        layer_mib = run.batch * run.sample_bytes / 2**20  # one layer's activations for the whole batch
        parts.append(f"The bound assumes a device takes the same time per sample at any batch size; on this CPU it "
                     f"did not: one device alone, running the same splits one after another, was "
                     f"{by_split.speedup[s]:.2f}x faster than on the whole batch, most likely because a split's "
                     f"activations stay in the core's caches and the batch's do not (one layer's activations: "
                     f"{layer_mib:.1f} MiB for the batch of {run.batch}, {layer_mib * s / run.batch:.2f} MiB for a "
                     f"split).")
    else:
        parts.append(f"Splitting alone did not make one device faster in every round (split by split: "
                     f"{by_split.speedup[s]:.2f}x).")
    gain = run.overlap_gain(s)
    if gain.low > bound:
        against = "above the bound in every round: more than the overlap model explains"
    elif gain.median > bound:
        against = "above the bound in some rounds but not in all: within noise of it"
    else:
        against = "within the bound"
    parts.append(f"What the overlap itself bought (pipelined over split by split) was {gain:.2f}x, {against}.")
    if speed_verdict(gain) != "faster":
        parts.append(f"Overlap pays only when each device has a core to itself; while this ran, the machine's "
                     f"{_load()}.")
    verdict = "overlap above the bound" if gain_above else "overlap within the bound"
    return ("03.bound", verdict, " ".join(parts),
            {"split_size": s, "bound": bound, "speedup": piped.speedup[s], "split_by_split": by_split.speedup[s],
             "overlap_gain": gain, "above_in_every_round": gain_above})


def copy_stream_speedup(run: SweepRun) -> Measured:
    """Lesson 04: the copy stream's best split over lesson 03's best split (copies in the compute
    stream), round by round."""
    before, after = run["pipelined"], run["dual_stream"]
    return speedup(before.timed[before.best_split], after.timed[after.best_split])


def split_costs(timed: Timed) -> dict[str, float]:
    """Per-split costs (s) read off the median round of a pipelined or dual-stream forward: the
    median duration of device 0's forward boxes, of the copies to device 1, and of device 1's
    forward boxes."""
    tl, (d0, d1) = timed.typical, timed.devices

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


def copy_stream_verdict(run: SweepRun) -> tuple[str, str, str, dict]:
    """Lesson 04: was the copy stream faster than lesson 03's best split? A direction only when
    every round agrees and the median is beyond a whole run's noise (`compare_medians`); beside
    it, what the pipeline formulas give with this run's per-split costs and a copy engine."""
    gain = copy_stream_speedup(run)
    best03, best04 = run["pipelined"].best_split, run["dual_stream"].best_split
    every_round = speed_verdict(gain)
    beyond_noise = compare_medians(gain, Measured.of([1.0]))
    agree = {"faster": "higher", "slower": "lower"}.get(every_round) == beyond_noise
    verdict = every_round if agree else "within noise"
    costs = split_costs(run["pipelined"].timed[best03])  # per split, from lesson 03's median run
    sim = simulated_forwards(costs, run.splits(best03))
    simulated = (f"With this run's per-split costs at split_size={best03} "
                 f"({', '.join(f'{name} {t * 1e3:.2f} ms' for name, t in costs.items())}) and a copy engine beside "
                 f"the compute units, as on a GPU, the pipeline formulas give {sim['pipelined'] * 1e3:.1f} ms before "
                 f"and {sim['dual_stream'] * 1e3:.1f} ms after: {sim['pipelined'] / sim['dual_stream']:.2f}x.")
    if verdict == "faster":
        text = f"the copy stream was faster than lesson 03's best split in every round: {gain:.2f}x. " + simulated
    elif verdict == "slower":
        text = (f"the copy stream was slower than lesson 03's best split in every round: {gain:.2f}x. On 2 CPU "
                f"cores the copy is a memory copy on a third thread, competing with the two compute threads for the "
                f"same two cores. " + simulated)
    else:
        lean = (f"; every round was {every_round} on this run, but by less than a median moves between runs"
                if every_round != "within noise" else "")
        text = (f"the copy stream and lesson 03's best split were within noise of each other ({gain:.2f}x{lean}): "
                f"2 CPU cores are too small for this effect to show, since the copy is a memory copy competing for "
                f"the same cores as compute ({_load()} while this ran). " + simulated)
    return ("04.copy_stream", verdict, text, {"speedup": gain, "split_03": best03, "split_04": best04,
                                              "simulated_speedup": sim["pipelined"] / sim["dual_stream"]})


# ---------------------------------------------------------------------------------------------
# Lesson 04: the race, where it can be seen
# ---------------------------------------------------------------------------------------------


@dataclass
class HazardRun:
    """One dual-stream forward checked two ways: the splits whose output differs from the
    one-device model's, and the splits whose compute started before their copy landed."""

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
    """Run the dual-stream forward once, with or without events, and check it against the
    one-device model and on the timeline (`model_parallel.raw_hazards`).

    `late_producer` holds device 0 until device 1 has run every split, as if device 0 were
    still busy with earlier work: without events every read then comes before its copy, by
    construction rather than by chance."""
    cfg.fits(Forward("dual_stream", split_size))
    if late_producer and use_events:
        raise ValueError("late_producer=True with use_events=True: device 1 would wait for device 0, "
                         "which waits for device 1; hold device 0 only with use_events=False")
    devs = list(cfg.devs)
    with torch.no_grad():
        ref = copy.deepcopy(cfg.model).cpu()(cfg.x.cpu())
        fresh_start(devs)
        release = devs[0].stream("compute").hold() if late_producer else (lambda: None)
        try:
            out = mp.forward_dual_stream(cfg.model, cfg.x, devs, split_size, use_events=use_events).cpu()
        finally:
            release()
        tl = timeline(devs)  # waits for copies still in flight
    wrong = [i for i, (o, r) in enumerate(zip(out.split(split_size), ref.split(split_size)))
             if not torch.allclose(o, r, rtol=1e-4, atol=1e-5)]
    return HazardRun(len(ref.split(split_size)), wrong, mp.raw_hazards(devs[1].timeline(), devs[1].label),
                     out, ref, tl)

"""Lessons 02-04 from a notebook: one process drives two devices, so there are no ranks to spawn.

    cfg = model_parallel.Config.resnet(devs, channels=64, blocks=2, batch=64, size=16)  # refuses bad input here
    run = model_parallel.naive_run(cfg)
    pipelab.conclude(*model_parallel.naive_verdict(run))

Lessons 03-04's sweeps are `experiments.split_pipelining`. Without two GPUs, `ResNet50Pace` paces
the devices as the tutorial's ResNet-50 on modelled GPUs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Hashable, Mapping, Sequence, TypeVar

import torch
from torch import nn

from pipelab import hardware
from pipelab import model_parallel as mp
from pipelab.checks import same_batch, whole_number
from pipelab.emulate import anchors, cost, node_name, resnet50, size_of, specs
from pipelab.measure import Measured, Steps, TimedSteps, alternate, ratios
from pipelab.models import SplitResNet
from pipelab.reference import Reference, assert_same, exact_fp32, reference_run
from pipelab.streams import Device, Pace, shares_one_gpu, timeline
from pipelab.timeline import Timeline, now

VARIANTS = ("one_device", "split_by_split", "naive", "pipelined", "dual_stream")
SPLIT_VARIANTS = ("split_by_split", "pipelined", "dual_stream")  # the ones a split sweep runs
ON_DEVICE_0 = ("one_device", "split_by_split")  # the whole model on device 0
TUTORIAL_SPLITS = (1, 3, 5, 8, 10, 12, 20, 40, 60, 120)  # the split sizes the tutorial tried, and one split

K = TypeVar("K", bound=Hashable)
Verdict = tuple[str, str, str, dict]


@dataclass(frozen=True)
class Forward:
    """One forward: a `variant` of `VARIANTS` and its split size (None: the whole batch at once)."""

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
    batch (x, y), and how many alternating rounds each timing runs."""

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

    @cached_property
    def x_first(self) -> torch.Tensor:
        """The batch on device 0, moved there once before any timing: a forward times the devices."""
        return self.devs[0].own(self.x)

    def fits(self, forward: Forward) -> Forward:
        """`forward`, if its split size cuts this batch."""
        if forward.split_size is not None:
            mp.check_split_size(forward.split_size, self.batch)
        return forward

    @classmethod
    def resnet(cls, devs: Sequence[Device], *, channels: int, blocks: int | tuple[int, int], batch: int,
               size: int, expansion: int = 1, repeats: int = 3, seed: int = 0) -> "Config":
        """The lessons' `SplitResNet`, seeded with `seed` and placed on `devs`, with `batch` random
        images of `size` x `size` and their labels."""
        pair = (blocks, blocks) if isinstance(blocks, int) and not isinstance(blocks, bool) else blocks
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"blocks must be a number of residual blocks per half or a pair (device 0's, "
                             f"device 1's), got {blocks!r}; pass e.g. blocks=2 or blocks=(1, 2)")
        for name, value in (("channels", channels), ("blocks", pair[0]), ("blocks", pair[1]), ("expansion", expansion),
                            ("batch", batch), ("size", size)):
            whole_number(name, value, example=f"{name}=8")
        whole_number("seed", seed, minimum=0, example="seed=0")
        torch.manual_seed(seed)
        model = mp.place(SplitResNet(channels, tuple(pair), expansion=expansion), list(devs))
        x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
        return cls(model=model, x=x, y=y, devs=devs, repeats=repeats)


class ResNet50Pace(resnet50.ResNet50Halves, Pace):
    """Paces lessons 02-04's virtual devices as `node`'s GPUs running the tutorial's ResNet-50 cut
    after `cut`: a split of r rows lasts, on its stream, `seq1`'s or `second_half`'s forward on
    r x 120 / `real_batch` images, the whole model both, a copy the cut's activation over the link."""

    SIZE: Mapping[str, Any] = {"cut": "layer2"}  # where the modelled ResNet-50 is cut (the tutorial's)

    def __init__(self, node, real_batch: int, cut: str = "layer2", dtype: str = "float32") -> None:
        Pace.__init__(self)
        resnet50.ResNet50Halves.__init__(self, node, real_batch, cut, dtype)

    @classmethod
    def on(cls, node, real_batch: int) -> "ResNet50Pace | None":
        """The pace of `node` (a name, or one with its size, e.g. cut="layer3"); None: nothing modelled."""
        name, size = node_name(node), size_of(cls.SIZE, node)
        return None if name is None else cls(name, real_batch, size.cut)

    def seconds(self, kind: str, fn, args: tuple) -> float:
        if kind == "copy":  # the stream's copy: (source, buffer)
            return self.copy_seconds(args[0].shape[0] * self.images_per_row)
        if fn is mp.second_half:  # (model, activation)
            return self.half_seconds("seq2", args[1].shape[0] * self.images_per_row)
        if isinstance(fn, nn.Module):
            images = args[0].shape[0] * self.images_per_row
            if all(isinstance(getattr(fn, h, None), nn.Module) for h in mp.HALVES):  # the whole model
                return self.half_seconds("seq1", images) + self.half_seconds("seq2", images)
            return self.half_seconds("seq1", images)  # a first half, submitted alone
        raise ValueError(f"a paced device times seq1, second_half, the whole model and copies; got {fn!r} "
                         f"({kind}): submit one of those, or run on this machine's cores")


def pace_of(devs: Sequence[Device]) -> ResNet50Pace | None:
    """The pace of paced virtual devices (a modelled node), else None."""
    return getattr(devs[0], "pace", None)


def where(devs: Sequence[Device]) -> str:
    """The devices a run timed, in words: the modelled node, the GPUs, one GPU's streams, or this machine's cores."""
    pace = pace_of(devs)
    if pace is not None:
        return f"the emulated {pace.node}"
    if shares_one_gpu(list(devs)):  # devices(2, device="cuda") on a one-GPU machine: measured, not two GPUs
        return f"two streams of one {torch.cuda.get_device_name(devs[0].torch_device)} (shared SMs)"
    if devs[0].torch_device.type == "cuda":
        return f"{torch.cuda.get_device_name(devs[0].torch_device)} x 2 ({devs[0].name}, {devs[1].name})"
    return f"this machine's CPU ({hardware.cpu_cores()} cores, a thread per stream)"


def run_flops(params: dict) -> float:
    """FLOPs of one run of lesson 02, 03 or 04 (`params["lesson"]`) at its notebook parameters
    `params` (missing names take 02's defaults), counted on the meta device: every timed forward
    (a warm-up round, the explorer's, the race's) and every checked training step."""
    p = {"lesson": "02", "channels": 8, "blocks": 2, "batch": 120, "size": 8, "expansion": 1, "repeats": 3, **params}
    sweep = {"02": (), "03": TUTORIAL_SPLITS, "04": (4, 8, 12, 20, 24, 30, 40, 60)}[p["lesson"]]
    sizes = len({s for s in sweep if s < p["batch"]} | {p["batch"]})
    per_round, extra, steps = {"02": (2, 0, 1), "03": (2 * sizes, 6, 3), "04": (1 + 2 * sizes, 3, 3)}[p["lesson"]]
    blocks = tuple(p["blocks"]) if isinstance(p["blocks"], (tuple, list)) else (p["blocks"], p["blocks"])
    with torch.device("meta"):
        model = SplitResNet(p["channels"], blocks, expansion=p["expansion"])
    f, i, w = cost.forward_backward_counts(model, torch.empty(p["batch"], 3, p["size"], p["size"], device="meta"))
    return (per_round * (p["repeats"] + 1) + extra) * f.flops + steps * (f.flops + i.flops + w.flops)


def forward(cfg: Config, f: Forward, model: nn.Module | None = None) -> torch.Tensor:
    """The forward `f` of `model` (default: the Config's) on the Config's batch and devices."""
    model, x, devs, split = cfg.model if model is None else model, cfg.x_first, list(cfg.devs), f.split_size or cfg.batch
    return {"one_device": lambda: mp.forward_one_device(model, x, devs[0]),
            "split_by_split": lambda: mp.forward_split_by_split(model, x, devs[0], split),
            "naive": lambda: mp.forward_naive(model, x, devs),
            "pipelined": lambda: mp.forward_pipelined(model, x, devs, split),
            "dual_stream": lambda: mp.forward_dual_stream(model, x, devs, split)}[f.variant]()


def fresh_start(devs: Sequence[Device]) -> None:
    """Wait for the devices' queued work and clear their recorders (paced devices: from time 0)."""
    for d in devs:
        d.synchronize()
    for d in devs:
        d.rec.clear()
        d.restart_clock()


def train_step(cfg: Config, f: Forward = Forward("naive")) -> tuple[torch.Tensor, Timeline]:
    """One forward and backward of `f`: the loss and the timeline of the forward's kernels and copies."""
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


GPU_TOLERANCE = 1e-4  # float32 on GPUs against the CPU reference, TF32 off: other summation orders


def tolerance(devs: Sequence[Device], tol: float = 1e-5) -> float:
    """`tol` on CPU devices; on GPUs (TF32 off) at least `GPU_TOLERANCE`: cuDNN sums in other orders."""
    return max(tol, GPU_TOLERANCE) if devs[0].torch_device.type == "cuda" else tol


def reference(cfg: Config) -> Reference:
    """One training step of a one-device copy of the model, in this process on the CPU."""
    host_copy = copy.deepcopy(cfg.model).cpu()  # the halves may sit on two GPUs
    return reference_run(host_copy, cfg.x.cpu(), cfg.y.cpu(), nn.functional.cross_entropy, lr=None)


def check_against_one_device(cfg: Config, f: Forward, tol: float = 1e-5) -> float:
    """Assert one step of `f` gives a one-device copy's loss and gradients (same weights and data,
    `tolerance(cfg.devs, tol)`, TF32 off); return the loss."""
    cfg.fits(f)
    ref = reference(cfg)
    cfg.model.zero_grad()
    with exact_fp32():  # TF32 off: a float32 check at 1e-5 would fail on precision, not correctness
        loss, _ = train_step(cfg, f)
    grads = {name: None if p.grad is None else p.grad.cpu() for name, p in cfg.model.named_parameters()}
    tol = tolerance(cfg.devs, tol)
    assert_same(ModelParallelRun(str(f), [loss.item()], grads), ref, atol=tol, rtol=tol)
    return float(loss)


@dataclass
class Timed(TimedSteps):
    """Repeats of one forward (`steps`: each round's time and timeline; `step_time` and `timeline`,
    the typical round, as every run has them), and the labels of device 0 and 1."""

    steps: Steps = field(repr=False)
    devices: tuple[str, str]

    @property
    def copy_share(self) -> Measured:
        """Per round: the share of device 1's compute stream that its copies took."""
        d1 = self.devices[1]
        return Measured.of(tl.filter(kind="copy").busy_time(d1, "compute") / (tl.busy_time(d1, "compute") or 1.0)
                           for tl in self.steps.timelines)

    @property
    def overlap(self) -> Measured:
        """Per round: the fraction of the copy time hidden behind computation on device 1."""
        return Measured.of(tl.overlap("compute", "copy", rank=self.devices[1]) for tl in self.steps.timelines)


def speedup(before: Timed, after: Timed) -> Measured:
    """How many times faster `after` ran than `before`: round-by-round ratios of their times."""
    return ratios(before.step_time.values, after.step_time.values)


def time_forwards(cfg: Config, forwards: Mapping[K, Forward]) -> dict[K, Timed]:
    """Time forwards in alternation (`measure.alternate`): each of `cfg.repeats` rounds runs every
    forward once, after a warm-up round, so round-by-round ratios (`speedup`) see the same machine
    load. Only the forward is timed. On paced devices a forward's time is its modelled end."""
    for f in forwards.values():
        cfg.fits(f)
    devs = list(cfg.devs)
    paced = pace_of(devs) is not None
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
            timelines[key].append(tl)
            return tl.end if paced else now() - start  # paced: the modelled end, from 0
        return run

    with torch.no_grad():
        seconds = alternate({key: timed(key, f) for key, f in forwards.items()}, cfg.repeats,
                            warmup=0 if paced else 1)
    labels = (devs[0].label, devs[1].label)
    return {key: Timed(Steps(list(seconds[key]), timelines[key][-cfg.repeats:]), labels)  # warm-up dropped
            for key in forwards}


@dataclass
class NaiveRun:
    """The naive and the one-device forward, timed in the same rounds, on `where` (in words)."""

    one_device: Timed
    naive: Timed
    where: str = "these devices"
    pace: ResNet50Pace | None = None  # the modelled node's, or None

    @property
    def speedup(self) -> Measured:
        """Per round, one device's time over naive's (`rounds` lists them)."""
        return speedup(self.one_device, self.naive)

    def rounds(self) -> list[dict]:
        """Per round: both times and their ratio, the figures `speedup` is computed from."""
        return [{"round": i + 1, "one device (ms)": f"{a * 1e3:.2f}", "naive (ms)": f"{b * 1e3:.2f}",
                 "one device / naive": f"{a / b:.3f}"}
                for i, (a, b) in enumerate(zip(self.one_device.step_time.values, self.naive.step_time.values))]


def naive_run(cfg: Config) -> NaiveRun:
    """Lesson 02's timing: one device and naive model parallel, `cfg.repeats` rounds."""
    runs = time_forwards(cfg, {"one device": Forward("one_device"), "naive": Forward("naive")})
    return NaiveRun(runs["one device"], runs["naive"], where(cfg.devs), pace_of(cfg.devs))


def speed_verdict(ratio: Measured) -> str:
    """The direction of a speedup (old time / new time), claimed only when every round agrees."""
    if ratio.low > 1.0:
        return "faster"
    if ratio.high < 1.0:
        return "slower"
    return "within noise"


def naive_verdict(run: NaiveRun) -> Verdict:
    """Lesson 02: was naive model parallelism faster than one device in every round? (Theory: no.)"""
    s = run.speedup
    verdict = "faster" if speed_verdict(s) == "faster" else "no faster"
    why = ("kernels overlapping on its SMs." if "streams of one" in run.where else
           "from a smaller working set per core.")
    text = (f"on {run.where}, naive model parallelism ran at {s.median:.3f}x one device's speed: "
            + ("no faster, as predicted, since the halves take turns." if verdict == "no faster" else
               f"faster in every round though the devices took turns, {why}"))
    return "02.naive_speedup", verdict, text, {"speedup": s, "repeats": len(s.values)}


def naive_anchor_rows(run: NaiveRun) -> list[dict]:
    """The modelled naive slowdown beside the tutorial's, and what sets it: the activation's copy.
    Each column names its hardware: the tutorial's GPUs are not named, so only the lesson's node runs."""
    pace, one = run.pace, run.one_device.step_time.median
    images = resnet50.EMULATED_BATCH  # the tutorial's whole batch crosses the cut
    nbytes, copy_s = pace.copy_bytes(images), pace.copy_seconds(images)
    pcie = pace.copy_seconds(images, specs.LINKS["pcie4"])
    key = "tutorial_naive_mp_slowdown"
    published, there = anchors.anchor(key).value, f"tutorial (training steps; {anchors.published_hardware(key)})"
    here = f"here (forward, modelled on {pace.node})"
    return [{"figure": "naive slower than one device", there: f"{published - 1:.0%}",
             here: f"{1 / run.speedup.median - 1:.1%}"},
            {"figure": f"the activation's copy ({nbytes / 1e6:.0f} MB)", there: "-",
             here: f"{copy_s * 1e3:.2f} ms over {pace.node.link.name}, {copy_s / one:.1%}"},
            {"figure": "the same copy over PCIe 4 x16", there: "-", here: f"{pcie * 1e3:.2f} ms, {pcie / one:.1%}"}]

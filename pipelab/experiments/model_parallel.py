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

Where the machine lacks two GPUs the lessons run on an emulated node: `ResNet50Pace` paces the
virtual devices (`streams.virtual.Pace`) so that each split's forward on a device and each copy
between them lasts what the device and link models give for the PyTorch tutorial's ResNet-50 at
its size (batches of 120 images of 128 x 128), counted on the meta device (`emulate.cost`). The
real math stays the small SplitResNet, checked against the one-device model as everywhere.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from typing import Hashable, Mapping, Sequence, TypeVar

import torch
from torch import nn

from pipelab import hardware
from pipelab import model_parallel as mp
from pipelab.checks import same_batch, whole_number
from pipelab.emulate import anchors, calibrated, cost, specs
from pipelab.measure import Measured, alternate, compare_medians, ratios
from pipelab.models import SplitResNet
from pipelab.reference import assert_same, exact_fp32, reference_run
from pipelab.streams import Device, Pace, timeline
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

    @cached_property
    def x_first(self) -> torch.Tensor:
        """The batch on device 0, moved there once (from pinned memory on a GPU), before any timing:
        a forward then times the devices, not a host-to-GPU copy per split."""
        return self.devs[0].own(self.x)

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
# The emulated node: the tutorial's ResNet-50, its time modelled, beside the real small model
# ---------------------------------------------------------------------------------------------

EMULATED_BATCH = 120  # the tutorial's batch: 120 images of 128 x 128, 1000 classes
EMULATED_IMAGE = 128
CUTS = {"layer1": 1, "layer2": 2, "layer3": 3}  # ResNet-50 cut after this stage (the tutorial: layer2)


class Bottleneck(nn.Module):
    """ResNet-50's block (torchvision's v1.5: the stride in the 3x3 convolution), for counting."""

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out = 4 * width
        self.body = nn.Sequential(nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
        self.down = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                     if stride != 1 or cin != out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.down(x))


def resnet50_halves(cut: str = "layer2") -> tuple[nn.Module, nn.Module]:
    """ResNet-50 (1000 classes) on the meta device, in two halves cut after stage `cut`: the stem
    and the stages up to `cut` (device 0); the rest, the pooling and fc (device 1)."""
    if cut not in CUTS:
        raise ValueError(f"cut={cut!r}: cut ResNet-50 after one of {', '.join(CUTS)} (the tutorial: 'layer2')")
    with torch.device("meta"):
        stages, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stages.append(nn.Sequential(Bottleneck(cin, width, stride), *(Bottleneck(4 * width, width)
                                                                           for _ in range(blocks - 1))))
            cin = 4 * width
        stem = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
        at = CUTS[cut]
        return (nn.Sequential(*stem, *stages[:at]),
                nn.Sequential(*stages[at:], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)))


_HALF_COUNTS: dict = {}  # (cut, image, dtype) -> counts of each half at 1 and 2 images


def half_counts(cut: str = "layer2", image: int = EMULATED_IMAGE, dtype: str = "float32") -> dict:
    """FLOPs, bytes and kernels of each half's forward at 1 and 2 images, counted on the meta device
    (`emulate.cost.count`), with the shape of the activation crossing the cut. Every layer works on
    each image alone, so a count is affine in the images: the weights once, the activations per
    image; two counts give any batch (`Counts` at n images = c1 + (n - 1)(c2 - c1))."""
    key = (cut, image, dtype)
    if key not in _HALF_COUNTS:
        first, second = resnet50_halves(cut)
        floating = specs.torch_dtype(dtype)
        x = {n: torch.empty(n, 3, image, image, device="meta", dtype=floating) for n in (1, 2)}
        h = {n: cost.meta_module(first, floating)(x[n]) for n in (1, 2)}
        _HALF_COUNTS[key] = {"seq1": {n: cost.count(cost.meta_module(first, floating), x[n]) for n in (1, 2)},
                             "seq2": {n: cost.count(cost.meta_module(second, floating), h[n]) for n in (1, 2)},
                             "cut": tuple(h[1].shape[1:]), "element_size": h[1].element_size()}
    return _HALF_COUNTS[key]


class ResNet50Pace(Pace):
    """Paces lessons 02-04's virtual devices as `node`'s GPUs running the PyTorch tutorial's
    ResNet-50 cut after `cut`, at batches of 120 images of 128 x 128 in `dtype` (float32: TF32
    off, as in the lessons' checks), while the real math is the lesson's small model.

    Each of the lesson's `real_batch` rows stands for 120 / real_batch images. A split of r rows
    then lasts, on its stream: `seq1` the first half's counts at that many images over the GPU's
    calibrated model (`emulate.cost.compute_seconds`: the longer of the kernels' launches and their
    FLOPs and bytes at the efficiency measured on that GPU); `second_half` the second half's; the whole model both; a copy the cut's
    activation of those images over the link (latency + bytes / bandwidth)."""

    def __init__(self, node, real_batch: int, cut: str = "layer2", dtype: str = "float32") -> None:
        super().__init__()
        whole_number("real_batch", real_batch, example="the lesson's batch, e.g. 120")
        self.node, self.cut, self.dtype = specs.parse_node(node), cut, dtype
        self.images_per_row = EMULATED_BATCH / real_batch
        self.counts = half_counts(cut, EMULATED_IMAGE, dtype)

    @classmethod
    def on(cls, node: str | None, real_batch: int, cut: str = "layer2") -> "ResNet50Pace | None":
        """The pace of `node` (None where nothing is emulated: then there is no pace)."""
        return None if node is None else cls(node, real_batch, cut)

    def label(self, index: int) -> str:
        """Paced device `index` on the timeline: the emulated GPU it stands for, not this machine's CPU."""
        return f"emulated {self.node.device.name.removeprefix('NVIDIA ')}:{index}"

    @property
    def size(self) -> str:
        """The emulated size, in words, for the lesson's first line."""
        return (f"the PyTorch tutorial's ResNet-50 cut after {self.cut}, batches of {EMULATED_BATCH} images of "
                f"{EMULATED_IMAGE} x {EMULATED_IMAGE} in {self.dtype}; each real sample stands for "
                + ("one image" if self.images_per_row == 1 else f"{self.images_per_row:g} images"))

    def half(self, name: str, images: float) -> cost.Counts:
        """The counts of half `name` ("seq1" or "seq2") on `images` images."""
        one, two = self.counts[name][1], self.counts[name][2]
        return cost.Counts(one.flops + (images - 1) * (two.flops - one.flops),
                           one.bytes + (images - 1) * (two.bytes - one.bytes), one.kernels)

    def half_seconds(self, name: str, images: float) -> float:
        return cost.compute_seconds(self.half(name, images), self.node.device, self.dtype)

    def copy_bytes(self, images: float) -> float:
        return images * math.prod(self.counts["cut"]) * self.counts["element_size"]

    def copy_seconds(self, images: float) -> float:
        return cost.message_seconds(self.copy_bytes(images), self.node.link)

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
        raise ValueError(f"an emulated device paces seq1, second_half, the whole model and copies; got {fn!r} "
                         f"({kind}): submit one of those, or run on this machine's cores (emulate=None)")


def pace_of(devs: Sequence[Device]) -> ResNet50Pace | None:
    """The pace of paced virtual devices (an emulated node), else None."""
    return getattr(devs[0], "pace", None)


def where(devs: Sequence[Device]) -> str:
    """The devices a run timed, in words: the emulated node, the GPUs, or this machine's cores."""
    pace = pace_of(devs)
    if pace is not None:
        return f"the emulated {pace.node}"
    if devs[0].torch_device.type == "cuda":
        import torch.cuda

        return f"{torch.cuda.get_device_name(devs[0].torch_device)} x 2 ({devs[0].name}, {devs[1].name})"
    return f"this machine's CPU ({hardware.cpu_cores()} cores, a thread per stream)"


def lesson_flops(*, channels: int, blocks, batch: int, size: int, expansion: int = 1, forwards: int,
                 train_steps: int) -> float:
    """FLOPs a lesson's run of the SplitResNet does: `forwards` forwards of the whole batch and
    `train_steps` training steps (a forward and a backward, counted together), counted on the meta
    device (`emulate.cost.forward_backward_counts`): the figure of a `gpu` profile's budget."""
    pair = (blocks, blocks) if isinstance(blocks, int) else tuple(blocks)
    with torch.device("meta"):
        model = SplitResNet(channels, pair, expansion=expansion)
    x = torch.empty(batch, 3, size, size, device="meta")
    f, i, w = cost.forward_backward_counts(model, x)
    return forwards * f.flops + train_steps * (f.flops + i.flops + w.flops)


# ---------------------------------------------------------------------------------------------
# One forward, one training step, checked against the one-device model
# ---------------------------------------------------------------------------------------------


def forward(cfg: Config, f: Forward, model: nn.Module | None = None) -> torch.Tensor:
    """The forward `f` of `model` (default: the Config's) on the Config's batch and devices."""
    model, x, devs = cfg.model if model is None else model, cfg.x_first, list(cfg.devs)
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
    """Wait for the devices' queued work and clear their recorders: what follows is one run's
    (on paced devices, from modelled time 0)."""
    for d in devs:
        d.synchronize()
    for d in devs:
        d.rec.clear()
        d.restart_clock()


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


GPU_TOLERANCE = 1e-4  # float32 on GPUs against the CPU reference, TF32 off: other summation orders


def tolerance(devs: Sequence[Device], tol: float = 1e-5) -> float:
    """The tolerance a check against the CPU reference uses: `tol` on CPU devices; on GPUs (TF32
    off) at least `GPU_TOLERANCE`, since cuDNN sums in other orders than the CPU does."""
    return max(tol, GPU_TOLERANCE) if devs[0].torch_device.type == "cuda" else tol


def check_against_one_device(cfg: Config, f: Forward, tol: float = 1e-5) -> float:
    """Run one step of `f` and of a one-device copy of the model (same weights, same data);
    assert the losses and every gradient match (within `tolerance(cfg.devs, tol)`, TF32 off);
    return the loss."""
    cfg.fits(f)
    host_copy = copy.deepcopy(cfg.model).cpu()  # the halves may sit on two GPUs
    ref = reference_run(host_copy, cfg.x.cpu(), cfg.y.cpu(), nn.functional.cross_entropy, lr=None)
    cfg.model.zero_grad()
    with exact_fp32():  # TF32 off: a float32 check at 1e-5 would fail on precision, not correctness
        loss, _ = train_step(cfg, f)
    grads = {name: None if p.grad is None else p.grad.cpu() for name, p in cfg.model.named_parameters()}
    run = ModelParallelRun(str(f), [loss.item()], grads)
    tol = tolerance(cfg.devs, tol)
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
    thread, so it would not show the devices working in parallel. On paced devices (an emulated
    node) a forward's time is its modelled end: every round gives the same figure, and no warm-up
    round is needed."""
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
            seconds = tl.end if paced else now() - start  # paced: the modelled end, from 0
            timelines[key].append(tl)
            return seconds
        return run

    with torch.no_grad():
        seconds = alternate({key: timed(key, f) for key, f in forwards.items()}, cfg.repeats,
                            warmup=0 if paced else 1)
    labels = (devs[0].label, devs[1].label)
    return {key: Timed(Measured.of(seconds[key]), timelines[key][-cfg.repeats:], labels)  # warm-up dropped
            for key in forwards}


# ---------------------------------------------------------------------------------------------
# Lesson 02: naive model parallel against one device
# ---------------------------------------------------------------------------------------------


@dataclass
class NaiveRun:
    """The naive two-device forward and the one-device forward, timed in the same rounds, on
    `where` (in words); `pace` is the emulated node's, or None."""

    one_device: Timed
    naive: Timed
    where: str = "these devices"
    pace: ResNet50Pace | None = None

    @property
    def speedup(self) -> Measured:
        """The speedup, one definition throughout: per round, one device's time over naive's; the
        figure is the median of those ratios, its range their min-max (`rounds` lists them)."""
        return speedup(self.one_device, self.naive)

    def rounds(self) -> list[dict]:
        """Per round: both times and their ratio, the figures `speedup` is computed from."""
        return [{"round": i + 1, "one device (ms)": f"{a * 1e3:.2f}", "naive (ms)": f"{b * 1e3:.2f}",
                 "one device / naive": f"{a / b:.3f}"}
                for i, (a, b) in enumerate(zip(self.one_device.seconds.values, self.naive.seconds.values))]


def naive_run(cfg: Config) -> NaiveRun:
    """Lesson 02's measurement: one device and naive model parallel, `cfg.repeats` rounds."""
    runs = time_forwards(cfg, {"one device": Forward("one_device"), "naive": Forward("naive")})
    return NaiveRun(runs["one device"], runs["naive"], where(cfg.devs), pace_of(cfg.devs))


def speed_verdict(ratio: Measured) -> str:
    """'faster', 'slower' or 'within noise': the direction of a speedup (old time / new time),
    claimed only when every round agrees, i.e. its whole min-max range lies above or below 1."""
    if ratio.low > 1.0:
        return "faster"
    if ratio.high < 1.0:
        return "slower"
    return "within noise"


def naive_verdict(run: NaiveRun) -> tuple[str, str, str, dict]:
    """Lesson 02's conclusion: was naive model parallelism faster than one device in every round?
    On an emulated node, beside the tutorial's published 7%, and why they differ."""
    s, repeats = run.speedup, len(run.naive.seconds.values)
    figures = {"speedup": s, "repeats": repeats}
    how = (f"speedup {s:.3f}x: one device's time over naive's in each of {repeats} rounds, median (min-max); "
           f"medians {run.one_device.seconds.median * 1e3:.2f} ms and {run.naive.seconds.median * 1e3:.2f} ms")
    if speed_verdict(s) != "faster":
        text = (f"on {run.where}, naive model parallelism was no faster than one device ({how}), as predicted "
                f"(at most 1x: the halves take turns).")
        verdict = "no faster"
    else:
        text = (f"on {run.where}, naive model parallelism came out faster than one device in every round ({how}), "
                f"although the devices took turns (utilization above). That is not parallelism: on a CPU each half "
                f"ran on a core of its own, with a smaller working set in that core's cache than the whole model "
                f"on one core. The theory's answer stays at most 1x.")
        verdict = "faster"
    if run.pace is not None:
        text += " " + naive_anchor_text(run)
        figures["published_slowdown"] = anchors.anchor("tutorial_naive_mp_slowdown").value
    return ("02.naive_speedup", verdict, text, figures)


def naive_anchor_text(run: NaiveRun) -> str:
    """The emulated naive slowdown beside the tutorial's 4.02 s / 3.75 s, and why they differ: what
    the copy costs here, and what it would cost over PCIe 4."""
    pace, published = run.pace, anchors.anchor("tutorial_naive_mp_slowdown")
    slowdown = 1 / run.speedup.median
    one = run.one_device.seconds.median
    copy_s = pace.copy_seconds(EMULATED_BATCH)
    pcie = cost.message_seconds(pace.copy_bytes(EMULATED_BATCH), specs.LINKS["pcie4"])
    return (f"The tutorial published naive {published.value - 1:.0%} slower than one GPU (4.02 s against 3.75 s); "
            f"here it is {slowdown - 1:.1%} slower. All of the difference here is the copy of the activation, "
            f"{pace.copy_bytes(EMULATED_BATCH) / 1e6:.0f} MB over {pace.node.link.name} in {copy_s * 1e3:.2f} ms, "
            f"{copy_s / one:.1%} of the one-device forward ({one * 1e3:.1f} ms). They differ because the tutorial "
            f"times training steps (the backward sends a gradient of the same size back) on GPUs it does not name, "
            f"and the link decides the copy's share: over PCIe 4 x16 the same copy takes {pcie * 1e3:.2f} ms, "
            f"{pcie / one:.1%} of this forward.")


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
    where: str = "these devices"  # the devices it ran on, in words
    pace: ResNet50Pace | None = None  # the emulated node's, or None

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
    (the whole batch at once), all timed in the same alternating rounds (`time_forwards`). One
    device split by split with one split IS the baseline: that entry is the baseline's own rounds
    (1.00x), not a second measurement of the same forward."""
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
    sample = mp.cut_shape(cfg.model, cfg.x[:1])
    return SweepRun(base, sweeps, cfg.batch, math.prod(sample) * cfg.x.element_size(), where(cfg.devs),
                    pace_of(cfg.devs))


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
    exact = " (modelled time: every round gives the same figures)" if run.pace is not None else ""
    text = (f"on {run.where}, the speedup curve: {shape}{exact}. The best split_size={best} reached "
            f"{sweep.speedup[best]:.2f}x; " + "; ".join(ends) + ".")
    return ("03.curve_shape", shape, text, {"best_split": best, "best": sweep.speedup[best],
                                            "interior": best not in (small, large),
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
    alone = by_split.speedup[s]
    if speed_verdict(alone) == "faster" and run.pace is None:
        layer_mib = run.batch * run.sample_bytes / 2**20  # one layer's activations for the whole batch
        parts.append(f"The bound assumes a device takes the same time per sample at any batch size; on "
                     f"{run.where} it did not: one device alone, running the same splits one after another, was "
                     f"{alone:.2f}x faster than on the whole batch, most likely because a split's activations stay "
                     f"in the core's caches and the batch's do not (one layer's activations: {layer_mib:.1f} MiB "
                     f"for the batch of {run.batch}, {layer_mib * s / run.batch:.2f} MiB for a split).")
    elif speed_verdict(alone) == "slower":
        parts.append(f"The bound assumes a device takes the same time per sample at any split size; on {run.where} "
                     f"it did not: one device alone, running the same {k} splits one after another, took "
                     f"{1 / alone.median:.2f}x its time on the whole batch." + (" " + launch_text(run, s)
                                                                                 if run.pace is not None else ""))
    else:
        parts.append(f"Splitting alone did not make one device faster or slower in every round (split by split: "
                     f"{alone:.2f}x).")
    gain = run.overlap_gain(s)
    if gain.low > bound:
        against = "above the bound in every round: more than the overlap model explains"
    elif gain.median > bound:
        against = "above the bound in some rounds but not in all: within noise of it"
    else:
        against = "within the bound"
    parts.append(f"What the overlap itself bought (pipelined over split by split) was {gain:.2f}x, {against}.")
    if speed_verdict(gain) != "faster" and run.pace is None and run.where.startswith("this machine"):
        parts.append(f"Overlap pays only when each device has a core to itself; while this ran, the machine's "
                     f"{_load()}.")
    verdict = "overlap above the bound" if gain_above else "overlap within the bound"
    return ("03.bound", verdict, " ".join(parts),
            {"split_size": s, "bound": bound, "speedup": piped.speedup[s], "split_by_split": by_split.speedup[s],
             "overlap_gain": gain, "above_in_every_round": gain_above})


def launch_text(run: SweepRun, split_size: int) -> str:
    """On an emulated node: what share of a split's modelled time its kernel launches take."""
    pace = run.pace
    images = split_size * pace.images_per_row
    kernels = pace.half("seq1", images).kernels + pace.half("seq2", images).kernels
    per_split = pace.half_seconds("seq1", images) + pace.half_seconds("seq2", images)
    launch = calibrated.efficiency_of(pace.node.device).launch_s
    return (f"Every split launches the model's {kernels} kernels again ({launch * 1e6:.1f} us each, the launch floor measured for "
            f"this GPU kind): at split_size={split_size}, launches are {min(1.0, kernels * launch / per_split):.0%} "
            f"of a split's modelled {per_split * 1e3:.2f} ms on the {pace.node.device.name}.")


def modelled_speedups(node, cut: str, split_sizes: Sequence[int], batch: int = EMULATED_BATCH) -> dict[int, float]:
    """The pipelined forward's speedup over one device at each split size, from the pipeline formula
    (`model_parallel.pipeline_time`) with `node`'s modelled per-split costs of the tutorial's ResNet-50
    (no run), with `batch` rows standing for the tutorial's 120 images: the paced run's figures on
    `node`, where the splits are equal."""
    pace = ResNet50Pace(node, batch, cut)
    images = pace.images_per_row  # emulated images per row of the batch
    one = pace.half_seconds("seq1", batch * images) + pace.half_seconds("seq2", batch * images)
    out = {}
    for s in split_sizes:
        a, c, b = (pace.half_seconds("seq1", s * images), pace.copy_seconds(s * images),
                   pace.half_seconds("seq2", s * images))
        out[s] = one / mp.pipeline_time([a, c + b], -(-batch // s))
    return out


TUTORIAL_SPLITS = (1, 3, 5, 8, 10, 12, 20, 40, 60, 120)  # the split sizes the tutorial tried, and one split


def anchor_rows(run: SweepRun) -> list[dict]:
    """The tutorial's published speedups beside this run's at the same split sizes (where it ran
    them) and the best split of each."""
    piped = run["pipelined"]
    rows = []
    for split, key in ((20, "tutorial_pipeline_split20_speedup"), (12, "tutorial_pipeline_split12_speedup")):
        here = piped.speedup.get(split)
        rows.append({"figure": f"pipelined speedup, split size {split}", "published": f"{anchors.anchor(key).value:.2f}x",
                     f"here ({run.where})": "not run" if here is None else f"{here.median:.2f}x"})
    best = piped.best_split
    rows.append({"figure": "best split size (speedup)", "published": f"12 ({anchors.anchor('tutorial_pipeline_split12_speedup').value:.2f}x)",
                 f"here ({run.where})": f"{best} ({piped.speedup[best].median:.2f}x)"})
    return rows


def anchor_verdict(run: SweepRun, slower_node: str = "2xT4") -> tuple[str, str, str, dict]:
    """Lesson 03: the emulated sweep beside the tutorial's published +49% (split 20) and +54%
    (split 12, its best); where they differ, why, computed: the forward alone against a training
    step, the launches' share of a split, and what the same formulas give on a slower card."""
    piped = run["pipelined"]
    best, published_best = piped.best_split, 12
    s20, s12 = anchors.anchor("tutorial_pipeline_split20_speedup").value, anchors.anchor("tutorial_pipeline_split12_speedup").value
    here = {s: piped.speedup[s].median for s in (20, 12) if s in piped.speedup}
    text = [f"the tutorial published +{s20 - 1:.0%} at split size 20 and +{s12 - 1:.0%} at 12, its best; on {run.where} "
            + ", ".join(f"split {s}: {v - 1:+.0%}" for s, v in here.items())
            + f", best split {best} ({piped.speedup[best].median - 1:+.0%})."]
    verdict = "same best split" if best == published_best else "other best split"
    if run.pace is not None:
        text.append("Here only the forward is timed; the tutorial times training steps (forward, backward, "
                    "optimizer).")
        if best > published_best:
            text.append(launch_text(run, published_best))
        slow = modelled_speedups(slower_node, run.pace.cut, TUTORIAL_SPLITS)
        slow_best = max(slow, key=slow.get)
        text.append(f"On a slower card the launches weigh less: the same formulas with the data sheet of "
                    f"{specs.parse_node(slower_node)} give the best split at {slow_best} ({slow[slow_best] - 1:+.0%}), "
                    f"{slow.get(20, float('nan')) - 1:+.0%} at 20 and {slow.get(12, float('nan')) - 1:+.0%} at 12, "
                    f"{'closer to' if abs(slow[slow_best] - s12) < abs(piped.speedup[best].median - s12) else 'no closer to'} "
                    f"the published figures: the tutorial's GPUs, which it does not name, are older than the H100, "
                    f"and the slower a card computes, the smaller the split at which launches stop mattering.")
    return ("03.anchor", verdict, " ".join(text), {"best_split": best, "published_best_split": published_best,
                                                   **{f"speedup_{s}": v for s, v in here.items()}})


def cores_verdict(emulated: SweepRun, cores: SweepRun) -> tuple[str, str, str, dict]:
    """Lesson 03: the same sweep on this machine's own cores beside the emulated one: which split
    won on each, what splitting alone did to one device, and what the overlap bought."""
    e, c = emulated["pipelined"], cores["pipelined"]
    shared = [s for s in cores.split_sizes if s in e.speedup]
    s = c.best_split
    alone_c, alone_e = cores["split_by_split"].speedup[s], emulated["split_by_split"].speedup
    gain = cores.overlap_gain(s)
    verdict = "same best split" if s == e.best_split else "other best split"
    direction = {"faster": "faster than on the whole batch in every round",
                 "slower": "slower than on the whole batch in every round",
                 "within noise": "neither faster nor slower in every round"}[speed_verdict(alone_c)]
    emulated_alone = (f"on the emulated GPU the same split size made it {alone_e[s].median:.2f}x"
                      if s in alone_e else "on the emulated GPU every split smaller than the batch made it slower "
                      f"({min(v.median for v in alone_e.values()):.2f}x at its smallest split)")
    text = (f"on {cores.where} the best split was {s} ({c.speedup[s]:.2f}x, median (min-max) of {cores.repeats} "
            f"rounds), on {emulated.where} {e.best_split} ({e.speedup[e.best_split].median:.2f}x). What splitting alone "
            f"did to one device differs: on the cores, one device split by split at split_size={s} was {direction} "
            f"({alone_c:.2f}x); {emulated_alone}, since there every split pays all the model's kernel launches again "
            f"and a small split fills the GPU's units poorly, where a CPU core has no launches to pay and keeps a "
            f"split's activations in its caches. The overlap itself (pipelined over split by split) bought {gain:.2f}x "
            f"on the cores, against a bound of {cores.bound(s):.2f}; the two compute threads share "
            f"{hardware.cpu_cores()} cores with everything else the machine runs ({_load()}), so the cores' "
            f"figures move from run to run where the emulated ones do not.")
    return ("03.cores", verdict, text, {"best_cores": c.best_split, "best_emulated": e.best_split,
                                        "shared_sizes": shared, "overlap_gain": gain})


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
    # modelled time has no noise: every round agrees exactly, so the direction needs no margin
    verdict = every_round if agree or run.pace is not None else "within noise"
    costs = split_costs(run["pipelined"].timed[best03])  # per split, from lesson 03's median run
    sim = simulated_forwards(costs, run.splits(best03))
    simulated = (f"With this run's per-split costs at split_size={best03} "
                 f"({', '.join(f'{name} {t * 1e3:.2f} ms' for name, t in costs.items())}) and a copy engine beside "
                 f"the compute units, as on a GPU, the pipeline formulas give {sim['pipelined'] * 1e3:.1f} ms before "
                 f"and {sim['dual_stream'] * 1e3:.1f} ms after: {sim['pipelined'] / sim['dual_stream']:.2f}x.")
    on_cpu = run.pace is None and run.where.startswith("this machine")
    cores = hardware.cpu_cores()
    if run.pace is not None:
        why = (f"On the emulated node each GPU has a copy engine beside its compute units, so a copy on its own "
               f"stream runs while device 1 computes; its copies take {costs['copy'] * 1e3:.2f} ms per split over "
               f"{run.pace.node.link.name}. ")
    elif on_cpu:
        why = (f"On {cores} CPU cores the copy is a memory copy on a third thread, competing with the two compute "
               f"threads for the same cores ({_load()} while this ran). ")
    else:
        why = ""
    if verdict == "faster":
        text = (f"on {run.where}, the copy stream was faster than lesson 03's best split in every round: {gain:.2f}x. "
                + why + simulated)
    elif verdict == "slower":
        text = (f"on {run.where}, the copy stream was slower than lesson 03's best split in every round: {gain:.2f}x. "
                + why + simulated)
    else:
        lean = (f"; every round was {every_round} on this run, but by less than a median moves between runs"
                if every_round != "within noise" else "")
        text = (f"on {run.where}, the copy stream and lesson 03's best split were within noise of each other "
                f"({gain:.2f}x{lean}). " + why + simulated)
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

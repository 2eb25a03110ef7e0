"""Lessons 02-04's emulated size: the PyTorch model-parallel tutorial's ResNet-50 in two halves.

The lessons compute with a small SplitResNet on this machine; on an emulated node each split's
forward on a device and each copy between the devices lasts what the device and link models give
for the tutorial's ResNet-50 (batches of 120 images of 128 x 128) at that many images, counted on
the meta device. `ResNet50Halves` holds those figures; the lessons' pace asks it for seconds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pipelab.emulate import calibrated, cost, specs

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
    """FLOPs, bytes and kernels of each half's forward at 1 and 2 images, counted on the meta device,
    with the shape of the activation crossing the cut. Every layer works on each image alone, so a
    count is affine in the images: two counts give any batch (at n images: c1 + (n - 1)(c2 - c1))."""
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


class ResNet50Halves:
    """`node`'s GPUs running the tutorial's ResNet-50 cut after `cut` in `dtype` (float32: TF32 off,
    as in the lessons' checks), where each of a lesson's `real_batch` rows stands for
    120 / real_batch images: the modelled seconds of a half's forward and of the cut's copy."""

    def __init__(self, node, real_batch: int, cut: str = "layer2", dtype: str = "float32") -> None:
        if isinstance(real_batch, bool) or not isinstance(real_batch, int) or real_batch < 1:
            raise ValueError(f"real_batch={real_batch!r}: give the lesson's batch, a whole number, e.g. 120")
        self.node, self.cut, self.dtype = specs.parse_node(node), cut, dtype
        self.images_per_row = EMULATED_BATCH / real_batch
        self.counts = half_counts(cut, EMULATED_IMAGE, dtype)

    def label(self, index: int) -> str:
        """Device `index` on the timeline: the emulated GPU it stands for, not this machine's CPU."""
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

    def copy_seconds(self, images: float, link=None) -> float:
        """The cut's activation of `images` images over `link` (default: the node's)."""
        return cost.message_seconds(self.copy_bytes(images), link or self.node.link)

    def split_seconds(self, rows: int) -> tuple[float, float, float]:
        """(device 0's half, the copy, device 1's half) for a split of `rows` of the lesson's rows."""
        images = rows * self.images_per_row
        return self.half_seconds("seq1", images), self.copy_seconds(images), self.half_seconds("seq2", images)

    def launch_share(self, rows: int) -> float:
        """The share of a split's modelled compute that its kernel launches take (at most 1)."""
        images = rows * self.images_per_row
        kernels = self.half("seq1", images).kernels + self.half("seq2", images).kernels
        per_split = self.half_seconds("seq1", images) + self.half_seconds("seq2", images)
        return min(1.0, kernels * calibrated.efficiency_of(self.node.device).launch_s / per_split)


def modelled_speedups(node, cut: str, split_sizes, batch: int = EMULATED_BATCH) -> dict[int, float]:
    """The pipelined forward's speedup over one device at each split size on `node`, from the
    pipeline formula (the first split crosses both stages, the slower stage paces the rest) with
    the modelled per-split costs: no run."""
    halves = ResNet50Halves(node, batch, cut)
    first, _, second = halves.split_seconds(batch)
    one = first + second  # one device, the whole batch, no copy
    out = {}
    for s in split_sizes:
        a, c, b = halves.split_seconds(s)
        stages, k = (a, c + b), -(-batch // s)
        out[s] = one / (sum(stages) + (k - 1) * max(stages))
    return out

"""Model parallelism in one process: a model split over two devices, driven through streams.

The model has two halves: `seq1` on device 0, `seq2` and `fc` on device 1 (`pipelab.models`
has `ToyModel` and `SplitResNet`). `forward_naive` runs the halves one after the other (one device
always idle); `forward_pipelined` cuts the batch into splits so device 1 works on split i while
device 0 works on split i+1; `forward_dual_stream` also moves the copies onto their own stream:
each lands in a buffer that device 1 owns, and an event per split tells device 1's compute
stream when it may read it. `raw_hazards` finds, on a timeline, the reads that came too early.
`forward_split_by_split` runs the splits one after another on one device: the baseline that
separates what overlap buys from what a smaller batch buys. `ideal_speedup` and `pipeline_time`
are the theory the lessons measure against.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from pipelab.checks import whole_number
from pipelab.streams import Device, Event
from pipelab.timeline import Timeline

HALVES = ("seq1", "seq2", "fc")  # seq1 runs on device 0, seq2 and fc on device 1

# cut_shape's memory: seq1 module -> {input shape: output shape}
_CUT_SHAPES: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def check_split_size(split_size: int, batch: int) -> None:
    """Refuse a split size that cannot cut the batch."""
    whole_number("split_size", split_size, example=f"a split size between 1 and {batch}")
    if split_size > batch:
        raise ValueError(f"split_size={split_size} is larger than the batch ({batch}); "
                         f"pick a split size between 1 and {batch}")


def check_halves(model: nn.Module) -> None:
    """Refuse a model that is not cut in the two halves the forwards run (`HALVES`)."""
    missing = [h for h in HALVES if not isinstance(getattr(model, h, None), nn.Module)]
    if missing:
        raise ValueError(f"the model has no {', '.join(missing)}: a two-device model runs seq1 on device 0 "
                         "and seq2, fc on device 1; use e.g. pipelab.models.ToyModel() or SplitResNet()")


def check_devices(devs: list[Device], halves: int = 2) -> None:
    """Refuse a device list that does not match the model's halves."""
    if len(devs) != halves:
        raise ValueError(f"got {len(devs)} devices but the model has {halves} halves; "
                         f"pass devices({halves})")


def place(model: nn.Module, devs: list[Device]) -> nn.Module:
    """Put `seq1` on device 0 and `seq2`, `fc` on device 1 (a no-op on virtual devices)."""
    check_halves(model)
    check_devices(devs)
    model.seq1.to(devs[0].torch_device)
    model.seq2.to(devs[1].torch_device)
    model.fc.to(devs[1].torch_device)
    return model


def second_half(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Device 1's part of the model: `seq2`, then `fc`, on the activation `h` from device 0."""
    return model.fc(model.seq2(h))


def forward_one_device(model: nn.Module, x: torch.Tensor, dev: Device) -> torch.Tensor:
    """The reference: the whole model on one device's compute stream."""
    return dev.stream("compute").submit(model, dev.own(x), kind="F").result()


def forward_split_by_split(model: nn.Module, x: torch.Tensor, dev: Device, split_size: int) -> torch.Tensor:
    """The whole model on one device, one split after another: the same kernels as the pipelined
    forward, with no second device to overlap them. Pipelined over this is what overlap buys;
    this over `forward_one_device` is what the smaller batch alone buys."""
    check_split_size(split_size, x.shape[0])
    s0 = dev.stream("compute")
    outs = [s0.submit(model, dev.own(xs), kind="F", mb=i) for i, xs in enumerate(x.split(split_size))]
    return torch.cat([o.result() for o in outs])


def forward_naive(model: nn.Module, x: torch.Tensor, devs: list[Device]) -> torch.Tensor:
    """Device 0 runs seq1, its output is copied to device 1, which runs the rest: one device idles."""
    check_devices(devs)
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    h = s0.submit(model.seq1, devs[0].own(x), kind="F", mb=0)
    h1 = s1.copy(h, mb=0)
    return s1.submit(second_half, model, h1, kind="F", mb=0).result()


def forward_pipelined(model: nn.Module, x: torch.Tensor, devs: list[Device], split_size: int) -> torch.Tensor:
    """Cut the batch into splits: while device 1 runs split i, device 0 already runs split i+1."""
    check_devices(devs)
    check_split_size(split_size, x.shape[0])
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        h1 = s1.copy(h, mb=i)  # the copy sits in device 1's compute queue
        outs.append(s1.submit(second_half, model, h1, kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


def ideal_speedup(splits: int) -> float:
    """The most that pipelining `splits` splits over 2 devices can gain over one device: 2k/(k+1).

    With halves of cost a each, one device takes 2a; the pipeline takes a/k (device 0's first
    split, device 1 idle) plus k splits of a/k on device 1: (k+1)a/k. Unequal halves or copies
    only lower it; one split (k=1) is the naive forward, 1x."""
    whole_number("splits", splits, example="splits=4")
    return 2 * splits / (splits + 1)


def pipeline_time(stage_costs: list[float], splits: int) -> float:
    """Time for `splits` equal splits to pass stages that each take one split at a time, in
    order (a flow shop): the first split crosses every stage, then the slowest stage sets the
    pace for the other k-1. Stages (device 0, copy, device 1) with times per split."""
    whole_number("splits", splits, example="splits=4")
    return sum(stage_costs) + (splits - 1) * max(stage_costs)


def cut_shape(model: nn.Module, xs: torch.Tensor) -> torch.Size:
    """The shape of `model.seq1(xs)`, worked out on the meta device: shapes flow through the
    layers, no data is read and nothing is computed. The receiver needs it to allocate its buffer
    before the sender has computed anything (torch.distributed.pipelining infers the shapes sent
    between stages the same way). Remembered per `seq1` and input shape."""
    known = _CUT_SHAPES.setdefault(model.seq1, {})
    if xs.shape not in known:
        # a meta copy of seq1, not the module itself: device 0 may be running it right now
        on_meta = copy.deepcopy(model.seq1).to("meta")
        known[xs.shape] = on_meta(xs.to("meta")).shape
    return known[xs.shape]


def forward_dual_stream(model: nn.Module, x: torch.Tensor, devs: list[Device], split_size: int,
                        use_events: bool = True) -> torch.Tensor:
    """Pipelined forward with each split's copy on device 1's own copy stream, into a buffer that
    device 1 owns. Compute reads the buffer; an event per split is the only thing that makes it
    wait until the copy has landed. `use_events=False` drops the waits (a race: run it only under
    `torch.no_grad()`; the buffers then start as NaN so an early read shows)."""
    check_devices(devs)
    check_split_size(split_size, x.shape[0])
    if not use_events and torch.is_grad_enabled():
        raise ValueError("use_events=False lets compute read a buffer while its copy is in flight; "
                         "run it under torch.no_grad() so the race stays out of autograd")
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    copy_stream = devs[1].stream("copy")
    poison = None if use_events else float("nan")  # without events, make an early read visible
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        buf = copy_stream.empty(cut_shape(model, xs), xs.dtype, fill=poison)  # memory device 1 owns
        copy_stream.copy(h, out=buf, mb=i)  # waits for h on device 0, then fills buf
        landed = Event()
        landed.record(copy_stream)  # marks the end of split i's copy
        if use_events:
            s1.wait(landed)  # compute on device 1 never reads buf before its copy lands
        outs.append(s1.submit(second_half, model, buf, kind="F", mb=i))  # buf is a plain tensor: no implicit wait
    return torch.cat([o.result() for o in outs])


def raw_hazards(tl: Timeline, rank: int | str) -> list[int]:
    """Splits whose compute on `rank` started before their copy had landed: read-after-write
    (RAW) hazards, as CUDA's compute-sanitizer calls them. The reader may have seen the buffer
    before the writer filled it."""
    landed = {s.mb: s.end for s in tl.filter(rank=rank, kind="copy")}
    reads = tl.filter(rank=rank, lane="compute", kind="F")
    return sorted({s.mb for s in reads if s.mb in landed and s.start < landed[s.mb]})

"""Model parallelism in one process: a model split over two devices, driven through streams.

`forward_naive` runs the halves one after the other (one device always idle); `forward_pipelined`
cuts the batch into splits so device 1 works on split i while device 0 works on split i+1;
`forward_dual_stream` also moves the copies onto their own stream: each lands in a buffer that
device 1 owns, and an event per split tells device 1's compute stream when it may read it.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Callable

import torch
from torch import nn

from pipelab.streams import Device, Event, Stream, timeline
from pipelab.timeline import Timeline, now

# cut_shape's memory: seq1 module -> {input shape: output shape}
_CUT_SHAPES: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


class ToyModel(nn.Module):
    """The two-device toy model of the PyTorch tutorial: Linear 10->10, ReLU on device 0; Linear 10->5 on device 1."""

    def __init__(self) -> None:
        super().__init__()
        self.seq1 = nn.Sequential(nn.Linear(10, 10), nn.ReLU())
        self.seq2 = nn.Linear(10, 5)
        self.fc = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.seq2(self.seq1(x)))


class _Block(nn.Module):
    """A residual block: x + conv(relu(conv(x)))."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class SplitResNet(nn.Module):
    """A small ResNet-style CNN in two halves: `seq1` (device 0), `seq2` and `fc` (device 1).

    `blocks_per_half` is a number of residual blocks for each half, or a pair (seq1's, seq2's)
    to make one half heavier than the other.

    `expansion` > 1 cuts the model in the wide middle of an inverted bottleneck (MobileNetV2,
    ConvNeXt, a transformer's MLP): `seq1` ends with a 1x1 convolution to expansion x channels,
    `seq2` starts with one back. The activation crossing devices is then `expansion` times bigger
    for little extra compute, as when a pipeline is cut where activations are wide."""

    def __init__(self, channels: int = 32, blocks_per_half: int | tuple[int, int] = 2, num_classes: int = 10,
                 expansion: int = 1) -> None:
        super().__init__()
        blocks1, blocks2 = (blocks_per_half, blocks_per_half) if isinstance(blocks_per_half, int) else blocks_per_half
        widen = [nn.Conv2d(channels, expansion * channels, 1), nn.ReLU()] if expansion > 1 else []
        narrow = [nn.Conv2d(expansion * channels, channels, 1), nn.ReLU()] if expansion > 1 else []
        self.seq1 = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(),
                                  *[_Block(channels) for _ in range(blocks1)], *widen)
        self.seq2 = nn.Sequential(*narrow, *[_Block(channels) for _ in range(blocks2)],
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.seq2(self.seq1(x)))


def _tail(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return model.fc(model.seq2(h))


def check_split_size(split_size: int, batch: int) -> None:
    """Refuse a split size that cannot cut the batch."""
    if not isinstance(split_size, int) or split_size <= 0 or split_size > batch:
        raise ValueError(f"split_size={split_size!r} must be an int in 1..{batch} (the batch size); "
                         f"pick a split size between 1 and {batch}")


def check_devices(devs: list[Device], halves: int = 2) -> None:
    """Refuse a device list that does not match the model's halves."""
    if len(devs) != halves:
        raise ValueError(f"got {len(devs)} devices but the model has {halves} halves; "
                         f"pass devices({halves})")


def place(model: nn.Module, devs: list[Device]) -> nn.Module:
    """Put `seq1` on device 0 and `seq2`, `fc` on device 1 (a no-op on virtual devices)."""
    check_devices(devs)
    model.seq1.to(devs[0].torch_device)
    model.seq2.to(devs[1].torch_device)
    model.fc.to(devs[1].torch_device)
    return model


def forward_one_device(model: nn.Module, x: torch.Tensor, dev: Device) -> torch.Tensor:
    """The reference: the whole model on one device's compute stream."""
    return dev.stream("compute").submit(model, dev.own(x), kind="F").result()


def forward_naive(model: nn.Module, x: torch.Tensor, devs: list[Device]) -> torch.Tensor:
    """Device 0 runs seq1, its output is copied to device 1, which runs the rest: one device idles."""
    check_devices(devs)
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    h = s0.submit(model.seq1, devs[0].own(x), kind="F", mb=0)
    h1 = s1.copy(h, mb=0)
    return s1.submit(_tail, model, h1, kind="F", mb=0).result()


def forward_pipelined(model: nn.Module, x: torch.Tensor, devs: list[Device], split_size: int) -> torch.Tensor:
    """Cut the batch into splits: while device 1 runs split i, device 0 already runs split i+1."""
    check_devices(devs)
    check_split_size(split_size, x.shape[0])
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        h1 = s1.copy(h, mb=i)  # the copy sits in device 1's compute queue
        outs.append(s1.submit(_tail, model, h1, kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


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
        outs.append(s1.submit(_tail, model, buf, kind="F", mb=i))  # buf is a plain tensor: no implicit wait
    return torch.cat([o.result() for o in outs])


def raw_hazards(tl: Timeline, rank: int | str) -> list[int]:
    """Splits whose compute on `rank` started before their copy had landed: read-after-write
    (RAW) hazards, as CUDA's compute-sanitizer calls them. The reader may have seen the buffer
    before the writer filled it."""
    landed = {s.mb: s.end for s in tl.filter(rank=rank, kind="copy")}
    reads = tl.filter(rank=rank, lane="compute", kind="F")
    return sorted({s.mb for s in reads if s.mb in landed and s.start < landed[s.mb]})


def _hold(stream: Stream) -> Callable[[], None]:
    """Keep `stream` busy, as if still running earlier work, until the returned release is
    called. A virtual device's thread waits on a gate; CUDA has no host-side gate, so a spin
    kernel keeps the GPU stream busy for about a second and release does nothing."""
    if stream.device.is_cuda:
        stream.submit(torch.cuda._sleep, 2_000_000_000, kind="held")  # ~1 s of clock cycles
        return lambda: None
    gate = threading.Event()
    stream.submit(gate.wait, 60, kind="held")  # 60 s: a forgotten gate cannot hang for ever
    return gate.set


def hazard_report(model: nn.Module, x: torch.Tensor, devs: list[Device], split_size: int,
                  use_events: bool, late_producer: bool = False) -> dict:
    """Run the dual-stream forward once, with or without events, and check it two ways: the
    splits whose output differs from the one-device model's, and the splits whose compute
    started before their copy landed (read from the timeline).

    `late_producer` holds device 0 until device 1 has run every split, as if device 0 were
    still busy with earlier work: without events every read then comes before its copy, by
    construction rather than by chance."""
    if late_producer and use_events:
        raise ValueError("late_producer=True with use_events=True: device 1 would wait for device 0, "
                         "which waits for device 1; hold device 0 only with use_events=False")
    with torch.no_grad():
        ref = copy.deepcopy(model).cpu()(x.cpu())
        for d in devs:
            d.synchronize()
            d.rec.clear()
        release = _hold(devs[0].stream("compute")) if late_producer else (lambda: None)
        try:
            out = forward_dual_stream(model, x, devs, split_size, use_events=use_events).cpu()
        finally:
            release()
        tl = timeline(devs)  # waits for copies still in flight
    wrong = [i for i, (o, r) in enumerate(zip(out.split(split_size), ref.split(split_size)))
             if not torch.allclose(o, r, rtol=1e-4, atol=1e-5)]
    return {"splits": len(ref.split(split_size)), "wrong_splits": wrong,
            "raw_hazards": raw_hazards(devs[1].timeline(), devs[1].label), "output": out,
            "reference": ref, "timeline": tl}


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, devs: list[Device],
               variant: str = "naive", split_size: int | None = None) -> tuple[torch.Tensor, Timeline]:
    """One forward and backward of `variant` (one_device, naive, pipelined, dual_stream);
    returns the loss and the timeline of the forward's kernels and copies."""
    for d in devs:
        d.synchronize()
        d.rec.clear()  # this step's spans only
    if variant == "one_device":
        out = forward_one_device(model, x, devs[0])
    elif variant == "naive":
        out = forward_naive(model, x, devs)
    elif variant == "pipelined":
        out = forward_pipelined(model, x, devs, split_size or x.shape[0])
    elif variant == "dual_stream":
        out = forward_dual_stream(model, x, devs, split_size or x.shape[0])
    else:
        raise ValueError(f"variant={variant!r}: use one of one_device, naive, pipelined, dual_stream")
    loss = nn.functional.cross_entropy(out, y.to(out.device))
    loss.backward()
    return loss.detach(), timeline(devs)


FORWARDS = {
    "one_device": lambda m, x, devs, split: forward_one_device(m, x, devs[0]),
    "naive": lambda m, x, devs, split: forward_naive(m, x, devs),
    "pipelined": forward_pipelined,
    "dual_stream": forward_dual_stream,
}


def _runnable(model: nn.Module, devs: list[Device], variant: str) -> nn.Module:
    """The model as `variant` runs it: on CUDA the one-device reference needs all of it on GPU 0."""
    if variant == "one_device" and devs[0].is_cuda:
        return copy.deepcopy(model).to(devs[0].torch_device)
    return model


def _time_once(model: nn.Module, x: torch.Tensor, devs: list[Device], variant: str,
               split_size: int | None) -> tuple[float, Timeline]:
    """Wall time (s) of one forward of `variant`, until every stream is done, and its timeline."""
    for d in devs:
        d.synchronize()
        d.rec.clear()
    t0 = now()
    FORWARDS[variant](model, x, devs, split_size)
    tl = timeline(devs)  # waits for every stream (on CUDA the forward only queues kernels)
    return now() - t0, tl


def time_forward(model: nn.Module, x: torch.Tensor, devs: list[Device], variant: str,
                 split_size: int | None = None, repeats: int = 3) -> tuple[float, Timeline]:
    """Best-of-`repeats` wall time (s) of one forward of `variant`, and that fastest run's
    timeline (the one least disturbed by whatever else the machine was doing).

    Only the forward is timed: on virtual devices autograd runs the backward on the calling
    thread, so it would not show the devices working in parallel."""
    best, tl = float("inf"), Timeline()
    model = _runnable(model, devs, variant)
    with torch.no_grad():
        FORWARDS[variant](model, x, devs, split_size)  # warm-up: thread start, allocator
        for _ in range(repeats):
            seconds, run = _time_once(model, x, devs, variant, split_size)
            if seconds < best:
                best, tl = seconds, run
    return best, tl


def split_sweeps(model: nn.Module, x: torch.Tensor, devs: list[Device], split_sizes: list[int],
                 variants: tuple[str, ...] = ("pipelined", "dual_stream"), repeats: int = 3) -> dict:
    """`split_sweep` of several variants, keyed by variant, against one one-device baseline.

    Timed in rounds: each round runs the one-device forward and every (variant, split size)
    once; each figure is the best of `repeats` rounds. On a machine whose load drifts during the
    sweep, all of them then see the same drift, not just the variant measured last."""
    for v in variants:
        if v not in ("pipelined", "dual_stream"):
            raise ValueError(f"variant={v!r}: a split sweep runs pipelined or dual_stream")
    for s in split_sizes:
        check_split_size(s, x.shape[0])
    whole = _runnable(model, devs, "one_device")
    runs = [("one_device", None)] + [(v, s) for v in variants for s in split_sizes]
    best = dict.fromkeys(runs, float("inf"))
    with torch.no_grad():
        for v, s in runs:  # warm-up: thread start, allocator
            FORWARDS[v](whole if v == "one_device" else model, x, devs, s)
        for _ in range(repeats):
            for v, s in runs:
                seconds, _ = _time_once(whole if v == "one_device" else model, x, devs, v, s)
                best[(v, s)] = min(best[(v, s)], seconds)
    base = best[("one_device", None)]
    sweeps = {}
    for v in variants:
        seconds = {s: best[(v, s)] for s in split_sizes}
        speedups = {s: base / t for s, t in seconds.items()}
        sweeps[v] = {"variant": v, "one_device_s": base, "seconds": seconds, "speedup": speedups,
                     "best_split": max(speedups, key=speedups.get)}
    return sweeps


def split_sweep(model: nn.Module, x: torch.Tensor, devs: list[Device], split_sizes: list[int],
                repeats: int = 3, variant: str = "pipelined") -> dict:
    """Forward time of `variant` (pipelined or dual_stream) for each split size, its speedup
    over the one-device forward measured in the same sweep, and the best split size."""
    return split_sweeps(model, x, devs, split_sizes, (variant,), repeats)[variant]


def check_against_one_device(model: nn.Module, x: torch.Tensor, y: torch.Tensor, devs: list[Device],
                             variant: str, split_size: int | None = None, tol: float = 1e-5) -> float:
    """Run one step of `variant` and of a one-device copy of the model (same weights, same data);
    assert the losses and every gradient match; return the loss."""
    ref = copy.deepcopy(model).cpu()
    ref_loss = nn.functional.cross_entropy(ref(x), y)
    ref_loss.backward()
    model.zero_grad()
    loss, _ = train_step(model, x, y, devs, variant, split_size)
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=tol, rtol=tol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    return float(loss)

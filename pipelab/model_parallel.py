"""Model parallelism in one process: a model split over two devices, driven through streams.

`forward_naive` runs the halves one after the other (one device always idle); `forward_pipelined`
cuts the batch into splits so device 1 works on split i while device 0 works on split i+1;
`forward_dual_stream` also moves the copies onto their own stream, guarded by events.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelab.streams import Device, Event, timeline
from pipelab.timeline import Timeline, now


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
    """A small ResNet-style CNN in two halves: `seq1` (device 0), `seq2` and `fc` (device 1)."""

    def __init__(self, channels: int = 32, blocks_per_half: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        self.seq1 = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(),
                                  *[_Block(channels) for _ in range(blocks_per_half)])
        self.seq2 = nn.Sequential(*[_Block(channels) for _ in range(blocks_per_half)],
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


def forward_dual_stream(model: nn.Module, x: torch.Tensor, devs: list[Device], split_size: int,
                        use_events: bool = True) -> torch.Tensor:
    """Pipelined forward with copies on device 1's own copy stream; an event per split makes the
    compute stream wait until that split's copy has landed."""
    check_devices(devs)
    check_split_size(split_size, x.shape[0])
    s0, s1, copy = devs[0].stream("compute"), devs[1].stream("compute"), devs[1].stream("copy")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        h1 = copy.copy(h, mb=i)
        landed = Event()
        landed.record(copy)
        if use_events:
            s1.wait(landed)  # compute on device 1 never reads h1 before its copy lands
        outs.append(s1.submit(_tail, model, h1, kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


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


def time_forward(model: nn.Module, x: torch.Tensor, devs: list[Device], variant: str,
                 split_size: int | None = None, repeats: int = 3) -> tuple[float, Timeline]:
    """Best-of-`repeats` wall time (s) of one forward of `variant`, and the last run's timeline.

    Only the forward is timed: on virtual devices autograd runs the backward on the calling
    thread, so it would not show the devices working in parallel."""
    best, tl = float("inf"), Timeline()
    if variant == "one_device" and devs[0].is_cuda:
        import copy

        model = copy.deepcopy(model).to(devs[0].torch_device)  # the whole model on GPU 0
    with torch.no_grad():
        FORWARDS[variant](model, x, devs, split_size)  # warm-up: thread start, allocator
        for _ in range(repeats):
            for d in devs:
                d.synchronize()
                d.rec.clear()
            t0 = now()
            FORWARDS[variant](model, x, devs, split_size)
            best = min(best, now() - t0)
            tl = timeline(devs)
    return best, tl


def split_sweep(model: nn.Module, x: torch.Tensor, devs: list[Device], split_sizes: list[int],
                repeats: int = 3) -> dict:
    """Speedup of the pipelined forward over the one-device forward, for each split size."""
    for s in split_sizes:
        check_split_size(s, x.shape[0])
    base, _ = time_forward(model, x, devs, "one_device", repeats=repeats)
    speedups = {s: base / time_forward(model, x, devs, "pipelined", s, repeats)[0] for s in split_sizes}
    best = max(speedups, key=speedups.get)
    return {"one_device_s": base, "speedup": speedups, "best_split": best}


def check_against_one_device(model: nn.Module, x: torch.Tensor, y: torch.Tensor, devs: list[Device],
                             variant: str, split_size: int | None = None, tol: float = 1e-5) -> float:
    """Run one step of `variant` and of a one-device copy of the model (same weights, same data);
    assert the losses and every gradient match; return the loss."""
    import copy

    ref = copy.deepcopy(model).cpu()
    ref_loss = nn.functional.cross_entropy(ref(x), y)
    ref_loss.backward()
    model.zero_grad()
    loss, _ = train_step(model, x, y, devs, variant, split_size)
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=tol, rtol=tol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    return float(loss)

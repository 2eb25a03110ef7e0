"""Which device a name means: a CUDA GPU (`CudaDevice`) or a virtual CPU device (`VirtualDevice`)."""

from __future__ import annotations

import torch

from pipelab.checks import whole_number
from pipelab.streams.base import Device
from pipelab.streams.cuda import CudaDevice
from pipelab.streams.virtual import Pace, VirtualDevice
from pipelab.timeline import Recorder, Timeline


def device(name: str, rec: Recorder | None = None, label: str | None = None) -> Device:
    """The device called `name`: "cuda:0" (or "cuda") a `CudaDevice`, "cpu:0" a `VirtualDevice`.

    `label` names its rows on the timeline (default: its name); `rec` records its spans (default:
    a recorder of its own)."""
    if name.startswith("cuda"):
        return CudaDevice(name, rec, label)
    if name.startswith("cpu"):
        return VirtualDevice(name, rec, label)
    raise ValueError(f"device name {name!r} is neither a GPU nor a virtual CPU device; "
                     f"pass e.g. 'cuda:0' or 'cpu:0'")


class Devices(list):
    """A list of devices that closes them all at the end of a `with` block:
    `with devices(2) as devs: ...` leaves no stream thread behind."""

    def close(self) -> None:
        for d in self:
            d.close()

    def __enter__(self) -> "Devices":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def devices(n: int, pace: Pace | None = None) -> Devices:
    """n CUDA devices when the machine has n GPUs, otherwise n virtual CPU devices.

    With fewer GPUs than n (e.g. one GPU and n = 2) we use virtual CPU devices: putting two
    "devices" on one GPU would share its SMs and teach nothing about idle devices. With a `pace`
    (`streams.virtual.Pace`: an emulated node was asked for) they are paced virtual devices.
    Use it as `with devices(2) as devs:`, or call `devs.close()`, to stop their threads."""
    whole_number("n", n, example="devices(2)")
    if pace is None and torch.cuda.is_available() and torch.cuda.device_count() >= n:
        return Devices(CudaDevice(f"cuda:{i}") for i in range(n))
    return Devices(VirtualDevice(f"cpu:{i}", label=pace and pace.label(i), pace=pace) for i in range(n))


def timeline(devs: list[Device]) -> Timeline:
    """All devices' spans on one timeline (waits for the work submitted so far)."""
    for d in devs:
        d.synchronize()
    return Timeline.merge([d.timeline() for d in devs])

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


DEVICE_CHOICES = ("auto", "cuda", "cpu")  # what a lesson's `device` parameter may say


def shared_gpu_label(gpu: str, index: int) -> str:
    """The timeline label of device `index` when every device is a set of streams of one GPU."""
    return f"{gpu} stream {index}"


def check_device_choice(device: str, pace: Pace | None = None) -> None:
    """Refuse a `device` choice this machine or an emulated node cannot take, before anything runs."""
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device={device!r}: use 'auto' (GPUs where there are enough, else virtual CPU devices), "
                         "'cuda' (this machine's GPUs; with one GPU, each device a set of its streams) or 'cpu'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda': this machine has no CUDA GPU; use device='auto' (virtual CPU devices, "
                         "or an emulated node's paced ones)")
    if device == "cuda" and pace is not None:
        raise ValueError("device='cuda' times this machine's GPU, but an emulated node paces virtual devices: "
                         "pass emulate=None with device='cuda', or device='auto'")


def devices(n: int, pace: Pace | None = None, device: str = "auto") -> Devices:
    """n devices: with `device="auto"`, n CUDA devices when the machine has n GPUs, otherwise n
    virtual CPU devices; `"cpu"`, virtual CPU devices; `"cuda"`, this machine's GPUs.

    "auto" never puts two devices on one GPU: they would share its SMs and teach nothing about idle
    devices. "cuda" on a machine with fewer GPUs than n is that choice made explicit: n devices on
    cuda:0, each with CUDA streams of its own, labelled "cuda:0 stream i" (their overlap is
    concurrency on one GPU). With a `pace` (`streams.virtual.Pace`: an emulated node was asked for)
    they are paced virtual devices. Use it as `with devices(2) as devs:`, or call `devs.close()`,
    to stop their threads."""
    whole_number("n", n, example="devices(2)")
    check_device_choice(device, pace)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < n:
        return Devices(CudaDevice("cuda:0", label=shared_gpu_label("cuda:0", i)) for i in range(n))
    if device != "cpu" and pace is None and gpus >= n:
        return Devices(CudaDevice(f"cuda:{i}") for i in range(n))
    return Devices(VirtualDevice(f"cpu:{i}", label=pace and pace.label(i), pace=pace) for i in range(n))


def shares_one_gpu(devs: list[Device]) -> bool:
    """Whether two or more of `devs` are streams of the same GPU (`devices(n, device="cuda")` on a smaller machine)."""
    gpus = [d.name for d in devs if isinstance(d, CudaDevice)]
    return len(gpus) > len(set(gpus))


def timeline(devs: list[Device]) -> Timeline:
    """All devices' spans on one timeline (waits for the work submitted so far)."""
    for d in devs:
        d.synchronize()
    return Timeline.merge([d.timeline() for d in devs])

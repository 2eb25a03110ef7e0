"""A device driven by this process, with named streams: a CUDA GPU or a virtual CPU device."""

from __future__ import annotations

import torch

from pipelab.checks import whole_number
from pipelab.streams.base import Stream
from pipelab.streams.cuda import CudaStream
from pipelab.streams.virtual import BufferCache, VirtualStream, owner_of, tag
from pipelab.timeline import Recorder, Timeline


class Device:
    """One device driven by this process: a CUDA GPU or a virtual CPU device, with named streams.

    The name picks the kind: "cuda:0" gets `CudaStream`s, "cpu:0" `VirtualStream`s. `label`
    names the device's rows on the timeline (default: its name). Two Device objects on one GPU
    each have their own streams and recorder; give them different labels to tell their rows apart.

    A virtual device's streams are threads: `close()` (or the end of a `with Device(...)` block)
    ends them once their queued work has run; a device nobody references any more ends them
    when it is garbage collected."""

    def __init__(self, name: str, rec: Recorder | None = None, label: str | None = None) -> None:
        self.name = name
        self.label = label or name
        self.is_cuda = name.startswith("cuda")
        self.torch_device = torch.device(name) if self.is_cuda else torch.device("cpu")
        if self.is_cuda and self.torch_device.index is None:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
            self.name = str(self.torch_device)
            self.label = label or self.name
        self.rec = rec or Recorder(rank=self.label, device=self.torch_device if self.is_cuda else None)
        self.stream_class: type[Stream] = CudaStream if self.is_cuda else VirtualStream
        self._streams: dict[str, Stream] = {}
        self.closed = False
        self._cache = None if self.is_cuda else BufferCache(self.name)
        if not self.is_cuda:
            torch.set_num_threads(1)  # one intra-op thread per virtual device (process-wide)

    def stream(self, name: str = "compute") -> Stream:
        """The stream called `name` on this device (created on first use)."""
        if name not in self._streams:
            if self.closed:
                raise ValueError(f"{self!r} is closed: make new devices with streams.devices(n)")
            self._streams[name] = self.stream_class(self, name)
        return self._streams[name]

    def cached_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised tensor of this virtual device, from its cache of freed buffers
        (see `BufferCache`)."""
        if self._cache is None:
            raise ValueError(f"{self.name!r} is a CUDA device: allocate with stream.empty(shape)")
        return self._cache.empty(shape, dtype)

    def owner(self, tensor: torch.Tensor) -> str | None:
        """The name of the device `tensor` lives on (None: an untagged host tensor)."""
        return str(tensor.device) if self.is_cuda else owner_of(tensor)

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """Place a host tensor on this device (a real copy on CUDA, a tag on a virtual device)."""
        if self.is_cuda:
            return tensor.to(self.torch_device)
        owner = owner_of(tensor)
        if owner is not None and owner != self.name:
            raise ValueError(f"tensor already on {owner!r}: move it to {self.name!r} with "
                             f"stream.copy(tensor), not own()")
        return tag(tensor, self.name)

    def synchronize(self) -> None:
        """Block until all work on this device's streams (on CUDA, all its streams) has run."""
        for s in self._streams.values():
            s.synchronize()
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)  # also the host-issued kernels (default stream)

    def timeline(self) -> Timeline:
        return self.rec.timeline()

    def close(self) -> None:
        """Run the work already queued, then stop the streams (a virtual device's threads end)."""
        self.closed = True
        for s in self._streams.values():
            s.close()

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Device({self.name!r})" if self.label == self.name else f"Device({self.name!r}, label={self.label!r})"


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


def devices(n: int) -> Devices:
    """n CUDA devices when the machine has n GPUs, otherwise n virtual CPU devices.

    With fewer GPUs than n (e.g. one GPU and n = 2) we use virtual CPU devices: putting two
    "devices" on one GPU would share its SMs and teach nothing about idle devices.
    Use it as `with devices(2) as devs:`, or call `devs.close()`, to stop their threads."""
    whole_number("n", n, example="devices(2)")
    if torch.cuda.is_available() and torch.cuda.device_count() >= n:
        return Devices(Device(f"cuda:{i}") for i in range(n))
    return Devices(Device(f"cpu:{i}") for i in range(n))


def timeline(devs: list[Device]) -> Timeline:
    """All devices' spans on one timeline (waits for the work submitted so far)."""
    for d in devs:
        d.synchronize()
    return Timeline.merge([d.timeline() for d in devs])

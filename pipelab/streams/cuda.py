"""A CUDA device and its streams: the host queues kernels on a `torch.cuda.Stream` and returns at once.

Ordering across streams is CUDA's own: a Future of a CUDA stream carries a CUDA event recorded
after its work, and `wait` is `cudaStreamWaitEvent`. What a lesson must add by hand is memory
ownership across streams (`record_stream`), so the caching allocator does not hand a block to new
work while another stream still reads it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from pipelab.streams.base import Device, Event, Stream, Work, tensors_in
from pipelab.timeline import Recorder

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """A CUDA stream of `device` for small jobs the host waits for (created on first use)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


_OUTGOING: dict[tuple, torch.cuda.Stream] = {}


def _outgoing_stream(source: torch.device, dest: "CudaStream") -> torch.cuda.Stream:
    """The stream of `source` that copies from it to `dest`'s stream run on (one per pair, so the
    copies of one destination stream keep their order)."""
    key = (source, id(dest.cuda))
    if key not in _OUTGOING:
        _OUTGOING[key] = torch.cuda.Stream(source)
    return _OUTGOING[key]


class CudaWork(Work):
    """A Future of work queued on a CUDA stream, with the CUDA event recorded right after it."""

    kernels_done: "torch.cuda.Event | None" = None

    def result(self, timeout: float | None = None):
        value = super().result(timeout)
        if self.kernels_done is not None:
            for t in tensors_in(value):
                # later host-issued kernels (torch.cat, the loss) run on the current stream
                current = torch.cuda.current_stream(t.device)
                current.wait_event(self.kernels_done)
                t.record_stream(current)
        return value


class CudaStream(Stream):
    """A stream of a CUDA device: work is queued on its own `torch.cuda.Stream` (`self.cuda`)."""

    def __init__(self, device: "CudaDevice", name: str) -> None:
        super().__init__(device, name)
        self.cuda = torch.cuda.Stream(device.torch_device)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
              fill: float | None = None) -> torch.Tensor:
        dev = self.device.torch_device
        if fill is None:
            with torch.cuda.device(dev), torch.cuda.stream(self.cuda):
                return torch.empty(shape, dtype=dtype, device=dev)
        # This stream may be busy behind earlier copies, so fill on a side stream the host
        # waits for: then nothing queued later, on any stream, can read it unfilled.
        side = _side_stream(dev)
        with torch.cuda.device(dev), torch.cuda.stream(side):
            buf = torch.full(shape, fill, dtype=dtype, device=dev)
        side.synchronize()
        return buf

    def wait(self, event: Event) -> None:
        marker = event._marker
        if isinstance(marker, torch.cuda.Event):
            self.cuda.wait_event(marker)
        elif marker is not None and not marker.query():
            raise ValueError("a CUDA stream cannot wait for an event of a virtual device: "
                             "keep the streams of one program on one kind of device")
        # else: never recorded, or already passed: nothing to wait for

    def hold(self) -> Callable[[], None]:
        # CUDA has no host-side gate: a spin kernel keeps the stream busy for about a second
        self.submit(torch.cuda._sleep, 2_000_000_000, kind="held")  # ~1 s of clock cycles
        return lambda: None

    def _enqueue(self, fn, args, kind, mb, lane) -> Work:
        # The host runs fn now, with this stream current: its kernels are queued on it.
        fut = CudaWork()
        with torch.cuda.device(self.device.torch_device), torch.cuda.stream(self.cuda):
            real = []
            for a in args:
                if isinstance(a, Future):
                    if isinstance(a, CudaWork) and a.kernels_done is not None:
                        self.cuda.wait_event(a.kernels_done)  # wait for the kernel that writes it
                    a = Future.result(a)
                for t in tensors_in(a):
                    if t.is_cuda:
                        # The caching allocator hands a freed block out again as soon as the
                        # stream that allocated it is done with it. This stream reads t too
                        # (a buffer allocated on a copy stream, read on a compute stream):
                        # record_stream makes the allocator also wait for this stream's work
                        # queued so far before reusing t's memory.
                        t.record_stream(self.cuda)
                real.append(a)
            with self.device.rec.span(kind, lane=lane, mb=mb, stream=self.cuda):
                out = fn(*real)
            fut.kernels_done = torch.cuda.Event()
            fut.kernels_done.record(self.cuda)
        fut.set_result(out)
        return fut

    def _land(self, src: torch.Tensor, out: torch.Tensor | None, chunk_bytes: int) -> torch.Tensor:
        # one non_blocking copy: the copy engine moves it in packets already (chunk_bytes unused)
        dst = torch.empty_like(src, device=self.device.torch_device) if out is None else out
        if src.device.type == "cpu" and not src.is_pinned():
            src = src.pin_memory()  # from pageable memory the copy would block the host
        if src.is_cuda and src.device != dst.device:
            # PyTorch issues a copy between two GPUs on the SOURCE device's current stream and orders
            # it both ways with the destination's current stream (this one). Make the source's
            # current stream a stream of its own for this one, so the copy leaves the source's
            # compute stream free and stays in this stream's order.
            out_stream = _outgoing_stream(src.device, self)
            src.record_stream(out_stream)
            with torch.cuda.stream(out_stream):
                return dst.copy_(src, non_blocking=True)
        return dst.copy_(src, non_blocking=True)

    def _mark(self) -> torch.cuda.Event:
        marker = torch.cuda.Event()
        marker.record(self.cuda)
        return marker


class CudaDevice(Device):
    """A CUDA GPU ("cuda:0", or "cuda" for the current one): its streams are `CudaStream`s, its
    spans are timed with CUDA events, and its tensors live in the GPU's memory."""

    stream_class = CudaStream

    def __init__(self, name: str, rec: Recorder | None = None, label: str | None = None) -> None:
        torch_device = torch.device(name)
        if torch_device.index is None:  # "cuda": the current GPU, named by its index
            torch_device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(str(torch_device), rec or Recorder(rank=label or str(torch_device), device=torch_device),
                         label)
        self.torch_device = torch_device

    def owner(self, tensor: torch.Tensor) -> str | None:
        return str(tensor.device)

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in this GPU's memory: as it is if it already lives here, else copied from pinned
        memory without blocking the host (move a batch once, before timing, not split by split)."""
        if tensor.device == self.torch_device:
            return tensor
        if tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.torch_device, non_blocking=True)

    def synchronize(self) -> None:
        super().synchronize()
        torch.cuda.synchronize(self.torch_device)  # also the host-issued kernels (default stream)

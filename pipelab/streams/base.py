"""What every device and stream offers, whatever runs it: submit work, copy tensors, place and
wait for events.

`Stream` and `Device` are the interfaces. They hold what both kinds share (which tensors a stream
may touch, the checks of a copy, `synchronize`, a device's named streams and its recorder);
`VirtualDevice`/`VirtualStream` (pipelab.streams.virtual) and `CudaDevice`/`CudaStream`
(pipelab.streams.cuda) fill in how work is queued, how a copy lands, how a marker is placed in the
queue, how another stream waits for it, and which tensors a device owns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Callable, ClassVar, Iterator

import torch

from pipelab.timeline import Recorder, Timeline

# A copy between virtual devices moves at most this many bytes per step, whole rows at a time.
CHUNK_BYTES = 1 << 20


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `obj` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def chunk_rows(t: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many rows (slices along the first dimension) of `t` fit in `chunk_bytes` (at least one)."""
    row_bytes = max(1, t[0].numel() * t.element_size()) if t.dim() > 0 and t.shape[0] > 0 else 1
    return max(1, chunk_bytes // row_bytes)


class Work(Future):
    """The result of work enqueued on a stream (a `concurrent.futures.Future`).

    `result()` hands the value over so that it is safe to use: on a virtual device it blocks
    until the work has run; on CUDA (`CudaWork`) it returns at once and makes the current stream
    of the value's device wait for the work first, as a CUDA event would. On a paced virtual
    device `modelled_end` is when the work ended in modelled time."""

    modelled_end: float | None = None


class Event:
    """A marker in a stream: `record(stream)` places it, `stream.wait(event)` makes later work on
    that stream wait until everything before the marker has run (like torch.cuda.Event).

    An event that was never recorded is complete: waiting for it returns at once, as on CUDA."""

    def __init__(self) -> None:
        self._marker = None  # what the stream placed: has query() and synchronize()

    def record(self, stream: "Stream") -> None:
        """Place the marker after all work submitted to `stream` so far."""
        # a fresh marker each time: a wait already queued keeps the marker it was given
        self._marker = stream._mark()

    def query(self) -> bool:
        """True when all work before the marker has run."""
        return self._marker is None or self._marker.query()

    def synchronize(self) -> None:
        """Block the caller until all work before the marker has run."""
        if self._marker is not None:
            self._marker.synchronize()


class Stream(ABC):
    """An in-order queue of work on one device: the interface of `VirtualStream` and `CudaStream`."""

    def __init__(self, device: "Device", name: str) -> None:
        self.device = device
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device.label!r}, {self.name!r})"

    def submit(self, fn: Callable, *args, kind: str = "F", mb: int | None = None,
               lane: str | None = None) -> Work:
        """Enqueue `fn(*args)`; return a Future of its result (tensor results belong to this device).

        A Future among `args` makes this work wait for the work that produces it; a plain tensor
        is read whenever this work runs (order it with an Event if another stream writes it).
        `fn` runs with the caller's grad mode (under `torch.no_grad()` it builds no graph)."""
        self._check(args)
        return self._enqueue(fn, args, kind, mb, lane or self.name)

    def copy(self, tensor: torch.Tensor | Future, kind: str = "copy", mb: int | None = None,
             out: torch.Tensor | None = None, chunk_bytes: int = CHUNK_BYTES) -> Work:
        """Enqueue a copy of `tensor` (a tensor or a Future of one, from any device) onto this
        stream's device; one span on the timeline per copy.

        Without `out` the copy lands in new memory, and the returned Future is how to use it: a
        stream handed that Future waits for the copy. With `out` (a buffer of this device, from
        `empty`) the copy writes into that buffer; a stream that reads the buffer is ordered
        after the copy only by an Event recorded on this stream after it.

        On a virtual device the copy is a real memory copy, `chunk_bytes` at a time, so it takes
        time in proportion to the bytes, and a reader that does not wait can find some rows
        landed and others not, as with a DMA transfer in flight. On CUDA it is one
        `non_blocking` copy: the copy engine already moves it as a stream of packets."""
        if out is not None:
            self._check_buffer(out, tensor)
        # out travels as an argument, so on CUDA it is recorded on this stream like any input
        return self._enqueue(lambda src, dst: self._copy_now(src, dst, chunk_bytes), (tensor, out), kind, mb,
                             self.name)

    def synchronize(self) -> None:
        """Block the caller until all work submitted so far has run."""
        ev = Event()
        ev.record(self)
        ev.synchronize()

    def close(self) -> None:
        """Stop taking work; a virtual stream's thread ends once the work already queued has run."""

    @abstractmethod
    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
              fill: float | None = None) -> torch.Tensor:
        """A buffer on this stream's device, allocated on this stream: a copy lands in it with
        `copy(src, out=buf)`.

        `fill` (e.g. NaN) writes every element before `empty` returns, so a read before the copy
        lands shows up as that value instead of whatever the memory held before: PyTorch's
        deterministic mode (`torch.utils.deterministic.fill_uninitialized_memory`) fills new
        memory with NaN for the same reason."""

    @abstractmethod
    def wait(self, event: Event) -> None:
        """Later work on this stream waits for `event` (recorded on any stream of any device).

        The caller does not block: the wait is itself queued, like `cudaStreamWaitEvent`."""

    @abstractmethod
    def hold(self) -> Callable[[], None]:
        """Keep this stream busy, as if still running earlier work, until the returned release
        is called (lesson 04 holds a producer back to show a race for certain)."""

    @abstractmethod
    def _enqueue(self, fn: Callable, args: tuple, kind: str, mb: int | None, lane: str) -> Work:
        """Queue `fn(*args)` as one span of `kind` on `lane`; Futures among `args` are waited for."""

    @abstractmethod
    def _land(self, src: torch.Tensor, out: torch.Tensor | None, chunk_bytes: int) -> torch.Tensor:
        """The copy itself, run by this stream: into `out`, or into new memory of this device."""

    @abstractmethod
    def _mark(self):
        """A fresh marker after all work submitted so far (an object with query() and synchronize())."""

    def _copy_now(self, src: torch.Tensor, out: torch.Tensor | None, chunk_bytes: int) -> torch.Tensor:
        # a Future source is known only now: check it against the buffer before copying
        if out is not None and (src.shape != out.shape or src.dtype != out.dtype):
            raise ValueError(f"copy of shape {tuple(src.shape)} ({src.dtype}) into a buffer of shape "
                             f"{tuple(out.shape)} ({out.dtype})")
        return self._land(src, out, chunk_bytes)

    def _check(self, args: tuple) -> None:
        for t in tensors_in(args):
            owner = self.device.owner(t)
            if owner is not None and owner != self.device.name:
                raise ValueError(
                    f"tensor on {owner!r} handed to stream {self.name!r} of {self.device.name!r}: "
                    f"copy it first with stream.copy(tensor, ...) onto {self.device.name!r}")

    def _check_buffer(self, out: torch.Tensor, src: torch.Tensor | Future) -> None:
        owner = self.device.owner(out)
        if owner != self.device.name:
            raise ValueError(f"copy onto {self.device.name!r} into a buffer on {owner!r}: "
                             f"allocate it with {self.device.name!r}'s stream.empty(shape)")
        if isinstance(src, torch.Tensor) and (src.shape != out.shape or src.dtype != out.dtype):
            raise ValueError(f"copy of a {src.dtype} tensor of shape {tuple(src.shape)} into a {out.dtype} "
                             f"buffer of shape {tuple(out.shape)}: allocate the buffer with the source's shape")


class Device(ABC):
    """One device driven by this process, with named streams: the interface of `VirtualDevice`
    and `CudaDevice` (`pipelab.streams.device` picks one by name).

    `label` names the device's rows on the timeline (default: its name). Two Device objects on
    one GPU each have their own streams and recorder; give them different labels to tell their
    rows apart. `close()` (or the end of a `with` block) stops taking work once the queued work
    has run."""

    stream_class: ClassVar[type[Stream]]  # the kind of stream this kind of device has
    torch_device: torch.device  # where its tensors live for PyTorch

    def __init__(self, name: str, rec: Recorder | None = None, label: str | None = None) -> None:
        self.name = name
        self.label = label or name
        self.rec = rec or Recorder(rank=self.label)
        self._streams: dict[str, Stream] = {}
        self.closed = False

    def stream(self, name: str = "compute") -> Stream:
        """The stream called `name` on this device (created on first use)."""
        if name not in self._streams:
            if self.closed:
                raise ValueError(f"{self!r} is closed: make new devices with streams.devices(n)")
            self._streams[name] = self.stream_class(self, name)
        return self._streams[name]

    @abstractmethod
    def owner(self, tensor: torch.Tensor) -> str | None:
        """The name of the device `tensor` lives on (None: a host tensor no device owns)."""

    @abstractmethod
    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """Place a host tensor on this device."""

    def synchronize(self) -> None:
        """Block until all work submitted to this device's streams has run."""
        for s in self._streams.values():
            s.synchronize()

    def timeline(self) -> Timeline:
        return self.rec.timeline()

    def restart_clock(self) -> None:
        """A paced device's streams start again at modelled time 0 (nothing to do elsewhere)."""

    def close(self) -> None:
        """Run the work already queued, then stop the streams."""
        self.closed = True
        for s in self._streams.values():
            s.close()

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = type(self).__name__
        return f"{kind}({self.name!r})" if self.label == self.name else f"{kind}({self.name!r}, label={self.label!r})"

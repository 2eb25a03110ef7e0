"""Single-process devices: real CUDA devices and streams, or CPU "virtual devices".

A virtual device runs each of its streams on a worker thread that executes submitted work in
order, exactly like a CUDA stream: `submit` returns at once, the work runs later. PyTorch releases
the GIL inside its kernels, so two virtual devices really compute at the same time on two cores.
Every kernel and copy is recorded as a Span (rank = device name, lane = stream name).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from pipelab.timeline import Recorder, Timeline, now

# Which virtual device a tensor lives on (all virtual devices share CPU memory, so the tag is
# what lets us refuse a tensor handed to the wrong device without a copy, as CUDA would).
_OWNER = WeakTensorKeyDictionary()


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class Event:
    """A marker in a stream: `record(stream)` places it, `stream.wait(event)` makes later work on
    that stream wait until everything before the marker has run (like torch.cuda.Event)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._cuda: torch.cuda.Event | None = None

    def record(self, stream: "Stream") -> None:
        self._done.clear()
        stream._record(self)

    def synchronize(self) -> None:
        if self._cuda is not None:
            self._cuda.synchronize()
        else:
            self._done.wait()


class Stream:
    """An in-order queue of work on one device."""

    def __init__(self, device: "Device", name: str) -> None:
        self.device = device
        self.name = name
        self._cuda = torch.cuda.Stream(device.torch_device) if device.is_cuda else None
        if not device.is_cuda:
            self._queue: queue.Queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, name=f"{device.name}/{name}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        # torch.set_num_threads is process-wide: the device constructor set it to 1 so each
        # virtual device uses exactly one core, and two devices use two.
        while True:
            item = self._queue.get()
            if item is None:
                return
            item()

    def _check(self, args: tuple) -> None:
        for t in _tensors(args):
            owner = _OWNER.get(t, None) if not self.device.is_cuda else str(t.device)
            if owner is not None and owner != self.device.name:
                raise ValueError(
                    f"tensor on {owner!r} handed to stream {self.name!r} of {self.device.name!r}: "
                    f"copy it first with stream.copy(tensor, ...) onto {self.device.name!r}")

    def submit(self, fn: Callable, *args, kind: str = "F", mb: int | None = None,
               lane: str | None = None) -> Future:
        """Enqueue `fn(*args)`; return a Future of its result (tensor results belong to this device)."""
        self._check(args)
        return self._enqueue(fn, args, kind, mb, lane or self.name)

    def copy(self, tensor: torch.Tensor, kind: str = "copy", mb: int | None = None) -> Future:
        """Enqueue a copy of `tensor` (from any device) onto this stream's device."""
        src = tensor
        if self.device.is_cuda:
            return self._enqueue(lambda t: t.to(self.device.torch_device, non_blocking=True),
                                 (src,), kind, mb, self.name)
        return self._enqueue(lambda t: t.clone(), (src,), kind, mb, self.name)

    def _enqueue(self, fn, args, kind, mb, lane) -> Future:
        fut: Future = Future()
        dev = self.device
        if dev.is_cuda:
            with torch.cuda.device(dev.torch_device), torch.cuda.stream(self._cuda):
                real = []
                for a in args:
                    if isinstance(a, Future):
                        # a result of another stream: wait for the kernel that writes it, and tell
                        # the allocator this stream uses its memory too
                        self._cuda.wait_event(a._cuda_done)
                        a = a.result()
                        for t in _tensors(a):
                            t.record_stream(self._cuda)
                    real.append(a)
                with dev.rec.span(kind, lane=lane, mb=mb, stream=self._cuda):
                    out = fn(*real)
                fut._cuda_done = torch.cuda.Event()
                fut._cuda_done.record(self._cuda)
            fut.set_result(out)
            return fut

        def work() -> None:
            try:
                real = [a.result() if isinstance(a, Future) else a for a in args]
                t0 = now()
                out = fn(*real)
                dev.rec.add(kind, t0, now(), lane=lane, mb=mb)
                for t in _tensors(out):
                    _OWNER[t] = dev.name
                fut.set_result(out)
            except BaseException as exc:  # surface the error to whoever waits on the result
                fut.set_exception(exc)

        self._queue.put(work)
        return fut

    def _record(self, event: Event) -> None:
        if self.device.is_cuda:
            event._cuda = torch.cuda.Event()
            event._cuda.record(self._cuda)
        else:
            self._queue.put(event._done.set)

    def wait(self, event: Event) -> None:
        """Later work on this stream waits for `event` (recorded on any stream)."""
        if self.device.is_cuda:
            self._cuda.wait_event(event._cuda)
        else:
            self._queue.put(event._done.wait)

    def synchronize(self) -> None:
        """Block the caller until all work submitted so far has run."""
        ev = Event()
        ev.record(self)
        ev.synchronize()

    def close(self) -> None:
        if not self.device.is_cuda:
            self._queue.put(None)


class Device:
    """One device driven by this process: a CUDA GPU or a virtual CPU device, with named streams."""

    def __init__(self, name: str, rec: Recorder | None = None) -> None:
        self.name = name
        self.is_cuda = name.startswith("cuda")
        self.torch_device = torch.device(name) if self.is_cuda else torch.device("cpu")
        self.rec = rec or Recorder(rank=name, device=self.torch_device if self.is_cuda else None)
        self._streams: dict[str, Stream] = {}
        if not self.is_cuda:
            torch.set_num_threads(1)  # one intra-op thread per virtual device (process-wide)

    def stream(self, name: str = "compute") -> Stream:
        """The stream called `name` on this device (created on first use)."""
        if name not in self._streams:
            self._streams[name] = Stream(self, name)
        return self._streams[name]

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """Place a host tensor on this device (a real copy on CUDA, a tag on a virtual device)."""
        if self.is_cuda:
            return tensor.to(self.torch_device)
        _OWNER[tensor] = self.name
        return tensor

    def synchronize(self) -> None:
        for s in self._streams.values():
            s.synchronize()

    def timeline(self) -> Timeline:
        return self.rec.timeline()

    def close(self) -> None:
        for s in self._streams.values():
            s.close()

    def __repr__(self) -> str:
        return f"Device({self.name!r})"


def devices(n: int) -> list[Device]:
    """n CUDA devices when the machine has n GPUs, otherwise n virtual CPU devices.

    With fewer GPUs than n (e.g. one GPU and n = 2) we use virtual CPU devices: putting two
    "devices" on one GPU would share its SMs and teach nothing about idle devices."""
    if n < 1:
        raise ValueError(f"devices(n) needs n >= 1, got n={n}")
    if torch.cuda.is_available() and torch.cuda.device_count() >= n:
        return [Device(f"cuda:{i}") for i in range(n)]
    return [Device(f"cpu:{i}") for i in range(n)]


def timeline(devs: list[Device]) -> Timeline:
    """All devices' spans on one timeline."""
    for d in devs:
        d.synchronize()
    return Timeline.merge([d.timeline() for d in devs])

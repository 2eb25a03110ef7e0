"""Single-process devices: real CUDA devices and streams, or CPU "virtual devices".

A virtual device runs each of its streams on a worker thread that executes submitted work in
order, exactly like a CUDA stream: `submit` returns at once, the work runs later. PyTorch releases
the GIL inside its kernels, so two virtual devices really compute at the same time on two cores.
Every kernel and copy is recorded as a Span (rank = device label, lane = stream name).

A tensor goes from one stream to another in one of two ways:

* hand over the Future that `submit` or `copy` returned: the receiving stream waits for the work
  that produces it (the Future carries that work's completion; on CUDA, a CUDA event);
* hand over a buffer that another stream fills (`copy(src, out=buf)`): then nothing orders the
  writer and the reader but an `Event` recorded on the writer and waited for by the reader, as in
  raw CUDA code. Forget the event and the reader may see the buffer before the copy lands.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from pipelab.timeline import Recorder, Timeline, now

# Which virtual device a tensor lives on (all virtual devices share CPU memory, so the tag is
# what lets us refuse a tensor handed to the wrong device without a copy, as CUDA would).
_OWNER = WeakTensorKeyDictionary()

# A copy between virtual devices moves at most this many bytes per step, whole rows at a time.
CHUNK_BYTES = 1 << 20

_VIRTUAL_STREAMS: "weakref.WeakSet[Stream]" = weakref.WeakSet()


@atexit.register
def _drain_virtual_streams() -> None:
    # Let queued work finish before the interpreter shuts down: a worker thread still inside a
    # PyTorch kernel when Python tears down its threads aborts the whole process.
    streams = list(_VIRTUAL_STREAMS)
    for s in streams:
        s.close()
    for s in streams:
        s._thread.join(timeout=5)


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def chunk_rows(t: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many rows (slices along the first dimension) of `t` fit in `chunk_bytes` (at least one)."""
    row_bytes = max(1, t[0].numel() * t.element_size()) if t.dim() > 0 and t.shape[0] > 0 else 1
    return max(1, chunk_bytes // row_bytes)


class Work(Future):
    """The result of work enqueued on a stream (a `concurrent.futures.Future`).

    `result()` hands the value over so that it is safe to use: on a virtual device it blocks
    until the work has run; on CUDA it returns at once and makes the current stream of the
    value's device wait for the work first, as a CUDA event would."""

    _cuda_done: "torch.cuda.Event | None" = None

    def result(self, timeout: float | None = None):
        value = super().result(timeout)
        if self._cuda_done is not None:
            for t in _tensors(value):
                # later host-issued kernels (torch.cat, the loss) run on the current stream
                current = torch.cuda.current_stream(t.device)
                current.wait_event(self._cuda_done)
                t.record_stream(current)
        return value


class Event:
    """A marker in a stream: `record(stream)` places it, `stream.wait(event)` makes later work on
    that stream wait until everything before the marker has run (like torch.cuda.Event).

    An event that was never recorded is complete: waiting for it returns at once, as on CUDA."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()
        self._cuda: torch.cuda.Event | None = None

    def record(self, stream: "Stream") -> None:
        """Place the marker after all work submitted to `stream` so far."""
        stream._record(self)

    def query(self) -> bool:
        """True when all work before the marker has run."""
        return self._cuda.query() if self._cuda is not None else self._done.is_set()

    def synchronize(self) -> None:
        """Block the caller until all work before the marker has run."""
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
            self._thread = threading.Thread(target=self._run, name=f"{device.label}/{name}", daemon=True)
            self._thread.start()
            _VIRTUAL_STREAMS.add(self)

    def __repr__(self) -> str:
        return f"Stream({self.device.label!r}, {self.name!r})"

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
            owner = self.device.owner(t)
            if owner is not None and owner != self.device.name:
                raise ValueError(
                    f"tensor on {owner!r} handed to stream {self.name!r} of {self.device.name!r}: "
                    f"copy it first with stream.copy(tensor, ...) onto {self.device.name!r}")

    def submit(self, fn: Callable, *args, kind: str = "F", mb: int | None = None,
               lane: str | None = None) -> Work:
        """Enqueue `fn(*args)`; return a Future of its result (tensor results belong to this device).

        A Future among `args` makes this work wait for the work that produces it; a plain tensor
        is read whenever this work runs (order it with an Event if another stream writes it).
        `fn` runs with the caller's grad mode (under `torch.no_grad()` it builds no graph)."""
        self._check(args)
        return self._enqueue(fn, args, kind, mb, lane or self.name)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
              fill: float | None = None) -> torch.Tensor:
        """A buffer on this stream's device, allocated on this stream: a copy lands in it with
        `copy(src, out=buf)`.

        `fill` (e.g. NaN) writes every element before `empty` returns, so a read before the copy
        lands shows up as that value instead of whatever the memory held before: PyTorch's
        deterministic mode (`torch.utils.deterministic.fill_uninitialized_memory`) fills new
        memory with NaN for the same reason."""
        if self.device.is_cuda:
            dev = self.device.torch_device
            if fill is None:
                with torch.cuda.device(dev), torch.cuda.stream(self._cuda):
                    return torch.empty(shape, dtype=dtype, device=dev)
            # This stream may be busy behind earlier copies, so fill on a side stream the host
            # waits for: then nothing queued later, on any stream, can read it unfilled.
            side = self.device.side_stream()
            with torch.cuda.device(dev), torch.cuda.stream(side):
                buf = torch.full(shape, fill, dtype=dtype, device=dev)
            side.synchronize()
            return buf
        buf = self.device.cached_empty(shape, dtype)
        if fill is not None:
            buf.fill_(fill)  # done now, on the host: the buffer is filled before anyone can read it
        return buf

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
        return self._enqueue(lambda src, dst: self._land(src, dst, chunk_bytes), (tensor, out), kind, mb, self.name)

    def _check_buffer(self, out: torch.Tensor, src: torch.Tensor | Future) -> None:
        owner = self.device.owner(out)
        if owner != self.device.name:
            raise ValueError(f"copy onto {self.device.name!r} into a buffer on {owner!r}: "
                             f"allocate it with {self.device.name!r}'s stream.empty(shape)")
        if isinstance(src, torch.Tensor) and (src.shape != out.shape or src.dtype != out.dtype):
            raise ValueError(f"copy of a {src.dtype} tensor of shape {tuple(src.shape)} into a {out.dtype} "
                             f"buffer of shape {tuple(out.shape)}: allocate the buffer with the source's shape")

    def _land(self, src: torch.Tensor, out: torch.Tensor | None, chunk_bytes: int) -> torch.Tensor:
        """The copy itself, run by this stream: into `out`, or into new memory of this device."""
        if out is not None and (src.shape != out.shape or src.dtype != out.dtype):
            raise ValueError(f"copy of shape {tuple(src.shape)} ({src.dtype}) into a buffer of shape "
                             f"{tuple(out.shape)} ({out.dtype})")
        if self.device.is_cuda:
            dst = torch.empty_like(src, device=self.device.torch_device) if out is None else out
            return dst.copy_(src, non_blocking=True)
        dst = self.device.cached_empty(src.shape, src.dtype) if out is None else out
        if dst.dim() == 0:
            return dst.copy_(src)
        rows = chunk_rows(dst, chunk_bytes)
        for k in range(0, dst.shape[0], rows):
            # slice dst only now: autograd then records each chunk's copy on top of the last one
            dst[k:k + rows].copy_(src[k:k + rows])
        return dst

    def _enqueue(self, fn, args, kind, mb, lane) -> Work:
        fut = Work()
        dev = self.device
        if dev.is_cuda:
            # On CUDA the host runs fn now, with this stream current: its kernels are queued on it.
            with torch.cuda.device(dev.torch_device), torch.cuda.stream(self._cuda):
                real = []
                for a in args:
                    if isinstance(a, Future):
                        # a result of another stream: wait for the kernel that writes it
                        done = getattr(a, "_cuda_done", None)
                        if done is not None:
                            self._cuda.wait_event(done)
                        a = Future.result(a)
                    for t in _tensors(a):
                        if t.is_cuda:
                            # The caching allocator hands a freed block out again as soon as the
                            # stream that allocated it is done with it. This stream reads t too
                            # (a buffer allocated on a copy stream, read on a compute stream):
                            # record_stream makes the allocator also wait for this stream's work
                            # queued so far before reusing t's memory.
                            t.record_stream(self._cuda)
                    real.append(a)
                with dev.rec.span(kind, lane=lane, mb=mb, stream=self._cuda):
                    out = fn(*real)
                fut._cuda_done = torch.cuda.Event()
                fut._cuda_done.record(self._cuda)
            fut.set_result(out)
            return fut

        grad_mode = torch.is_grad_enabled()  # grad mode is per thread: carry the caller's over

        def work() -> None:
            try:
                real = [a.result() if isinstance(a, Future) else a for a in args]
                t0 = now()
                with torch.set_grad_enabled(grad_mode):
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
        # a fresh marker each time: a wait already queued keeps the marker it was given
        if self.device.is_cuda:
            event._cuda = torch.cuda.Event()
            event._cuda.record(self._cuda)
        else:
            event._cuda, event._done = None, threading.Event()
            self._queue.put(event._done.set)

    def wait(self, event: Event) -> None:
        """Later work on this stream waits for `event` (recorded on any stream of any device).

        The caller does not block: the wait is itself queued, like `cudaStreamWaitEvent`."""
        if not self.device.is_cuda:
            self._queue.put(event._cuda.synchronize if event._cuda is not None else event._done.wait)
        elif event._cuda is not None:
            self._cuda.wait_event(event._cuda)
        elif not event._done.is_set():
            raise ValueError("a CUDA stream cannot wait for an event of a virtual device: "
                             "keep the streams of one program on one kind of device")
        # else: never recorded, nothing to wait for

    def synchronize(self) -> None:
        """Block the caller until all work submitted so far has run."""
        ev = Event()
        ev.record(self)
        ev.synchronize()

    def close(self) -> None:
        if not self.device.is_cuda:
            self._queue.put(None)


class Device:
    """One device driven by this process: a CUDA GPU or a virtual CPU device, with named streams.

    `label` names the device's rows on the timeline (default: its name). Two Device objects on
    one GPU each have their own streams and recorder; give them different labels to tell their
    rows apart."""

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
        self._streams: dict[str, Stream] = {}
        self._free: dict[tuple, list[torch.Tensor]] = {}  # virtual device: freed buffers by (shape, dtype)
        self._free_lock = threading.RLock()  # re-entrant: a release can run inside a take (GC)
        self._side: "torch.cuda.Stream | None" = None
        if not self.is_cuda:
            torch.set_num_threads(1)  # one intra-op thread per virtual device (process-wide)

    def stream(self, name: str = "compute") -> Stream:
        """The stream called `name` on this device (created on first use)."""
        if name not in self._streams:
            self._streams[name] = Stream(self, name)
        return self._streams[name]

    def side_stream(self) -> "torch.cuda.Stream":
        """A CUDA stream of this device for small jobs the host waits for (created on first use)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.torch_device)
        return self._side

    def cached_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised tensor of this virtual device, from its cache of freed buffers.

        Like CUDA's caching allocator, a virtual device keeps the memory of a buffer nobody uses
        any more (no reference, no pending work, nothing saved for backward) and hands it out
        again. Memory fresh from the OS costs a page fault per 4 KiB page on its first write;
        without the cache every copy into a new buffer would pay that and look slow."""
        key = (tuple(shape), dtype)
        with self._free_lock:
            free = self._free.get(key)
            block = free.pop() if free else None
        if block is None:
            block = torch.empty(shape, dtype=dtype)
        buf = block.detach()  # an alias with no autograd history; when it is gone, block is free again
        weakref.finalize(buf, self._release, key, block)
        _OWNER[buf] = self.name
        return buf

    def _release(self, key: tuple, block: torch.Tensor) -> None:
        with self._free_lock:
            self._free.setdefault(key, []).append(block)

    def owner(self, tensor: torch.Tensor) -> str | None:
        """The name of the device `tensor` lives on (None: an untagged host tensor)."""
        if self.is_cuda:
            return str(tensor.device)
        return _OWNER.get(tensor, None)

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """Place a host tensor on this device (a real copy on CUDA, a tag on a virtual device)."""
        if self.is_cuda:
            return tensor.to(self.torch_device)
        owner = _OWNER.get(tensor, None)
        if owner is not None and owner != self.name:
            raise ValueError(f"tensor already on {owner!r}: move it to {self.name!r} with "
                             f"stream.copy(tensor), not own()")
        _OWNER[tensor] = self.name
        return tensor

    def synchronize(self) -> None:
        """Block until all work on this device's streams (on CUDA, all its streams) has run."""
        for s in self._streams.values():
            s.synchronize()
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)  # also the host-issued kernels (default stream)

    def timeline(self) -> Timeline:
        return self.rec.timeline()

    def close(self) -> None:
        for s in self._streams.values():
            s.close()

    def __repr__(self) -> str:
        return f"Device({self.name!r})" if self.label == self.name else f"Device({self.name!r}, label={self.label!r})"


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
    """All devices' spans on one timeline (waits for the work submitted so far)."""
    for d in devs:
        d.synchronize()
    return Timeline.merge([d.timeline() for d in devs])

"""A virtual CPU device: each of its streams is a worker thread that runs the work submitted to
it, in order.

All virtual devices share CPU memory, so a tag says which device a tensor lives on: that is what
lets a stream refuse a tensor handed to the wrong device without a copy, as CUDA would. Each
device keeps freed buffers for reuse (`BufferCache`), as CUDA's caching allocator does.

**Paced devices** (an emulated node). A device given a `Pace` keeps the real threads and the real
math, but its timeline runs on modelled time, one logical clock per stream:

- a work item starts when its stream is free (the end of the stream's previous item, in modelled
  time) and every Future it was handed has landed (that Future's modelled end); it lasts what
  `pace.seconds(kind, fn, args)` gives for it at the emulated size. So a copy stream's copy starts
  after the compute that produced its source, and a compute stream handed the copy's Future after
  the copy: the dependencies that order the real threads order the modelled times too;
- an `Event` recorded on a stream carries that stream's modelled time at the marker, and a stream
  that waits for it moves its clock up to that time: an event's time is the modelled time;
- nothing else orders the clocks. A compute stream that reads a buffer without waiting for the
  event starts at its own time, before the copy lands, as on a GPU: `raw_hazards` then finds it.

The clocks never wait out the modelled time (no sleeping), so a run is as fast as its real math and
its timeline is the same on a loaded laptop and an idle one. The alternative, each thread doing its
math and then sleeping until its modelled end, would keep real and modelled time together but put
the machine's scheduling noise back into every figure.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from concurrent.futures import Future
from typing import Callable

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from pipelab.streams.base import Device, Event, Stream, Work, chunk_rows, tensors_in
from pipelab.timeline import Recorder, now

_OWNER = WeakTensorKeyDictionary()  # tensor -> name of the virtual device it lives on
_LIVE_STREAMS: "weakref.WeakSet[VirtualStream]" = weakref.WeakSet()


@atexit.register
def _drain_virtual_streams() -> None:
    # Let queued work finish before the interpreter shuts down: a worker thread still inside a
    # PyTorch kernel when Python tears down its threads aborts the whole process.
    for s in list(_LIVE_STREAMS):
        s.close(timeout=5)


def _serve(work: queue.Queue) -> None:
    """A virtual stream's thread: run the queued work in order until a None arrives.

    It holds the queue only, never the stream, so a stream nobody uses any more can be garbage
    collected; its finalizer then queues the None that ends this thread."""
    # torch.set_num_threads is process-wide: the device constructor set it to 1 so each
    # virtual device uses exactly one core, and two devices use two.
    while True:
        item = work.get()
        if item is None:
            return
        item()
        del item  # the finished work (and the device it names) is not kept alive while we wait


def owner_of(tensor: torch.Tensor) -> str | None:
    """The virtual device `tensor` lives on (None: an untagged host tensor)."""
    return _OWNER.get(tensor, None)


def tag(tensor: torch.Tensor, device_name: str) -> torch.Tensor:
    """Mark `tensor` as living on the virtual device `device_name`."""
    _OWNER[tensor] = device_name
    return tensor


class BufferCache:
    """A virtual device's caching allocator.

    Like CUDA's caching allocator, it keeps the memory of a buffer nobody uses any more (no
    reference, no pending work, nothing saved for backward) and hands it out again. Memory fresh
    from the OS costs a page fault per 4 KiB page on its first write; without the cache every
    copy into a new buffer would pay that and look slow."""

    def __init__(self, device_name: str) -> None:
        self.device_name = device_name
        self._free: dict[tuple, list[torch.Tensor]] = {}  # freed blocks by (shape, dtype)
        self._lock = threading.RLock()  # re-entrant: a release can run inside a take (GC)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised tensor of the device, a freed block of that shape and dtype if any."""
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key)
            block = free.pop() if free else None
        if block is None:
            block = torch.empty(shape, dtype=dtype)
        buf = block.detach()  # an alias with no autograd history; when it is gone, block is free again
        weakref.finalize(buf, self._release, key, block)
        return tag(buf, self.device_name)

    def _release(self, key: tuple, block: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(key, []).append(block)


class Pace:
    """How long work on paced virtual devices lasts in modelled time (an emulated node).

    A subclass gives `seconds(kind, fn, args)`: the modelled duration of `fn(*args)` submitted as
    `kind` (a copy's `fn` is the stream's copy, its `args` the source and the buffer). One Pace is
    shared by the devices of one program; it remembers the latest modelled time any stream reached
    (`latest`), which is when a held stream is let go (`hold`)."""

    def __init__(self) -> None:
        self._latest = 0.0
        self._lock = threading.Lock()

    def seconds(self, kind: str, fn: Callable, args: tuple) -> float:
        raise NotImplementedError

    def label(self, index: int) -> str | None:
        """What paced device `index` is called on the timeline (None: its own name, "cpu:0")."""
        return None

    def reached(self, t: float) -> None:
        with self._lock:
            self._latest = max(self._latest, t)

    def latest(self) -> float:
        with self._lock:
            return self._latest

    def restart(self) -> None:
        with self._lock:
            self._latest = 0.0


class _Marker(threading.Event):
    """A marker in a virtual stream's queue: set when the stream's thread reaches it; `t` is the
    stream's modelled time there (paced devices)."""

    t = 0.0

    def query(self) -> bool:
        return self.is_set()

    def synchronize(self) -> None:
        self.wait()


class VirtualStream(Stream):
    """A stream of a virtual CPU device: a worker thread runs the queued work in order.

    Each work item is timed on the shared clock, or on this stream's logical clock `t` when the
    device is paced; its tensor results are tagged as this device's."""

    def __init__(self, device: "VirtualDevice", name: str) -> None:
        super().__init__(device, name)
        self.t = 0.0  # paced devices: the modelled end of this stream's last work
        self._cache = device.cache  # where its buffers come from: the device's freed blocks
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=_serve, args=(self._queue,), name=f"{device.label}/{name}",
                                        daemon=True)
        self._thread.start()
        # stop the thread when the stream is closed or garbage collected, whichever comes first
        self._stop = weakref.finalize(self, self._queue.put, None)
        _LIVE_STREAMS.add(self)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
              fill: float | None = None) -> torch.Tensor:
        buf = self._cache.empty(shape, dtype)
        if fill is not None:
            buf.fill_(fill)  # done now, on the host: the buffer is filled before anyone can read it
        return buf

    def wait(self, event: Event) -> None:
        self._check_open()
        marker = event._marker
        if marker is None:  # never recorded: nothing to wait for
            return

        def wait_for_marker() -> None:
            marker.synchronize()
            self.t = max(self.t, getattr(marker, "t", 0.0))  # modelled time: not before the event
        self._queue.put(wait_for_marker)

    def hold(self) -> Callable[[], None]:
        # the thread waits on a gate; 60 s: a forgotten gate cannot hang for ever
        gate = threading.Event()
        self.submit(gate.wait, 60, kind="held")
        return gate.set

    def close(self, timeout: float | None = None) -> None:
        """Run the work already queued, then end the thread (waiting at most `timeout` s for it)."""
        self._stop()  # queues the None once, however often close is called
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return not self._stop.alive

    def restart_clock(self) -> None:
        self.t = 0.0

    def _enqueue(self, fn, args, kind, mb, lane) -> Work:
        self._check_open()
        fut, dev = Work(), self.device
        grad_mode = torch.is_grad_enabled()  # grad mode is per thread: carry the caller's over

        def work() -> None:
            try:
                real = [a.result() if isinstance(a, Future) else a for a in args]
                t0 = now()
                with torch.set_grad_enabled(grad_mode):
                    out = fn(*real)
                if dev.pace is None:
                    dev.rec.add(kind, t0, now(), lane=lane, mb=mb)
                else:
                    fut.modelled_end = self._pace(kind, fn, real, args, lane, mb)
                for t in tensors_in(out):
                    tag(t, dev.name)
                fut.set_result(out)
            except BaseException as exc:  # surface the error to whoever waits on the result
                fut.set_exception(exc)

        self._queue.put(work)
        return fut

    def _pace(self, kind, fn, real, args, lane, mb) -> float:
        """Record the work just run in modelled time (a paced device); return its modelled end."""
        pace = self.device.pace
        landed = [a.modelled_end for a in args if getattr(a, "modelled_end", None) is not None]
        start = max([self.t, *landed])  # the stream is free and every input has landed
        if kind == "held":
            end = max(start, pace.latest())  # let go by the host after what ran meanwhile
        else:
            end = start + pace.seconds(kind, fn, tuple(real))
        self.t = end
        pace.reached(end)
        self.device.rec.add(kind, start, end, lane=lane, mb=mb)
        return end

    def _land(self, src: torch.Tensor, out: torch.Tensor | None, chunk_bytes: int) -> torch.Tensor:
        dst = self._cache.empty(src.shape, src.dtype) if out is None else out
        if dst.dim() == 0:
            return dst.copy_(src)
        rows = chunk_rows(dst, chunk_bytes)
        for k in range(0, dst.shape[0], rows):
            # slice dst only now: autograd then records each chunk's copy on top of the last one
            dst[k:k + rows].copy_(src[k:k + rows])
        return dst

    def _mark(self) -> _Marker:
        marker = _Marker()

        def reach() -> None:
            marker.t = self.t  # the stream's modelled time at the marker
            marker.set()
        if self.closed:
            reach()  # close ran all queued work: nothing is left to wait for
        else:
            self._queue.put(reach)
        return marker

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"{self!r} is closed (Device.close, or the end of `with devices(n) as devs:`): "
                             f"make new devices with streams.devices(n)")


class VirtualDevice(Device):
    """A virtual CPU device ("cpu:0", "cpu:1", ...): its streams are `VirtualStream`s, threads
    of this process, and its tensors are host tensors tagged with its name.

    Each device computes with one intra-op thread, so two devices use two cores. A device nobody
    references any more stops its threads when it is garbage collected. With a `pace` (see the
    module's docstring) its timeline runs on modelled time, a logical clock per stream."""

    stream_class = VirtualStream

    def __init__(self, name: str, rec: Recorder | None = None, label: str | None = None,
                 pace: Pace | None = None) -> None:
        super().__init__(name, rec, label)
        self.pace = pace
        self.torch_device = torch.device("cpu")
        self.cache = BufferCache(self.name)
        torch.set_num_threads(1)  # one intra-op thread per virtual device (process-wide)

    def owner(self, tensor: torch.Tensor) -> str | None:
        return owner_of(tensor)

    def restart_clock(self) -> None:
        """Paced: every stream's logical clock back to 0 (call with no work in flight)."""
        for s in self._streams.values():
            s.restart_clock()
        if self.pace is not None:
            self.pace.restart()

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """Tag a host tensor as this device's (no copy: all virtual devices share host memory)."""
        owner = owner_of(tensor)
        if owner is not None and owner != self.name:
            raise ValueError(f"tensor already on {owner!r}: move it to {self.name!r} with "
                             f"stream.copy(tensor), not own()")
        return tag(tensor, self.name)

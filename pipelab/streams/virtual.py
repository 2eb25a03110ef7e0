"""A virtual CPU device: each of its streams is a worker thread that runs the work submitted to
it, in order.

All virtual devices share CPU memory, so a tag says which device a tensor lives on: that is what
lets a stream refuse a tensor handed to the wrong device without a copy, as CUDA would. Each
device keeps freed buffers for reuse (`BufferCache`), as CUDA's caching allocator does.
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


class _Marker(threading.Event):
    """A marker in a virtual stream's queue: set when the stream's thread reaches it."""

    def query(self) -> bool:
        return self.is_set()

    def synchronize(self) -> None:
        self.wait()


class VirtualStream(Stream):
    """A stream of a virtual CPU device: a worker thread runs the queued work in order.

    Each work item is timed on the shared clock; its tensor results are tagged as this device's."""

    def __init__(self, device: "VirtualDevice", name: str) -> None:
        super().__init__(device, name)
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
        if event._marker is not None:  # never recorded: nothing to wait for
            self._queue.put(event._marker.synchronize)

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
                dev.rec.add(kind, t0, now(), lane=lane, mb=mb)
                for t in tensors_in(out):
                    tag(t, dev.name)
                fut.set_result(out)
            except BaseException as exc:  # surface the error to whoever waits on the result
                fut.set_exception(exc)

        self._queue.put(work)
        return fut

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
        if self.closed:
            marker.set()  # close ran all queued work: nothing is left to wait for
        else:
            self._queue.put(marker.set)
        return marker

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"{self!r} is closed (Device.close, or the end of `with devices(n) as devs:`): "
                             f"make new devices with streams.devices(n)")


class VirtualDevice(Device):
    """A virtual CPU device ("cpu:0", "cpu:1", ...): its streams are `VirtualStream`s, threads
    of this process, and its tensors are host tensors tagged with its name.

    Each device computes with one intra-op thread, so two devices use two cores. A device nobody
    references any more stops its threads when it is garbage collected."""

    stream_class = VirtualStream

    def __init__(self, name: str, rec: Recorder | None = None, label: str | None = None) -> None:
        super().__init__(name, rec, label)
        self.torch_device = torch.device("cpu")
        self.cache = BufferCache(self.name)
        torch.set_num_threads(1)  # one intra-op thread per virtual device (process-wide)

    def owner(self, tensor: torch.Tensor) -> str | None:
        return owner_of(tensor)

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """Tag a host tensor as this device's (no copy: all virtual devices share host memory)."""
        owner = owner_of(tensor)
        if owner is not None and owner != self.name:
            raise ValueError(f"tensor already on {owner!r}: move it to {self.name!r} with "
                             f"stream.copy(tensor), not own()")
        return tag(tensor, self.name)

"""Single-process devices: real CUDA devices and streams, or CPU "virtual devices".

A virtual device runs each of its streams on a worker thread that executes submitted work in
order, exactly like a CUDA stream: `submit` returns at once, the work runs later. PyTorch releases
the GIL inside its kernels, so two virtual devices really compute at the same time on two cores.
Every kernel and copy is recorded as a Span (rank = device label, lane = stream name).

Both kinds have one interface, `Device` with its `Stream`s: a `VirtualDevice` has `VirtualStream`s
(CPU worker threads; `streams.virtual`), a `CudaDevice` has `CudaStream`s (a `torch.cuda.Stream`
each; `streams.cuda`), and `device(name)` / `devices(n)` pick the kind (`streams.device`).
Virtual devices given a `Pace` run on modelled time, a logical clock per stream (an emulated
node; see `streams.virtual`).

A tensor goes from one stream to another in one of two ways:

* hand over the Future that `submit` or `copy` returned: the receiving stream waits for the work
  that produces it (the Future carries that work's completion; on CUDA, a CUDA event);
* hand over a buffer that another stream fills (`copy(src, out=buf)`): then nothing orders the
  writer and the reader but an `Event` recorded on the writer and waited for by the reader, as in
  raw CUDA code. Forget the event and the reader may see the buffer before the copy lands.
"""

from pipelab.streams.base import CHUNK_BYTES, Device, Event, Stream, Work, chunk_rows
from pipelab.streams.cuda import CudaDevice, CudaStream, CudaWork
from pipelab.streams.device import DEVICE_CHOICES, Devices, device, devices, shares_one_gpu, timeline
from pipelab.streams.virtual import Pace, VirtualDevice, VirtualStream

__all__ = ["CHUNK_BYTES", "DEVICE_CHOICES", "CudaDevice", "CudaStream", "CudaWork", "Device", "Devices", "Event",
           "Pace", "Stream", "VirtualDevice", "VirtualStream", "Work", "chunk_rows", "device", "devices",
           "shares_one_gpu", "timeline"]

"""One flat all-reduce: many gradients averaged over a group in a single message.

Flatten the gradients into one buffer, divided by the number of replicas as they are copied (the
sum the all-reduce computes is then the average, and the division needs no extra pass), launch the
all-reduce asynchronously so that it travels while the caller computes, and write the averages
back into `.grad` once it has arrived. `BucketedDDP` does this per bucket (filling the buffer one
gradient at a time, as backward produces them), the grid's `StageAllReduce` per pipeline stage,
and DeepSpeed's engine per stage at the end of a batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from pipelab.timeline import Recorder, now


def flatten(params: Sequence[torch.Tensor], divisor: float) -> torch.Tensor:
    """The gradients of `params` in one flat buffer, divided by `divisor`; a parameter without a
    gradient takes part with zeros (every rank must send the same number of elements)."""
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    return torch.cat([g.reshape(-1) for g in grads]).div_(divisor)


def write_back(flat: torch.Tensor, params: Sequence[torch.Tensor], keep: Sequence[bool] | None = None) -> None:
    """Each parameter's slice of `flat`, in order, into its `.grad` (a copy, so `flat` can be
    reused); with `keep`, only the parameters it marks True (the others' slices are skipped)."""
    offset = 0
    for i, p in enumerate(params):
        if keep is None or keep[i]:
            average = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = average.clone()
            else:
                p.grad.copy_(average)
        offset += p.numel()


_side_streams: dict = {}  # per CUDA device: a stream that runs nothing but waits for collectives


def side_stream(device: torch.device):
    """The stream of `device` that only waits for collectives, so an event recorded on it after a
    collective's `wait()` fires when the collective has finished, not when other work has."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def on_events(rec: Recorder, device: torch.device) -> bool:
    """Whether spans of work on `device` are CUDA events of `rec`: a CUDA recorder on that same
    device (events of two devices cannot be compared; a module spread over devices keeps to the
    host clock), not on a logical clock."""
    return rec._is_cuda() and rec.clock is None and torch.device(device) == torch.device(rec.device)


def arrival_stamp(work, rec: Recorder, device: torch.device):
    """The moment collective `work` finishes, on the rank's clock, as `rec.add_stamped` takes it:
    on a CUDA device a CUDA event recorded on a side stream made to wait for the collective (the
    communication stream's end, not a host callback: NCCL's future fires when the collective is
    *enqueued*); for a handle that knows its own end (a timed communication layer) that end; on a CPU the moment gloo's thread
    finished it (a callback of the work's future, read on the shared clock)."""
    if hasattr(work, "end"):  # a handle that knows when it ends (NCCL's ordering rule on gloo)
        return None  # read at wait(): its end is known once the operation ran
    if on_events(rec, device):
        stream = side_stream(device)
        with torch.cuda.stream(stream):
            work.wait()  # the side stream waits for the collective; the host does not
            return rec.stamp(stream)
    try:
        return work.get_future().then(lambda _: now())
    except (RuntimeError, NotImplementedError):  # a backend without futures: read at wait()
        return None


def resolve_arrival(work, arrival, rec: Recorder):
    """The arrival as a stamp, once `work.wait()` has returned: the modelled end, the event, the
    time the future's callback read, or (a backend that tells neither) the recorder's time now."""
    if arrival is None:
        end = getattr(work, "end", None)
        return end if end is not None else rec.stamp()
    return arrival if isinstance(arrival, torch.cuda.Event) else arrival.wait()


class FlatAllReduce:
    """An asynchronous all-reduce (sum) of one flat buffer over `group`, launched when built.

    `wait()` returns the buffer once the sum has arrived. With an enabled recorder it also draws
    the all-reduce on the `comm` lane from launch to arrival (`meta` goes on the span), both on the
    rank's one clock (`arrival_stamp`): the moment the sum landed, not the moment someone asked."""

    def __init__(self, flat: torch.Tensor, group=None, rec: Recorder | None = None, **meta):
        self.flat, self.rec, self.meta = flat, rec, meta
        self.recording = rec is not None and rec.enabled
        # The launch: on a GPU an event on the current stream, which the collective waits for.
        self.launched = (rec.stamp() if on_events(rec, flat.device) else rec.now()) if self.recording else now()
        self.work = dist.all_reduce(flat, group=group, async_op=True)
        self.arrival = arrival_stamp(self.work, rec, flat.device) if self.recording else None

    def wait(self) -> torch.Tensor:
        """Block until the sum is here; return the buffer that holds it."""
        self.work.wait()
        if self.recording:
            self.rec.add_stamped("allreduce", self.launched, resolve_arrival(self.work, self.arrival, self.rec), lane="comm",
                                 bytes=self.flat.nbytes, **self.meta)
        return self.flat


def average_gradients(params: Sequence[torch.Tensor], group=None, divisor: float | None = None,
                      rec: Recorder | None = None, **meta) -> FlatAllReduce:
    """Launch the flat all-reduce of `params`' gradients over `group`, each divided by `divisor`
    (default: the group's size, so the sum is the average). Call `write_back(op.wait(), params)`
    when the averages are needed."""
    divisor = dist.get_world_size(group) if divisor is None else divisor
    return FlatAllReduce(flatten(params, divisor), group, rec, **meta)

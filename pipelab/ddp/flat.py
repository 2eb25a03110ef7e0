"""One flat all-reduce: many gradients averaged over a group in a single message.

Flatten the gradients into one buffer, divided by the number of replicas as they are copied (the
sum the all-reduce computes is then the average, and the division costs no extra pass), launch the
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


class FlatAllReduce:
    """An asynchronous all-reduce (sum) of one flat buffer over `group`, launched when built.

    `wait()` returns the buffer once the sum has arrived. With an enabled recorder it also draws
    the all-reduce on the `comm` lane from launch to arrival (`meta` goes on the span); the arrival
    is read by a callback on the communication thread, so it is the moment the sum landed, not the
    moment someone asked."""

    def __init__(self, flat: torch.Tensor, group=None, rec: Recorder | None = None, **meta):
        self.flat, self.rec, self.meta = flat, rec, meta
        self.recording = rec is not None and rec.enabled
        self.launched = rec.now() if rec is not None else now()
        self.work = dist.all_reduce(flat, group=group, async_op=True)
        # On an emulated node the handle knows its modelled end on the rank's clock. Elsewhere a
        # callback on the communication thread reads the clock when the sum lands; it needs Python's
        # GIL, so it costs a little per all-reduce and can be late by whatever Python runs then.
        modelled = hasattr(self.work, "end")
        self.arrival = self.work.get_future().then(lambda _: now()) if self.recording and not modelled else None

    def wait(self) -> torch.Tensor:
        """Block until the sum is here; return the buffer that holds it."""
        self.work.wait()
        if self.recording:
            arrived = self.work.end if self.arrival is None else self.arrival.wait()
            self.rec.add("allreduce", self.launched, arrived, lane="comm", bytes=self.flat.nbytes, **self.meta)
        return self.flat


def average_gradients(params: Sequence[torch.Tensor], group=None, divisor: float | None = None,
                      rec: Recorder | None = None, **meta) -> FlatAllReduce:
    """Launch the flat all-reduce of `params`' gradients over `group`, each divided by `divisor`
    (default: the group's size, so the sum is the average). Call `write_back(op.wait(), params)`
    when the averages are needed."""
    divisor = dist.get_world_size(group) if divisor is None else divisor
    return FlatAllReduce(flatten(params, divisor), group, rec, **meta)

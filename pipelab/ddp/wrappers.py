"""Data parallelism built by hand: every rank holds a whole replica of the model, computes the
gradients of its own slice of the batch, and the ranks average their gradients with all-reduce,
so every replica takes the same optimizer step and the replicas stay equal.

* `NaiveDDP` waits until backward is done, then all-reduces the gradients one by one. Simple, but
  the network idles while backward computes, and the processor idles while the gradients travel.
* `BucketedDDP` groups the gradients into buckets of about `bucket_cap_mb` MiB, in the order
  backward produces them (last layer first), and sends each bucket the moment it is complete,
  while backward carries on with the layers before it. That is what
  `torch.nn.parallel.DistributedDataParallel` does.

Both are drop-in like torch's DDP: `out = ddp(x)`, `loss.backward()`, and the gradients are
averaged when `backward()` returns. Both draw what they did on the rank's timeline: the forward
(`F`) and each layer's backward (`B`) on the `compute` lane, each all-reduce on the `comm` lane.

A replica may itself be spread over several devices (lesson 05: half the model on each of two
GPUs). Then each layer's backward goes to the lane of its device, and `BucketedDDP`'s buckets
never mix devices: each bucket is one flat buffer on the device of its parameters, as in torch.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from pipelab.ddp.base import DDPBase
from pipelab.ddp.buckets import check_bucket_cap, module_bucket_plan
from pipelab.ddp.flat import FlatAllReduce, write_back
from pipelab.display import format_bucket_plan
from pipelab.timeline import Recorder


class NaiveDDP(DDPBase):
    """Data parallelism, the simplest way: after backward, all-reduce every gradient one by one
    and divide by the number of ranks.

    Nothing overlaps: communication starts only when backward has finished, and each parameter
    pays a message's fixed cost. A parameter that got no gradient on this rank takes part with
    zeros (every rank must issue the same all-reduces), and gets the average like the others."""

    def finish_gradients(self) -> None:
        for name, p in reversed(self.params):  # the order backward produced them
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            # On a GPU the stamps are CUDA events on the current stream, which waits for the
            # all-reduce: the span runs from the gradient being ready to the sum having arrived.
            start = self.stamp()
            dist.all_reduce(p.grad, group=self.process_group)
            self.rec.add_stamped("allreduce", start, self.stamp(), lane="comm", param=name, bytes=p.grad.nbytes)
            p.grad.div_(self.world_size)


class BucketedDDP(DDPBase):
    """Data parallelism that hides communication behind backward, as torch's DDP does.

    Parameters are grouped into buckets of about `bucket_cap_mb` MiB in reverse registration
    order (`plan_buckets`). When a parameter's gradient is ready, a hook copies it, divided by the
    number of ranks, into its slot of the bucket's flat buffer; the moment a bucket is complete,
    the buffer goes out in an asynchronous all-reduce (its sum is the average) while backward goes
    on with the layers before it. At the end of backward we wait for the buckets in order and copy
    each one's averages back into `.grad` as soon as it has arrived.

    Buckets are sent strictly in plan order, even if a later one fills first: collectives must be
    issued in the same order on every rank, or they would pair up the wrong buckets.

    Unused parameters (no gradient in a step) keep their bucket from ever completing. With
    `find_unused_parameters=False` (the default, like torch) that is an error: at the end of
    backward we still send the incomplete buckets, so that no peer hangs waiting for them, and then
    raise a RuntimeError naming the parameters. With `find_unused_parameters=True` they are marked
    ready at the end of backward with zero gradients (so their buckets go out only then), and one
    more small all-reduce per step tells every rank which parameters no rank used: those keep
    `.grad` untouched (None), exactly as in a single process. torch finds them already after forward, by
    walking the autograd graph; marking them at the end is simpler and gives up some overlap.

    A module spread over devices gets buckets that never mix devices (`plan_buckets` keeps one
    open bucket per device), each a flat buffer on its own device, so no gradient is copied
    between devices; the alternative, one buffer per bucket per device, would send each bucket as
    several all-reduces anyway. On virtual devices, which all live in CPU memory, pass
    `device_of` (parameter name -> device name) to say which parameter lives where."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False,
                 recorder: Recorder | None = None, process_group=None, device_of: Mapping[str, str] | None = None,
                 broadcast_buffers: bool = True):
        check_bucket_cap(bucket_cap_mb)  # before any collective, so a bad value fails fast
        super().__init__(module, recorder, process_group, device_of, broadcast_buffers)
        dtypes = {p.dtype for _, p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"BucketedDDP flattens gradients into one buffer per bucket, so all parameters "
                             f"need one dtype; got {sorted(map(str, dtypes))}: convert the model with "
                             "module.to(dtype)")
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.buckets = module_bucket_plan(module, bucket_cap_mb, device_of)
        self._slots, self._flat = self.allocate()  # one flat gradient buffer per bucket
        index_of = {name: i for i, (name, _) in enumerate(self.params)}
        self._members = [[index_of[name] for name in b.names] for b in self.buckets]  # in slot order
        self.reset()

    def allocate(self):
        """Each parameter's (bucket, offset, numel), and one flat gradient buffer per bucket, on
        the device (and with the dtype) of the bucket's parameters."""
        index_of = {name: i for i, (name, _) in enumerate(self.params)}
        slots: list[tuple[int, int, int]] = [(0, 0, 0)] * len(self.params)
        buffers = []
        for bucket in self.buckets:
            offset = 0
            members = [self.params[index_of[name]][1] for name in bucket.names]
            for name, p in zip(bucket.names, members):
                slots[index_of[name]] = (bucket.index, offset, p.numel())
                offset += p.numel()
            places = {p.device for p in members}
            if len(places) > 1:
                raise ValueError(f"bucket {bucket.index} holds parameters on {sorted(map(str, places))}: "
                                 "device_of must give parameters on different torch devices different names")
            buffers.append(torch.zeros(offset, dtype=members[0].dtype, device=members[0].device))
        return slots, buffers

    def describe(self) -> str:
        """The bucket plan as a table."""
        return format_bucket_plan(self.buckets)

    def reset(self) -> None:
        super().reset()
        if not hasattr(self, "buckets"):
            return  # called by DDPBase.__init__, before the plan exists
        self._ready = [False] * len(self.params)  # which parameters have their gradient
        self._left = [len(b.names) for b in self.buckets]  # gradients each bucket still waits for
        self._next = 0  # the next bucket to send
        self._inflight: list[FlatAllReduce] = []  # the buckets' all-reduces, in launch order

    def slot(self, index: int) -> torch.Tensor:
        """Parameter `index`'s place in its bucket's flat buffer (a view)."""
        bucket, offset, numel = self._slots[index]
        return self._flat[bucket][offset:offset + numel]

    # ---- during backward --------------------------------------------------------------------
    def grad_ready(self, index: int, param: torch.Tensor) -> None:
        self._ready[index] = True
        # Divide while copying into the bucket: the all-reduce's sum is then the average, and the
        # division needs no extra pass over the gradients (torch's DDP does the same).
        torch.div(param.grad.reshape(-1), self.world_size, out=self.slot(index))
        self._left[self._slots[index][0]] -= 1
        self.send_complete_buckets()

    def send_complete_buckets(self) -> None:
        """Send every complete bucket whose predecessors have all been sent."""
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self.all_reduce_async(self._next)
            self._next += 1

    def all_reduce_async(self, bucket: int) -> None:
        """Launch the bucket's all-reduce and return at once; backward goes on meanwhile."""
        self._inflight.append(FlatAllReduce(self._flat[bucket], self.process_group, self.rec, bucket=bucket))

    # ---- at the end of backward -------------------------------------------------------------
    def finish_gradients(self) -> None:
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        for i in missing:  # zeros from this rank; their buckets can go out now
            self.slot(i).zero_()
            self._left[self._slots[i][0]] -= 1
        self.send_complete_buckets()
        self.wait_and_write_back()
        if missing and not self.find_unused_parameters:
            names = [self.params[i][0] for i in missing]
            raise RuntimeError(f"parameters {names} got no gradient in this backward on rank {self.rank}, so "
                               "their buckets could only be sent at its end. If the model really "
                               "skips them in some steps, pass find_unused_parameters=True; otherwise "
                               "make the loss depend on them (or set requires_grad=False)")
        if self.find_unused_parameters:  # every rank, every step: the peers can't know we need it
            used = self.used_anywhere(missing)
            for i in missing:
                if used[i]:  # another rank had a gradient for it: take the average too
                    self.write_average(i)

    def wait_and_write_back(self) -> None:
        """Wait for the buckets in order; copy each one's averages into `.grad` as soon as it is
        back, while the later buckets are still on their way. (An all-reduce's span runs from launch
        to arrival: waiting for the peers to launch theirs, queueing behind earlier buckets and
        moving the bytes. So spans of one rank may overlap.)"""
        for op in self._inflight:
            bucket, flat = op.meta["bucket"], op.wait()
            copy_start = self.stamp()
            members = self._members[bucket]
            write_back(flat, [self.params[i][1] for i in members], keep=[self._ready[i] for i in members])
            self.rec.ran("copy", bytes=flat.nbytes)
            self.rec.add_stamped("copy", copy_start, self.stamp(), lane=self.buckets[bucket].device or "compute",
                                 bucket=bucket)
        self._inflight = []

    def write_average(self, index: int) -> None:
        """Parameter `index`'s averaged gradient, from its slot into `.grad`."""
        write_back(self.slot(index), [self.params[index][1]])

    def used_anywhere(self, missing: list[int]) -> list[bool]:
        """Which parameters had a gradient on at least one rank (one small all-reduce)."""
        used = torch.ones(len(self.params), device=self._flat[0].device)
        used[missing] = 0
        start = self.stamp()
        dist.all_reduce(used, group=self.process_group)
        self.rec.add_stamped("allreduce", start, self.stamp(), lane="comm", what="used flags", bytes=used.nbytes)
        return (used > 0).tolist()

"""The collectives sharding is built from, each call counted and put on the timeline.

Bytes sent are counted from the tensors each call really passes, as the bytes one rank puts on the
wire when the collective runs as a ring (lesson 00), for a full tensor of n bytes on N ranks:

    all-reduce      2 (N-1)/N * n   (a reduce-scatter, then an all-gather)
    reduce-scatter    (N-1)/N * n   (n: the input, every rank's whole vector)
    all-gather        (N-1)/N * n   (n: the output, the whole vector put together)

So data parallelism sends 2(N-1)/N * 4Ψ bytes per step for Ψ fp32 parameters ("2Ψ" in the ZeRO
paper, which counts in elements and lets N grow), ZeRO-1 and ZeRO-2 the same, ZeRO-3 1.5 times it.
`payload` counts the other way: the bytes of the full tensor handed to each call.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipelab.ddp.flat import arrival_stamp, on_events, resolve_arrival
from pipelab.timeline import Recorder, now

RING_SHARE = {"allreduce": 2, "reducescatter": 1, "allgather": 1}  # times (N-1)/N of the full tensor


def ring_bytes(kind: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for collective `kind` on a full tensor of `nbytes`, as a ring."""
    return RING_SHARE[kind] * (world_size - 1) / world_size * nbytes


@dataclass(frozen=True)
class Message:
    """One collective this rank took part in."""

    kind: str  # "allreduce", "reducescatter" or "allgather"
    payload: int  # bytes of the full tensor (all-reduce's tensor, reduce-scatter's input, all-gather's output)
    sent: float  # bytes this rank sends, as a ring
    layer: str | None


class Pending:
    """A collective in flight: `wait()` returns once it has arrived. Its span on the `comm` lane runs
    from issue to arrival (the moment the backend finished it, not the moment someone waited), both
    on the rank's one clock: on a GPU CUDA events, the arrival recorded on a stream that waits for
    the collective and nothing else (`pipelab.ddp.flat.arrival_stamp`); on a logical clock the end
    it gives; on a CPU the moment gloo's thread finished it. `start` is a `Recorder.stamp`."""

    def __init__(self, work, rec: Recorder, kind: str, start, device: torch.device | None = None, **meta):
        self.work, self.rec, self.kind, self.start, self.meta = work, rec, kind, start, meta
        self.arrival = arrival_stamp(work, rec, device) if work is not None else None

    def wait(self) -> None:
        if self.work is None:  # ran synchronously: it has arrived (on a GPU the stream waited for it)
            end = self.rec.stamp() if not isinstance(self.start, (int, float)) else self.rec.now()
        else:
            self.work.wait()
            end = resolve_arrival(self.work, self.arrival, self.rec)
        if isinstance(end, (int, float)) and isinstance(self.start, (int, float)):
            end = max(end, self.start)
        self.rec.add_stamped(self.kind, self.start, end, lane="comm", **self.meta)
        self.work = None


# torch 2.13 renamed reduce_scatter_tensor and all_gather_into_tensor to reduce_scatter_single and
# all_gather_single; the old names, which every torch since 1.13 has and a timed communication layer sees,
# still work (they call the new ones) but warn at every rank. We call the old names, unwarned.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                        r"is deprecated", category=FutureWarning)


class Collectives:
    """All-reduce, reduce-scatter and all-gather over `group`, each call counted in `messages` and
    drawn on `rec`'s `comm` lane. `async_op=True` returns at once; call `wait()` on what it returns."""

    def __init__(self, rec: Recorder, group=None):
        self.rec, self.group = rec, group
        self.world_size = dist.get_world_size(group)
        self.clock = getattr(rec, "now", None) or now  # a recorder with a logical clock keeps its own time
        self.messages: list[Message] = []

    def all_reduce(self, tensor: torch.Tensor, layer: str | None = None, async_op: bool = False) -> Pending:
        """Sum `tensor` over the ranks, in place."""
        return self._issue("allreduce", tensor, layer, async_op,
                           lambda: dist.all_reduce(tensor, group=self.group, async_op=async_op))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, layer: str | None = None,
                       async_op: bool = False) -> Pending:
        """Sum `full` over the ranks and leave this rank's piece in `shard` (full is N shards long)."""
        return self._issue("reducescatter", full, layer, async_op,
                           lambda: dist.reduce_scatter_tensor(shard, full, group=self.group, async_op=async_op))

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, layer: str | None = None,
                   async_op: bool = False) -> Pending:
        """Put every rank's `shard` into `full`, in rank order (`shard` may be a view into `full`)."""
        return self._issue("allgather", full, layer, async_op,
                           lambda: dist.all_gather_into_tensor(full, shard, group=self.group, async_op=async_op))

    def _issue(self, kind: str, full: torch.Tensor, layer, async_op: bool, call) -> Pending:
        payload = full.numel() * full.element_size()
        self.messages.append(Message(kind, payload, ring_bytes(kind, payload, self.world_size), layer))
        # On a GPU an event on the current stream, which the collective waits for.
        start = self.rec.stamp() if on_events(self.rec, full.device) else self.rec.now()
        pending = Pending(call(), self.rec, kind, start, full.device, layer=layer)
        if not async_op:
            pending.wait()
        return pending

    def bytes_sent(self) -> float:
        """Bytes this rank sent since the last `clear()`, counted as a ring."""
        return sum(m.sent for m in self.messages)

    def clear(self) -> None:
        self.messages.clear()

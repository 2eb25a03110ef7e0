"""Lesson 00's workers: all-reduce and broadcast, a ping-pong between two ranks (latency and
bandwidth against message size), the ring all-reduce and its cost, a compute-then-communicate step.

Each worker runs inside a process started by `pipelab.launch.spawn`, so `ctx` tells it its rank,
the world size and its device, and `ctx.rec` records what it did on the timeline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from pipelab.hardware import synchronize
from pipelab.latency_bandwidth import ring_all_reduce_time  # noqa: F401 - lesson 00 shows it from here
from pipelab.measure import Measured
from pipelab.timeline import Timeline
from pipelab.worker import RankContext


@dataclass
class BeforeAfter:
    """What one rank held before and after a collective."""

    rank: int
    before: torch.Tensor
    after: torch.Tensor

    def __str__(self) -> str:
        return f"rank {self.rank}: before {self.before.tolist()}  after {self.after.tolist()}"


def allreduce_demo(ctx: RankContext) -> BeforeAfter:
    """Every rank holds [rank+1, rank+1, rank+1]; after all_reduce(SUM) every rank holds the sum."""
    t = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    before = t.clone().cpu()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return BeforeAfter(ctx.rank, before, t.cpu())


def broadcast_demo(ctx: RankContext, src: int = 0) -> BeforeAfter:
    """Only rank `src` starts with real values; after broadcast every rank holds them."""
    t = torch.arange(3.0, device=ctx.device) + 10 if ctx.rank == src else torch.zeros(3, device=ctx.device)
    before = t.clone().cpu()
    dist.broadcast(t, src=src)
    return BeforeAfter(ctx.rank, before, t.cpu())


# ---------------------------------------------------------------------------------------------
# Ping-pong: latency and bandwidth of one message
# ---------------------------------------------------------------------------------------------


def round_trip(ctx: RankContext, msg: torch.Tensor, peer: int) -> float:
    """Seconds for `msg` to go from rank 0 to `peer` and back (rank `peer` echoes it), on the
    rank's clock (`ctx.now`, whichever clock the rank keeps)."""
    synchronize(ctx.device)
    start = ctx.now()
    if ctx.rank == 0:
        dist.send(msg, peer)
        dist.recv(msg, peer)
    else:
        dist.recv(msg, peer)
        dist.send(msg, peer)
    synchronize(ctx.device)
    return ctx.now() - start


@dataclass
class MessageTime:
    """One message size of a ping-pong: its one-way time and bandwidth, one figure per round."""

    bytes: int
    one_way: Measured  # seconds
    bandwidth: Measured  # bytes per second


def ping_pong(ctx: RankContext, sizes_bytes: Sequence[int], rounds: int = 5, trips: int = 4,
              warmup: int = 1) -> list[MessageTime] | None:
    """Rank 0 sends a message to rank 1, which sends it straight back; half the round trip is the
    one-way time of a message. Other ranks sit this one out.

    The sizes are swept `rounds` times (after `warmup` untimed sweeps), so a hiccup of the machine
    spreads over all sizes instead of ruining one; a round's figure for a size is the median of
    its `trips` round trips. Returns, on rank 0, one row per size: bytes, the one-way time
    (`Measured`, seconds, one value per round) and the bandwidth (bytes / one-way time)."""
    if ctx.rank > 1:
        return None
    peer = 1 - ctx.rank
    msgs = [torch.zeros(max(1, size // 4), dtype=torch.float32, device=ctx.device) for size in sizes_bytes]
    one_way: list[list[float]] = [[] for _ in msgs]
    for round_ in range(-warmup, rounds):
        for i, msg in enumerate(msgs):
            times = [round_trip(ctx, msg, peer) for _ in range(trips)]
            if round_ >= 0:
                one_way[i].append(statistics.median(times) / 2)
    if ctx.rank != 0:
        return None
    return [MessageTime(msg.nbytes, Measured.of(t), Measured.of(msg.nbytes / s for s in t))
            for msg, t in zip(msgs, one_way)]


def small_message_latency(rows: list[MessageTime], small_bytes: int = 4096) -> Measured:
    """The latency of a message: per round, the median one-way time over the sizes up to
    `small_bytes` (at least the smallest size), where the bytes themselves cost next to nothing.
    A median over several sizes, so one disturbed size cannot become the figure."""
    small = [r for r in rows if r.bytes <= small_bytes] or [min(rows, key=lambda r: r.bytes)]
    rounds = len(small[0].one_way.values)
    return Measured.of(statistics.median(r.one_way.values[k] for r in small) for k in range(rounds))


def fit_latency_bandwidth(rows: list[MessageTime], small_bytes: int = 4096, large: int = 2) -> tuple[float, float]:
    """(latency in s, bandwidth in bytes/s) of the model `time = latency + bytes / bandwidth`,
    fitted to a ping-pong sweep: the latency from the small messages (`small_message_latency`),
    the bandwidth from the `large` largest ones, as their bytes over the time left once the
    latency is paid (median over those sizes). So the fitted line passes through the small
    messages' time and the large ones' time; a row's own bandwidth (bytes over its whole time,
    latency included) always lies below the fitted one, which is the slope the line tends to."""
    latency = small_message_latency(rows, small_bytes).median
    biggest = sorted(rows, key=lambda r: r.bytes)[-large:]
    # A message whose bytes take under 5 % of its time (too small to show the bandwidth, or noise)
    # would give a near-infinite bandwidth: it is left out, and if every one of them is such, the
    # largest one's whole time is counted as bytes.
    rates = [row.bytes / (row.one_way.median - latency) for row in biggest
             if row.one_way.median - latency > 0.05 * row.one_way.median]
    return latency, statistics.median(rates) if rates else biggest[-1].bytes / biggest[-1].one_way.median


# ---------------------------------------------------------------------------------------------
# The ring all-reduce, and what it costs
# ---------------------------------------------------------------------------------------------


def ring_schedule(world_size: int) -> list[list[tuple[int, int]]]:
    """Which chunk every rank sends and receives at each of the ring's 2(N-1) steps.

    The tensor is cut into N chunks; each rank sends only to its right neighbour (rank + 1) and
    receives only from its left one (rank - 1). `steps[s][rank]` is (chunk sent, chunk received).
    Steps 0 .. N-2 are the reduce-scatter: rank r starts by sending its own chunk r, and each
    chunk travels round the ring collecting one more rank's contribution per step, so after N-1
    steps rank r holds the full sum of chunk r+1. Steps N-1 .. 2N-3 are the all-gather: every
    rank passes on the finished chunk it last got, until every rank has all N."""
    if world_size < 1:
        raise ValueError(f"world_size must be 1 or more, got {world_size}")
    n = world_size
    reduce_scatter = [[((r - s) % n, (r - s - 1) % n) for r in range(n)] for s in range(n - 1)]
    all_gather = [[((r + 1 - s) % n, (r - s) % n) for r in range(n)] for s in range(n - 1)]
    return reduce_scatter + all_gather


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group`, in place, with point-to-point messages only: the
    ring algorithm NCCL uses for large tensors (gloo has one too). Returns `tensor`.

    Every rank cuts the tensor into N chunks (the first ones a bit larger when N does not divide
    its length) and walks `ring_schedule(N)`: N-1 steps of reduce-scatter, where the chunk it
    receives is added to its own, then N-1 steps of all-gather, where it replaces its own."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce cuts the tensor's memory into chunks, so it needs a contiguous "
                         "tensor; pass tensor.contiguous() and use what it returns")
    chunks = torch.tensor_split(tensor.view(-1), n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step, plan in enumerate(ring_schedule(n)):
        send, recv = plan[rank]
        if step < n - 1:  # reduce-scatter: add the left neighbour's partial sum to ours
            incoming = torch.empty_like(chunks[recv])
            exchange(chunks[send], right, incoming, left, group)
            chunks[recv].add_(incoming)
        else:  # all-gather: the left neighbour's finished chunk replaces ours
            exchange(chunks[send], right, chunks[recv], left, group)
    return tensor


def exchange(outgoing: torch.Tensor, right: int, incoming: torch.Tensor, left: int, group=None) -> None:
    """One ring step on this rank: send `outgoing` to `right` while receiving `incoming` from
    `left` (ranks within `group`). Both are posted together (`batch_isend_irecv`), so no rank
    waits for its right neighbour before listening to its left one and the whole ring moves at
    once; a blocking send first would deadlock wherever a send waits for its receiver (NCCL)."""
    ops = []
    # A tensor with fewer elements than ranks has empty chunks: nothing to send or receive then
    # (the sender and the receiver of a chunk agree on its size, so both skip it).
    if outgoing.numel():
        ops.append(dist.P2POp(dist.isend, outgoing, group=group, group_peer=right))
    if incoming.numel():
        ops.append(dist.P2POp(dist.irecv, incoming, group=group, group_peer=left))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def back_to_back(ctx: RankContext, all_reduce, tensors: Sequence[torch.Tensor]) -> float:
    """Median seconds of one `all_reduce(t)` over `tensors`, called back to back after a barrier,
    on the rank's clock (`ctx.now`)."""
    ctx.barrier()
    times = []
    for t in tensors:
        start = ctx.now()
        all_reduce(t)
        synchronize(ctx.device)
        times.append(ctx.now() - start)
    return statistics.median(times)


@dataclass
class AllReduceTime:
    """One tensor size of the all-reduce sweep: torch's and our ring's seconds, one figure per
    round, and the largest difference between their sums."""

    bytes: int
    torch: Measured  # seconds
    ring: Measured  # seconds
    max_difference: float


def all_reduce_sweep(ctx: RankContext, sizes_bytes: Sequence[int], rounds: int = 3,
                     trips: int = 3) -> list[AllReduceTime] | None:
    """Time torch's `dist.all_reduce` and our `ring_all_reduce` at each size, call by call in turn
    (torch, ours, torch, ours ...) so that a busy moment of the machine hits both, and check that
    they give the same sums.

    Like the ping-pong, a round's figure is the median of `trips` calls made back to back
    (`back_to_back`), timed on rank 0. Returns, on rank 0, one row per size: bytes, "torch" and
    "ring" (`Measured` seconds, one value per round) and the largest difference between the two
    results."""
    gen = torch.Generator().manual_seed(ctx.rank)
    tensors = [torch.randn(max(1, size // 4), generator=gen).to(ctx.device) for size in sizes_bytes]
    ways = {"torch": dist.all_reduce, "ring": ring_all_reduce}
    figures = {way: [[] for _ in tensors] for way in ways}
    worst = [0.0 for _ in tensors]
    for round_ in range(-1, rounds):  # round -1 warms up (connections, allocator)
        for i, t in enumerate(tensors):
            sums = {}
            for way, all_reduce in ways.items():
                sums[way] = [t.clone() for _ in range(trips)]
                seconds = back_to_back(ctx, all_reduce, sums[way])
                if round_ >= 0:
                    figures[way][i].append(seconds)
            worst[i] = max(worst[i], (sums["torch"][0] - sums["ring"][0]).abs().max().item())
    if ctx.rank != 0:
        return None
    return [AllReduceTime(t.nbytes, Measured.of(figures["torch"][i]), Measured.of(figures["ring"][i]), worst[i])
            for i, t in enumerate(tensors)]


# ---------------------------------------------------------------------------------------------
# A step on the timeline
# ---------------------------------------------------------------------------------------------


def matmuls(x: torch.Tensor, w: torch.Tensor, times: int) -> torch.Tensor:
    """`times` layers of tanh(y @ w): the compute of the toy step."""
    y = x
    for _ in range(times):
        y = torch.tanh(y @ w)
    return y


def work_of(rank: int) -> int:
    """How many matrix products rank `rank` does per step: higher ranks get more work."""
    return 4 + 4 * rank


def compute_then_communicate(ctx: RankContext, n: int = 256, steps: int = 3) -> Timeline:
    """A toy training step, `steps` times: compute (a few matmuls, like forward and backward), then
    all-reduce the result (like gradients). Nothing overlaps yet: while a rank communicates, it
    does not compute. Returns this rank's timeline."""
    torch.manual_seed(ctx.rank)
    x = torch.randn(n, n, device=ctx.device)
    w = torch.randn(n, n, device=ctx.device) / n**0.5
    times = work_of(ctx.rank)  # the others wait for the busiest rank
    for step in range(-1, steps):  # step -1 warms up (first calls allocate and connect), unrecorded
        if step == 0:
            ctx.rec.clear()
        with ctx.rec.span("F", lane="compute", mb=step):
            y = matmuls(x, w, times)
            synchronize(ctx.device)
        with ctx.rec.span("allreduce", lane="comm", mb=step):
            dist.all_reduce(y)
            synchronize(ctx.device)
    return ctx.timeline()

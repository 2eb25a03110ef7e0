"""Lesson 00's workers: all-reduce and broadcast, a ping-pong between two ranks (latency and
bandwidth against message size), a compute-then-communicate step.

Each function runs inside a worker process started by `pipelab.launch.spawn`, so `ctx` tells it its
rank, the world size and its device, and `ctx.rec` records what it did on the timeline.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from pipelab.hardware import synchronize
from pipelab.timeline import now


def allreduce_demo(ctx) -> dict:
    """Every rank holds [rank+1, rank+1, rank+1]; after all_reduce(SUM) every rank holds the sum."""
    t = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    before = t.clone().cpu()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return {"rank": ctx.rank, "before": before, "after": t.cpu()}


def broadcast_demo(ctx, src: int = 0) -> dict:
    """Only rank `src` starts with real values; after broadcast every rank holds them."""
    t = torch.arange(3.0, device=ctx.device) + 10 if ctx.rank == src else torch.zeros(3, device=ctx.device)
    before = t.clone().cpu()
    dist.broadcast(t, src=src)
    return {"rank": ctx.rank, "before": before, "after": t.cpu()}


def ping_pong(ctx, sizes_bytes: list[int], repeats: int = 20, warmup: int = 3) -> list[dict] | None:
    """Rank 0 sends a message to rank 1, which sends it straight back; half the round trip is the
    one-way latency, and size / latency the bandwidth. Other ranks sit this one out.

    Returns, on rank 0, one row per size: median latency (s) and bandwidth (bytes/s)."""
    if ctx.rank > 1:
        return None
    peer = 1 - ctx.rank
    rows = []
    for size in sizes_bytes:
        msg = torch.zeros(max(1, size // 4), dtype=torch.float32, device=ctx.device)
        trips = []
        for i in range(warmup + repeats):
            synchronize(ctx.device)
            t0 = now()
            if ctx.rank == 0:
                dist.send(msg, peer)
                dist.recv(msg, peer)
            else:
                dist.recv(msg, peer)
                dist.send(msg, peer)
            synchronize(ctx.device)
            t1 = now()
            if i >= warmup:
                trips.append(t1 - t0)
                if i == warmup:  # one round trip per size on the timeline is plenty
                    ctx.rec.add("send" if ctx.rank == 0 else "recv", t0, t1, lane="comm", bytes=msg.nbytes)
        latency = statistics.median(trips) / 2
        rows.append({"bytes": msg.nbytes, "latency_s": latency, "bandwidth_Bps": msg.nbytes / latency})
    return rows if ctx.rank == 0 else None


def compute_then_communicate(ctx, n: int = 256, steps: int = 3) -> object:
    """A toy training step, `steps` times: compute (a few matmuls, like forward and backward), then
    all-reduce the result (like gradients). Nothing overlaps yet: while a rank communicates, it
    does not compute. Returns this rank's timeline."""
    torch.manual_seed(ctx.rank)
    x = torch.randn(n, n, device=ctx.device)
    w = torch.randn(n, n, device=ctx.device) / n**0.5
    for step in range(-1, steps):  # step -1 warms up (first calls allocate and connect), unrecorded
        if step == 0:
            ctx.rec.clear()
        with ctx.rec.span("F", lane="compute", mb=step):
            y = x
            for _ in range(4 + 2 * ctx.rank):  # higher ranks get more work: the others wait for them
                y = torch.tanh(y @ w)
            synchronize(ctx.device)
        with ctx.rec.span("allreduce", lane="comm", mb=step):
            dist.all_reduce(y)
            synchronize(ctx.device)
    return ctx.timeline()

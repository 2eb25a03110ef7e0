"""Three hangs in miniature, each a worker for `pipelab.launch.spawn` that ends in seconds under a
small process-group timeout (`runs.short_timeout`): ranks calling different collectives
(DeepSpeed#7044's kind), point-to-point receives posted before the sends (NCCL's ordering rule), and
a two-stage pipeline whose ranks disagree on the micro-batches of a step, or one of which stalls.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from pipelab.debug.bugs import two_stage_gpipe
from pipelab.debug.consistency import collective_check
from pipelab.debug.flight_recorder import flight_recorder
from pipelab.debug.runs import short_timeout


def mismatched_collectives(ctx, hang_seconds: float, checked: bool = False, seconds: float = 2.0) -> None:
    """Rank 0 all-reduces its gradient; rank 1, on another branch, broadcasts it (DeepSpeed#7044's kind)."""
    short_timeout(hang_seconds)
    grad = torch.ones(4, 8)
    with collective_check(seconds) if checked else contextlib.nullcontext():
        if ctx.rank == 0:
            dist.all_reduce(grad)
        else:
            dist.broadcast(grad, src=0)


def receive_first(ctx, hang_seconds: float) -> None:
    """Both ranks post their receive before their send: gloo runs it, NCCL hangs."""
    from pipelab.emulate import comm

    short_timeout(hang_seconds)
    if comm.active() is not None:  # under NCCL's rule: its watchdog calls the hang after as long
        comm.active().watchdog.seconds = hang_seconds
    peer = 1 - ctx.rank
    recv = dist.irecv(torch.empty(4), peer)
    send = dist.isend(torch.ones(4), peer)
    recv.wait()
    send.wait()


def gpipe_step(ctx, cfg, stage: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> None:
    """One GPipe step of the two stages over `m` micro-batches of the batch's rows / num_microbatches."""
    two_stage_gpipe(ctx, stage, x, y, cfg.batch // cfg.num_microbatches, m, 2 * cfg.width)


def pipeline_with_planted_hang(ctx, cfg, dump_dir: str, plant: str) -> None:
    """Two GPipe stages for `cfg.steps` recorded steps. `plant="microbatches"`: in the last step
    rank 0 cuts its batch into one micro-batch fewer than rank 1 expects (a short last batch);
    `plant="stall"`: in the last step rank 1 stops in its own work (a stuck data loader)."""
    short_timeout(cfg.hang_seconds)
    model, (x, y) = cfg.model(), cfg.data()
    stage = model[:2] if ctx.rank == 0 else model[2:]
    # A job's first step is slow (autograd starts its machinery, memory is allocated): on a busy
    # machine it could outlast the timeout, so it runs before the recorder watches.
    gpipe_step(ctx, cfg, stage, x, y, cfg.num_microbatches)
    with flight_recorder(dump_dir, cfg.capacity, cfg.hang_seconds):
        for step in range(cfg.steps):
            m, last = cfg.num_microbatches, step == cfg.steps - 1
            if last and plant == "microbatches" and ctx.rank == 0:
                m -= 1
            if last and plant == "stall" and ctx.rank == 1:
                time.sleep(10 * cfg.hang_seconds)  # stopped long before, when rank 0 times out
            gpipe_step(ctx, cfg, stage, x, y, m)

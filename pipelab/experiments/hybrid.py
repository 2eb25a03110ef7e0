"""Lesson 05 from a notebook, part 1-2: data parallelism over replicas that each span two devices.

`run_replicas` starts `world_size` processes; each builds a `ModelParallelReplica` on its two
devices (GPUs, or virtual CPU devices), wraps it with our `BucketedDDP` and with torch's
`DistributedDataParallel(device_ids=None)`, and trains a few SGD steps on its slice of the batch.
A `ReplicaRun` carries losses, first-step gradients and final weights for
`reference.assert_same`, the timed steps, and the three overlaps of the lesson, measured on every
timed step: copy/compute, device/device and all-reduce/compute (`overlaps`).

The grid of part 3-4 is in `pipelab.experiments.grid`.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import nn

from pipelab.checks import divisors, positive_number, whole_number
from pipelab.ddp import Bucket, BucketedDDP, check_bucket_cap
from pipelab.experiments.ddp import replica_spread, shard
from pipelab.hybrid import HALVES, ModelParallelReplica, gpu_path, replica_devices
from pipelab.launch import spawn
from pipelab.measure import Measured, TimedSteps, Steps, gather_steps, time_steps
from pipelab.streams import Device
from pipelab.timeline import Recorder, Span, Timeline

REPLICA_VARIANTS = ("bucketed", "torch")
OVERLAPS = ("copy/compute", "device/device", "all-reduce/compute")

# ---------------------------------------------------------------------------------------------
# What overlapped: shares of one kind of work hidden under another, read off a timeline
# ---------------------------------------------------------------------------------------------


def is_compute(span: Span) -> bool:
    """Work of a device: a forward or a backward on a device lane."""
    return span.kind in ("F", "B", "I", "W") and span.lane != "comm"


def hidden_share(tl: Timeline, hidden: Callable[[Span], bool], behind: Callable[[Span], bool],
                 any_rank: bool = False) -> float:
    """Share of the time taken by `hidden` spans during which a `behind` span ran too, on the same
    process (or, with `any_rank`, on any process): 1.0 means all of it was hidden, 0.0 none."""
    covered = total = 0.0
    for rank in tl.ranks:
        mine = [replace(s, lane="hidden") for s in tl.filter(rank=rank) if hidden(s)]
        pool = tl if any_rank else tl.filter(rank=rank)
        under = [replace(s, rank=rank, lane="behind") for s in pool if behind(s)]
        both = Timeline(mine + under)
        covered += both.overlap_time("behind", "hidden", rank)
        total += both.busy_time(rank, "hidden")
    return covered / total if total > 0 else 0.0


def devices_together(tl: Timeline) -> float:
    """Share of the time some device of a process computed during which both of its devices did."""
    both = either = 0.0
    for rank in tl.ranks:
        dev0 = Timeline([replace(s, lane="0") for s in tl.filter(rank=rank, lane="device 0") if is_compute(s)])
        dev1 = Timeline([replace(s, lane="1") for s in tl.filter(rank=rank, lane="device 1") if is_compute(s)])
        joined = Timeline(dev0.spans + dev1.spans)
        both += joined.overlap_time("0", "1", rank)
        either += joined.busy_time(rank, "0") + joined.busy_time(rank, "1") - joined.overlap_time("0", "1", rank)
    return both / either if either > 0 else 0.0


def overlaps(tl: Timeline) -> dict[str, float]:
    """The lesson's three overlaps in one step: the share of activation-copy time during which a
    device computed, the share of compute time during which both devices computed, and the share
    of all-reduce time during which a device computed."""
    return {
        "copy/compute": hidden_share(tl, lambda s: s.kind == "copy" and s.mb is not None, is_compute),
        "device/device": devices_together(tl),
        "all-reduce/compute": hidden_share(tl, lambda s: s.kind == "allreduce", is_compute),
    }


# ---------------------------------------------------------------------------------------------
# On each process: a replica on two devices, wrapped, trained
# ---------------------------------------------------------------------------------------------


def wrap_replica(variant: str, replica: ModelParallelReplica, bucket_cap_mb: float, recorder: Recorder) -> nn.Module:
    """The replica wrapped by our `BucketedDDP` or torch's DDP. A module on several devices has no
    one device to scatter the inputs to, so torch's DDP gets `device_ids=None` and no `output_device`."""
    if variant == "bucketed":
        return BucketedDDP(replica, bucket_cap_mb, recorder=recorder, device_of=replica.device_of())
    if variant == "torch":
        return nn.parallel.DistributedDataParallel(replica, device_ids=None, bucket_cap_mb=bucket_cap_mb)
    raise ValueError(f"variant must be one of {REPLICA_VARIANTS}, got {variant!r}")


def record_devices(rec: Recorder, devs: list[Device]) -> None:
    """Move the devices' spans (forward kernels, copies) onto the process's timeline: a lane per
    device ("device 0", "device 1"; a stream other than compute gets its own, e.g. "device 1 copy")."""
    for d in devs:
        d.synchronize()
        for s in d.timeline():
            lane = d.label if s.lane == "compute" else f"{d.label} {s.lane}"
            rec.add(s.kind, s.start, s.end, lane=lane, mb=s.mb, **s.meta)
        d.rec.clear()


def _start_elsewhere(module: nn.Module, seed: int) -> None:
    """Other weights on this process, as if it had built its model with its own seed: the
    wrapper's broadcast must make the replicas equal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device))


def replica_worker(ctx, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                   variants: Sequence[str], split_size: int | None, bucket_cap_mb: float, lr: float,
                   steps: int, device: str) -> dict[str, dict]:
    """Worker: for each variant, a replica of `model` on this process's two devices, wrapped, and
    `steps` SGD steps on this process's slice of (x, y); the first is checked and warms up."""
    results = {}
    for variant in variants:
        devs = replica_devices(ctx.rank, ctx.world_size, device)
        replica = ModelParallelReplica(copy.deepcopy(model), devs, split_size)
        if ctx.rank != 0:
            _start_elsewhere(replica, seed=ctx.rank)
        wrapped = wrap_replica(variant, replica, bucket_cap_mb, ctx.rec)
        optimizer = torch.optim.SGD(replica.parameters(), lr=lr)
        xs = shard(x, ctx.rank, ctx.world_size)
        ys = shard(y, ctx.rank, ctx.world_size).to(devs[1].torch_device)  # the output's device
        grads: dict = {}

        def prepare(i: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            for d in devs:  # the last step's work done, its spans forgotten
                d.synchronize()
                d.rec.clear()

        def step(i: int) -> float:
            loss = loss_fn(wrapped(xs), ys)
            loss.backward()  # the wrapper averages the gradients before this returns
            optimizer.step()
            record_devices(ctx.rec, devs)
            if i == 0:
                grads.update({n: p.grad.detach().cpu().clone() for n, p in replica.named_parameters()})
            return loss.item()

        measured = time_steps(ctx, step, steps, prepare=prepare)
        results[variant] = {
            "steps": measured, "grads": grads if ctx.rank == 0 else None,
            "weights": {n: p.detach().cpu().clone() for n, p in replica.named_parameters()} if ctx.rank == 0 else None,
            "spread": replica_spread([p.detach().cpu() for p in replica.parameters()]),  # over gloo, in host memory
            "buckets": wrapped.buckets if isinstance(wrapped, BucketedDDP) else None,
            "devices": [d.name for d in devs],
        }
        if isinstance(wrapped, BucketedDDP):
            wrapped.remove_hooks()
        for d in devs:
            d.close()
    return results


# ---------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------


@dataclass
class ReplicaRun(TimedSteps):
    """One variant on all processes; `pipelab.reference.assert_same(run, reference)` checks it."""

    variant: str
    split_size: int | None
    losses: list[float]  # per step: the mean of the processes' losses
    grads: dict[str, torch.Tensor]  # rank 0's averaged gradients of the first step
    weights: dict[str, torch.Tensor]  # rank 0's weights after the last step
    replica_spread: float  # largest weight difference between processes after the last step
    steps: Steps = field(repr=False)  # the timed steps, all processes
    buckets: list[Bucket] | None = None  # BucketedDDP's plan
    devices: list[list[str]] = field(default_factory=list)  # per process, its two devices

    @property
    def name(self) -> str:
        how = "naive forward" if self.split_size is None else f"split_size={self.split_size}"
        return f"{self.variant} ({how})"

    def overlap(self, kind: str) -> Measured:
        """One of the `OVERLAPS`, measured on every timed step."""
        return Measured.of(overlaps(tl)[kind] for tl in self.steps.timelines)


def check_replica_inputs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int,
                         variants: Sequence[str], split_size: int | None, bucket_cap_mb: float, lr: float,
                         steps: int, device: str) -> None:
    """Refuse what cannot run, before any process starts."""
    gpu_path(world_size, 2, device)  # also refuses more GPUs than the machine has
    missing = [h for h in HALVES if not isinstance(getattr(model, h, None), nn.Module)]
    if missing:
        raise ValueError(f"the model has no {', '.join(missing)}: a two-device replica runs seq1 on device 0 "
                         "and seq2, fc on device 1; use e.g. pipelab.models.ToyModel() or SplitResNet()")
    bad = [v for v in variants if v not in REPLICA_VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants must be some of {REPLICA_VARIANTS}, got {list(variants)!r}")
    check_bucket_cap(bucket_cap_mb)
    positive_number("lr", lr, example="lr=0.1")
    whole_number("steps", steps, example="steps=3")
    batch = x.shape[0]
    if y.shape[0] != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {y.shape[0]}; pass one target per input")
    if batch % world_size:
        raise ValueError(f"a batch of {batch} samples does not split evenly over world_size={world_size} "
                         f"replicas; use world_size in {divisors(batch, 16)}, or a batch that is a "
                         f"multiple of {world_size}")
    if split_size is not None:
        whole_number("split_size", split_size, example="split_size=8")
        if split_size > batch // world_size:
            raise ValueError(f"split_size={split_size} is larger than a replica's slice of the batch "
                             f"({batch // world_size} samples); pick a split size between 1 and {batch // world_size}")


def run_replicas(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None = None,
                 world_size: int = 2, variants: Sequence[str] = REPLICA_VARIANTS, split_size: int | None = None,
                 bucket_cap_mb: float = 25.0, lr: float = 0.1, steps: int = 3, device: str = "auto",
                 timeout: float = 180.0) -> dict[str, ReplicaRun]:
    """Train `model` (halves seq1 | seq2, fc) with each variant on `world_size` processes, each
    holding one replica over two devices and its slice of the batch: `steps` SGD steps, the first
    checked and not timed (unless it is the only one)."""
    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    check_replica_inputs(model, x, y, world_size, variants, split_size, bucket_cap_mb, lr, steps, device)
    # Launch binds NCCL to one GPU per process, and a replica here spans two: its all-reduces go
    # through gloo (host memory) on every path.
    per_rank = spawn(replica_worker, world_size, model, x, y, loss_fn, list(variants), split_size, bucket_cap_mb,
                     lr, steps, device, backend="gloo", timeout=timeout)
    runs = {}
    for v in variants:
        mine = [r[v] for r in per_rank]
        losses = [statistics.mean(step) for step in zip(*(r["steps"].results for r in mine))]
        runs[v] = ReplicaRun(v, split_size, losses, mine[0]["grads"], mine[0]["weights"],
                             max(r["spread"] for r in mine), gather_steps([r["steps"] for r in mine]),
                             mine[0]["buckets"], [r["devices"] for r in mine])
    return runs

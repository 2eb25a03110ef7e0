"""Lesson 01 from a notebook: train a replica with each data-parallel variant on real processes,
check it against one process, time it, and sweep the bucket size beside torch's DDP.

The wrappers themselves (`NaiveDDP`, `BucketedDDP`) live in `pipelab.ddp`; here are the workers
that train with them (and with torch's `DistributedDataParallel`), `run_ddp` that starts and
gathers them, and `bucket_sweep`. Check a run with `pipelab.reference.assert_same(run, reference)`.
"""

from __future__ import annotations

import copy
import statistics
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipelab.checks import divisors, whole_number
from pipelab.ddp import Bucket, BucketedDDP, DDPBase, NaiveDDP, check_bucket_cap, trainable_parameters
from pipelab.launch import spawn
from pipelab.measure import Measured, TimedSteps, RankSteps, Steps, alternate, gather_steps, ratios, time_steps
from pipelab.timeline import Recorder, Timeline

VARIANTS = ("naive", "bucketed", "torch")

# ---------------------------------------------------------------------------------------------
# On each rank: a replica, its slice of the batch, one training step
# ---------------------------------------------------------------------------------------------


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal slice of the batch: ranks take consecutive rows."""
    return batch.chunk(world_size)[rank]


def wrap(variant: str, module: nn.Module, bucket_cap_mb: float = 25.0, recorder: Recorder | None = None,
         find_unused_parameters: bool = False, device: torch.device | None = None) -> nn.Module:
    """`module` wrapped by one of the variants: "naive", "bucketed" (ours) or "torch" (torch's DDP)."""
    if variant == "naive":
        return NaiveDDP(module, recorder=recorder)
    if variant == "bucketed":
        return BucketedDDP(module, bucket_cap_mb, find_unused_parameters, recorder=recorder)
    if variant == "torch":
        device_ids = [device.index] if device is not None and device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                                                   find_unused_parameters=find_unused_parameters)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def train_step(ctx, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               loss_fn: Callable) -> float:
    """One data-parallel training step on this rank's slice (forward, backward, optimizer step);
    returns this rank's loss. Zero the gradients before it (`time_steps`' `prepare`).

    Our wrappers put their own F and B spans on the timeline; torch's DDP is a black box, so for it
    we time its forward and its whole backward (which includes waiting for its all-reduces)."""
    black_box = isinstance(model, nn.parallel.DistributedDataParallel)
    with ctx.rec.span("F", lane="compute") if black_box else nullcontext():
        out = model(x)
    loss = loss_fn(out, y)
    with ctx.rec.span("B", lane="compute") if black_box else nullcontext():
        loss.backward()
    with ctx.rec.span("optimizer", lane="compute"):
        optimizer.step()
    return loss.item()


def _perturb(module: nn.Module, seed: int) -> None:
    """Give this replica different weights, as if its rank had built the model with its own seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device))


def replica_spread(tensors, group=None) -> float:
    """Largest difference of any element of `tensors` (e.g. a replica's parameters) between any
    two ranks: 0.0 means every rank holds the same values."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return (hi - lo).abs().max().item()


def _checked_step(ctx, replica: nn.Module) -> dict:
    """After the first step: how far the replicas are apart, and rank 0's gradients and weights."""
    checked: dict = {"spread": replica_spread(replica.parameters())}
    if ctx.rank == 0:
        checked["grads"] = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                            for n, p in replica.named_parameters()}
        checked["weights"] = {n: p.detach().cpu().clone() for n, p in replica.named_parameters()}
    return checked


def ddp_worker(ctx, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
               variants: Sequence[str] = VARIANTS, bucket_cap_mb: float = 25.0, lr: float = 0.1,
               steps: int = 3, find_unused_parameters: bool = False) -> dict[str, dict]:
    """Worker: train a replica of `model` with each variant on this rank's slice of (x, y).

    Ranks other than 0 start from different weights, as if each had built its model with its own
    seed: the wrapper's broadcast must make them equal. The first step is the one checked against
    the reference (gradients, weights after the SGD step) and warms up; the others are timed."""
    xs = shard(x, ctx.rank, ctx.world_size).to(ctx.device)
    ys = shard(y, ctx.rank, ctx.world_size).to(ctx.device)
    results = {}
    for variant in variants:
        replica = copy.deepcopy(model).to(ctx.device)
        if ctx.rank != 0:
            _perturb(replica, seed=ctx.rank)
        wrapped = wrap(variant, replica, bucket_cap_mb, ctx.rec, find_unused_parameters, ctx.device)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr)
        checked: dict = {}

        def step(i: int) -> float:
            loss = train_step(ctx, wrapped, optimizer, xs, ys, loss_fn)
            if i == 0:  # the warm-up step: not timed, unless it is the only one
                checked.update(_checked_step(ctx, replica))
            return loss

        measured = time_steps(ctx, step, steps, prepare=lambda i: optimizer.zero_grad(set_to_none=True))
        buckets = wrapped.buckets if isinstance(wrapped, BucketedDDP) else None
        if isinstance(wrapped, DDPBase):
            wrapped.remove_hooks()
        results[variant] = {"steps": measured, "buckets": buckets, **checked}
    return results


# ---------------------------------------------------------------------------------------------
# The parent side: check, spawn, gather
# ---------------------------------------------------------------------------------------------


def _median_overlap(timelines: Sequence[Timeline]) -> float:
    """Median over steps of the fraction of all-reduce time hidden behind computation."""
    return statistics.median(tl.overlap("compute", "comm") for tl in timelines)


@dataclass
class DDPRun(TimedSteps):
    """What one variant did on all ranks; `pipelab.reference.assert_same(run, reference)` checks it."""

    variant: str
    losses: list[float]  # the checked (first) step's loss: the mean of the ranks' losses
    grads: dict[str, torch.Tensor | None]  # rank 0's averaged gradients after the first step
    weights: dict[str, torch.Tensor]  # rank 0's weights after the first SGD step
    replica_spread: float  # largest weight difference between ranks after that step
    steps: Steps | None = field(default=None, repr=False)  # the timed steps, all ranks
    buckets: list[Bucket] | None = None  # BucketedDDP's plan

    @property
    def name(self) -> str:
        return self.variant

    @property
    def loss(self) -> float:
        return self.losses[0]

    @property
    def overlap(self) -> float:
        """Fraction of the all-reduce time hidden behind computation (median over timed steps)."""
        return _median_overlap(self.steps.timelines)

    @property
    def overlaps(self) -> Measured:
        """The fraction of all-reduce time hidden behind computation, step by step (timed steps)."""
        return Measured.of(tl.overlap("compute", "comm") for tl in self.steps.timelines)

    def bucket_all_reduce_times(self) -> list[Measured]:
        """Seconds from launch to arrival of each bucket's all-reduce (BucketedDDP), one figure
        per timed step and rank. A span includes waiting for the peers to launch the same bucket
        and for the buckets before it, not only the bytes on the wire."""
        if self.buckets is None:
            raise ValueError(f"variant {self.variant!r} has no buckets of its own; use the 'bucketed' run")
        spans = [s for tl in self.steps.timelines for s in tl.filter(kind="allreduce") if "bucket" in s.meta]
        return [Measured.of(s.duration for s in spans if s.meta["bucket"] == b.index) for b in self.buckets]


def check_ddp_inputs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int,
                     bucket_cap_mb: float = 25.0, variants: Sequence[str] = VARIANTS, steps: int = 1,
                     loss_fn: Callable | None = None) -> None:
    """Refuse what cannot run, before any worker starts."""
    check_bucket_cap(bucket_cap_mb)
    if getattr(loss_fn, "reduction", None) == "none":
        raise ValueError(f"loss_fn {loss_fn} returns one loss per sample (reduction='none'); backward "
                         "starts from one number: use reduction='mean', e.g. nn.MSELoss()")
    if not trainable_parameters(model):
        raise ValueError("the model has no parameters that require gradients: there is nothing to "
                         "average; pass the model you train (e.g. pipelab.models.mlp([8, 16, 4]))")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants must be some of {VARIANTS}, got {list(variants)!r}")
    whole_number("world_size", world_size)
    batch = x.shape[0]
    if batch == 0:
        raise ValueError(f"the batch is empty (0 samples); pass at least world_size={world_size} samples, "
                         "one slice per rank")
    if batch % world_size:
        raise ValueError(f"a batch of {batch} samples does not split evenly over world_size={world_size} "
                         f"ranks (the averaged gradient would then differ from the full batch's); use "
                         f"world_size in {divisors(batch, 16)}, or a batch that is a multiple of {world_size}")
    if y.shape[0] != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {y.shape[0]}; pass one target per input")
    whole_number("steps", steps)


def _gather(variant: str, per_rank: list[dict]) -> DDPRun:
    first = per_rank[0]
    loss = statistics.mean(r["steps"].results[0] for r in per_rank)
    return DDPRun(variant, [loss], first["grads"], first["weights"], max(r["spread"] for r in per_rank),
                  gather_steps([r["steps"] for r in per_rank]), first["buckets"])


def run_ddp(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None = None,
            world_size: int = 2, variants: Sequence[str] = VARIANTS, bucket_cap_mb: float = 25.0,
            lr: float = 0.1, steps: int = 3, find_unused_parameters: bool = False,
            backend: str = "auto", timeout: float = 120.0) -> dict[str, DDPRun]:
    """Train `model` one SGD step (plus `steps`-1 timed ones) with each variant on `world_size`
    real processes, each on its slice of the batch; return each variant's `DDPRun`."""
    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    check_ddp_inputs(model, x, y, world_size, bucket_cap_mb, variants, steps, loss_fn)
    per_rank = spawn(ddp_worker, world_size, model, x, y, loss_fn, list(variants), bucket_cap_mb, lr,
                     steps, find_unused_parameters, backend=backend, timeout=timeout)
    return {v: _gather(v, [r[v] for r in per_rank]) for v in variants}


# ---------------------------------------------------------------------------------------------
# Bucket size: one set of processes, every size, ours beside torch's
# ---------------------------------------------------------------------------------------------


@dataclass
class SweepPoint:
    """BucketedDDP (and torch's DDP) at one bucket size."""

    bucket_cap_mb: float
    num_buckets: int
    step_time: float  # seconds, ours: median over timed steps of the slowest rank
    overlap: float  # ours: median fraction of all-reduce time hidden behind compute
    torch_step_time: float | None  # torch's DDP with the same bucket_cap_mb
    timeline: Timeline = field(repr=False)  # ours, a typical step
    times: Measured | None = None  # seconds, ours: every timed step of every round (slowest rank)
    overlaps: Measured | None = None  # ours: every timed step's overlap
    torch_times: Measured | None = None  # seconds, torch's: every timed step of every round
    ratio: Measured | None = None  # ours / torch, round by round (each round runs both in turn)


def bucket_sweep_worker(ctx, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                        caps_mb: Sequence[float], steps: int = 3, rounds: int = 2, with_torch: bool = True,
                        lr: float = 0.01) -> dict:
    """Worker: for each bucket size, our BucketedDDP and torch's DDP on the same replica weights,
    `steps` timed steps each, in turn (`measure.alternate`) for `rounds` rounds, so that a busy
    machine slows both alike. Each wrapper's first step warms up (torch's DDP also rebuilds its
    buckets after it) and is not kept. Returns every timed step, and each wrapper's median step
    per round on this rank."""
    xs = shard(x, ctx.rank, ctx.world_size).to(ctx.device)
    ys = shard(y, ctx.rank, ctx.world_size).to(ctx.device)
    kinds = ["bucketed", "torch"] if with_torch else ["bucketed"]
    wrappers = {}
    for cap in caps_mb:
        for kind in kinds:
            wrapped = wrap(kind, copy.deepcopy(model).to(ctx.device), cap, ctx.rec, device=ctx.device)
            wrappers[cap, kind] = (wrapped, torch.optim.SGD(wrapped.parameters(), lr=lr))
    measured = {key: RankSteps([], [], []) for key in wrappers}

    def run(key, count: int) -> RankSteps:
        wrapped, optimizer = wrappers[key]
        return time_steps(ctx, lambda i: train_step(ctx, wrapped, optimizer, xs, ys, loss_fn), count,
                          prepare=lambda i: optimizer.zero_grad(set_to_none=True), warmup=0)

    def one_round(key) -> float:
        got = run(key, steps)
        measured[key].results.extend(got.results)
        measured[key].seconds.extend(got.seconds)
        measured[key].timelines.extend(got.timelines)
        return statistics.median(got.seconds)

    for key in wrappers:  # the warm-up step of each wrapper, not kept
        run(key, 1)
    per_round = alternate({key: partial(one_round, key) for key in wrappers}, rounds, warmup=0)
    buckets = {cap: len(wrappers[cap, "bucketed"][0].buckets) for cap in caps_mb}
    return {"steps": measured, "rounds": per_round, "buckets": buckets}


def bucket_sweep(model: nn.Module, x: torch.Tensor, y: torch.Tensor, caps_mb: Sequence[float],
                 loss_fn: Callable | None = None, world_size: int = 2, steps: int = 3, rounds: int = 2,
                 with_torch: bool = True, backend: str = "auto", timeout: float = 300.0) -> list[SweepPoint]:
    """Step time and overlap of BucketedDDP at each bucket size (and torch's DDP beside it), all
    measured in one set of `world_size` processes."""
    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    if not caps_mb or len(set(caps_mb)) != len(caps_mb):
        raise ValueError(f"give one or more different bucket sizes, got caps_mb={caps_mb!r}; "
                         "e.g. caps_mb=[0.25, 1, 4, 25]")
    for cap in caps_mb:
        check_ddp_inputs(model, x, y, world_size, cap, steps=steps, loss_fn=loss_fn)
    whole_number("rounds", rounds)
    per_rank = spawn(bucket_sweep_worker, world_size, model, x, y, loss_fn, list(caps_mb), steps, rounds,
                     with_torch, backend=backend, timeout=timeout)
    points = []
    for cap in caps_mb:
        ours = gather_steps([r["steps"][cap, "bucketed"] for r in per_rank])
        theirs = gather_steps([r["steps"][cap, "torch"] for r in per_rank]) if with_torch else None
        point = SweepPoint(cap, per_rank[0]["buckets"][cap], ours.step_time, _median_overlap(ours.timelines),
                           theirs.step_time if theirs is not None else None, ours.typical,
                           times=Measured.of(ours.seconds),
                           overlaps=Measured.of(tl.overlap("compute", "comm") for tl in ours.timelines))
        if with_torch:
            point.torch_times = Measured.of(theirs.seconds)
            point.ratio = ratios(_slowest_per_round(per_rank, (cap, "bucketed")),
                                 _slowest_per_round(per_rank, (cap, "torch")))
        points.append(point)
    return points


def _slowest_per_round(per_rank: list[dict], key) -> list[float]:
    """Per round, the slowest rank's median step of one wrapper."""
    return [max(rounds) for rounds in zip(*(r["rounds"][key] for r in per_rank))]

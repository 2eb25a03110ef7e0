"""Lesson 01 from a notebook: train a replica with each data-parallel variant on real processes,
check it against one process, time it, and say what the figures show.

    cfg = ddp.Config(model=model, x=x, y=y, bucket_cap_mb=2.0)   # refuses bad input here
    runs = experiments.run(ddp.worker, cfg, ddp.gather)          # {"naive": DDPRun, ...}
    pipelab.conclude(*ddp.overlap_verdict(runs))

The wrappers (`NaiveDDP`, `BucketedDDP`) live in `pipelab.ddp`; the bucket-size sweep is
`experiments.bucket_sweep`. On a modelled node each layer lasts what it would at `cfg.size`.
"""

from __future__ import annotations

import copy
import statistics
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipelab import experiments
from pipelab.checks import divides, mean_loss, positive_number, same_batch, trainable, whole_number
from pipelab.collectives import ring_all_reduce_time
from pipelab.ddp import Bucket, BucketedDDP, DDPBase, NaiveDDP, check_bucket_cap
from pipelab.display import human_bytes
from pipelab.emulate import cost, work
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, compare, gather_steps, time_steps
from pipelab.reference import Reference, perturb, reference_run
from pipelab.timeline import Recorder, Timeline
from pipelab.worker import RankContext

VARIANTS = ("naive", "bucketed", "torch")
Verdict = tuple[str, str, str, dict]


@dataclass(frozen=True, kw_only=True)
class Training(experiments.Config):
    """What every data-parallel run here trains: `model` on the batch (`x`, `y`), split evenly
    over the ranks, with a mean loss, `steps` SGD steps of `lr`. SIZE: on a modelled node every
    Linear layer is timed `width` wide (a whole multiple of the model's) on `batch` rows in all
    (None: the model's own)."""

    model: nn.Module = field(repr=False)
    x: torch.Tensor = field(repr=False)
    y: torch.Tensor = field(repr=False)
    loss_fn: Callable = field(default_factory=nn.MSELoss)
    lr: float = 0.1
    steps: int = 3
    SIZE: ClassVar[Mapping[str, Any]] = {"width": None, "batch": None}

    def check(self) -> None:
        super().check()
        trainable(self.model)
        mean_loss(self.loss_fn)  # DDP averages over ranks: with a summed loss every gradient is world_size times too small
        divides("batch", same_batch(self.x, self.y), "world_size", self.world_size)  # else the average is not the batch's
        whole_number("steps", self.steps, example="steps=3")
        positive_number("lr", self.lr, example="lr=0.1")
        width, batch = self.size.width, self.size.batch
        if width is not None and whole_number("width", width, example="width=4096") % self.x.shape[-1]:
            raise ValueError(f"width={width} must be a whole multiple of the model's width {self.x.shape[-1]}: "
                             "every Linear layer is counted that many times wider")
        if batch is not None:
            divides("batch", whole_number("batch", batch, example="batch=4096"), "world_size", self.world_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        # counted once here, before any rank starts (each rank would pay counting's first-use cost)
        costs = None if self.node is None else work.layer_costs(self.model, self.x.chunk(self.world_size)[0],
                                                                 self.width_scale, self.rows)
        object.__setattr__(self, "layer_costs", costs)

    @property
    def rows(self) -> int:
        """Rows per rank the modelled work is counted on."""
        return (self.size.batch or self.x.shape[0]) // self.world_size

    @property
    def width_scale(self) -> int:
        """How many times wider every Linear layer is counted on a modelled node."""
        return (self.size.width or self.x.shape[-1]) // self.x.shape[-1]

    @property
    def bytes_scale(self) -> float:
        """Gradient bytes at the modelled size per real byte (1.0 at the model's own size)."""
        return 1.0 if self.layer_costs is None else self.layer_costs.bytes_scale


@dataclass(frozen=True, kw_only=True)
class Config(Training):
    """One run of each of `variants` ("naive", "bucketed": ours, "torch": torch's DDP): the first
    step is checked against one process and warms up, the other `steps` - 1 are timed."""

    variants: Sequence[str] = VARIANTS
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False

    def check(self) -> None:
        super().check()
        check_bucket_cap(self.bucket_cap_mb)
        if not self.variants or isinstance(self.variants, str) or any(v not in VARIANTS for v in self.variants):
            raise ValueError(f"variants must be some of {VARIANTS}, got {self.variants!r}; e.g. variants=['bucketed']")
        if self.node is not None and "torch" in self.variants:
            raise ValueError(TORCH_OWN_CORES + "; e.g. variants=['naive', 'bucketed'], and torch_on_own_cores(cfg)")


TORCH_OWN_CORES = ("torch's DistributedDataParallel runs its all-reduces in C++, out of the emulator's reach, "
                   "so its time cannot be modelled: run it on this machine's own cores")


def torch_on_own_cores(cfg: Config, steps: int | None = None) -> Config:
    """torch's DDP on this machine's own cores, with `cfg`'s model, batch and bucket size."""
    return replace(cfg, variants=("torch",), emulate=None, steps=cfg.steps if steps is None else steps)


def emulated_size(cfg: Training) -> str:
    """The modelled size in words, for the lesson's first line."""
    grads = 4 * cfg.bytes_scale * sum(p.numel() for p in cfg.model.parameters())
    return (f"every Linear layer {cfg.width_scale}x wider ({cfg.x.shape[-1] * cfg.width_scale} features), "
            f"{cfg.rows * cfg.world_size} rows per step in float32, {human_bytes(grads)} of gradients per step")


DEFAULTS = dict(width=512, layers=8, batch=128, steps=6, sweep_mb=[0.001, 1, 2, 4, 8], sweep_steps=3, sweep_rounds=3)


def run_flops(params: dict) -> float:
    """FLOPs of the lesson's run at the notebook parameters `params` (missing names take the
    notebook's defaults), counted on the meta device: every forward and backward of the MLP on
    the whole batch (three variants' steps, the sweep's, the exercise's three)."""
    from pipelab.models import mlp

    p = {**DEFAULTS, **params}
    with torch.device("meta"):
        model = mlp([p["width"]] * (p["layers"] + 1))
    forward, grad_input, grad_weight = cost.forward_backward_counts(model, torch.empty(p["batch"], p["width"], device="meta"))
    passes = 3 * p["steps"] + 2 * len(p["sweep_mb"]) * (1 + p["sweep_rounds"] * p["sweep_steps"]) + 3
    return passes * (forward.flops + grad_input.flops + grad_weight.flops)


def link_figures(cfg: Training, sizes: Sequence[int], rounds: int) -> tuple[float, float, str]:
    """(latency s, bandwidth B/s, where from) of the link the buckets travel: the modelled link's
    ring as the emulator plays it, or on this machine lesson 00's ping-pong over `sizes`, run now."""
    if cfg.node is not None:
        link = cfg.node.link
        return (*cost.ring_figures(link), f"the modelled {link.name}")
    from pipelab.experiments import collectives

    pp = experiments.run(collectives.ping_pong_worker, collectives.Config(
        world_size=cfg.world_size, sizes_bytes=sizes, rounds=rounds), collectives.gather_ping_pong)
    return pp.latency.median, pp.bandwidth, "lesson 00's ping-pong on this machine, this run"


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal slice of the batch: ranks take consecutive rows."""
    return batch.chunk(world_size)[rank]


def modelled(ctx: RankContext, cfg: Training) -> ContextManager:
    """On a modelled node, the work inside timed by `cfg.model`'s layers at `cfg.size` (and every
    message at its gradients' size); elsewhere nothing changes."""
    costs = cfg.layer_costs
    return work.timed_as(ctx, costs and costs.table(), costs.bytes_scale if costs else 1.0)


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


def train_step(ctx: RankContext, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, loss_fn: Callable) -> float:
    """One training step on this rank's slice; returns its loss. Our wrappers record their own F
    and B spans; torch's DDP is a black box, so its forward and whole backward are timed here."""
    black_box = isinstance(model, nn.parallel.DistributedDataParallel)
    with ctx.rec.span("F", lane="compute") if black_box else nullcontext():
        out = model(x)
    loss = loss_fn(out, y)
    with ctx.rec.span("B", lane="compute") if black_box else nullcontext():
        loss.backward()
    with ctx.rec.span("optimizer", lane="compute"):
        optimizer.step()
    return loss.item()


def replica_spread(tensors, group=None) -> float:
    """Largest difference of any element of `tensors` between any two ranks (0.0: all equal)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return (hi - lo).abs().max().item()


@dataclass
class Result:
    """One rank, one variant: its steps, and after the first (checked) step how far the replicas
    were apart and, on rank 0, the gradients and weights."""

    variant: str
    steps: RankSteps
    spread: float = 0.0
    grads: dict[str, torch.Tensor | None] | None = None
    weights: dict[str, torch.Tensor] | None = None
    buckets: list[Bucket] | None = None  # BucketedDDP's plan


def worker(ctx: RankContext, cfg: Config) -> list[Result]:
    """Train a replica of `cfg.model` with each variant on this rank's slice; one `Result` each.

    Ranks other than 0 start from other weights, as if each had seeded its own model: the wrapper's
    broadcast must make them equal. The first step is checked and warms up; the others are timed."""
    xs = shard(cfg.x, ctx.rank, ctx.world_size).to(ctx.device)
    ys = shard(cfg.y, ctx.rank, ctx.world_size).to(ctx.device)
    results = []
    with modelled(ctx, cfg):
        for variant in cfg.variants:
            replica = copy.deepcopy(cfg.model).to(ctx.device)
            if ctx.rank != 0:
                perturb(replica, seed=ctx.rank)
            wrapped = wrap(variant, replica, cfg.bucket_cap_mb, ctx.rec, cfg.find_unused_parameters, ctx.device)
            optimizer = torch.optim.SGD(wrapped.parameters(), lr=cfg.lr)
            result = Result(variant, RankSteps([], [], []))

            def step(i: int) -> float:
                loss = train_step(ctx, wrapped, optimizer, xs, ys, cfg.loss_fn)
                if i == 0:  # the checked step
                    result.spread = replica_spread(replica.parameters())
                    if ctx.rank == 0:
                        result.grads = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                                        for n, p in replica.named_parameters()}
                        result.weights = {n: p.detach().cpu().clone() for n, p in replica.named_parameters()}
                return loss

            result.steps = time_steps(ctx, step, cfg.steps, prepare=lambda i: optimizer.zero_grad(set_to_none=True))
            result.buckets = wrapped.buckets if isinstance(wrapped, BucketedDDP) else None
            if isinstance(wrapped, DDPBase):
                wrapped.remove_hooks()
            results.append(result)
    return results


def reference(cfg: Training) -> Reference:
    """The first step in one process on the whole batch: its loss, gradients and weights after SGD."""
    return reference_run(cfg.model, cfg.x, cfg.y, cfg.loss_fn, steps=1, lr=cfg.lr)


def overlaps(timelines: Sequence[Timeline]) -> Measured:
    """Per timed step, the fraction of all-reduce time hidden behind computation."""
    return Measured.of(tl.overlap("compute", "comm") for tl in timelines)


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
    node: object = None  # the node that timed it, or None: this machine

    @property
    def name(self) -> str:
        return self.variant

    @property
    def overlap(self) -> Measured:
        """The fraction of all-reduce time hidden behind computation, step by step (timed steps)."""
        return overlaps(self.steps.timelines)

    def bucket_all_reduce_times(self) -> list[Measured]:
        """Seconds from launch to arrival of each bucket's all-reduce, per timed step and rank:
        waiting for the peers and for earlier buckets included."""
        if self.buckets is None:
            raise ValueError(f"variant {self.variant!r} has no buckets of its own; use the 'bucketed' run")
        spans = [s for tl in self.steps.timelines for s in tl.filter(kind="allreduce") if "bucket" in s.meta]
        return [Measured.of(s.duration for s in spans if s.meta["bucket"] == b.index) for b in self.buckets]


def gather(cfg: Config, results: Sequence[list[Result]]) -> dict[str, DDPRun]:
    """Each variant's `DDPRun`: the mean loss, rank 0's gradients and weights, the largest spread,
    and the steps lined up (slowest rank per step)."""
    runs = {}
    for variant in cfg.variants:
        ranks = [next(r for r in per_rank if r.variant == variant) for per_rank in results]
        loss = statistics.mean(r.steps.results[0] for r in ranks)
        runs[variant] = DDPRun(variant, [loss], ranks[0].grads, ranks[0].weights, max(r.spread for r in ranks),
                               gather_steps([r.steps for r in ranks]), ranks[0].buckets, cfg.node)
    return runs


def overlap_estimate(buckets: Sequence[Bucket]) -> float:
    """The overlap a bucket plan allows if an all-reduce lasts in proportion to its bytes: every
    bucket but the last (the first layers, ready only at the end of backward) hidden."""
    return 1 - buckets[-1].nbytes / sum(b.nbytes for b in buckets)


def overlap_verdict(runs: dict[str, DDPRun]) -> Verdict:
    """How much of BucketedDDP's all-reduce time was hidden, against the plan's estimate."""
    bucketed, estimate = runs["bucketed"].overlap, overlap_estimate(runs["bucketed"].buckets)
    verdict = compare(bucketed, Measured.of([0.0]))
    against = {"lower": "below", "higher": "above", "within noise": "on both sides of"}[
        compare(bucketed, Measured.of([estimate]))]
    text = (f"BucketedDDP hid {bucketed.median:.0%} of its all-reduce time behind compute"
            + {"higher": " in every step", "within noise": ", nothing in some steps", "lower": ", impossibly"}[verdict]
            + f"; the steps were {against} the plan's estimate of {estimate:.0%}.")
    return ("01.overlap_of_reversed_buckets", verdict, text,
            {"bucketed_overlap": bucketed, "naive_overlap": runs["naive"].overlap, "estimate": estimate})


def bucket_predictions(run: DDPRun, world_size: int, latency: float, bandwidth: float,
                       bytes_scale: float = 1.0) -> list[float]:
    """Each bucket's all-reduce seconds by lesson 00's ring model, at `bytes_scale` times its bytes."""
    return [ring_all_reduce_time(b.nbytes * bytes_scale, world_size, bandwidth, latency) for b in run.buckets]


def bucket_model_verdict(run: DDPRun, predicted: Sequence[float], latency: float, bandwidth: float,
                         tolerance: float = 0.05) -> Verdict:
    """The buckets' all-reduces against the ring model: "fits" when every bucket's median lies
    within `tolerance` of its prediction, "mixed" when some lie above."""
    ratio = Measured.of(m.median / p for m, p in zip(run.bucket_all_reduce_times(), predicted))  # one per bucket
    verdict = {"higher": "slower than the model", "lower": "faster than the model", "within noise": "mixed"}[
        compare(ratio, Measured.of([1.0 - tolerance, 1.0 + tolerance]))]
    if verdict == "mixed" and ratio.low >= 1 - tolerance and ratio.high <= 1 + tolerance:
        verdict = "fits"
    text = (f"the buckets' all-reduces took {ratio.median:.2f}x the ring model's prediction (median over buckets): "
            + {"slower than the model": "every bucket waited for the other rank or an earlier bucket.",
               "faster than the model": "every bucket beat it, so the ping-pong underestimated the bandwidth.",
               "fits": "each lasted what the formula gives, none waiting behind an earlier bucket.",
               "mixed": "some were launched while an earlier bucket still travelled, and waited behind it."}[verdict])
    return "01.bucket_model", verdict, text, {"ratio": ratio, "latency_s": latency, "bandwidth_Bps": bandwidth}


def overlap_parts(timeline: Timeline) -> dict[str, float]:
    """Of the all-reduce time, the fractions hidden behind backward's `B` spans and behind the
    other compute (the averages copied back into `.grad`, the forward, the optimizer)."""
    comm = [s for s in timeline if s.lane == "comm"]
    backward = Timeline(comm + [s for s in timeline if s.lane != "comm" and s.kind == "B"])
    other = Timeline(comm + [s for s in timeline if s.lane != "comm" and s.kind != "B"])
    return {"backward": backward.overlap("compute", "comm"), "other": other.overlap("compute", "comm")}


def registration_verdict(timeline: Timeline, right_order: Measured) -> Verdict:
    """The overlap of buckets planned in the wrong order (layers registered last-first), split into
    what hid behind backward and what behind copying the averages back into `.grad`."""
    parts, total = overlap_parts(timeline), timeline.overlap("compute", "comm")
    verdict = "none behind backward" if parts["backward"] == 0.0 else "some behind backward"
    text = (f"with the layers registered last-first, {total:.0%} of the all-reduce time overlapped compute "
            f"(in the right order {right_order.median:.0%}), "
            + ("none of it behind backward: no bucket left before backward ended." if parts["backward"] == 0.0 else
               "some of it behind backward: a bucket filled early on this run."))
    return "01.registration_order", verdict, text, {"overlap": total, **parts}

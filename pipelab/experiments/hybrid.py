"""Lesson 05, parts 1-2: data parallelism over replicas that each span two devices.

    cfg = hybrid.Config(model=models.SplitMLP(512, 2, 512), x=x, y=y, split_size=16)  # refuses bad input here
    runs = experiments.run(hybrid.worker, cfg, hybrid.gather)  # variant -> ReplicaRun

Each process builds a `ModelParallelReplica` on its two devices (GPUs, or virtual CPU devices),
wraps it with our `BucketedDDP` or torch's `DistributedDataParallel(device_ids=None)`, and trains
SGD steps on its slice of the batch. A `ReplicaRun` carries what `reference.assert_same` checks and,
per timed step, what ran at once. The grid of parts 3-4 is in `pipelab.experiments.grid`.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from pipelab import experiments, hardware
from pipelab.checks import divides, mean_loss, positive_number, same_batch, whole_number
from pipelab.ddp import Bucket, BucketedDDP, check_bucket_cap
from pipelab.experiments.ddp import replica_spread, shard
from pipelab.hybrid import HALVES, ModelParallelReplica, gpu_path, replica_devices
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, compare, gather_steps, time_steps
from pipelab.reference import Reference, perturb, reference_run
from pipelab.streams import Device
from pipelab.timeline import Recorder, Span, Timeline, length, overlap
from pipelab.worker import RankContext

REPLICA_VARIANTS = ("bucketed", "torch")

# --- what ran at once: shares of one kind of work hidden under another, read off a timeline ----


def is_compute(span: Span) -> bool:
    """Work of a device: a forward or a backward on a device lane."""
    return span.kind in ("F", "B", "I", "W") and span.lane != "comm"


def _times(spans) -> list[tuple[float, float]]:
    return [(s.start, s.end) for s in spans]


def hidden_share(tl: Timeline, hidden: Callable[[Span], bool], behind: Callable[[Span], bool],
                 any_rank: bool = False) -> float:
    """Share of the time of `hidden` spans during which a `behind` span ran too, on the same process
    (or, with `any_rank`, on any process): 1.0 all of it hidden, 0.0 none."""
    covered = total = 0.0
    for rank in tl.ranks:
        mine = _times(s for s in tl.filter(rank=rank) if hidden(s))
        covered += length(overlap(mine, _times(s for s in (tl if any_rank else tl.filter(rank=rank)) if behind(s))))
        total += length(mine)
    return covered / total if total > 0 else 0.0


def allreduce_overlap(tl: Timeline) -> float:
    """Share of the buckets' all-reduce time during which a device of the same process computed."""
    return hidden_share(tl, lambda s: s.kind == "allreduce", is_compute)


def copy_overlap(tl: Timeline) -> float:
    """Share of the activation copies' time (device 0 to device 1) during which a device computed."""
    return hidden_share(tl, lambda s: s.kind == "copy" and s.mb is not None, is_compute)


def device_concurrency(tl: Timeline) -> float:
    """Share of the time some device of a process computed during which both of its devices did."""
    both = either = 0.0
    for rank in tl.ranks:
        dev0, dev1 = (_times(s for s in tl.filter(rank=rank, lane=f"device {d}") if is_compute(s)) for d in (0, 1))
        both += length(overlap(dev0, dev1))
        either += length(dev0 + dev1)
    return both / either if either > 0 else 0.0


# --- what a run is: checked when built ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """`model` (halves seq1 | seq2, fc) trained on (x, y) by `world_size` two-device replicas, once per
    variant: `steps` SGD steps, the first checked and not timed (unless it is the only one).
    `split_size` None runs lesson 02's forward in each replica, a number lesson 03's splits. The
    all-reduces go through gloo: launch binds NCCL to one GPU per process, and a replica spans two."""

    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable = field(default_factory=nn.MSELoss)
    variants: tuple[str, ...] = REPLICA_VARIANTS
    split_size: int | None = None
    bucket_cap_mb: float = 25.0
    lr: float = 0.1
    steps: int = 3
    device: str = "auto"  # "cuda": two GPUs per replica; "cpu": two virtual devices per process
    backend: str = "gloo"
    timeout: float = 180.0

    def check(self) -> None:
        super().check()
        gpu_path(self.world_size, 2, self.device)  # also refuses more GPUs than the machine has
        missing = [h for h in HALVES if not isinstance(getattr(self.model, h, None), nn.Module)]
        if missing:
            raise ValueError(f"the model has no {', '.join(missing)}: a two-device replica runs seq1 on device 0 "
                             "and seq2, fc on device 1; use e.g. pipelab.models.ToyModel() or SplitMLP()")
        if not self.variants or any(v not in REPLICA_VARIANTS for v in self.variants):
            raise ValueError(f"variants must be some of {REPLICA_VARIANTS}, got {list(self.variants)!r}")
        check_bucket_cap(self.bucket_cap_mb)
        positive_number("lr", self.lr, example="lr=0.1")
        whole_number("steps", self.steps, example="steps=3")
        mean_loss(self.loss_fn)
        batch = same_batch(self.x, self.y)
        divides("batch", batch, "world_size", self.world_size)
        if self.split_size is not None:
            whole_number("split_size", self.split_size, example="split_size=8")
            if self.split_size > batch // self.world_size:
                raise ValueError(f"split_size={self.split_size} is larger than a replica's slice of the batch "
                                 f"({batch // self.world_size} samples); pick a split size between 1 and "
                                 f"{batch // self.world_size}")

    @property
    def on_gpus(self) -> bool:
        """Whether each replica gets two real GPUs (else two virtual CPU devices per process)."""
        return gpu_path(self.world_size, 2, self.device)


def toy_config(world_size: int = 2, **changes) -> Config:
    """The DDP tutorial's `ToyModel` on a batch of 32 from seed 0 (part 1; every node builds the same)."""
    from pipelab.models import ToyModel

    torch.manual_seed(0)
    model = ToyModel()
    return Config(model=model, x=torch.randn(32, 10), y=torch.randn(32, 5), world_size=world_size, **changes)


NODE_STEPS = 2  # SGD steps of the run on torchrun nodes


def on_nodes(ctx: RankContext) -> str:
    """Lesson 05's worker as a torchrun target (`nodes.torchrun_nodes("pipelab.experiments.hybrid:on_nodes")`):
    part 1's Config, `NODE_STEPS` steps, both wrappers, handed back with `nodes.save_node_result`."""
    from pipelab.nodes import save_node_result

    return save_node_result(ctx, worker(ctx, toy_config(ctx.world_size, steps=NODE_STEPS)))


def reference(cfg: Config) -> Reference:
    """What one process computes with the same model, batch, loss and SGD steps."""
    return reference_run(cfg.model, cfg.x, cfg.y, cfg.loss_fn, steps=cfg.steps, lr=cfg.lr)


# --- on each process: a replica on two devices, wrapped, trained ------------------------------


@dataclass
class Result:
    """What one process brings back for one variant."""

    variant: str
    steps: RankSteps  # each step's loss on this process's slice; the timed steps' times and spans
    grads: dict[str, torch.Tensor] | None  # process 0: the averaged gradients of the first step
    weights: dict[str, torch.Tensor] | None  # process 0: the weights after the last step
    spread: float  # largest weight difference between processes after the last step
    buckets: list[Bucket] | None  # BucketedDDP's plan
    devices: list[str]  # this process's two devices


def wrap_replica(variant: str, replica: ModelParallelReplica, bucket_cap_mb: float, recorder: Recorder) -> nn.Module:
    """The replica wrapped by our `BucketedDDP` or torch's DDP: a module on several devices has no one
    device to scatter the inputs to, so torch's gets `device_ids=None`."""
    if variant == "bucketed":
        return BucketedDDP(replica, bucket_cap_mb, recorder=recorder, device_of=replica.device_of())
    return nn.parallel.DistributedDataParallel(replica, device_ids=None, bucket_cap_mb=bucket_cap_mb)


def record_devices(rec: Recorder, devs: list[Device]) -> None:
    """The devices' spans onto the process's timeline, a lane per device ("device 1 copy" for another stream)."""
    for d in devs:
        d.synchronize()
        for s in d.timeline():
            rec.add(s.kind, s.start, s.end, lane=d.label if s.lane == "compute" else f"{d.label} {s.lane}",
                    mb=s.mb, **s.meta)
        d.rec.clear()


def train_variant(ctx: RankContext, cfg: Config, variant: str) -> Result:
    """A replica on this process's two devices, wrapped by `variant`, and `cfg.steps` SGD steps on
    its slice of the batch; the first is checked and warms up."""
    devs = replica_devices(ctx.rank, ctx.world_size, cfg.device)
    replica = ModelParallelReplica(copy.deepcopy(cfg.model), devs, cfg.split_size)
    if ctx.rank != 0:
        perturb(replica, seed=ctx.rank)
    wrapped = wrap_replica(variant, replica, cfg.bucket_cap_mb, ctx.rec)
    optimizer = torch.optim.SGD(replica.parameters(), lr=cfg.lr)
    xs = shard(cfg.x, ctx.rank, ctx.world_size)
    ys = shard(cfg.y, ctx.rank, ctx.world_size).to(devs[1].torch_device)  # the output's device
    grads: dict = {}

    def prepare(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        for d in devs:  # the last step's work done, its spans forgotten
            d.synchronize()
            d.rec.clear()

    def step(i: int) -> float:
        loss = cfg.loss_fn(wrapped(xs), ys)
        loss.backward()  # the wrapper averages the gradients before this returns
        optimizer.step()
        record_devices(ctx.rec, devs)
        if i == 0:
            grads.update({n: p.grad.detach().cpu().clone() for n, p in replica.named_parameters()})
        return loss.item()

    measured = time_steps(ctx, step, cfg.steps, prepare=prepare)
    first, bucketed = ctx.rank == 0, isinstance(wrapped, BucketedDDP)
    result = Result(variant, measured, grads if first else None,
                    {n: p.detach().cpu().clone() for n, p in replica.named_parameters()} if first else None,
                    replica_spread([p.detach().cpu() for p in replica.parameters()]),  # over gloo, in host memory
                    wrapped.buckets if bucketed else None, [d.name for d in devs])
    if bucketed:
        wrapped.remove_hooks()
    for d in devs:
        d.close()
    return result


def worker(ctx: RankContext, cfg: Config) -> list[Result]:
    """Worker: each variant in turn on this process's replica (one `Result` per variant)."""
    return [train_variant(ctx, cfg, variant) for variant in cfg.variants]


def worker_many(ctx: RankContext, cfgs: Sequence[Config]) -> list[list[Result]]:
    """Worker: `worker` for each Config in turn, on the same processes."""
    return [worker(ctx, cfg) for cfg in cfgs]


def run_many(*cfgs: Config) -> list[dict[str, "ReplicaRun"]]:
    """Each Config's runs (as `experiments.run(worker, cfg, gather)` gives them), one Config after the
    other on one set of processes: starting them costs a second or two each time on a small machine."""
    from pipelab.launch import spawn

    if not cfgs or any((c.world_size, c.backend) != (cfgs[0].world_size, cfgs[0].backend) for c in cfgs):
        raise ValueError("run_many runs its Configs on the same processes: give one or more Configs with the same "
                         f"world_size and backend, got {[(c.world_size, c.backend) for c in cfgs]}")
    per_rank = spawn(worker_many, cfgs[0].world_size, cfgs, backend=cfgs[0].backend,
                     timeout=sum(c.timeout for c in cfgs))
    return [gather(cfg, [r[i] for r in per_rank]) for i, cfg in enumerate(cfgs)]


# --- the parent side --------------------------------------------------------------------------


@dataclass
class ReplicaRun(TimedSteps):
    """One variant on all processes; `pipelab.reference.assert_same(run, reference)` checks it."""

    variant: str
    split_size: int | None
    losses: list[float]  # per step: the mean of the processes' losses
    grads: dict[str, torch.Tensor]  # process 0's averaged gradients of the first step
    weights: dict[str, torch.Tensor]  # process 0's weights after the last step
    replica_spread: float  # largest weight difference between processes after the last step
    steps: Steps = field(repr=False)  # the timed steps, all processes
    buckets: list[Bucket] | None = None  # BucketedDDP's plan
    devices: list[list[str]] = field(default_factory=list)  # per process, its two devices

    @property
    def name(self) -> str:
        return f"{self.variant} ({'naive forward' if self.split_size is None else f'split_size={self.split_size}'})"

    def per_step(self, share: Callable[[Timeline], float]) -> Measured:
        """`share` of each timed step's timeline."""
        return Measured.of(share(tl) for tl in self.steps.timelines)

    @property
    def overlap(self) -> Measured:
        """Per timed step, the share of the buckets' all-reduce time hidden behind compute."""
        return self.per_step(allreduce_overlap)

    @property
    def copy_overlap(self) -> Measured:
        """Per timed step, the share of the activation copies' time hidden behind compute."""
        return self.per_step(copy_overlap)

    @property
    def device_concurrency(self) -> Measured:
        """Per timed step, the share of the compute time during which both devices computed."""
        return self.per_step(device_concurrency)


def shares(run: ReplicaRun) -> dict[str, Measured]:
    """The run's three figures of what ran at once, by what overlaps what."""
    return {"copy/compute": run.copy_overlap, "device/device": run.device_concurrency, "all-reduce/compute": run.overlap}


def gather(cfg: Config, results: Sequence[list[Result]]) -> dict[str, ReplicaRun]:
    """Each variant's `ReplicaRun`, from every process's results (by rank)."""
    runs = {}
    for i, variant in enumerate(cfg.variants):
        mine = [r[i] for r in results]
        losses = [statistics.mean(step) for step in zip(*(r.steps.results for r in mine))]
        runs[variant] = ReplicaRun(variant, cfg.split_size, losses, mine[0].grads, mine[0].weights,
                                   max(r.spread for r in mine), gather_steps([r.steps for r in mine]),
                                   mine[0].buckets, [r.devices for r in mine])
    return runs


# --- verdicts ---------------------------------------------------------------------------------


def early_buckets_verdict(run: ReplicaRun) -> tuple[str, str, str, dict]:
    """Whether device 1's buckets travelled during device 0's backward in the median step (`BucketedDDP`)."""
    device_of_bucket = {b.index: b.device for b in run.buckets}
    early = run.per_step(lambda tl: hidden_share(
        tl, lambda s: s.kind == "allreduce" and device_of_bucket[s.meta["bucket"]] == "device 1",
        lambda s: s.kind == "B" and s.lane == "device 0"))
    verdict = "overlaps" if early.median > 0 else "does not overlap"
    return ("05.early_buckets", verdict,
            f"in the median step, device 1's buckets were in flight during device 0's backward for "
            f"{early.median:.0%} of their all-reduce time.", dict(early=early))


WHY_SPLITS_OVERLAP = {"copy/compute": "a split's copy travels while device 0 computes the next split",
                      "device/device": "device 1 computes split i while device 0 computes split i + 1"}


def splits_verdict(without: ReplicaRun, with_splits: ReplicaRun, kind: str) -> tuple[str, str, str, dict]:
    """Whether lesson 03's splits let `kind` ("copy/compute" or "device/device") overlap: any step
    with splits beyond every step without (threads waiting for a shared core overlap nothing)."""
    now, before = shares(with_splits)[kind], shares(without)[kind]
    beyond = sum(v > before.high for v in now.values)
    verdict = "higher" if beyond else "lower" if now.high < before.low else "within noise"
    return (f"05.splits_{kind.replace('/', '_')}", verdict,
            f"{beyond} of {len(now.values)} steps with splits overlapped {kind} more than any step without: "
            + {"higher": WHY_SPLITS_OVERLAP[kind], "lower": "less, against lesson 03's prediction",
               "within noise": "the shared cores never ran the threads at once"}[verdict] + ".",
            dict(with_splits=now, without=before, steps_beyond=beyond))


def split_time_verdict(without: ReplicaRun, with_splits: ReplicaRun, cfg: Config) -> tuple[str, str, str, dict]:
    """Whether the splits made a step faster; with fewer cores than virtual devices they cannot."""
    cores, threads = hardware.cpu_cores(), cfg.world_size * 2
    splits = math.ceil(cfg.x.shape[0] // cfg.world_size / cfg.split_size)
    bound = 2 * splits / (splits + 1)  # lesson 03: 2 devices, k splits, equal halves
    if not cfg.on_gpus and threads > cores:  # the virtual devices share the cores
        verdict = "too few cores"  # not "within noise": shared cores decide the ranges
        text = (f"with {threads} virtual devices on {cores} cores splits cannot save time; two GPUs per replica "
                f"could gain up to {bound:.2f}x (lesson 03).")
    else:
        verdict = compare(with_splits.step_time, without.step_time)
        text = (f"the median step took {with_splits.step_time.median * 1e3:.1f} ms with splits against "
                f"{without.step_time.median * 1e3:.1f} ms without: {verdict}.")
    return ("05.splits_step_time", verdict, text,
            dict(with_splits=with_splits.step_time, without=without.step_time, bound=bound, cores=cores))


def shares_table(runs: dict[str, ReplicaRun]) -> list[dict]:
    """One row per share (what overlaps what), one column per run: median (lowest-highest) in %."""
    figures = {label: shares(run) for label, run in runs.items()}
    return [{"overlap": kind, **{label: format(f[kind].scaled(100), ".0f") + " %" for label, f in figures.items()}}
            for kind in ("copy/compute", "device/device", "all-reduce/compute")]

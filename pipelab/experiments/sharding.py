"""Lesson 11 from a notebook: train one model with data parallelism, ZeRO-1/2/3 (ours, from
`pipelab.sharding`), torch's ZeroRedundancyOptimizer and FSDP2 `fully_shard` on real processes;
check each against one process; count the bytes each rank holds and sends; time ZeRO-3's prefetch.

    cfg = sharding.Config(model=model, x=x, y=y, world_size=2)      # refuses bad input here
    run = experiments.run(sharding.worker, cfg, sharding.gather)
    sharding.assert_same(run, sharding.reference(cfg))
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from pipelab import experiments
from pipelab.checks import divides, mean_loss, positive_number, same_batch, trainable, whole_number
from pipelab.display import human_bytes
from pipelab.emulate import cost, sized
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, compare, compare_medians, gather_steps, time_steps
from pipelab.sharding import (OPTIMIZERS, Collectives, DataParallel, Held, Zero1, Zero2, Zero3, formula,
                              layers_of, make_optimizer)
from pipelab.sharding.torch_side import TorchFSDP, TorchZero1
from pipelab.worker import RankContext

OURS = ("dp", "zero1", "zero2", "zero3", "zero3_no_prefetch")
TORCH = ("torch_zero1", "fully_shard", "fully_shard_keep")
VARIANTS = OURS + TORCH
STAGE = {"dp": "dp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "zero3_no_prefetch": "zero3",
         "torch_zero1": "zero1", "fully_shard": "zero3", "fully_shard_keep": "zero3"}
LABEL = {"dp": "DP (ours)", "zero1": "ZeRO-1 (ours)", "zero2": "ZeRO-2 (ours)", "zero3": "ZeRO-3 (ours, prefetch)",
         "zero3_no_prefetch": "ZeRO-3 (ours, no prefetch)",
         "torch_zero1": "torch ZeroRedundancyOptimizer + DDP",
         "fully_shard": "torch fully_shard, reshard_after_forward=True",
         "fully_shard_keep": "torch fully_shard, reshard_after_forward=False"}
MOMENTS = {"adam": 2, "adamw": 2, "sgd": 0}  # optimizer state values per parameter


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """One sharding experiment. `model` is a module (every rank takes a copy) or a function that
    builds it (every rank calls it, as real sharded training does: it must build the same weights).
    SIZE: the per-rank `batch` a modelled node times each layer's compute at (None: the real one)."""

    model: nn.Module | Callable[[], nn.Module]
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable = field(default_factory=nn.MSELoss)
    variants: tuple[str, ...] = VARIANTS
    optimizer: str = "adam"
    lr: float = 1e-3
    steps: int = 4  # every step checked against one process; all but the first timed
    SIZE: ClassVar[Mapping[str, Any]] = {"batch": None}

    def check(self) -> None:
        super().check()
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ValueError(f"variants must be some of {VARIANTS}, got {tuple(self.variants)!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={self.optimizer!r} cannot be sharded here: each rank steps only its piece of every "
                f"layer's flat vector, which gives one process's result only for an optimizer that updates "
                f"each value on its own ({', '.join(OPTIMIZERS)}). One that looks at a whole tensor or the whole "
                f"gradient (LBFGS, Adafactor, LAMB's trust ratio, Muon) would see pieces; use optimizer='adam'")
        positive_number("lr", self.lr, example="lr=1e-3")
        if self.size.batch is not None:
            whole_number("batch", self.size.batch, example="batch=512")
        whole_number("steps", self.steps, example="steps=4")
        divides("batch", same_batch(self.x, self.y), "world_size", self.world_size)
        mean_loss(self.loss_fn)
        same_start(self.model)
        layers_fit(self.build(), self.world_size)

    def build(self) -> nn.Module:
        """The model as a rank builds it: a copy of `model`, or what the function `model` returns."""
        return copy.deepcopy(self.model) if isinstance(self.model, nn.Module) else self.model()

    @property
    def psi(self) -> int:
        """Ψ, the model's parameter count."""
        return sum(p.numel() for p in self.build().parameters())


def same_start(model) -> None:
    """Refuse a model function that builds different weights on different calls: every rank calls
    it and keeps only its shard, so the shards would come from different models."""
    if isinstance(model, nn.Module):
        return
    if not callable(model):
        raise ValueError(f"model must be an nn.Module or a function that builds one, got {type(model).__name__}")
    a, b = model().state_dict(), model().state_dict()
    for name in a:
        if not torch.equal(a[name], b[name]):
            diff = (a[name] - b[name]).abs().max().item()
            raise ValueError(
                f"model: two calls of {getattr(model, '__name__', model)!r} built different weights (up to {diff:.3g} "
                f"apart in {name!r}); every rank builds its own model and keeps only its shard, so the ranks would "
                f"start from different weights. Seed it (torch.manual_seed(0) first thing inside), or pass a built "
                f"nn.Module")


def layers_fit(model: nn.Module, world_size: int) -> None:
    """Refuse a layer with fewer parameters than ranks: some rank would own only padding of it."""
    trainable(model)
    for layer in layers_of(model, world_size):
        if layer.layout.numel < world_size:
            raise ValueError(
                f"layer {layer.name!r} ({layer.module.__class__.__name__}) has {layer.layout.numel} parameters, fewer "
                f"than world_size={world_size} ranks: some rank would own none of it; use world_size <= "
                f"{layer.layout.numel}, or a wider layer")


def trainer(ctx: RankContext, cfg: Config, variant: str, model: nn.Module):
    """The trainer of `variant` around this rank's model."""
    ours = {"dp": DataParallel, "zero1": Zero1, "zero2": Zero2, "zero3": Zero3}
    if variant in ours:
        return ours[variant](model, Collectives(ctx.rec), cfg.optimizer, cfg.lr)
    if variant == "zero3_no_prefetch":
        return Zero3(model, Collectives(ctx.rec), cfg.optimizer, cfg.lr, prefetch=False)
    if variant == "torch_zero1":
        return TorchZero1(ctx, model, cfg.optimizer, cfg.lr)
    return TorchFSDP(ctx, model, cfg.optimizer, cfg.lr, reshard_after_forward=variant == "fully_shard")


@dataclass
class VariantResult:
    """One rank, one variant."""

    losses: list[float]  # this rank's loss, every step
    weights: dict[str, torch.Tensor] | None  # the whole model after the last step (rank 0 only)
    held: Held  # bytes held after the last step
    sent: float | None  # bytes this rank sent in the last step, as a ring (ours only)
    payload: float | None  # bytes of the full tensors handed to the collectives in the last step
    messages: dict[str, int] | None  # collectives of the last step, by kind
    peak_gathered: int | None  # ZeRO-3: most bytes of whole-layer parameters held at once
    steps: RankSteps = field(repr=False)


def train(ctx: RankContext, cfg: Config, variant: str, x: torch.Tensor, y: torch.Tensor) -> VariantResult:
    """Train this rank's model with `variant` for cfg.steps steps on its slice (x, y)."""
    model = cfg.build().to(ctx.device)
    layers = [(layer.name, layer.module) for layer in layers_of(model, 1)]
    sized.time_sharded_layers(ctx, layers, model, x, cfg.size.batch or x.shape[0])  # a modelled node's clock
    t = trainer(ctx, cfg, variant, model)
    comm = getattr(t, "comm", None)

    def step(i: int) -> float:
        if comm is not None:
            comm.clear()  # count the bytes of one step: the last
        return t.step(x, y, cfg.loss_fn)

    measured = time_steps(ctx, step, cfg.steps)
    weights = t.full_parameters()  # a collective: every rank gathers, rank 0 keeps them
    weights = weights if ctx.rank == 0 else None
    if comm is None:
        return VariantResult(measured.results, weights, t.held(), None, None, None, None, measured)
    kinds = {k: sum(m.kind == k for m in comm.messages) for k in ("allreduce", "reducescatter", "allgather")}
    return VariantResult(measured.results, weights, t.held(), comm.bytes_sent(),
                         float(sum(m.payload for m in comm.messages)), kinds, getattr(t, "peak_gathered", None), measured)


def worker(ctx: RankContext, cfg: Config) -> dict[str, VariantResult]:
    """Every variant in turn, each on this rank's equal slice of the batch."""
    x = cfg.x.chunk(ctx.world_size)[ctx.rank].to(ctx.device)
    y = cfg.y.chunk(ctx.world_size)[ctx.rank].to(ctx.device)
    return {v: train(ctx, cfg, v, x, y) for v in cfg.variants}


@dataclass
class VariantRun(TimedSteps):
    """One variant on all ranks."""

    variant: str
    losses: list[float]  # per step: the mean of the ranks' losses (the whole batch's loss)
    weights: dict[str, torch.Tensor]  # the whole model after the last step
    held: list[Held]  # per rank
    sent: list[float] | None  # per rank: bytes sent in one step, as a ring
    payload: list[float] | None
    messages: dict[str, int] | None  # rank 0's collectives in one step, by kind
    peak_gathered: list[int] | None  # per rank (ZeRO-3)
    steps: Steps = field(repr=False)

    @property
    def label(self) -> str:
        return LABEL[self.variant]

    @property
    def held_per_rank(self) -> float:
        """The most any rank holds (ranks differ by padding, and by whole tensors in torch's ZeRO-1)."""
        return max(h.total for h in self.held)

    @property
    def makespan(self) -> Measured:
        """Seconds from the first span to the last of each timed step, all ranks: the step as its
        timeline shows it (modelled time on a modelled node)."""
        return Measured.of(tl.makespan for tl in self.steps.timelines)

    @property
    def exposed_comm(self) -> Measured:
        """Seconds per timed step during which a rank waited on communication with no compute to
        hide it (the slowest rank of each step)."""
        return Measured.of(max(tl.busy_time(r, "comm") - tl.overlap_time("compute", "comm", r) for r in tl.ranks)
                           for tl in self.steps.timelines)


@dataclass
class Run:
    """Every variant of one experiment, on `world_size` ranks, for a model of `psi` parameters."""

    world_size: int
    psi: int
    moments: int  # optimizer state values per parameter (Adam: 2)
    variants: dict[str, VariantRun]
    node: str | None = None  # the node that timed it (modelled time), or None: this machine

    def __getitem__(self, variant: str) -> VariantRun:
        return self.variants[variant]

    @property
    def modelled(self) -> bool:
        """Whether its times are modelled (they repeat exactly) rather than measured."""
        return self.node is not None

    def formula(self, variant: str) -> Held:
        return formula(STAGE[variant], self.psi, self.world_size, state_bytes=4 * self.moments)


def gather(cfg: Config, results: Sequence[dict[str, VariantResult]]) -> Run:
    variants = {}
    for v in cfg.variants:
        ranks = [r[v] for r in results]

        def each(name: str) -> list | None:
            return None if getattr(ranks[0], name) is None else [getattr(r, name) for r in ranks]
        variants[v] = VariantRun(v, [statistics.mean(step) for step in zip(*(r.losses for r in ranks))],
                                 ranks[0].weights, each("held"), each("sent"), each("payload"), ranks[0].messages,
                                 each("peak_gathered"), gather_steps([r.steps for r in ranks]))
    return Run(cfg.world_size, cfg.psi, MOMENTS[cfg.optimizer], variants, cfg.node_name)


@dataclass
class Reference:
    """One process, the whole batch: the loss of every step and the weights after the last."""

    losses: list[float]
    weights: dict[str, torch.Tensor]


def reference(cfg: Config) -> Reference:
    """Train the model in this process on the whole batch, with the same optimizer and steps."""
    model = cfg.build()
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    losses = []
    for _ in range(cfg.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = cfg.loss_fn(model(cfg.x), cfg.y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return Reference(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def assert_same(run: Run, ref: Reference, atol: float = 1e-5, rtol: float = 1e-5) -> dict[str, float]:
    """Assert every variant's losses and final weights are one process's; return each variant's
    largest weight difference."""
    worst = {}
    for v, r in run.variants.items():
        torch.testing.assert_close(torch.tensor(r.losses), torch.tensor(ref.losses), atol=atol, rtol=rtol,
                                   msg=lambda m, v=v: f"{v}: losses: {m}")
        if sorted(r.weights) != sorted(ref.weights):
            raise AssertionError(f"{v}: weights named {sorted(r.weights)}, expected {sorted(ref.weights)}")
        for name, w in ref.weights.items():
            torch.testing.assert_close(r.weights[name].cpu(), w, atol=atol, rtol=rtol,
                                       msg=lambda m, v=v, n=name: f"{v}: weight {n}: {m}")
        worst[v] = max((r.weights[n].cpu() - w).abs().max().item() for n, w in ref.weights.items())
    return worst


def memory_rows(runs: Sequence[Run]) -> list[dict]:
    """Bytes per rank, measured (the fullest rank) beside the formula, for each run and variant."""
    rows = []
    for run in runs:
        for v, r in run.variants.items():
            h, f = max(r.held, key=lambda h: h.total), run.formula(v)
            rows.append({"N": run.world_size, "variant": r.label, "parameters": human_bytes(h.parameters),
                         "gradients": human_bytes(h.gradients), "optimizer": human_bytes(h.optimizer_state),
                         "measured": human_bytes(h.total), "formula": human_bytes(f.total),
                         "measured / formula": f"{h.total / f.total:.3f}"})
    return rows


def bytes_rows(run: Run) -> list[dict]:
    """Bytes each rank sent in one step (as a ring), in units of 4Ψ and against data parallelism."""
    dp = max(run["dp"].sent) if "dp" in run.variants else None
    rows = []
    for v, r in run.variants.items():
        if r.sent is None:
            continue
        sent = max(r.sent)
        ring = {"dp": 2, "zero1": 2, "zero2": 2}.get(STAGE[v], 3) * (run.world_size - 1) / run.world_size
        rows.append({"variant": r.label, "collectives": ", ".join(f"{n} {k}" for k, n in r.messages.items() if n),
                     "sent": human_bytes(sent), "sent / 4Ψ": f"{sent / (4 * run.psi):.3f}",
                     "formula / 4Ψ": f"{ring:.3f}", "x DP": f"{sent / dp:.3f}" if dp else "-"})
    return rows


def fit_rows(psi: float, world_size: int, device_bytes: float, param_bytes: float = 2, grad_bytes: float = 2,
             state_bytes: float = 12) -> list[dict]:
    """The formula for a large model (mixed precision by default: the ZeRO paper's 2 + 2 + 12
    bytes per parameter) on `world_size` devices of `device_bytes`: does each stage fit?"""
    rows = []
    for stage in ("dp", "zero1", "zero2", "zero3"):
        f = formula(stage, psi, world_size, param_bytes, grad_bytes, state_bytes)
        rows.append({"stage": stage, "parameters": f"{f.parameters / 1e9:.1f} GB",
                     "gradients": f"{f.gradients / 1e9:.1f} GB", "optimizer": f"{f.optimizer_state / 1e9:.1f} GB",
                     "per device": f"{f.total / 1e9:.1f} GB", "fits": f.total <= device_bytes})
    return rows


def prefetch_rows(run: Run) -> list[dict]:
    """ZeRO-3 with prefetch and without: step (first to last span), communication no compute hid,
    and the most whole-layer parameter bytes held at once."""
    clock = "modelled" if run.modelled else "measured"
    return [{"ZeRO-3": name, f"step (ms, {clock})": f"{r.makespan.scaled(1e3):.3g}",
             f"exposed communication (ms, {clock})": f"{r.exposed_comm.scaled(1e3):.3g}",
             "whole layers held at once": human_bytes(max(r.peak_gathered))}
            for name, r in (("prefetch", run["zero3"]), ("no prefetch", run["zero3_no_prefetch"]))]


def prefetch_verdict(run: Run) -> tuple[str, str, str, dict]:
    """What prefetching did to ZeRO-3's step and exposed communication, and what it cost in memory.
    Modelled time repeats exactly, so any difference is real; measured time only beyond its noise."""
    on, off = run["zero3"], run["zero3_no_prefetch"]
    differ = compare if run.modelled else compare_medians
    step, exposed = differ(on.makespan, off.makespan), differ(on.exposed_comm, off.exposed_comm)
    peak_on, peak_off = max(on.peak_gathered), max(off.peak_gathered)
    where = "on the emulated node (modelled)" if run.modelled else "on this machine (measured)"
    held = "more" if peak_on > peak_off else "as many" if peak_on == peak_off else "fewer"
    text = (f"{where}, ZeRO-3's step took {on.makespan.median * 1e3:.3g} ms with prefetch and "
            f"{off.makespan.median * 1e3:.3g} ms without ({step}), holding {held} whole-layer parameters at once")
    return ("11.prefetch", f"step {step}; exposed communication {exposed}", text,
            dict(step_ms_prefetch=on.makespan.scaled(1e3), step_ms_no_prefetch=off.makespan.scaled(1e3),
                 exposed_ms_prefetch=on.exposed_comm.scaled(1e3), exposed_ms_no_prefetch=off.exposed_comm.scaled(1e3),
                 peak_gathered_prefetch=peak_on, peak_gathered_no_prefetch=peak_off))


def run_flops(params: dict) -> float:
    """FLOPs of lesson 11 at the notebook parameters `params` (missing names take the defaults),
    counted on the meta device: every variant's `steps` on the whole batch and the reference, the
    one-rank run (4 variants, 2 steps) and the 4-rank run (our 5 variants, 3 steps, and its
    reference); Adam's element-wise update is left out (it is small)."""
    from pipelab import models

    p = {"width": 256, "batch": 64, "steps": 5, **params}
    model = models.mlp([p["width"], p["width"] + 1, p["width"] + 1, p["width"]]).to("meta")
    step = cost.step_flops(model, torch.empty(p["batch"], p["width"], device="meta"))
    return step * (p["steps"] * (len(VARIANTS) + 1) + 2 * 4 + 3 * (len(OURS) + 1))

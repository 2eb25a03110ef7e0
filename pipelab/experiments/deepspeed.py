"""Lesson 08 from a notebook: AlexNet's cuts timed (modelled, or measured here), the DeepSpeed-style
engine trained on real ranks, the real DeepSpeed beside it where it is installed, and the verdicts.

    cfg = deepspeed.Config(module=mlp, inputs=x, targets=y, num_microbatches=4, steps=8, lr=0.5)
    run = experiments.run(deepspeed.worker, cfg, deepspeed.gather)  # a TrainRun, named as build_reference() names
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch
import torch.nn as nn

from pipelab import experiments
from pipelab.checks import divides, mean_loss, positive_number, same_batch, whole_number
from pipelab.emulate import layers as modelled
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, compare, gather_steps, time_steps
from pipelab.pipeline.cuts import CutTimes, lightest_heaviest, model_cuts, time_cuts  # noqa: F401 - the lesson runs them here
from pipelab.pipeline.deepspeed_interop import deepspeed_available, deepspeed_partitions, deepspeed_train, import_deepspeed
from pipelab.pipeline.engine import PipelineEngine
from pipelab.pipeline.instructions import TrainSchedule
from pipelab.pipeline.module import PipelineModule
from pipelab.pipeline.partition import check_method, layer_name, profile_layers, stage_sums
from pipelab.pipeline.topology import PipeDataParallelTopology, ProcessTopology
from pipelab.timeline import Timeline
from pipelab.worker import RankContext

# --- AlexNet's cuts: each layer's time modelled, or measured in this process ---


def layer_profile(layers: list, sample: torch.Tensor, device=None, dtype="float32", repeats: int = 3,
                  tries: int = 1) -> list[Measured]:
    """Each layer's forward+backward ms: modelled on `device`, or (None) measured here on `sample`."""
    if device is not None:
        return [Measured.of([1e3 * (s["F"] + s["B"])]) for s in modelled.layer_seconds(layers, sample, device, dtype)]
    return [t.scaled(1e3) for t in profile_layers(layers, sample, repeats=repeats, tries=tries)]


def speedup_verdict(speedup: Measured, new: str = "new cut", same_cut: bool = False,
                    min_rounds: int = 3) -> tuple[str, str]:
    """(verdict, phrase) for a round-by-round ratio "old cut's slowest stage / `new`'s": 'faster' or
    'slower' only when every round says so, else 'within noise' (or 'same cut')."""
    rounds, direction = len(speedup.values), compare(speedup, Measured.of([1.0]))  # 'higher': every round above 1
    if same_cut:
        return "same cut", "both methods chose the same cut"
    if rounds < min_rounds:
        return "within noise", f"{rounds} round(s) are too few to tell a direction"
    if direction in ("higher", "lower"):
        word = "faster" if direction == "higher" else "slower"
        return word, f"in every round the {new}'s slowest stage was {word} ({speedup.median:.2f}x, median)"
    return "within noise", f"the rounds disagree ({speedup.median:.2f}x by the median), within this machine's noise"


def fastest(times: CutTimes, num_stages: int) -> tuple[str, dict[str, Measured]]:
    """The method whose cut has the fastest slowest stage ('profile' on a tie); every method's slowest."""
    slowest = {m: t for (s, m), t in times.slowest.items() if s == num_stages}
    return min(slowest, key=lambda m: (slowest[m].median, m != "profile")), slowest


def profile_verdict(times: CutTimes, num_stages: int = 2) -> tuple[str, str, str, dict]:
    """(key, verdict, text, figures): is the 'profile' cut's slowest stage of `num_stages` faster than the
    'parameters' cut's (modelled: exactly; measured: in every round)? Where another cut's is, why."""
    S, w = num_stages, times.layer_ms
    by_params, by_profile = times.cuts[S, "parameters"], times.cuts[S, "profile"]
    (winner, slowest), speedup = fastest(times, S), times.speedup(S)
    heaviest = {m: max(stage_sums(w, times.cuts[S, m])) for m in slowest}
    if times.modelled:  # exact: one value decides
        r = speedup.median
        verdict = "same cut" if by_params == by_profile else "as fast" if r == 1 else "faster" if r > 1 else "slower"
        how = f"the parameters cut's slowest stage takes {r:.2f}x the profile cut's (modelled)"
    else:
        verdict, how = speedup_verdict(speedup, "profile cut", same_cut=by_params == by_profile)
    best_ms, best_cut = lightest_heaviest(w, S)
    balanced = "as partition_balanced minimises heaviest minus lightest"
    if winner != "profile":  # by the profile's own weights, or (measured) against them
        why = f", {balanced}" if heaviest[winner] < heaviest["profile"] else ": layers timed alone do not add up to a stage"
        how += f"; the {winner} cut's is the fastest{why}"
    elif heaviest["profile"] > best_ms * (1 + 1e-9):
        how += f"; a lighter heaviest stage exists, {balanced}"
    else:
        how += "; by its weights no cut of whole layers could do better"
    return f"08.profile_{S}_stages", verdict, f"{S} stages: {how}.", {
        "speedup": speedup, "predicted": heaviest["parameters"] / heaviest["profile"],
        "parameters_ms": slowest["parameters"], "profile_ms": slowest["profile"], "fastest": winner,
        "best_possible_ms": best_ms, "best_cut": str(best_cut)}


def contrast_verdict(here: CutTimes, model: CutTimes, layers: list, device_name: str,
                     kind: str = "Conv2d") -> tuple[str, str, str, dict]:
    """(key, verdict, text, figures): the `kind` layers' share of the time measured here (`here`) and
    modelled on `device_name` (`model`), and whether the measured rounds moved."""
    which = [i for i, layer in enumerate(layers) if layer_name(layer) == kind]
    share_here, share_there = (sum(t.layer_ms[i] for i in which) / sum(t.layer_ms) for t in (here, model))
    noise = max(t.relative_spread for t in here.slowest.values())
    text = f"The {kind} layers take {share_here:.0%} of the time measured here and {share_there:.0%} on the {device_name}"
    if min(len(t.values) for t in here.slowest.values()) < 2:
        verdict, text = "one round", text + "; one measured round cannot show how much a measurement moves."
    else:
        verdict = "noisier than modelled" if noise > 0 else "as steady as modelled"
        text += "; measured slowest stages moved between rounds, modelled ones cannot."
    return "08.profile_here_and_emulated", verdict, text, {
        "share_here": share_here, "share_modelled": share_there, "spread_here": noise}


def contrast_table(here: CutTimes, model: CutTimes) -> list[dict]:
    """Per stage count: the profile's cut here and modelled, the fastest cut here, how far a
    measured slowest stage moved between rounds."""
    rows = []
    for S in sorted({S for S, _ in here.cuts}):
        winner, slowest = fastest(here, S)
        rows.append({"stages": S, "profile cut here": str(here.cuts[S, "profile"]),
                     "modelled": str(model.cuts[S, "profile"]), "fastest cut here": winner,
                     "its slowest stage (ms)": f"{slowest[winner]:.4g}",
                     "moved between rounds": f"{max(t.relative_spread for t in slowest.values()):.0%}"})
    return rows


# --- The engine on real ranks ---


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """`steps` SGD steps of the engine on one batch, each replica's share in `num_microbatches`, on
    `world_size` ranks (default: the module's topology, else one per stage). A modelled node times each
    stage at `SIZE`: `layers` (the module's list, wider) on micro-batches like `microbatch`, in `dtype`."""

    module: PipelineModule
    inputs: torch.Tensor
    targets: torch.Tensor
    num_microbatches: int
    steps: int = 1
    lr: float = 0.1
    world_size: int | None = None
    SIZE: ClassVar[Mapping[str, Any]] = {"layers": None, "microbatch": None, "dtype": "float32"}

    @property
    def topology(self) -> ProcessTopology:
        """The pipe x data grid: the module's own, else num_stages x (world_size / num_stages)."""
        S = self.module.num_stages
        return self.module._topo or PipeDataParallelTopology(num_pp=S, num_dp=self.world_size // S)

    def check(self) -> None:
        module = self.module  # first: the default world size is read off it
        if not isinstance(module, PipelineModule):
            raise ValueError(f"the engine needs a PipelineModule, got {type(module).__name__}; "
                             "wrap the layers: PipelineModule(layers, num_stages=2, loss_fn=...)")
        if module.loss_fn is None:
            raise ValueError("the last stage needs a loss; build the module with loss_fn=, "
                             "e.g. PipelineModule(layers, num_stages=2, loss_fn=torch.nn.MSELoss())")
        mean_loss(module.loss_fn)
        S, grid = module.num_stages, module._topo
        if grid is not None and "data" not in grid.get_axis_names():
            raise ValueError(f"the engine runs a pipe x data grid, but the module's topology has axes "
                             f"{grid.get_axis_names()}; build it with PipeDataParallelTopology("
                             f"num_pp={S}, num_dp=1) for a pipeline alone")
        if self.world_size is None:
            object.__setattr__(self, "world_size", grid.world_size() if grid is not None else S)
        super().check()
        if self.world_size % S:
            raise ValueError(f"num_stages={S} does not divide world_size={self.world_size}: every stage needs "
                             f"the same number of data-parallel ranks; use a world size that is a multiple "
                             f"of {S} (e.g. {S} or {2 * S}), or fewer stages")
        if grid is not None and grid.world_size() != self.world_size:
            raise ValueError(f"world_size={self.world_size} but the module's topology has {grid.world_size()} "
                             "ranks; leave world_size out, or build the module with a matching topology")
        whole_number("num_microbatches", self.num_microbatches, example="num_microbatches=4")
        whole_number("steps", self.steps, example="steps=2")
        positive_number("lr", self.lr, example="lr=0.1")
        for name, t in (("inputs", self.inputs), ("targets", self.targets)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor with one row per sample, got {type(t).__name__}")
        dp = self.world_size // S
        divides("batch", same_batch(self.inputs, self.targets),
                "num_microbatches" if dp == 1 else f"num_microbatches x {dp} replicas", dp * self.num_microbatches)
        big, example = self.size.layers, self.size.microbatch
        if self.node is not None and (big is None or example is None):
            raise ValueError("a modelled node times each stage at its size: give the module's layer list at that "
                             "size and one micro-batch there, e.g. Emulated(node, layers=wide_specs, microbatch=torch."
                             "empty(1024, 4096, device='meta')); or run on this machine's clock (no node)")
        if big is not None and len(big) != len(module):
            raise ValueError(f"the modelled size's layers has {len(big)} layers and the module {len(module)}: "
                             "give the module's own layer list at the modelled size, layer for layer")


@dataclass
class Result:
    """What one rank of the engine reports."""

    rank: int
    stage: int
    losses: list[float | None]  # per step: the batch's mean loss on a last stage, else None
    mb_losses: list[list[float]]  # per step: its replica's micro-batch losses on a last stage, else []
    grads: dict[str, torch.Tensor]  # this stage's gradients of the first step
    weights: dict[str, torch.Tensor]  # this stage's weights after the last step
    steps: RankSteps = field(repr=False)


def worker(ctx: RankContext, cfg: Config) -> Result:
    """Build this rank's stage, train `cfg.steps` batches on its replica's share of the batch."""
    topology, M = cfg.topology, cfg.num_microbatches
    dp, coord = topology.get_dim("data"), topology.get_coord(ctx.rank)
    if cfg.node is not None:  # modelled time: this stage at the modelled size, its messages too
        size, real = cfg.size, cfg.inputs[: cfg.inputs.shape[0] // (dp * M)]
        modelled.time_stage(ctx.emulator, size.layers, size.microbatch, size.dtype, cfg.module._layer_specs, real,
                            cfg.module.partitions(), coord.pipe)
    engine = PipelineEngine(ctx, cfg.module, topology, M, cfg.lr)
    x, y = cfg.inputs.chunk(dp)[coord.data], cfg.targets.chunk(dp)[coord.data]
    data = list(zip(x.chunk(M), y.chunk(M)))
    measured = time_steps(ctx, lambda _: (engine.train_batch(data), engine.micro_batch_losses), cfg.steps)
    weights = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return Result(ctx.rank, engine.stage_id, [loss for loss, _ in measured.results],
                  [list(mbs) for _, mbs in measured.results], engine.step_grads, weights, measured)


@dataclass
class TrainRun(TimedSteps):
    """A pipelined training run from every rank; gradients and weights named as `build_reference()` names them."""

    parts: list[int]
    topology: ProcessTopology
    num_microbatches: int  # per replica
    losses: list[float]  # per step: the batch's mean loss, before its optimizer step
    mb_losses: list[list[float]]  # per step: each micro-batch's loss (last stage), replica 0's first
    grads: list[dict[str, torch.Tensor]]  # per rank: the gradients of the first batch
    weights: list[dict[str, torch.Tensor]]  # per rank: the weights after the last step
    steps: Steps = field(repr=False)  # timed batches (the first warms up), all ranks


def gather(cfg: Config, results: list[Result]) -> TrainRun:
    """The ranks' results as one run: losses from the last stage of each replica."""
    topology = cfg.topology
    S, dp = topology.get_dim("pipe"), topology.get_dim("data")
    lasts = [results[topology.get_rank(pipe=S - 1, data=d)] for d in range(dp)]
    mb_losses = [[loss for replica in per_step for loss in replica] for per_step in zip(*(r.mb_losses for r in lasts))]
    return TrainRun(parts=cfg.module.partitions(), topology=topology, num_microbatches=cfg.num_microbatches,
                    losses=lasts[0].losses, mb_losses=mb_losses, grads=[r.grads for r in results],
                    weights=[r.weights for r in results], steps=gather_steps([r.steps for r in results]))


def peak_in_flight(timeline: Timeline) -> dict[int, int]:
    """Per rank, the most micro-batches held at once (forward begun, backward not ended), off the timeline."""
    peaks = {}
    for rank in timeline.ranks:
        held = peak = 0
        for span in sorted(timeline.filter(rank=rank, lane="compute"), key=lambda s: s.start):
            held += {"F": 1, "B": -1}.get(span.kind, 0)
            peak = max(peak, held)
        peaks[rank] = peak
    return peaks


def in_flight_verdict(run: TrainRun) -> tuple[str, str, str, dict]:
    """(key, verdict, text, figures): did each stage hold at most min(S - s, M) micro-batches at
    once (1F1B's bound), as counted on the run's timeline?"""
    S, M = run.topology.get_dim("pipe"), run.num_microbatches
    held, expected = peak_in_flight(run.timeline), {s: min(S - s, M) for s in range(S)}
    buffers = [TrainSchedule(M, S, s).num_pipe_buffers() for s in range(S)]
    text = (f"Each stage held at most {list(held.values())} micro-batches at once, "
            + ("as min(S - s, M) predicts." if held == expected else f"where min(S - s, M) predicts {list(expected.values())}."))
    return "08.in_flight", "as predicted" if held == expected else "differs", text, {
        "held": str(held), "expected": str(expected), "buffers": str(buffers)}


# --- The real DeepSpeed, beside ours ---


def require_deepspeed(method: str | None = None) -> None:
    """Refuse before any process starts: DeepSpeed missing, or a method it does not implement."""
    if method is not None and method.lower() == "profile":
        raise ValueError("DeepSpeed does not implement partition_method='profile'; compare another method "
                         "('uniform', 'parameters' or 'type:REGEX')")
    if not deepspeed_available():
        raise ValueError('deepspeed is not installed; pip install -e ".[deepspeed]" to compare with it')


@dataclass(frozen=True, kw_only=True)
class PartitionsConfig(experiments.Config):
    """DeepSpeed's boundaries of `layers` for each (num_stages, method) in `cuts` (default ranks: their lcm)."""

    layers: list
    cuts: list[tuple[int, str]]
    world_size: int | None = None
    timeout: float = 300.0  # the first DeepSpeed run on a machine compiles an op

    def check(self) -> None:
        if isinstance(self.cuts, (str, tuple)) or not self.cuts:
            raise ValueError(f"cuts must be a list of (num_stages, partition_method) pairs, got {self.cuts!r}; "
                             "e.g. [(2, 'uniform'), (2, 'parameters')]")
        for cut in self.cuts:
            if not isinstance(cut, tuple) or len(cut) != 2:
                raise ValueError(f"each cut is a (num_stages, partition_method) pair, got {cut!r}; e.g. (2, 'uniform')")
            whole_number("num_stages", cut[0], example="(2, 'uniform')")
            require_deepspeed(check_method(cut[1]))
        if self.world_size is None:
            object.__setattr__(self, "world_size", math.lcm(*(s for s, _ in self.cuts)))
        super().check()


def partitions_worker(ctx: RankContext, cfg: PartitionsConfig) -> dict[tuple[int, str], list[int]]:
    """Build `deepspeed.pipe.PipelineModule` for each (num_stages, method); its boundaries."""
    import_deepspeed(ctx.backend)
    return deepspeed_partitions(cfg.layers, cfg.cuts)


def gather_partitions(cfg: PartitionsConfig, results: list[dict]) -> dict[tuple[int, str], list[int]]:
    return results[0]  # every rank built the same modules


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig(Config):
    """What `Config` trains, trained by DeepSpeed's own engine."""

    timeout: float = 300.0

    def check(self) -> None:
        super().check()
        require_deepspeed(self.module.partition_method)


@dataclass
class DeepSpeedRun:
    """What a `TrainRun` shows, done by DeepSpeed: partition, losses, final weights (per rank, our names)."""

    parts: list[int]
    losses: list[float]
    weights: list[dict[str, torch.Tensor]]


def deepspeed_worker(ctx: RankContext, cfg: DeepSpeedConfig) -> DeepSpeedRun:
    """The same layers, partition method, seeds, data and SGD through DeepSpeed's pipeline engine."""
    parts, losses, weights = deepspeed_train(import_deepspeed(ctx.backend), cfg.module, cfg.inputs, cfg.targets,
                                             cfg.num_microbatches, cfg.steps, cfg.lr, ctx.world_size)
    return DeepSpeedRun(parts, losses, [weights])


def gather_deepspeed(cfg: DeepSpeedConfig, results: list[DeepSpeedRun]) -> DeepSpeedRun:
    last = cfg.topology.get_rank(pipe=cfg.topology.get_dim("pipe") - 1, data=0)
    return DeepSpeedRun(results[0].parts, results[last].losses, [w for r in results for w in r.weights])


# --- What the lesson costs at a profile's size ---

# The parameters cell's defaults that `run_flops` reads.
DEFAULTS = dict(image_size=224, profile_batch=8, profile_repeats=3, profile_tries=1, width=256, num_microbatches=4,
                microbatch_size=16, steps=8)


def run_flops(params: dict) -> float:
    """FLOPs of lesson 08 at the notebook parameters `params` (missing: the defaults), counted on the
    meta device: AlexNet's measured profile and timed cuts, and the MLP's `steps` batches three times."""
    from pipelab.models import alexnet_layers

    p = {**DEFAULTS, **params}
    image = torch.empty(p["profile_batch"], 3, p["image_size"], p["image_size"], device="meta")
    passes = p["profile_tries"] * ((1 + p["profile_repeats"]) + p["profile_repeats"] * 4 * 2)
    width = p["width"]
    with torch.device("meta"):  # the lesson's MLP, never allocated
        mlp = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 8))
    rows = torch.empty(p["num_microbatches"] * p["microbatch_size"], width, device="meta")
    return (passes * modelled.chained_flops(alexnet_layers(num_classes=10), image)
            + 3 * p["steps"] * modelled.chained_flops([mlp], rows))

"""Lesson 08 from a notebook: AlexNet's cuts timed, the DeepSpeed-style engine trained on real
ranks, the real DeepSpeed beside it, and the verdicts the lesson concludes.

    cfg = deepspeed.Config(module=mlp, inputs=x, targets=y, num_microbatches=4, steps=8, lr=0.5)
    run = experiments.run(deepspeed.worker, cfg, deepspeed.gather)  # a TrainRun
    assert_same(run, reference_run(mlp.build_reference(), x, y, mlp.loss_fn, steps=8, lr=0.5))

A `TrainRun` names gradients and weights as `module.build_reference()` does. Where DeepSpeed is
installed, `PartitionsConfig` and `DeepSpeedConfig` ask the real `deepspeed.pipe` for the same
partitions and the same training.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pipelab import experiments
from pipelab.checks import divides, mean_loss, positive_number, same_batch, whole_number
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, compare, gather_steps, ratios, time_steps
from pipelab.pipeline.engine import PipelineEngine
from pipelab.pipeline.instructions import TrainSchedule
from pipelab.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from pipelab.pipeline.partition import (check_method, measure_partitions, partition_layers, slowest_stage,
                                        stage_sums)
from pipelab.pipeline.topology import PipeDataParallelTopology, ProcessTopology
from pipelab.timeline import Timeline
from pipelab.worker import RankContext

# ---------------------------------------------------------------------------------------------
# AlexNet's cuts, timed in this process
# ---------------------------------------------------------------------------------------------


@dataclass
class CutTimes:
    """Layers cut by each method into each number of stages, and every cut's stages timed."""

    cuts: dict[tuple[int, str], list[int]]  # (num_stages, method) -> boundaries
    stage_ms: dict[tuple[int, str], list[Measured]]  # (num_stages, method) -> per stage, every round (ms)
    layer_ms: list[float]  # per layer, the median forward+backward: the 'profile' method's weights

    @property
    def slowest(self) -> dict[tuple[int, str], Measured]:
        """Each cut's slowest stage, round by round: the pace of its pipeline."""
        return {key: slowest_stage(per_stage) for key, per_stage in self.stage_ms.items()}

    def speedup(self, num_stages: int = 2) -> Measured:
        """Round by round, the 'parameters' cut's slowest stage over the 'profile' cut's."""
        slowest = self.slowest
        return ratios(slowest[num_stages, "parameters"].values, slowest[num_stages, "profile"].values)

    def table(self) -> str:
        slowest = self.slowest
        lines = [f"{'stages':>6}  {'method':20s} {'boundaries':24s} slowest stage, ms: median (min-max)"]
        lines += [f"{S:>6}  {m:20s} {str(parts):24s} {slowest[S, m]:.0f}" for (S, m), parts in self.cuts.items()]
        return "\n".join(lines)


def time_cuts(layers: list, sample: torch.Tensor, layer_ms: list[float], methods: list[str],
              stage_counts: tuple[int, ...] = (2, 4), repeats: int = 3, tries: int = 1,
              warmup: int = 0) -> CutTimes:
    """Cut `layers` by each method ('profile' weighs a layer by `layer_ms`) into each of
    `stage_counts` stages, and time each distinct cut's stages on `sample` in the same rounds
    (`partition.measure_partitions`), the 'parameters' and 'profile' cuts of the fewest stages first,
    side by side, as `profile_verdict` compares them. No warm-up round by default: the layers have
    just been profiled."""
    whole_number("repeats", repeats, example="repeats=3")
    whole_number("tries", tries, example="tries=2")
    cuts = {(S, m): partition_layers(layers, S, m, profile=lambda: list(layer_ms))
            for S in stage_counts for m in methods}
    fewest = min(stage_counts)
    pair = [tuple(cuts[fewest, m]) for m in ("parameters", "profile") if (fewest, m) in cuts]
    distinct = list(dict.fromkeys(pair + sorted({tuple(parts) for parts in cuts.values()})))  # each cut once
    timed = measure_partitions(layers, distinct, sample, repeats=repeats, tries=tries, warmup=warmup)
    measured = {parts: [t.scaled(1e3) for t in per_stage] for parts, per_stage in zip(distinct, timed)}
    return CutTimes(cuts, {key: measured[tuple(parts)] for key, parts in cuts.items()}, list(layer_ms))


def speedup_verdict(speedup: Measured, new: str = "new cut", same_cut: bool = False,
                    min_rounds: int = 3) -> tuple[str, str]:
    """(verdict, phrase) for a round-by-round ratio "old cut's slowest stage / `new`'s": 'faster'
    only when every round says so, 'slower' likewise, else 'within noise' (or 'same cut')."""
    rounds = len(speedup.values)
    direction = compare(speedup, Measured.of([1.0]))  # 'higher': every round above 1
    if same_cut:
        return "same cut", "both methods chose the same cut, so there is nothing to compare"
    if rounds < min_rounds:
        return "within noise", (f"{rounds} round(s) ({speedup:.2f}x) are too few to tell a direction; "
                                f"measure at least {min_rounds}")
    if direction == "higher":
        return "faster", (f"in every one of the {rounds} rounds the {new}'s slowest stage was the faster, "
                          f"by {speedup:.2f}x (median, min-max over the rounds)")
    if direction == "lower":
        return "slower", (f"in every one of the {rounds} rounds the {new}'s slowest stage was the slower "
                          f"({speedup:.2f}x)")
    return "within noise", (f"the {rounds} rounds do not all agree ({speedup:.2f}x, median and min-max): this "
                            "machine's noise is as large as the effect, so read the prediction instead")


def profile_verdict(times: CutTimes, num_stages: int = 2) -> tuple[str, str, str, dict]:
    """(key, verdict, text, figures): did the 'profile' cut's slowest stage beat the 'parameters'
    cut's in every round, beside what the per-layer medians predict?"""
    by_params, by_profile = times.cuts[num_stages, "parameters"], times.cuts[num_stages, "profile"]
    slowest, speedup = times.slowest, times.speedup(num_stages)
    predicted = max(stage_sums(times.layer_ms, by_params)) / max(stage_sums(times.layer_ms, by_profile))
    verdict, how = speedup_verdict(speedup, "profile cut", same_cut=by_params == by_profile)
    params_ms, profile_ms = slowest[num_stages, "parameters"], slowest[num_stages, "profile"]
    text = (f"{num_stages} stages, slowest stage: parameters cut {by_params} {params_ms:.0f} ms, profile cut "
            f"{by_profile} {profile_ms:.0f} ms; {how}. Summed from the per-layer medians, the profile "
            f"predicts {predicted:.2f}x.")
    return "08.profile_vs_parameters", verdict, text, {"speedup": speedup, "predicted": predicted,
                                                       "parameters_ms": params_ms, "profile_ms": profile_ms}


# ---------------------------------------------------------------------------------------------
# The engine on real ranks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """One training run of the engine: `steps` SGD steps (learning rate `lr`) on the same batch,
    each replica's share cut into `num_microbatches`. `world_size` defaults to the module's
    topology, else one rank per stage; a larger multiple of num_stages adds data-parallel replicas."""

    module: PipelineModule
    inputs: torch.Tensor
    targets: torch.Tensor
    num_microbatches: int
    steps: int = 1
    lr: float = 0.1
    world_size: int | None = None

    @property
    def topology(self) -> ProcessTopology:
        """The pipe x data grid: the module's own, else num_stages x (world_size / num_stages)."""
        S = self.module.num_stages
        return self.module._topo or PipeDataParallelTopology(num_pp=S, num_dp=self.world_size // S)

    def check(self) -> None:
        # The module first: the default world size is read off it.
        module = self.module
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
        dp, M = self.world_size // S, self.num_microbatches
        for name, t in (("inputs", self.inputs), ("targets", self.targets)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor with one row per sample, got {type(t).__name__}")
        batch = same_batch(self.inputs, self.targets)
        divides("batch", batch, "num_microbatches" if dp == 1 else f"num_microbatches x {dp} replicas", dp * M)


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
    engine = PipelineEngine(ctx, cfg.module, topology, M, cfg.lr)
    dp, replica = topology.get_dim("data"), topology.get_coord(ctx.rank).data
    x, y = cfg.inputs.chunk(dp)[replica], cfg.targets.chunk(dp)[replica]
    data = list(zip(x.chunk(M), y.chunk(M)))
    measured = time_steps(ctx, lambda _: (engine.train_batch(data), engine.micro_batch_losses), cfg.steps)
    weights = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return Result(ctx.rank, engine.stage_id, [loss for loss, _ in measured.results],
                  [list(mbs) for _, mbs in measured.results], engine.step_grads, weights, measured)


@dataclass
class TrainRun(TimedSteps):
    """A pipelined training run, gathered from every rank. Gradients and weights are named as in
    `module.build_reference()` (layer index first: "2.weight")."""

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
    """Per rank, the most micro-batches it held at once: forwards begun whose backward had not
    yet ended (each one fills a pipe buffer until its backward frees it), read off the timeline."""
    peaks = {}
    for rank in timeline.ranks:
        held = peak = 0
        for span in sorted(timeline.filter(rank=rank, lane="compute"), key=lambda s: s.start):
            held += {"F": 1, "B": -1}.get(span.kind, 0)
            peak = max(peak, held)
        peaks[rank] = peak
    return peaks


def in_flight_verdict(run: TrainRun) -> tuple[str, str, str, dict]:
    """(key, verdict, text, figures): did each stage of a pipeline hold at most min(S - s, M)
    micro-batches at once (1F1B's bound), as counted on the run's timeline?"""
    S, M = run.topology.get_dim("pipe"), run.num_microbatches
    held = peak_in_flight(run.timeline)
    expected = {s: min(S - s, M) for s in range(S)}
    buffers = [TrainSchedule(M, S, s).num_pipe_buffers() for s in range(S)]
    text = (f"on a typical batch each stage held at most {list(held.values())} micro-batches at once "
            f"(stages 0..{S - 1}), against min(S - s, M) = {list(expected.values())}, in {buffers} pipe buffers.")
    return "08.in_flight", "as predicted" if held == expected else "differs", text, {
        "held": str(held), "expected": str(expected)}


# ---------------------------------------------------------------------------------------------
# The real DeepSpeed, beside ours
# ---------------------------------------------------------------------------------------------


def deepspeed_available() -> bool:
    """True when `import deepspeed` works here (`pip install -e ".[deepspeed]"`)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def require_deepspeed() -> None:
    if not deepspeed_available():
        raise ValueError('deepspeed is not installed; pip install -e ".[deepspeed]" to compare with it')


def no_profile(method: str) -> None:
    if method.lower() == "profile":
        raise ValueError("DeepSpeed does not implement partition_method='profile'; compare another method "
                         "('uniform', 'parameters' or 'type:REGEX')")


def check_cuts(cuts) -> None:
    """Each cut is (num_stages, method) with a method DeepSpeed implements."""
    if isinstance(cuts, (str, tuple)) or not cuts:
        raise ValueError(f"cuts must be a list of (num_stages, partition_method) pairs, got {cuts!r}; "
                         "e.g. [(2, 'uniform'), (2, 'parameters')]")
    for cut in cuts:
        if not isinstance(cut, tuple) or len(cut) != 2:
            raise ValueError(f"each cut is a (num_stages, partition_method) pair, got {cut!r}; e.g. (2, 'uniform')")
        whole_number("num_stages", cut[0], example="(2, 'uniform')")
        no_profile(check_method(cut[1]))


@dataclass(frozen=True, kw_only=True)
class PartitionsConfig(experiments.Config):
    """Ask `deepspeed.pipe.PipelineModule` for its boundaries of `layers` for each (num_stages,
    method) in `cuts` ('uniform', 'parameters' or 'type:REGEX'), on `world_size` ranks (by default
    the least common multiple of the stage counts)."""

    layers: list
    cuts: list[tuple[int, str]]
    world_size: int | None = None
    timeout: float = 300.0  # the first DeepSpeed run on a machine compiles an op

    def check(self) -> None:
        check_cuts(self.cuts)  # first: the default world size is read off them
        if self.world_size is None:
            object.__setattr__(self, "world_size", math.lcm(*(s for s, _ in self.cuts)))
        super().check()
        require_deepspeed()


def partitions_worker(ctx: RankContext, cfg: PartitionsConfig) -> dict[tuple[int, str], list[int]]:
    """Build `deepspeed.pipe.PipelineModule` for each (num_stages, method); its boundaries."""
    import contextlib
    import io

    _import_deepspeed(ctx)
    like = PipelineModule(cfg.layers, num_stages=1, partition_method="uniform", verbose=False)
    parts = {}
    for num_stages, method in cfg.cuts:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints every stage table
            module = _deepspeed_module(cfg.layers, num_stages, method, like)
        parts[num_stages, method] = [int(p) for p in module.parts]
    return parts


def gather_partitions(cfg: PartitionsConfig, results: list[dict]) -> dict[tuple[int, str], list[int]]:
    return results[0]


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig(Config):
    """What `Config` trains, trained by DeepSpeed's own engine."""

    timeout: float = 300.0

    def check(self) -> None:
        super().check()
        no_profile(self.module.partition_method)
        require_deepspeed()


@dataclass
class DeepSpeedResult:
    rank: int
    parts: list[int]
    losses: list[float]
    weights: dict[str, torch.Tensor]


@dataclass
class DeepSpeedRun:
    """What a `TrainRun` shows, done by DeepSpeed: its partition, losses and final weights."""

    parts: list[int]
    losses: list[float]
    weights: list[dict[str, torch.Tensor]]  # per rank, named as our stages name them


def to_deepspeed_layers(layers: list) -> list:
    """Our layer list with each LayerSpec / TiedLayerSpec rewritten as DeepSpeed's own."""
    from deepspeed.pipe import LayerSpec as DSLayerSpec, TiedLayerSpec as DSTiedLayerSpec

    out = []
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            out.append(DSTiedLayerSpec(layer.key, layer.typename, *layer.module_args, forward_fn=layer.forward_fn,
                                       tied_weight_attr=layer.tied_weight_attr, **layer.module_kwargs))
        elif isinstance(layer, LayerSpec):
            out.append(DSLayerSpec(layer.typename, *layer.module_args, **layer.module_kwargs))
        else:
            out.append(layer)
    return out


def _import_deepspeed(ctx: RankContext):
    """Import DeepSpeed in a worker, quietly, and have it adopt the process group we started."""
    import logging
    import os
    import warnings

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, rather than have DeepSpeed warn
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    # DeepSpeed broadcasts tied weights that require grad; autograd warns about it, harmlessly.
    warnings.filterwarnings("ignore", message="c10d::broadcast_")
    deepspeed.init_distributed(dist_backend=ctx.backend)
    return deepspeed


def _deepspeed_module(layers: list, num_stages: int, method: str, like: PipelineModule):
    """`deepspeed.pipe.PipelineModule` on our layers, with `like`'s loss, seeds and checkpointing."""
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    return DSPipelineModule(
        to_deepspeed_layers(layers), num_stages=num_stages, loss_fn=like.loss_fn, partition_method=method,
        base_seed=like.base_seed, seed_layers=like.seed_layers,
        activation_checkpoint_interval=like.activation_checkpoint_interval,
        # DeepSpeed's own seeding passes a numpy integer to random.seed, which Python 3.11 refuses.
        seed_fn=lambda seed: torch.manual_seed(int(seed)))


def deepspeed_worker(ctx: RankContext, cfg: DeepSpeedConfig) -> DeepSpeedResult:
    """The same layers, partition method, seeds, data and SGD through `deepspeed.pipe.PipelineModule`
    and DeepSpeed's pipeline engine."""
    deepspeed = _import_deepspeed(ctx)
    module, M = cfg.module, cfg.num_microbatches
    ds_module = _deepspeed_module(module._layer_specs, module.num_stages, module.partition_method, module)
    optimizer = torch.optim.SGD(ds_module.parameters(), lr=cfg.lr)
    dp = ctx.world_size // module.num_stages
    micro = cfg.inputs.shape[0] // (dp * M)
    config = {"train_batch_size": micro * M * dp, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": M, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=ds_module, optimizer=optimizer, config=config)
    replica = engine.grid.get_data_parallel_rank()
    x, y = cfg.inputs.chunk(dp)[replica], cfg.targets.chunk(dp)[replica]
    data = list(zip(x.chunk(M), y.chunk(M)))
    losses = [float(engine.train_batch(iter(data))) for _ in range(cfg.steps)]
    weights = {n: p.detach().cpu().clone() for n, p in ds_module.named_parameters()}
    return DeepSpeedResult(ctx.rank, [int(p) for p in ds_module.parts], losses, weights)


def gather_deepspeed(cfg: DeepSpeedConfig, results: list[DeepSpeedResult]) -> DeepSpeedRun:
    topology = cfg.topology
    last = topology.get_rank(pipe=topology.get_dim("pipe") - 1, data=0)
    return DeepSpeedRun(results[0].parts, results[last].losses, [r.weights for r in results])

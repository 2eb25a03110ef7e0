"""Lesson 08 from a notebook: AlexNet's cuts timed (modelled on an emulated device, or measured),
the DeepSpeed-style engine trained on real ranks, the real DeepSpeed beside it, and the verdicts the
lesson concludes.

    cfg = deepspeed.Config(module=mlp, inputs=x, targets=y, num_microbatches=4, steps=8, lr=0.5)
    run = experiments.run(deepspeed.worker, cfg, deepspeed.gather)  # a TrainRun
    assert_same(run, reference_run(mlp.build_reference(), x, y, mlp.loss_fn, steps=8, lr=0.5))

A `TrainRun` names gradients and weights as `module.build_reference()` does. Where DeepSpeed is
installed, `PartitionsConfig` and `DeepSpeedConfig` ask the real `deepspeed.pipe` for the same
partitions and the same training.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn as nn

from pipelab import experiments
from pipelab.checks import divides, mean_loss, positive_number, same_batch, whole_number
from pipelab.emulate.cost import meta_module, stage_seconds, to_meta
from pipelab.emulate.specs import torch_dtype
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, compare, gather_steps, ratios, time_steps
from pipelab.pipeline.engine import PipelineEngine
from pipelab.pipeline.instructions import TrainSchedule
from pipelab.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from pipelab.pipeline.partition import (check_method, layer_name, measure_partitions, partition_layers,
                                        profile_layers, slowest_stage, stage_sums)
from pipelab.pipeline.topology import PipeDataParallelTopology, ProcessTopology
from pipelab.timeline import Timeline
from pipelab.worker import RankContext

# ---------------------------------------------------------------------------------------------
# AlexNet's cuts: each layer's time modelled on an emulated device, or measured in this process
# ---------------------------------------------------------------------------------------------


class Apply(nn.Module):
    """A plain function of one tensor (or a tied module's `forward_fn`) as a module, so that the
    cost model can count it; `module`, if given, is what the function uses (its weights count)."""

    def __init__(self, fn, module: nn.Module | None = None):
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, x):
        return self.fn(x) if self.module is None else self.fn(self.module, x)


def counted_layer(layer) -> nn.Module:
    """A META copy of `layer` to count (a spec built there, a function wrapped, the caller's layer
    untouched), in-place operators made out-of-place: they move the same bytes, and the counted
    input is a leaf, which autograd does not let an operator overwrite."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            built = layer.build()
        forward_fn = getattr(layer, "forward_fn", None)
        module = built if forward_fn is None else Apply(forward_fn, built)
    elif isinstance(layer, nn.Module):
        module = copy.deepcopy(meta_module(layer))
    else:
        module = Apply(layer)
    for m in module.modules():
        if getattr(m, "inplace", False):
            m.inplace = False
    return module


def modelled_layer_seconds(layers: list, example: torch.Tensor, device, dtype="float32") -> list[dict[str, float]]:
    """Each layer's modelled F, B, I and W seconds on `device` (an `emulate.specs.Device`) in
    `dtype` for one micro-batch shaped like `example` (a META tensor will do), each layer fed the one
    before's output. Counted on the meta device (`emulate.cost.stage_seconds`): any size costs no
    memory, and the same layers always get the same times."""
    x, seconds = to_meta(example), []
    for layer in layers:
        module = counted_layer(layer)
        seconds.append(stage_seconds(module, x, device, dtype))
        with torch.no_grad():
            x = module(x)
    return seconds


def layer_profile(layers: list, sample: torch.Tensor, device=None, dtype="float32", repeats: int = 3,
                  tries: int = 1) -> list[Measured]:
    """Each layer's forward+backward milliseconds, the 'profile' method's weights: modelled on
    `device` (an emulated node's `specs.Device`; one exact value per layer) or, with device=None,
    measured here on `sample` (`partition.profile_layers`: `repeats` rounds, each layer's time in
    a round the fastest of `tries` runs)."""
    if device is not None:
        return [Measured.of([1e3 * (s["F"] + s["B"])]) for s in modelled_layer_seconds(layers, sample, device, dtype)]
    return [t.scaled(1e3) for t in profile_layers(layers, sample, repeats=repeats, tries=tries)]


@dataclass
class CutTimes:
    """Layers cut by each method into each number of stages, and every cut's stage times: measured
    in rounds, or `modelled` (one exact value per stage)."""

    cuts: dict[tuple[int, str], list[int]]  # (num_stages, method) -> boundaries
    stage_ms: dict[tuple[int, str], list[Measured]]  # (num_stages, method) -> per stage, every round (ms)
    layer_ms: list[float]  # per layer, forward+backward: the 'profile' method's weights
    modelled: bool = False

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
        how = "modelled" if self.modelled else "median (min-max)"
        lines = [f"{'stages':>6}  {'method':20s} {'boundaries':24s} slowest stage, ms: {how}"]
        lines += [f"{S:>6}  {m:20s} {str(parts):24s} {slowest[S, m]:.4g}" for (S, m), parts in self.cuts.items()]
        return "\n".join(lines)


def _cuts(layers: list, layer_ms: list[float], methods: list[str], stage_counts) -> dict:
    return {(S, m): partition_layers(layers, S, m, profile=lambda: list(layer_ms)) for S in stage_counts for m in methods}


def model_cuts(layers: list, layer_ms: list[float], methods: list[str], stage_counts: tuple[int, ...] = (2, 4)) -> CutTimes:
    """Cut `layers` by each method ('profile' weighs a layer by its modelled `layer_ms`) into each
    of `stage_counts` stages; a stage's modelled time is the sum of its layers' (the device runs
    them one after another), so it cannot vary from run to run."""
    cuts = _cuts(layers, layer_ms, methods, stage_counts)
    stage_ms = {key: [Measured.of([ms]) for ms in stage_sums(layer_ms, parts)] for key, parts in cuts.items()}
    return CutTimes(cuts, stage_ms, list(layer_ms), modelled=True)


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
    cuts = _cuts(layers, layer_ms, methods, stage_counts)
    fewest = min(stage_counts)
    pair = [tuple(cuts[fewest, m]) for m in ("parameters", "profile") if (fewest, m) in cuts]
    distinct = list(dict.fromkeys(pair + sorted({tuple(parts) for parts in cuts.values()})))  # each cut once
    timed = measure_partitions(layers, distinct, sample, repeats=repeats, tries=tries, warmup=warmup)
    measured = {parts: [t.scaled(1e3) for t in per_stage] for parts, per_stage in zip(distinct, timed)}
    return CutTimes(cuts, {key: measured[tuple(parts)] for key, parts in cuts.items()}, list(layer_ms))


def lightest_heaviest(weights: list[float], num_stages: int) -> tuple[float, list[int]]:
    """The lightest heaviest stage any cut of `weights` into `num_stages` non-empty contiguous
    stages reaches, and that cut (the earliest on a tie): what a partition that balances the
    pipeline's pace would choose. DeepSpeed's `partition_balanced` minimises heaviest minus
    lightest instead, which need not give the same cut."""
    whole_number("num_stages", num_stages, example="num_stages=2")
    n = len(weights)
    if n < num_stages:
        raise ValueError(f"{n} layers cannot fill {num_stages} non-empty stages; use at most {n} stages")
    prefix = [0.0, *accumulate(float(w) for w in weights)]
    best = {(0, 0): (0.0, [0])}  # (layers, stages) -> (heaviest, boundaries) of the best cut
    for j in range(1, num_stages + 1):
        for i in range(j, n - (num_stages - j) + 1):
            best[i, j] = min(((max(best[k, j - 1][0], prefix[i] - prefix[k]), best[k, j - 1][1] + [i])
                              for k in range(j - 1, i) if (k, j - 1) in best), key=lambda option: option[0])
    return best[n, num_stages]


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


def modelled_verdict(speedup: float, same_cut: bool) -> tuple[str, str]:
    """(verdict, phrase) for a modelled ratio "parameters cut's slowest stage / profile cut's": exact,
    so one value decides."""
    if same_cut:
        return "same cut", "both methods chose the same cut, so there is nothing to compare"
    if speedup == 1:
        return "as fast", "their slowest stages take the same modelled time"
    word = "faster" if speedup > 1 else "slower"
    return word, f"the profile cut's slowest stage is the {word}, by {speedup:.2f}x (modelled, exactly)"


def _spread(weights: list[float], parts: list[int]) -> float:
    sums = stage_sums(weights, parts)
    return max(sums) - min(sums)


def why_not_profile(times: CutTimes, num_stages: int, winner: str) -> str:
    """Why the `winner` method's slowest stage beat the 'profile' cut's, from the figures: by the
    profile's own weights (DeepSpeed's rule balances the spread, not the heaviest stage), or, when
    the weights predicted the opposite, measurement (layers timed alone, this machine's noise)."""
    S, w = num_stages, times.layer_ms
    mine, theirs = times.cuts[S, "profile"], times.cuts[S, winner]
    predicted_mine, predicted_theirs = max(stage_sums(w, mine)), max(stage_sums(w, theirs))
    if predicted_theirs < predicted_mine:
        best_ms, best_cut = lightest_heaviest(w, S)
        tie = " (a tie, which it breaks toward the later cut)" if _spread(w, mine) == _spread(w, theirs) else ""
        return (f"The profile's own layer times say so too ({winner} {predicted_theirs:.4g} ms against profile "
                f"{predicted_mine:.4g} ms): partition_balanced, as DeepSpeed's, picks the cut with the smallest "
                f"heaviest-minus-lightest ({_spread(w, mine):.4g} ms for the profile cut, {_spread(w, theirs):.4g} ms "
                f"for the {winner} cut{tie}), not the lightest heaviest stage; that is {best_cut}, at {best_ms:.4g} ms.")
    slowest = times.slowest
    gap = slowest[S, "profile"].median / slowest[S, winner].median - 1
    noise = max(t.relative_spread for t in slowest.values())
    rounds = min(len(t.values) for t in slowest.values())
    moved = (f"a slowest stage moved by up to {noise:.0%} of its median between rounds on this machine" if rounds > 1
             else "one round cannot tell this machine's noise from the effect")
    return (f"By the layer times taken one at a time the profile cut should have won (slowest stage summed: "
            f"{predicted_mine:.4g} ms against {winner} {predicted_theirs:.4g} ms), but run whole, its slowest stage "
            f"took {gap:.0%} longer than the {winner} cut's: layers timed alone do not add up to a stage, and "
            f"{moved}.")


def profile_verdict(times: CutTimes, num_stages: int = 2) -> tuple[str, str, str, dict]:
    """(key, verdict, text, figures) for `num_stages` stages: is the 'profile' cut's slowest stage
    faster than the 'parameters' cut's (modelled: exactly; measured: in every round)? The text
    gives every method's slowest stage and, where another method beat 'profile', why."""
    S = num_stages
    by_params, by_profile = times.cuts[S, "parameters"], times.cuts[S, "profile"]
    slowest, speedup = {m: t for (s, m), t in times.slowest.items() if s == S}, times.speedup(S)
    predicted = max(stage_sums(times.layer_ms, by_params)) / max(stage_sums(times.layer_ms, by_profile))
    if times.modelled:
        verdict, how = modelled_verdict(speedup.median, same_cut=by_params == by_profile)
    else:
        verdict, how = speedup_verdict(speedup, "profile cut", same_cut=by_params == by_profile)
    each = ", ".join(f"{m} {t:.4g}" for m, t in slowest.items())
    text = (f"{S} stages, slowest stage ({'modelled' if times.modelled else 'measured'}, ms): {each}. "
            f"Parameters cut {by_params} against profile cut {by_profile}: {how}.")
    if not times.modelled:
        text += f" Summed from the per-layer medians, the profile predicts {predicted:.2f}x."
    winner = min(slowest, key=lambda m: (slowest[m].median, m != "profile"))
    best_ms, best_cut = lightest_heaviest(times.layer_ms, S)
    if winner != "profile":
        text += " The " + winner + " cut's slowest stage beat the profile's. " + why_not_profile(times, S, winner)
    elif max(stage_sums(times.layer_ms, by_profile)) > best_ms * (1 + 1e-9):
        text += (f" No method's slowest stage beat the profile's, yet by the profile's own weights its heaviest "
                 f"stage sums to {max(stage_sums(times.layer_ms, by_profile)):.4g} ms where the cut {best_cut} "
                 f"would give {best_ms:.4g} ms: partition_balanced minimises heaviest minus lightest.")
    else:
        text += " No method's slowest stage beat the profile's, and by its weights no cut of whole layers could."
    return f"08.profile_{S}_stages", verdict, text, {
        "speedup": speedup, "predicted": predicted, "parameters_ms": slowest["parameters"],
        "profile_ms": slowest["profile"], "fastest": winner, "best_possible_ms": best_ms}


def contrast_verdict(here: CutTimes, emulated: CutTimes, layers: list, device_name: str,
                     kind: str = "Conv2d") -> tuple[str, str, str, dict]:
    """(key, verdict, text, figures): the same cuts measured on this machine's cores (`here`) beside
    their modelled times on the emulated device (`emulated`). What differs: where each profile cuts
    (the share of the time in the `kind` layers), which method's slowest stage was the fastest here
    and, where not the profile's, why; and the measured rounds' spread, which a model does not have."""
    which = [i for i, layer in enumerate(layers) if layer_name(layer) == kind]
    share_here = sum(here.layer_ms[i] for i in which) / sum(here.layer_ms)
    share_there = sum(emulated.layer_ms[i] for i in which) / sum(emulated.layer_ms)
    noise = max(t.relative_spread for t in here.slowest.values())
    rounds = min(len(t.values) for t in here.slowest.values())
    counts = sorted({S for S, _ in here.cuts})
    text = (f"The {len(which)} {kind} layers take {share_here:.0%} of the layer time measured here and "
            f"{share_there:.0%} of the {device_name}'s modelled time.")
    for S in counts:
        slowest = {m: t for (s, m), t in here.slowest.items() if s == S}
        winner = min(slowest, key=lambda m: (slowest[m].median, m != "profile"))
        text += (f" {S} stages: the profile cuts at {here.cuts[S, 'profile']} here and at {emulated.cuts[S, 'profile']} "
                 f"on the {device_name}; the fastest slowest stage here is the {winner} cut's ({slowest[winner]:.4g} ms).")
        if winner != "profile":
            text += " " + why_not_profile(here, S, winner)
    if rounds < 2:
        text += " One measured round cannot show how much a measurement moves; a modelled one never does."
        verdict = "one round"
    else:
        text += (f" Measured here, a cut's slowest stage moved by up to {noise:.0%} of its median between rounds; "
                 f"modelled, it is the same on every run.")
        verdict = "noisier than modelled" if noise > 0 else "as steady as modelled"
    return "08.profile_here_and_emulated", verdict, text, {
        "share_here": share_here, "share_emulated": share_there, "spread_here": noise}


# ---------------------------------------------------------------------------------------------
# The engine on real ranks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """One training run of the engine: `steps` SGD steps (learning rate `lr`) on the same batch,
    each replica's share cut into `num_microbatches`. `world_size` defaults to the module's
    topology, else one rank per stage; a larger multiple of num_stages adds data-parallel replicas.

    On an emulated node (`emulate="2xH100-nvlink"`) each stage's forward and backward last what the
    same layers take at the emulated size: `emulated_layers` (the module's layer list, wider), on
    micro-batches like `emulated_microbatch` (a META tensor will do), in `emulated_dtype`; its
    messages are timed at that size too. Off an emulated node these three are not used."""

    module: PipelineModule
    inputs: torch.Tensor
    targets: torch.Tensor
    num_microbatches: int
    steps: int = 1
    lr: float = 0.1
    world_size: int | None = None
    emulated_layers: list | None = None
    emulated_microbatch: torch.Tensor | None = None
    emulated_dtype: str = "float32"

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
        self.check_emulated()

    def check_emulated(self) -> None:
        """On an emulated node the stages' compute needs the layers at the emulated size."""
        layers, microbatch = self.emulated_layers, self.emulated_microbatch
        if self.emulate is not None and (layers is None or microbatch is None):
            raise ValueError(f"emulate={self.emulate!r} times each stage at the emulated size: give "
                             "emulated_layers= (the module's layer list at that size) and emulated_microbatch= "
                             "(one micro-batch there, e.g. torch.empty(1024, 4096, device='meta')), or leave emulate out")
        if layers is not None and len(layers) != len(self.module):
            raise ValueError(f"emulated_layers has {len(layers)} layers and the module {len(self.module)}: give "
                             "the module's own layer list at the emulated size, layer for layer")


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
    emulate_stage(ctx, cfg, topology.get_coord(ctx.rank).pipe)
    engine = PipelineEngine(ctx, cfg.module, topology, M, cfg.lr)
    dp, replica = topology.get_dim("data"), topology.get_coord(ctx.rank).data
    x, y = cfg.inputs.chunk(dp)[replica], cfg.targets.chunk(dp)[replica]
    data = list(zip(x.chunk(M), y.chunk(M)))
    measured = time_steps(ctx, lambda _: (engine.train_batch(data), engine.micro_batch_losses), cfg.steps)
    weights = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return Result(ctx.rank, engine.stage_id, [loss for loss, _ in measured.results],
                  [list(mbs) for _, mbs in measured.results], engine.step_grads, weights, measured)


def activation_bytes(layers: list, example: torch.Tensor, upto: int, dtype=None) -> int:
    """Bytes of what layer `upto` receives (what the first `upto` layers make of `example`), counted
    on the meta device, its floating values in `dtype` if given."""
    x = to_meta(example)
    with torch.no_grad():
        for layer in layers[:upto]:
            x = counted_layer(layer)(x)
    return x.numel() * (torch_dtype(dtype).itemsize if dtype is not None and x.is_floating_point() else x.element_size())


def emulate_stage(ctx: RankContext, cfg: Config, stage: int) -> None:
    """On an emulated node, time this stage by its modelled F and B seconds: its layers at the emulated size
    one after another (`modelled_layer_seconds`); its messages are timed at that size too (the
    activations it sends, or on the last stage receives). None elsewhere: spans take what they take."""
    if ctx.emulator is None or cfg.emulated_layers is None:
        return
    from pipelab.emulate.table import stage_table

    parts, S = cfg.module.partitions(), cfg.module.num_stages
    lo, hi = parts[stage], parts[stage + 1]
    seconds = modelled_layer_seconds(cfg.emulated_layers[:hi], cfg.emulated_microbatch, ctx.emulator.node.device,
                                     cfg.emulated_dtype)[lo:]
    boundary = hi if stage < S - 1 else lo
    real_microbatch = cfg.inputs[: cfg.inputs.shape[0] // (cfg.topology.get_dim("data") * cfg.num_microbatches)]
    ctx.emulator.scale_messages(activation_bytes(cfg.emulated_layers, cfg.emulated_microbatch, boundary, cfg.emulated_dtype),
                                activation_bytes(cfg.module._layer_specs, real_microbatch, boundary))
    ctx.emulator.use(stage_table({stage: {kind: sum(s[kind] for s in seconds) for kind in ("F", "B")}}))


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


# ---------------------------------------------------------------------------------------------
# What the lesson costs at a profile's size
# ---------------------------------------------------------------------------------------------


def run_flops(layers: list, image_size: int, profile_batch: int, profile_repeats: int, profile_tries: int,
              width: int, num_microbatches: int, microbatch_size: int, steps: int, methods: int = 4,
              stage_counts: int = 2) -> float:
    """FLOPs of the lesson's run with its profile's figures measured (a GPU node), counted on the
    meta device: AlexNet's (`layers`) forward and backward on `profile_batch` images, once per
    round of the layer profile (a warm-up and `profile_repeats` rounds) and once per cut and round
    of `time_cuts` (at most `methods` x `stage_counts` distinct cuts), each `profile_tries` times;
    and the MLP's `steps` batches three times (the engine, one process, DeepSpeed). The tied
    model's are too small to count. What the `gpu` profile's time budget is estimated from."""
    from pipelab.emulate.cost import forward_backward_counts

    image = torch.empty(profile_batch, 3, image_size, image_size, device="meta")
    alexnet = sum(sum(c.flops for c in forward_backward_counts(layer, x))
                  for layer, x in zip(*_chained([counted_layer(l) for l in layers], image)))
    passes = profile_tries * ((1 + profile_repeats) + profile_repeats * methods * stage_counts)
    with torch.device("meta"):  # the lesson's MLP, never allocated
        mlp = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 8))
    rows = torch.empty(num_microbatches * microbatch_size, width, device="meta")
    step = sum(c.flops for c in forward_backward_counts(mlp, rows))
    return passes * alexnet + 3 * steps * step


def _chained(modules: list, x: torch.Tensor) -> tuple[list, list]:
    """The modules and the input each receives when they run one after another from `x`."""
    inputs = []
    with torch.no_grad():
        for module in modules:
            inputs.append(x)
            x = module(x)
    return modules, inputs

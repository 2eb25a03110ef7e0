"""A layer list cut by each partition method into each number of stages, and every cut's stage
times: measured side by side in rounds (`partition.measure_partitions`), or summed from modelled
layer times. Lesson 08 compares the cuts by their slowest stage, the pace of a pipeline, and
`lightest_heaviest` says what the best cut of whole layers by that measure would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pipelab.checks import whole_number
from pipelab.measure import Measured, ratios
from pipelab.pipeline.partition import measure_partitions, partition_layers, slowest_stage, stage_sums


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
        """Each cut: its boundaries, its slowest stage, and by the profile's weights its heaviest
        minus lightest stage (what `partition_balanced` minimises)."""
        slowest = self.slowest
        how = "modelled" if self.modelled else "measured, median (min-max)"
        lines = [f"{'stages':>6}  {'method':20s} {'boundaries':24s} {'heaviest - lightest':>19}  slowest stage, ms ({how})"]
        lines += [f"{S:>6}  {m:20s} {str(parts):24s} {spread(self.layer_ms, parts):>19.4g}  {slowest[S, m]:.4g}"
                  for (S, m), parts in self.cuts.items()]
        return "\n".join(lines)


def spread(weights: list[float], parts: list[int]) -> float:
    """Heaviest minus lightest stage of the cut `parts` of `weights`."""
    sums = stage_sums(weights, parts)
    return max(sums) - min(sums)


def _cuts(layers: list, layer_ms: list[float], methods: list[str], stage_counts) -> dict:
    return {(S, m): partition_layers(layers, S, m, profile=lambda: list(layer_ms)) for S in stage_counts for m in methods}


def model_cuts(layers: list, layer_ms: list[float], methods: list[str], stage_counts: tuple[int, ...] = (2, 4)) -> CutTimes:
    """Cut `layers` by each method ('profile' weighs a layer by its modelled `layer_ms`) into each
    of `stage_counts` stages; a stage's modelled time is the sum of its layers'."""
    cuts = _cuts(layers, layer_ms, methods, stage_counts)
    stage_ms = {key: [Measured.of([ms]) for ms in stage_sums(layer_ms, parts)] for key, parts in cuts.items()}
    return CutTimes(cuts, stage_ms, list(layer_ms), modelled=True)


def time_cuts(layers: list, sample: torch.Tensor, layer_ms: list[float], methods: list[str],
              stage_counts: tuple[int, ...] = (2, 4), repeats: int = 3, tries: int = 1,
              warmup: int = 0) -> CutTimes:
    """Cut `layers` by each method ('profile' weighs a layer by `layer_ms`) into each of
    `stage_counts` stages, and time each distinct cut's stages on `sample` in the same rounds
    (`partition.measure_partitions`), the fewest stages' 'parameters' and 'profile' cuts first.
    No warm-up round by default: the layers have just been profiled."""
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
    stages reaches, and that cut (the earliest on a tie). DeepSpeed's `partition_balanced`
    minimises heaviest minus lightest instead, which need not give the same cut."""
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

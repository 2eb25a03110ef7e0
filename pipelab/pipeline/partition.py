"""Cut a flat list of layers into pipeline stages, the way DeepSpeed does.

A partition is a list of ``num_parts + 1`` boundaries: stage ``s`` owns layers
``parts[s]`` up to (not including) ``parts[s + 1]``. The results, tie rules and
edge cases match ``deepspeed.runtime.utils.partition_uniform`` and
``partition_balanced`` (the dynamic-programming version).

The methods of ``PipelineModule(partition_method=...)``:

* ``"uniform"``: the same number of layers per stage;
* ``"parameters"``: balance the trainable parameters per stage;
* ``"type:REGEX"``: balance the number of layers whose class name matches REGEX;
* ``"profile"``: balance measured forward+backward time per layer (DeepSpeed names this method
  but raises ``NotImplementedError`` for it).

``split_model`` cuts a ``nn.Sequential`` into stage modules directly (lessons 06 and 07).
"""
from __future__ import annotations

import math
import re
import statistics
import time
from itertools import accumulate
from typing import Callable, Sequence

import torch
import torch.nn as nn

from pipelab.checks import whole_number
from pipelab.hardware import synchronize
from pipelab.measure import Measured
from pipelab.models import trainable_parameters

METHODS = ("uniform", "parameters", "type:REGEX", "profile")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal-count stages; the first ``num_items % num_parts`` stages get one extra item."""
    whole_number("num_parts", num_parts, example="num_stages=2")
    if num_items <= num_parts:
        # More stages than layers: one layer per stage, trailing stages empty.
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous stages whose heaviest-minus-lightest total weight is smallest.

    The linear-partition dynamic programme: ``cost[i][j]`` is the best spread (heaviest stage
    minus lightest) of the first ``i`` items cut into ``j`` stages, found by trying every start
    ``k`` of the last stage. On ties the latest ``k`` wins, as in DeepSpeed, so zero-weight
    layers go to the earlier stage. With no more items than parts it falls back to uniform.
    """
    whole_number("num_parts", num_parts, example="num_stages=2")
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0, *accumulate(float(w) for w in weights)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    heavy = [[inf] * (m + 1) for _ in range(n + 1)]  # heaviest stage of that best cut
    light = [[inf] * (m + 1) for _ in range(n + 1)]  # lightest stage of that best cut
    start = [[0] * (m + 1) for _ in range(n + 1)]  # where its last stage starts
    cost[0][0], heavy[0][0] = 0.0, 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                last = prefix[i] - prefix[k]
                hi, lo = max(heavy[k][j - 1], last), min(light[k][j - 1], last)
                if cost[i][j] >= hi - lo:
                    cost[i][j], heavy[i][j], light[i][j], start[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(start[parts[-1]][j])
    return parts[::-1]


def split_model(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """Cut a Sequential into `num_stages` consecutive stages with (nearly) equal numbers of
    parameterised layers; a parameter-free layer (an activation) stays with the layer before it."""
    whole_number("num_stages", num_stages)
    blocks: list[list[nn.Module]] = []
    for layer in model:
        if any(True for _ in layer.parameters()) or not blocks:
            blocks.append([layer])
        else:
            blocks[-1].append(layer)
    if num_stages > len(blocks):
        raise ValueError(f"cannot cut a model with {len(blocks)} layers into {num_stages} stages: "
                         f"use at most {len(blocks)} stages, or a deeper model "
                         f"(e.g. models.mlp with {num_stages + 1} widths or more)")
    sizes = partition_uniform(len(blocks), num_stages)
    return [nn.Sequential(*[layer for block in blocks[lo:hi] for layer in block])
            for lo, hi in zip(sizes[:-1], sizes[1:])]


# ---------------------------------------------------------------------------------------------
# Weights per layer
# ---------------------------------------------------------------------------------------------

def layer_name(layer) -> str | None:
    """The name DeepSpeed matches and prints: a spec's class, a module's class, a function's name."""
    if hasattr(layer, "typename"):  # a LayerSpec names its class without building it
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def parameter_counts(layers: Sequence) -> list[int]:
    """Trainable parameters per layer (0 for functions and parameter-free modules).

    A LayerSpec is built once, on the side, to be counted; DeepSpeed does the same."""
    counts = []
    with torch.random.fork_rng(devices=[]):  # building draws random weights: keep the caller's seed
        for layer in layers:
            module = layer.build() if hasattr(layer, "typename") else layer
            counts.append(sum(p.numel() for _, p in trainable_parameters(module))
                          if isinstance(module, nn.Module) else 0)
    return counts


def type_weights(layers: Sequence, regex: str) -> list[int]:
    """1 for each layer whose class name matches ``regex`` (case-insensitive search), else 0."""
    try:
        pattern = re.compile(regex, re.IGNORECASE)
    except re.error as e:
        raise ValueError(f"partition method 'type:{regex}' is not a valid regular expression ({e}); "
                         "write e.g. 'type:Linear' or 'type:conv|linear'") from e
    names = [layer_name(l) for l in layers]
    weights = [1 if name is not None and pattern.search(name) else 0 for name in names]
    if sum(weights) == 0:
        known = sorted({n for n in names if n is not None})
        raise ValueError(f"partition method 'type:{regex}' matches no layer; use a regular expression "
                         f"that matches one of the layer types {known}")
    return weights


def forward_backward_time(fn: Callable, x: torch.Tensor, repeats: int = 3,
                          warmup: int = 1) -> tuple[float, torch.Tensor]:
    """Median seconds of one forward and one backward of ``fn`` on ``x``, and ``fn(x)``.

    The backward starts from a gradient of ones at the output, and reaches the input when it is
    floating point, as it would inside a pipeline stage."""
    times, out = [], None
    for i in range(warmup + repeats):
        leaf = x.detach().requires_grad_(x.is_floating_point())
        inp = leaf.clone()  # a non-leaf, so that in-place layers (ReLU(inplace=True)) may write it
        synchronize(x.device)
        t0 = time.perf_counter()
        out = fn(inp)
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        synchronize(x.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out.detach()


def profile_weights(layers: Sequence[Callable], sample: torch.Tensor, repeats: int = 3,
                    tries: int = 1) -> list[float]:
    """Measured forward+backward seconds of each layer (the median of ``repeats`` rounds), feeding
    each the previous one's output: the weights of ``partition_method="profile"``."""
    return [t.median for t in profile_layers(layers, sample, repeats, tries)]


def profile_layers(layers: Sequence[Callable], sample: torch.Tensor, repeats: int = 3,
                   tries: int = 1) -> list[Measured]:
    """Every repeat of each layer's forward+backward seconds (the stage times of the partition
    that gives every layer a stage of its own)."""
    return measure_partitions(layers, [list(range(len(layers) + 1))], sample, repeats, tries=tries)[0]


def measure_partitions(layers: Sequence[Callable], partitions: Sequence[Sequence[int]], sample: torch.Tensor,
                       repeats: int = 3, warmup: int = 1, tries: int = 1) -> list[list[Measured]]:
    """Seconds per stage of each partition, every repeat kept, in round order. Within a round a
    stage's time is the fastest of ``tries`` back-to-back runs: a load spike rarely covers them all.

    Each round runs every partition once, stage after stage, so a slow spell of the machine
    (another program busy on its cores) slows all partitions alike instead of just one, and
    repeat ``r`` of every stage comes from the same round (see ``slowest_stage``). Every other
    round runs them in reverse order (A B C, C B A, ...), so a load that grows or fades over the
    rounds favours none; partitions compared with each other are best passed side by side."""
    runs = [[[] for _ in range(len(parts) - 1)] for parts in partitions]
    # Dropout draws random numbers: they must not disturb the caller's seed.
    with torch.random.fork_rng(devices=[sample.device] if sample.is_cuda else []):
        for round_ in range(warmup + repeats):
            order = list(zip(partitions, runs))
            for parts, per_stage in (order[::-1] if round_ % 2 else order):
                x = sample
                for (lo, hi), seconds in zip(zip(parts[:-1], parts[1:]), per_stage):
                    stage = _chain(layers[lo:hi])
                    t, x = min((forward_backward_time(stage, x, repeats=1, warmup=0) for _ in range(tries)),
                               key=lambda result: result[0])
                    if round_ >= warmup:
                        seconds.append(t)
    for fn in layers:  # profiling leaves no gradients behind
        if isinstance(fn, nn.Module):
            fn.zero_grad(set_to_none=True)
    return [[Measured.of(t) for t in per_stage] for per_stage in runs]


def slowest_stage(per_stage: Sequence[Measured]) -> Measured:
    """The slowest stage of a partition, round by round: the pipeline's pace in each repeat."""
    return Measured.of(max(rounds) for rounds in zip(*(t.values for t in per_stage)))


def stage_sums(weights: Sequence[float], parts: Sequence[int]) -> list[float]:
    """Total weight of each stage of a partition."""
    return [sum(weights[lo:hi]) for lo, hi in zip(parts[:-1], parts[1:])]


def check_method(method) -> str:
    """``method`` in lower case if it names a partition method, else a ValueError listing them."""
    key = method.lower() if isinstance(method, str) else None
    if key is None or not (key in ("uniform", "parameters", "profile") or key.startswith("type:")):
        raise ValueError(f"unknown partition method {method!r}; use one of {METHODS}")
    return key


def check_profile(seconds, num_layers: int) -> list[float]:
    """A profile gives every layer a time that is a number >= 0."""
    seconds = list(seconds)
    if len(seconds) != num_layers:
        raise ValueError(f"the profile gave {len(seconds)} times for {num_layers} layers; it must give one "
                         "per layer, in order (e.g. profile_weights(layers, sample))")
    for i, t in enumerate(seconds):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"the profile's time of layer {i} is {t!r}; every layer needs a finite "
                             "number of seconds >= 0")
    return seconds


def partition_layers(layers: Sequence, num_stages: int, method: str = "parameters",
                     profile: Callable[[], list[float]] | None = None) -> list[int]:
    """Stage boundaries for ``layers`` by ``method``: 'uniform', 'parameters', 'type:REGEX' or
    'profile' (then ``profile()`` returns the measured seconds per layer)."""
    key = check_method(method)
    if key == "uniform":
        return partition_uniform(len(layers), num_stages)
    if key == "parameters":
        return partition_balanced(parameter_counts(layers), num_stages)
    if key.startswith("type:"):
        return partition_balanced(type_weights(layers, method[len("type:"):]), num_stages)
    if profile is None:  # the method is 'profile'
        raise ValueError("partition method 'profile' times every layer on a sample micro-batch; "
                         "pass one, e.g. PipelineModule(..., partition_method='profile', "
                         "profile_input=x[:8])")
    return partition_balanced(check_profile(profile(), len(layers)), num_stages)


def _chain(fns: Sequence[Callable]) -> Callable:
    def run(x):
        for fn in fns:
            x = fn(x)
        return x
    return run

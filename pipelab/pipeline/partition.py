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
"""
from __future__ import annotations

import re
import statistics
import time
from itertools import accumulate
from typing import Callable, Sequence

import torch
import torch.nn as nn

from pipelab.hardware import synchronize

METHODS = ("uniform", "parameters", "type:REGEX", "profile")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal-count stages; the first ``num_items % num_parts`` stages get one extra item."""
    _check_parts(num_parts)
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
    _check_parts(num_parts)
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
            counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad)
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


def profile_weights(layers: Sequence[Callable], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Measured forward+backward seconds of each layer, feeding each the previous one's output.

    ``layers`` are built modules or functions; ``sample`` is one micro-batch of inputs. (It is the
    stage time of the partition that gives every layer a stage of its own.)"""
    return stage_times(layers, list(range(len(layers) + 1)), sample, repeats)


def stage_times(layers: Sequence[Callable], parts: Sequence[int], sample: torch.Tensor,
                repeats: int = 3) -> list[float]:
    """Measured forward+backward seconds of each stage of a partition (its layers run together)."""
    return compare_partitions(layers, [parts], sample, repeats)[0]


def compare_partitions(layers: Sequence[Callable], partitions: Sequence[Sequence[int]], sample: torch.Tensor,
                       repeats: int = 3, warmup: int = 1) -> list[list[float]]:
    """Measured seconds per stage of each partition: the median of ``repeats`` rounds.

    Each round runs every partition once, stage after stage, so a slow spell of the machine
    (another program busy on its cores) slows all partitions alike instead of just one."""
    runs = [[[] for _ in range(len(parts) - 1)] for parts in partitions]
    # Dropout draws random numbers: they must not disturb the caller's seed.
    with torch.random.fork_rng(devices=[sample.device] if sample.is_cuda else []):
        for round_ in range(warmup + repeats):
            for parts, per_stage in zip(partitions, runs):
                x = sample
                for (lo, hi), seconds in zip(zip(parts[:-1], parts[1:]), per_stage):
                    t, x = forward_backward_time(_chain(layers[lo:hi]), x, repeats=1, warmup=0)
                    if round_ >= warmup:
                        seconds.append(t)
    for fn in layers:  # profiling leaves no gradients behind
        if isinstance(fn, nn.Module):
            fn.zero_grad(set_to_none=True)
    return [[statistics.median(t) for t in per_stage] for per_stage in runs]


def stage_sums(weights: Sequence[float], parts: Sequence[int]) -> list[float]:
    """Total weight of each stage of a partition."""
    return [sum(weights[lo:hi]) for lo, hi in zip(parts[:-1], parts[1:])]


def partition_layers(layers: Sequence, num_stages: int, method: str = "parameters",
                     profile: Callable[[], list[float]] | None = None) -> list[int]:
    """Stage boundaries for ``layers`` by ``method``: 'uniform', 'parameters', 'type:REGEX' or
    'profile' (then ``profile()`` returns the measured seconds per layer)."""
    if not isinstance(method, str):
        raise ValueError(f"partition method must be a string, got {method!r}; use one of {METHODS}")
    key = method.lower()
    if key == "uniform":
        return partition_uniform(len(layers), num_stages)
    if key == "parameters":
        return partition_balanced(parameter_counts(layers), num_stages)
    if key.startswith("type:"):
        return partition_balanced(type_weights(layers, method[len("type:"):]), num_stages)
    if key == "profile":
        if profile is None:
            raise ValueError("partition method 'profile' times every layer on a sample micro-batch; "
                             "pass one, e.g. PipelineModule(..., partition_method='profile', "
                             "profile_input=x[:8])")
        return partition_balanced(profile(), num_stages)
    raise ValueError(f"unknown partition method {method!r}; use one of {METHODS}")


def _check_parts(num_parts) -> None:
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_parts={num_parts!r} must be a whole number >= 1, e.g. num_stages=2")


def _chain(fns: Sequence[Callable]) -> Callable:
    def run(x):
        for fn in fns:
            x = fn(x)
        return x
    return run


def plot_stage_bars(per_method: dict[str, Sequence[float]], ylabel: str, title: str, ax=None):
    """Grouped bars: for each stage, one bar per partition method (e.g. parameters or seconds)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    num_stages = max(len(v) for v in per_method.values())
    width = 0.8 / len(per_method)
    for i, (method, values) in enumerate(per_method.items()):
        xs = [s + (i - (len(per_method) - 1) / 2) * width for s in range(len(values))]
        ax.bar(xs, values, width=width, label=method)
    ax.set_xticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    top = max(max(v) for v in per_method.values())
    ax.set_ylim(0, 1.45 * top if top > 0 else 1)  # head room for the legend above the bars
    ax.legend(title="partition method", fontsize="small", loc="upper center", ncol=2)
    return ax

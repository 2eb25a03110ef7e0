"""Cut a flat list of layers into pipeline stages, the way DeepSpeed does.

A partition is a list of ``num_parts + 1`` boundaries: stage ``s`` owns layers
``parts[s]`` up to (not including) ``parts[s + 1]``. The results, tie rules and
edge cases match ``deepspeed.runtime.utils.partition_uniform`` and
``partition_balanced`` (the dynamic-programming version).
"""
from __future__ import annotations

import re
from itertools import accumulate
from typing import Sequence

import torch.nn as nn

METHODS = ("uniform", "parameters", "type:REGEX")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal-count stages; the first ``num_items % num_parts`` stages get one extra item."""
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be at least 1")
    if num_items <= num_parts:
        # More stages than layers: one layer per stage, trailing stages empty.
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous stages whose heaviest-minus-lightest weight is smallest (linear partition DP).

    On ties the latest cut wins, as in DeepSpeed, so zero-weight layers go to the earlier stage.
    """
    n, m = len(weights), num_parts
    if m < 1:
        raise ValueError(f"num_parts={num_parts} must be at least 1")
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0] + [float(w) for w in accumulate(float(w) for w in weights)]
    # best[i][j] = (cost, heaviest, lightest) for the first i items in j stages.
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    heavy = [[inf] * (m + 1) for _ in range(n + 1)]
    light = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    cost[0][0], heavy[0][0] = 0.0, 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                last = prefix[i] - prefix[k]
                hi, lo = max(heavy[k][j - 1], last), min(light[k][j - 1], last)
                if cost[i][j] >= hi - lo:
                    cost[i][j], heavy[i][j], light[i][j], cut[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]


def parameter_counts(layers: Sequence) -> list[int]:
    """Trainable parameters per layer (0 for functions and parameter-free modules)."""
    return [sum(p.numel() for p in l.parameters() if p.requires_grad) if isinstance(l, nn.Module) else 0
            for l in layers]


def type_weights(layers: Sequence, regex: str) -> list[int]:
    """1 for each layer whose class name matches ``regex`` (case-insensitive search), else 0."""
    pattern = re.compile(regex, re.IGNORECASE)
    weights = [1 if pattern.search(_layer_name(l)) else 0 for l in layers]
    if sum(weights) == 0:
        names = sorted({_layer_name(l) for l in layers})
        raise ValueError(f"partition method 'type:{regex}' matches no layer; layer types are {names}")
    return weights


def partition_layers(layers: Sequence, num_stages: int, method: str = "parameters") -> list[int]:
    """Stage boundaries for ``layers`` by ``method``: 'uniform', 'parameters' or 'type:REGEX'."""
    key = method.lower()
    if key == "uniform":
        return partition_uniform(len(layers), num_stages)
    if key == "parameters":
        return partition_balanced(parameter_counts(layers), num_stages)
    if key.startswith("type:"):
        return partition_balanced(type_weights(layers, method[len("type:"):]), num_stages)
    raise ValueError(f"unknown partition method {method!r}; use one of {METHODS}")


def _layer_name(layer) -> str:
    # A layer spec names its class without building it; a built layer names its own type.
    return (getattr(layer, "typename", None) or type(layer)).__name__

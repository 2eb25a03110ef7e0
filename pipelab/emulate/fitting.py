"""Fit the emulator's hardware model to measured rows: small least-squares fits in plain Python.

Every fit minimises the squared log of modelled over measured time, so a row at 32 KiB weighs as
much as one at 16 GiB (a 10 % miss is a 10 % miss at any size). `pipelab.emulate.calibrated` holds
the constants these fits return on the rows marked `calibrate` in `pipelab.emulate.measured`; the
tests refit and compare, so every constant is reproducible from the published rows.

- `fit_matmul`: a device's matrix products, time = max(launch, (FLOPs + half) / (peak x e_max)):
  a saturating efficiency curve e(F) = e_max F / (F + half) against the work F of one product,
  floored by the host's cost of issuing one kernel;
- `fit_memory`: a memory-bound kernel, time = max(launch, bytes / (fraction x sheet bandwidth));
- `fit_fabric`: NCCL over one kind of link, each protocol a per-step latency and a bus bandwidth,
  NCCL taking the fastest for each size (see `calibrated.ring_seconds`).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence


def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], step: float = 0.5,
                iterations: int = 2000, tolerance: float = 1e-12) -> list[float]:
    """The point near `x0` where `f` is least (the downhill simplex of Nelder and Mead, 1965)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centre = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def toward(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, worst)]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best point
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p)] for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def log_error(modelled: float, measured: float) -> float:
    """The squared log ratio: 0 when equal, the same for 2x too slow as for 2x too fast."""
    return math.log(modelled / measured) ** 2


def matmul_time(flops: float, launch_s: float, e_max: float, half_flops: float, peak: float) -> float:
    """Seconds of one matrix product of `flops`: the launch floor or the saturating curve, the longer."""
    return max(launch_s, (flops + half_flops) / (peak * e_max))


def fit_matmul(rows: Sequence[tuple[float, float]], peak: float, launch_s: float) -> tuple[float, float]:
    """(e_max, half_flops) of one device and dtype from rows of (FLOPs of one product, seconds)."""
    def loss(p):
        e_max, half = min(1.0, math.exp(p[0])), math.exp(p[1])
        return sum(log_error(matmul_time(f, launch_s, e_max, half, peak), t) for f, t in rows)
    best = min((nelder_mead(loss, [math.log(0.7), math.log(h)]) for h in (1e8, 1e10)), key=loss)
    return min(1.0, math.exp(best[0])), math.exp(best[1])


def fit_device(rows: dict[str, Sequence[tuple[float, float]]], peaks: dict[str, float]
               ) -> tuple[float, dict[str, tuple[float, float]]]:
    """A device's launch floor and its (e_max, half_flops) per dtype, from its matrix products
    (dtype -> rows of (FLOPs, seconds)): the launch floor is shared by every dtype."""
    def total(launch):
        fits = {d: fit_matmul(r, peaks[d], launch) for d, r in rows.items()}
        return sum(log_error(matmul_time(f, launch, *fits[d], peaks[d]), t)
                   for d, r in rows.items() for f, t in r), fits
    shortest = min(t for r in rows.values() for _, t in r)
    candidates = [shortest * 0.3 * 1.08 ** i for i in range(16)]  # 0.3x to 1.0x the shortest call
    launch = min(candidates, key=lambda c: total(c)[0])
    return launch, total(launch)[1]


def fit_memory(rows: Sequence[tuple[float, float]], bandwidth: float) -> tuple[float, float]:
    """(launch_s, fraction of the sheet's bandwidth) from rows of (bytes moved, seconds)."""
    def loss(p):
        launch, fraction = math.exp(p[0]), min(1.0, math.exp(p[1]))
        return sum(log_error(max(launch, b / (fraction * bandwidth)), t) for b, t in rows)
    best = nelder_mead(loss, [math.log(min(t for _, t in rows)), math.log(0.8)])
    return math.exp(best[0]), min(1.0, math.exp(best[1]))


def fit_fabric(rows: Sequence, model: Callable[[dict, object], float], free: dict[str, float],
               fixed: dict[str, float] | None = None) -> dict[str, float]:
    """The parameters named in `free` (start values; every one > 0) that make `model(params, row)`
    closest to each row's measured `seconds()`; `fixed` parameters are held as given."""
    names, fixed = list(free), dict(fixed or {})

    def params(p):
        return {**fixed, **{k: math.exp(v) for k, v in zip(names, p)}}

    def loss(p):
        return sum(log_error(model(params(p), row), row.seconds()) for row in rows)
    start = [math.log(free[k]) for k in names]
    for _ in range(3):  # restart from the best point: the simplex can stall on a ridge
        start = nelder_mead(loss, start, iterations=4000)
    return {k: v for k, v in params(start).items() if k in free}

"""Lesson 00 from a notebook: the ping-pong, the all-reduce sweep and a compute-then-communicate
step on real processes (`pipelab.collectives`), with their parameters in one checked `Config`.

    cfg = collectives.Config(world_size=2, rounds=5)   # refuses bad input here
    pp = experiments.run(collectives.ping_pong_worker, cfg, collectives.gather_ping_pong)
    pipelab.conclude(*collectives.bytes_verdict(pp))
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Mapping, Sequence

import torch

from pipelab import experiments
from pipelab.checks import whole_number
from pipelab.collectives import (AllReduceTime, MessageTime, all_reduce_sweep, compute_then_communicate,
                                 fit_latency_bandwidth, matmuls, ping_pong, ring_all_reduce_time,
                                 small_message_latency, work_of)
from pipelab.display import human_bytes
from pipelab.emulate import cost, work
from pipelab.measure import Measured, compare
from pipelab.timeline import Timeline
from pipelab.worker import RankContext

Verdict = tuple[str, str, str, dict]


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """Lesson 00's parameters: the ping-pong's message sizes (each swept `rounds` times with `trips`
    round trips), the all-reduce sweep's tensor sizes and rounds, and the step's `matrix_size` and
    `steps`. SIZE: the `matrix` size a modelled node times the step's products at (None: their own)."""

    sizes_bytes: Sequence[int] = tuple(2**k for k in range(3, 23, 2))  # 8 B ... 2 MiB
    rounds: int = 5
    trips: int = 4
    allreduce_sizes: Sequence[int] = (8, 2**10, 2**15, 2**18, 2**20, 2**22)
    allreduce_rounds: int = 3
    matrix_size: int = 256
    steps: int = 7
    SIZE: ClassVar[Mapping[str, Any]] = {"matrix": None}

    def check(self) -> None:
        super().check()
        if self.world_size < 2:
            raise ValueError(f"world_size={self.world_size}: a ping-pong, a ring and a collective need a peer "
                             "to talk to; use world_size=2 or more")
        for name in ("sizes_bytes", "allreduce_sizes"):
            sizes = getattr(self, name)
            if isinstance(sizes, (str, int)) or not sizes:
                raise ValueError(f"{name} must be a list of one or more sizes in bytes, got {sizes!r}; "
                                 f"e.g. {name}=[8, 1024, 2**20]")
            for size in sizes:
                whole_number(f"each of {name}", size, example=f"{name}=[8, 1024, 2**20]")
        for name in ("rounds", "trips", "allreduce_rounds", "matrix_size", "steps"):
            whole_number(name, getattr(self, name), example=f"{name}={getattr(type(self), name)}")
        if self.size.matrix is not None:
            whole_number("matrix", self.size.matrix, example="matrix=4096")


def own_cores(cfg: Config) -> Config:
    """The same parameters on this machine's own cores: nothing modelled."""
    return replace(cfg, emulate=None)


@dataclass
class PingPongRun:
    """The ping-pong's rows (one per message size), its latency (per round, over the small sizes)
    and the bandwidth of `time = latency + bytes / bandwidth` fitted to them."""

    rows: list[MessageTime]
    latency: Measured  # seconds
    bandwidth: float  # bytes per second
    node: object = None  # the node that timed it, or None: this machine

    def model(self, nbytes: float) -> float:
        """The fitted model's one-way seconds for a message of `nbytes`."""
        return self.latency.median + nbytes / self.bandwidth

    def misfit(self) -> float:
        """The largest distance of the fitted model from a row's median, as a fraction of the row."""
        return max(abs(self.model(r.bytes) / r.one_way.median - 1) for r in self.rows)


def ping_pong_worker(ctx: RankContext, cfg: Config) -> list[MessageTime] | None:
    """`ping_pong` between ranks 0 and 1 (the others sit out); rank 0 returns the rows."""
    return ping_pong(ctx, cfg.sizes_bytes, cfg.rounds, cfg.trips)


def gather_ping_pong(cfg: Config, results: Sequence[list[MessageTime] | None]) -> PingPongRun:
    rows = results[0]
    return PingPongRun(rows, small_message_latency(rows), fit_latency_bandwidth(rows)[1], cfg.node)


def bytes_verdict(pp: PingPongRun) -> Verdict:
    """Whether the largest message's bytes, not the latency, set its time, round by round."""
    largest = pp.rows[-1]
    # round by round: a hiccup of the machine during one round slows both, so it mostly cancels out
    times_latency = Measured.of(big / small for big, small in zip(largest.one_way.values, pp.latency.values))
    verdict = compare(times_latency, Measured.of([1.0]))
    text = (f"a {human_bytes(largest.bytes)} message took {times_latency.median:.1f}x a small message's time in "
            "the same round: " + {"higher": "its bytes, not the latency, set its time.",
                                  "lower": "faster than a small message, which only noise explains.",
                                  "within noise": "in some round the machine's noise hid its bytes' cost."}[verdict])
    return "00.bytes_cost_time", verdict, text, {
        "largest_bytes": largest.bytes, "largest_one_way_s": largest.one_way, "latency_s": pp.latency,
        "times_latency": times_latency, "bandwidth_Bps": pp.bandwidth}


def fit_verdict(pp: PingPongRun) -> Verdict:
    """How close the fitted `latency + bytes / bandwidth` comes to the rows it was fitted to."""
    misfit = pp.misfit()
    verdict = "fits" if misfit <= 0.1 else "misses"
    text = (f"the fitted latency + bytes / bandwidth lies within {misfit:.1%} of every row's median"
            + (", so one straight line describes this sweep." if verdict == "fits" else
               ": one straight line does not describe this sweep."))
    return "00.fit", verdict, text, {"misfit": misfit, "latency_s": pp.latency.median, "bandwidth_Bps": pp.bandwidth,
                                     "largest_row_Bps": pp.rows[-1].bandwidth.median}


def two_levels(values: Sequence[float], gap: float = 3.0) -> tuple[list[float], list[float]] | None:
    """The values split in two groups (of two or more) at the widest jump between sorted
    neighbours, if it is `gap` times or more; None when they form one group."""
    ordered = sorted(values)
    jumps = [(b / a if a > 0 else float("inf"), i) for i, (a, b) in enumerate(zip(ordered, ordered[1:]), start=1)
             if 2 <= i <= len(ordered) - 2]
    if not jumps:
        return None
    ratio, at = max(jumps)
    return (ordered[:at], ordered[at:]) if ratio >= gap else None


def small_messages(own: PingPongRun, small_bytes: int = 4096) -> list[float]:
    """Every one-way time (per size and round) of the messages up to `small_bytes`."""
    return [v for r in own.rows if r.bytes <= small_bytes for v in r.one_way.values]


def own_cores_rows(modelled: PingPongRun, own: PingPongRun) -> list[dict]:
    """The ping-pong on this machine's cores beside the modelled link, and the levels its small
    messages' times fell into (a receiver still running, or one woken by the scheduler)."""
    rows = [{"figure": "latency (µs)", "modelled link": f"{modelled.latency.median * 1e6:.2f}",
             "this machine's cores": f"{own.latency.scaled(1e6):.1f}"},
            {"figure": "fitted bandwidth (GB/s)", "modelled link": f"{modelled.bandwidth / 1e9:.3g}",
             "this machine's cores": f"{own.bandwidth / 1e9:.3g}"}]
    for name, level in zip(("fast level", "slow level"), two_levels(small_messages(own)) or ()):
        rows.append({"figure": f"small messages, {name} (µs)", "modelled link": "-",
                     "this machine's cores": f"{len(level)} near {statistics.median(level) * 1e6:.0f}"})
    return rows


def own_cores_verdict(modelled: PingPongRun, own: PingPongRun) -> Verdict:
    """The ping-pong on this machine's own cores against the modelled link."""
    slower = own.latency.median / modelled.latency.median
    narrower = modelled.bandwidth / own.bandwidth
    verdict = "slower than the link" if slower > 1 and narrower > 1 else "not slower than the link"
    text = (f"on this machine's cores a small message took {slower:.0f}x the modelled link's latency and the "
            f"bandwidth was {narrower:.0f}x narrower: a message here is a copy through the kernel's loopback.")
    return "00.own_cores", verdict, text, {
        "own_latency_s": own.latency, "link_latency_s": modelled.latency.median, "latency_ratio": slower,
        "own_bandwidth_Bps": own.bandwidth, "link_bandwidth_Bps": modelled.bandwidth,
        "bandwidth_ratio": narrower, "two_levels": two_levels(small_messages(own)) is not None}


@dataclass
class AllReduceRun:
    """The all-reduce sweep's rows (one per tensor size) and the ring model's prediction of each."""

    rows: list[AllReduceTime]
    predicted: list[float]  # seconds, from the ping-pong's latency and bandwidth
    node: object = None  # the node that timed it, or None: this machine

    @property
    def max_difference(self) -> float:
        """The largest difference between our ring's sums and dist.all_reduce's, over all sizes."""
        return max(r.max_difference for r in self.rows)


def all_reduce_worker(ctx: RankContext, cfg: Config) -> list[AllReduceTime] | None:
    """`all_reduce_sweep` over `cfg.allreduce_sizes`; rank 0 returns the rows."""
    return all_reduce_sweep(ctx, cfg.allreduce_sizes, cfg.allreduce_rounds)


def all_reduce_run(cfg: Config, pp: PingPongRun) -> AllReduceRun:
    """Run the sweep on `cfg.world_size` ranks and predict each size from the ping-pong's fit."""
    rows = experiments.run(all_reduce_worker, cfg)[0]
    return AllReduceRun(rows, [ring_all_reduce_time(r.bytes, cfg.world_size, pp.bandwidth, pp.latency.median)
                               for r in rows], cfg.node)


def ring_model_verdict(run: AllReduceRun, tolerance: float = 0.05) -> Verdict:
    """The largest all-reduce against the ring model: "fits" when every round lies within
    `tolerance` of the prediction. The smallest, where only latency counts, is a figure."""
    big, small = run.rows[-1], run.rows[0]
    big_ratio = big.torch.scaled(1 / run.predicted[-1])  # per round: this run's time / predicted
    verdict = {"higher": "slower than the model", "lower": "faster than the model",
               "within noise": "fits"}[compare(big_ratio, Measured.of([1 - tolerance, 1 + tolerance]))]
    text = (f"the largest all-reduce took {big_ratio.median:.2f}x the ring model's prediction from the ping-pong: "
            + {"slower than the model": "slower in every round, so here the model is a lower bound.",
               "faster than the model": "faster in every round, so the ping-pong underestimated the bandwidth.",
               "fits": f"within {tolerance:.0%} of it."}[verdict])
    return "00.ring_model", verdict, text, {
        "bytes": big.bytes, "measured_s": big.torch, "predicted_s": run.predicted[-1], "ratio": big_ratio,
        "small_ratio": small.torch.scaled(1 / run.predicted[0])}


def step_worker(ctx: RankContext, cfg: Config) -> Timeline:
    """`compute_then_communicate` for `cfg.steps` steps of `cfg.matrix_size` matrices; this rank's
    spans (on a modelled node, products and bytes last what they would at `cfg.size.matrix`)."""
    size = cfg.size.matrix or cfg.matrix_size
    big = torch.empty(size, size, device="meta")
    with work.timed_as(ctx, work.call_table(matmuls, big, big, work_of(ctx.rank)), size ** 2 / cfg.matrix_size ** 2):
        return compute_then_communicate(ctx, cfg.matrix_size, cfg.steps)


def run_flops(params: dict) -> float:
    """FLOPs of the step's matrix products at the notebook parameters `params` (missing names take
    Config's defaults): all ranks, its warm-up step included, counted on the meta device."""
    cfg = Config(**{k: v for k, v in params.items() if k in ("world_size", "matrix_size", "steps")})
    meta = torch.empty(cfg.matrix_size, cfg.matrix_size, device="meta")
    return (cfg.steps + 1) * sum(cost.count(matmuls, meta, meta, work_of(r)).flops for r in range(cfg.world_size))


def gather_timeline(cfg: Config, results: Sequence[Timeline]) -> Timeline:
    """Every rank's spans on one timeline."""
    return Timeline.merge(results)


def waiting_verdict(timeline: Timeline) -> Verdict:
    """Whether rank 0, with the least work, waited inside the all-reduce for the busiest rank:
    step by step, how much longer its all-reduce box was than the slowest rank's."""
    fastest, slowest = 0, max(s.rank for s in timeline)
    boxes = {r: [s.duration * 1e3 for s in timeline.filter(rank=r, kind="allreduce")] for r in (fastest, slowest)}
    # a pause of the machine stretches both ranks' boxes in that step, so it cancels out in the
    # differences; the typical step decides (a sign test), "every" only when every step agrees
    extra = Measured.of(a - b for a, b in zip(boxes[fastest], boxes[slowest]))
    verdict = "higher" if extra.median > 0 else "lower" if extra.median < 0 else "within noise"
    every = "every" if compare(extra, Measured.of([0.0])) == verdict else "the typical"
    text = {"higher": f"in {every} step rank {fastest}, with less work, waited inside the all-reduce for rank "
                      f"{slowest}: its box was {extra.median:.2f} ms longer.",
            "lower": f"in the typical step rank {slowest} waited longer, though it had more work: the machine's noise "
                     "was larger than the difference in work.",
            "within noise": "the typical boxes were about as long: the machine's noise was as large as the "
                            "difference in work."}[verdict]
    return "00.fast_rank_waits", verdict, text, {"extra_wait_ms": extra, "steps": len(extra.values)}

"""Lesson 00 from a notebook: the ping-pong, the all-reduce sweep and a compute-then-communicate
step on real processes, and what their figures say.

    cfg = collectives.Config(world_size=2, rounds=5)   # refuses bad input here
    pp = experiments.run(collectives.ping_pong_worker, cfg, collectives.gather_ping_pong)
    pipelab.conclude(*collectives.bytes_verdict(pp))

The workers (`ping_pong`, `all_reduce_sweep`, `compute_then_communicate`) and the ring all-reduce
live in `pipelab.collectives`; here they get their parameters from one checked `Config`. On a
modelled node every message lasts what the link model gives; `own_cores(cfg)` is the same run on
this machine's own cores.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from pipelab import experiments
from pipelab.checks import modelled_size, whole_number
from pipelab.collectives import (AllReduceTime, MessageTime, all_reduce_sweep, compute_then_communicate,
                                 fit_latency_bandwidth, matmuls, ping_pong, ring_all_reduce_time,
                                 small_message_latency, work_of)
from pipelab.display import human_bytes
from pipelab.emulate import cost, table, work
from pipelab.measure import Measured, compare
from pipelab.timeline import Timeline
from pipelab.worker import RankContext


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """Lesson 00's parameters: the ping-pong's message sizes (`sizes_bytes`, each swept `rounds`
    times with `trips` round trips), the all-reduce sweep's tensor sizes and rounds, and the
    compute-then-communicate step (`matrix_size`, `steps`). On a modelled node the step's
    matrix products last what they would at the size below (the math runs at `matrix_size`)."""

    sizes_bytes: Sequence[int] = tuple(2**k for k in range(3, 23, 2))  # 8 B ... 2 MiB
    rounds: int = 5
    trips: int = 4
    allreduce_sizes: Sequence[int] = (8, 2**10, 2**15, 2**18, 2**20, 2**22)
    allreduce_rounds: int = 3
    matrix_size: int = 256
    steps: int = 7
    emulated_matrix: int | None = None

    def check(self) -> None:
        super().check()  # world_size: a whole number, and not more ranks than the machine holds
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
        modelled_size(self, "emulated_matrix")


def own_cores(cfg: Config) -> Config:
    """The same parameters on this machine's own cores: nothing modelled."""
    return replace(cfg, emulate=None, emulated_matrix=None)


# ---------------------------------------------------------------------------------------------
# The ping-pong: latency and bandwidth of one message
# ---------------------------------------------------------------------------------------------


@dataclass
class PingPongRun:
    """The ping-pong's rows (one per message size), its latency (per round, over the small
    sizes) and the bandwidth of the model `time = latency + bytes / bandwidth` fitted to them."""

    rows: list[MessageTime]
    latency: Measured  # seconds
    bandwidth: float  # bytes per second
    node: object = None  # the modelled node it ran on (a specs.Node), or None: this machine

    def model(self, nbytes: float) -> float:
        """The fitted model's one-way seconds for a message of `nbytes`: latency + bytes / bandwidth."""
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


def bytes_verdict(pp: PingPongRun) -> tuple[str, str, str, dict]:
    """Whether the largest message's bytes, not the latency, set its time, round by round."""
    largest = pp.rows[-1]
    # Round by round, the largest message's time over the small ones': a hiccup of the machine during
    # one round slows both, so it mostly cancels out here.
    times_latency = Measured.of(big / small for big, small in zip(largest.one_way.values, pp.latency.values))
    verdict = compare(times_latency, Measured.of([1.0]))
    text = (f"a {human_bytes(largest.bytes)} message took {times_latency.median:.1f}x a small message's time in "
            "the same round: " + {"higher": "its bytes, not the latency, set its time.",
                                  "lower": "faster than a small message, which only noise explains.",
                                  "within noise": "in some round the machine's noise hid its bytes' cost."}[verdict])
    return "00.bytes_cost_time", verdict, text, {
        "largest_bytes": largest.bytes, "largest_one_way_s": largest.one_way, "latency_s": pp.latency,
        "times_latency": times_latency, "bandwidth_Bps": pp.bandwidth}


def fit_verdict(pp: PingPongRun) -> tuple[str, str, str, dict]:
    """How close the fitted `latency + bytes / bandwidth` comes to the rows it was fitted to."""
    misfit = pp.misfit()
    verdict = "fits" if misfit <= 0.1 else "misses"
    text = (f"the fitted latency + bytes / bandwidth lies within {misfit:.1%} of every row's median"
            + (", so one straight line describes this sweep." if verdict == "fits" else
               ": one straight line does not describe this sweep."))
    return "00.fit", verdict, text, {"misfit": misfit, "latency_s": pp.latency.median, "bandwidth_Bps": pp.bandwidth,
                                     "largest_row_Bps": pp.rows[-1].bandwidth.median}


def two_levels(values: Sequence[float], gap: float = 3.0) -> tuple[list[float], list[float]] | None:
    """The values split in two groups where sorted neighbours differ by `gap` times or more (the
    widest such jump), each group holding at least two; None when they form one group."""
    ordered = sorted(values)
    jumps = [(b / a if a > 0 else float("inf"), i) for i, (a, b) in enumerate(zip(ordered, ordered[1:]), start=1)]
    jumps = [(ratio, i) for ratio, i in jumps if 2 <= i <= len(ordered) - 2]
    if not jumps:
        return None
    ratio, at = max(jumps)
    return (ordered[:at], ordered[at:]) if ratio >= gap else None


def small_messages(own: PingPongRun, small_bytes: int = 4096) -> list[float]:
    """Every one-way time (per size and round) of the messages up to `small_bytes`."""
    return [v for r in own.rows if r.bytes <= small_bytes for v in r.one_way.values]


def own_cores_rows(modelled: PingPongRun, own: PingPongRun) -> list[dict]:
    """The ping-pong on this machine's cores beside the modelled link, and the levels its small
    messages' times fell into on this run (a receiver still running, or one woken by the scheduler)."""
    rows = [{"figure": "latency (µs)", "modelled link": f"{modelled.latency.median * 1e6:.2f}",
             "this machine's cores": f"{own.latency.scaled(1e6):.1f}"},
            {"figure": "fitted bandwidth (GB/s)", "modelled link": f"{modelled.bandwidth / 1e9:.3g}",
             "this machine's cores": f"{own.bandwidth / 1e9:.3g}"}]
    levels = two_levels(small_messages(own))
    for name, level in zip(("fast level", "slow level"), levels or ()):
        rows.append({"figure": f"small messages, {name} (µs)", "modelled link": "-",
                     "this machine's cores": f"{len(level)} near {statistics.median(level) * 1e6:.0f}"})
    return rows


def own_cores_verdict(modelled: PingPongRun, own: PingPongRun) -> tuple[str, str, str, dict]:
    """The same ping-pong on this machine's own cores against the modelled link: how much slower
    its latency and narrower its bandwidth."""
    slower = own.latency.median / modelled.latency.median
    narrower = modelled.bandwidth / own.bandwidth
    verdict = "slower than the link" if slower > 1 and narrower > 1 else "not slower than the link"
    text = (f"on this machine's cores a small message took {slower:.0f}x the modelled link's latency and the "
            f"bandwidth was {narrower:.0f}x narrower: a message here is a copy through the kernel's loopback.")
    return "00.own_cores", verdict, text, {
        "own_latency_s": own.latency, "link_latency_s": modelled.latency.median, "latency_ratio": slower,
        "own_bandwidth_Bps": own.bandwidth, "link_bandwidth_Bps": modelled.bandwidth,
        "bandwidth_ratio": narrower, "two_levels": two_levels(small_messages(own)) is not None}


# ---------------------------------------------------------------------------------------------
# The all-reduce: torch's and our ring, against the ring's cost model
# ---------------------------------------------------------------------------------------------


@dataclass
class AllReduceRun:
    """The all-reduce sweep's rows (one per tensor size) and the ring model's prediction of each."""

    rows: list[AllReduceTime]
    predicted: list[float]  # seconds, from the ping-pong's latency and bandwidth
    node: object = None  # the modelled node it ran on (a specs.Node), or None: this machine

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


def ring_model_verdict(run: AllReduceRun, tolerance: float = 0.05) -> tuple[str, str, str, dict]:
    """The largest all-reduce against the ring model: "fits" when every round lies within
    `tolerance` of the prediction. The smallest, where only latency counts, is a figure."""
    (big, big_predicted), (small, small_predicted) = (run.rows[-1], run.predicted[-1]), (run.rows[0], run.predicted[0])
    big_ratio = big.torch.scaled(1 / big_predicted)  # per round: this run's time / predicted
    small_ratio = small.torch.scaled(1 / small_predicted)
    verdict = {"higher": "slower than the model", "lower": "faster than the model",
               "within noise": "fits"}[compare(big_ratio, Measured.of([1 - tolerance, 1 + tolerance]))]
    text = (f"the largest all-reduce took {big_ratio.median:.2f}x the ring model's prediction from the ping-pong: "
            + {"slower than the model": "slower in every round, so here the model is a lower bound.",
               "faster than the model": "faster in every round, so the ping-pong underestimated the bandwidth.",
               "fits": f"within {tolerance:.0%} of it."}[verdict])
    return "00.ring_model", verdict, text, {
        "bytes": big.bytes, "measured_s": big.torch, "predicted_s": big_predicted, "ratio": big_ratio,
        "small_ratio": small_ratio}


# ---------------------------------------------------------------------------------------------
# A step on the timeline
# ---------------------------------------------------------------------------------------------


def step_table(rank: int, size: int) -> table.CostTable:
    """This rank's matrix products at `size` x `size`, counted on the meta device: what its compute lasts."""
    big = torch.empty(size, size, device="meta")
    return table.CostTable({("F",): cost.count(matmuls, big, big, work_of(rank))})


def step_worker(ctx: RankContext, cfg: Config) -> Timeline:
    """`compute_then_communicate` for `cfg.steps` steps of `cfg.matrix_size` matrices (on a modelled
    node timed at the Config's modelled size, products and bytes); this rank's spans."""
    size = cfg.emulated_matrix or cfg.matrix_size
    with work.timed_as(ctx, step_table(ctx.rank, size), size ** 2 / cfg.matrix_size ** 2):
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


def waiting_verdict(timeline: Timeline) -> tuple[str, str, str, dict]:
    """Whether rank 0, with the least work, waited inside the all-reduce for the busiest rank:
    step by step, how much longer its all-reduce box was than the slowest rank's."""
    fastest, slowest = 0, max(s.rank for s in timeline)
    boxes = {r: [s.duration * 1e3 for s in timeline.filter(rank=r, kind="allreduce")] for r in (fastest, slowest)}
    # A pause of the machine during one step stretches both ranks' boxes in that step, so it cancels
    # out in the differences; the typical step decides (the median of the differences: a sign test),
    # "in every step" only when it holds in every step.
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

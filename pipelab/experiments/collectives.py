"""Lesson 00 from a notebook: the ping-pong, the all-reduce sweep and a compute-then-communicate
step on real processes, and what their measurements say.

    cfg = collectives.Config(world_size=2, rounds=5)   # refuses bad input here
    pp = experiments.run(collectives.ping_pong_worker, cfg, collectives.gather_ping_pong)
    pipelab.conclude(*collectives.bytes_verdict(pp))

The workers it runs (`ping_pong`, `all_reduce_sweep`, `compute_then_communicate`) and the ring
all-reduce live in `pipelab.collectives`; here they get their parameters from one checked `Config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipelab import experiments
from pipelab.checks import whole_number
from pipelab.collectives import (AllReduceTime, MessageTime, all_reduce_sweep, compute_then_communicate,
                                 fit_latency_bandwidth, ping_pong, ring_all_reduce_time, small_message_latency)
from pipelab.display import human_bytes
from pipelab.measure import Measured, compare
from pipelab.timeline import Timeline
from pipelab.worker import RankContext


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """Lesson 00's parameters: the ping-pong's message sizes (`sizes_bytes`, each swept `rounds`
    times with `trips` round trips), the all-reduce sweep's tensor sizes and rounds, and the
    compute-then-communicate step (`matrix_size`, `steps`)."""

    sizes_bytes: Sequence[int] = tuple(2**k for k in range(3, 23, 2))  # 8 B ... 2 MiB
    rounds: int = 5
    trips: int = 4
    allreduce_sizes: Sequence[int] = (8, 2**10, 2**15, 2**18, 2**20, 2**22)
    allreduce_rounds: int = 3
    matrix_size: int = 256
    steps: int = 7

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


def ping_pong_worker(ctx: RankContext, cfg: Config) -> list[MessageTime] | None:
    """`ping_pong` between ranks 0 and 1 (the others sit out); rank 0 returns the rows."""
    return ping_pong(ctx, cfg.sizes_bytes, cfg.rounds, cfg.trips)


def gather_ping_pong(cfg: Config, results: Sequence[list[MessageTime] | None]) -> PingPongRun:
    rows = results[0]
    return PingPongRun(rows, small_message_latency(rows), fit_latency_bandwidth(rows)[1])


def bytes_verdict(pp: PingPongRun) -> tuple[str, str, str, dict]:
    """Whether the largest message's bytes, not the latency, set its time, round by round."""
    largest = pp.rows[-1]
    # Round by round, the largest message's time over the small ones': a hiccup of the machine during
    # one round slows both, so it mostly cancels out here.
    times_latency = Measured.of(big / small for big, small in zip(largest.one_way.values, pp.latency.values))
    verdict = compare(times_latency, Measured.of([1.0]))
    text = (f"a {human_bytes(largest.bytes)} message took {largest.one_way.scaled(1e6):.0f} µs one way, "
            f"{times_latency:.1f} times a small message's time in the same round: "
            + {"higher": "in every round the bytes, not the latency, set its time.",
               "lower": "faster than a small message in every round, which only noise can explain: rerun the sweep.",
               "within noise": "in some round it was no slower than a small message: the machine's noise hid the "
                               "bytes' cost."}[verdict])
    return "00.bytes_cost_time", verdict, text, {
        "largest_bytes": largest.bytes, "largest_one_way_s": largest.one_way, "latency_s": pp.latency,
        "times_latency": times_latency, "bandwidth_Bps": pp.bandwidth}


# ---------------------------------------------------------------------------------------------
# The all-reduce: torch's and our ring, against the ring's cost model
# ---------------------------------------------------------------------------------------------


@dataclass
class AllReduceRun:
    """The all-reduce sweep's rows (one per tensor size) and the ring model's prediction of each."""

    rows: list[AllReduceTime]
    predicted: list[float]  # seconds, from the ping-pong's latency and bandwidth

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
                               for r in rows])


def ring_model_verdict(run: AllReduceRun) -> tuple[str, str, str, dict]:
    """The largest all-reduce against the ring model (and the smallest, where only latency counts)."""
    (big, big_predicted), (small, small_predicted) = (run.rows[-1], run.predicted[-1]), (run.rows[0], run.predicted[0])
    big_ratio = big.torch.scaled(1 / big_predicted)  # per round: measured / predicted
    small_ratio = small.torch.scaled(1 / small_predicted)
    verdict = {"higher": "slower than the model", "lower": "faster than the model",
               "within noise": "fits within noise"}[compare(big.torch, Measured.of([big_predicted]))]
    explain = {
        "slower than the model": "slower in every round, so here the model is a lower bound; it leaves out what a "
                                 "ring step costs beyond one message (see the answer above).",
        "faster than the model": "faster in every round: the ping-pong's bandwidth underestimates what a ring step "
                                 "moves.",
        "fits within noise": "the prediction lies within the spread of the rounds.",
    }[verdict]
    text = (f"a {human_bytes(big.bytes)} all-reduce took {big.torch.scaled(1e6):.0f} µs, {big_ratio:.1f}x the "
            f"{big_predicted * 1e6:.0f} µs the model predicts from the ping-pong: {explain} "
            f"At {human_bytes(small.bytes)}, where only the latency term counts, it took {small_ratio:.1f}x the "
            f"model's {small_predicted * 1e6:.0f} µs.")
    return "00.ring_model", verdict, text, {
        "bytes": big.bytes, "measured_s": big.torch, "predicted_s": big_predicted, "ratio": big_ratio,
        "small_ratio": small_ratio}


# ---------------------------------------------------------------------------------------------
# A step on the timeline
# ---------------------------------------------------------------------------------------------


def step_worker(ctx: RankContext, cfg: Config) -> Timeline:
    """`compute_then_communicate` for `cfg.steps` steps of `cfg.matrix_size` matrices; this rank's spans."""
    return compute_then_communicate(ctx, cfg.matrix_size, cfg.steps)


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
    every = compare(extra, Measured.of([0.0])) == verdict
    steps = len(extra.values)
    text = (f"rank {fastest}'s all-reduce box was {extra:.2f} ms longer than rank {slowest}'s (median, min-max over "
            f"{steps} steps): "
            + {"higher": f"in {'every' if every else 'the typical'} step rank {fastest}, with less work, waited inside "
                         f"the all-reduce for rank {slowest}.",
               "lower": f"in the typical step rank {slowest} waited longer, though it had more work: the machine's "
                        "noise was larger than the difference in work on this run.",
               "within noise": "the typical boxes were about as long: the machine's noise was as large as the "
                               "difference in work."}[verdict])
    return "00.fast_rank_waits", verdict, text, {"extra_wait_ms": extra, "steps": steps}

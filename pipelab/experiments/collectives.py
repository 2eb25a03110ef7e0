"""Lesson 00 from a notebook: the ping-pong, the all-reduce sweep and a compute-then-communicate
step on real processes, and what their measurements say.

    cfg = collectives.Config(world_size=2, rounds=5, emulate="2xH100-nvlink")   # refuses bad input here
    pp = experiments.run(collectives.ping_pong_worker, cfg, collectives.gather_ping_pong)
    pipelab.conclude(*collectives.bytes_verdict(pp))

The workers it runs (`ping_pong`, `all_reduce_sweep`, `compute_then_communicate`) and the ring
all-reduce live in `pipelab.collectives`; here they get their parameters from one checked `Config`.

On an emulated node (`emulate=`) every message and collective lasts what the link model gives
(latency + bytes / bandwidth, the ring formulas), so the lesson's fits and predictions meet the
rows they come from; `own_cores(cfg)` is the same run on this machine's own cores, and
`own_cores_verdict` says how the two differ.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Sequence

from pipelab import experiments
from pipelab.checks import whole_number
from pipelab.collectives import (AllReduceTime, MessageTime, all_reduce_sweep, compute_then_communicate,
                                 fit_latency_bandwidth, ping_pong, ring_all_reduce_time, small_message_latency)
from pipelab.display import human_bytes
from pipelab.measure import Measured, compare, spread_words
from pipelab.timeline import Timeline
from pipelab.worker import RankContext


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """Lesson 00's parameters: the ping-pong's message sizes (`sizes_bytes`, each swept `rounds`
    times with `trips` round trips), the all-reduce sweep's tensor sizes and rounds, and the
    compute-then-communicate step (`matrix_size`, `steps`). On an emulated node (`emulate`) the
    step's compute is modelled at `emulated_matrix` x `emulated_matrix` (the math runs at
    `matrix_size`); messages and all-reduces are modelled at their own sizes."""

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
        if self.emulated_matrix is not None:
            whole_number("emulated_matrix", self.emulated_matrix, example="emulated_matrix=4096")
            if self.emulate is None:
                raise ValueError(f"emulated_matrix={self.emulated_matrix} sizes the modelled compute of an emulated "
                                 "node; name one (emulate='2xH100-nvlink') or leave emulated_matrix=None")


def own_cores(cfg: Config) -> Config:
    """The same parameters on this machine's own cores: nothing emulated."""
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
    emulate: str | None = None  # the emulated node it ran on (modelled time), or None: this machine

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
    return PingPongRun(rows, small_message_latency(rows), fit_latency_bandwidth(rows)[1], cfg.emulate)


def bytes_verdict(pp: PingPongRun) -> tuple[str, str, str, dict]:
    """Whether the largest message's bytes, not the latency, set its time, round by round."""
    largest = pp.rows[-1]
    # Round by round, the largest message's time over the small ones': a hiccup of the machine during
    # one round slows both, so it mostly cancels out here.
    times_latency = Measured.of(big / small for big, small in zip(largest.one_way.values, pp.latency.values))
    verdict = compare(times_latency, Measured.of([1.0]))
    share = 1 - 1 / times_latency.median  # of its time, what the bytes cost beyond a small message's
    text = (f"a {human_bytes(largest.bytes)} message took {largest.one_way.scaled(1e6):.1f} µs one way, "
            f"{times_latency:.2f} times a small message's time in the same round: "
            + {"higher": f"in every round its bytes cost time, {share:.0%} of its time beyond the latency.",
               "lower": "faster than a small message in every round, which only noise can explain: rerun the sweep.",
               "within noise": "in some round it was no slower than a small message: the machine's noise hid the "
                               "bytes' cost."}[verdict])
    return "00.bytes_cost_time", verdict, text, {
        "largest_bytes": largest.bytes, "largest_one_way_s": largest.one_way, "latency_s": pp.latency,
        "times_latency": times_latency, "bandwidth_Bps": pp.bandwidth}


def fit_verdict(pp: PingPongRun) -> tuple[str, str, str, dict]:
    """How close the fitted `latency + bytes / bandwidth` comes to the rows it was fitted to, and why
    every row's own bandwidth lies below the fitted one."""
    misfit = pp.misfit()
    largest = pp.rows[-1]
    verdict = "fits" if misfit <= 0.1 else "misses"
    text = (f"the fitted model, {pp.latency.median * 1e6:.2f} µs + bytes / {pp.bandwidth / 1e9:.3g} GB/s, lies within "
            f"{misfit:.1%} of every row's median" + (". " if verdict == "fits" else
            ": a straight line does not describe this sweep (the machine's noise, or a change of protocol "
            "between small and large messages). ")
            + f"A row's bandwidth is its bytes over its whole time, latency included, so it stays below the "
            f"fitted {pp.bandwidth / 1e9:.3g} GB/s, the slope the rows tend to as messages grow: at "
            f"{human_bytes(largest.bytes)} it is {largest.bandwidth.median / 1e9:.3g} GB/s, "
            f"{largest.bandwidth.median / pp.bandwidth:.0%} of it.")
    return "00.fit", verdict, text, {"misfit": misfit, "latency_s": pp.latency.median, "bandwidth_Bps": pp.bandwidth,
                                     "largest_row_Bps": largest.bandwidth.median}


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


def own_cores_verdict(emulated: PingPongRun, own: PingPongRun, small_bytes: int = 4096) -> tuple[str, str, str, dict]:
    """The same ping-pong on this machine's own cores against the emulated link: how much slower its
    latency and bandwidth (the verdict), and whether its small messages' times split in two levels on
    this run (said in the text)."""
    from pipelab.emulate.specs import parse_node

    link = parse_node(emulated.emulate).link
    slower = own.latency.median / emulated.latency.median
    narrower = emulated.bandwidth / own.bandwidth
    small = [v for r in own.rows if r.bytes <= small_bytes for v in r.one_way.values]
    levels = two_levels(small)
    text = (f"on this machine's own cores a small message took {own.latency.scaled(1e6):.1f} µs one way "
            f"(median, min-max over rounds), {slower:.0f}x the emulated {link.name}'s {emulated.latency.median * 1e6:.1f} µs, "
            f"and the fitted bandwidth was {own.bandwidth / 1e9:.3g} GB/s, {narrower:.0f}x below its "
            f"{emulated.bandwidth / 1e9:.3g} GB/s. Here a message is a copy through the kernel's loopback socket: "
            "system calls on both sides, a copy into and out of the kernel's buffers by the same CPU cores that "
            "run the ranks, and a wake-up of the receiving process by the kernel's scheduler; a GPU link moves "
            "the bytes with its own engines. ")
    if levels is not None:
        low, high = levels
        text += (f"On this run the small messages' times (one figure per size and round) fell into two levels: "
                 f"{len(low)} near {statistics.median(low) * 1e6:.0f} µs and {len(high)} near "
                 f"{statistics.median(high) * 1e6:.0f} µs "
                 f"({statistics.median(high) / statistics.median(low):.0f}x). The fast level is a receiver that was "
                 "still running; the slow one a receiver the scheduler had put to sleep, or whose core another "
                 "process held, so the message waited for a wake-up and a time slice. Modelled time has one level.")
    else:
        text += (f"On this run the small messages' times stayed within {max(small) / min(small):.1f}x of each other "
                 "(no two levels).")
    # The verdict is the comparison the cell is about; whether this run's small messages split in two
    # levels is the machine's mood of the moment, so it is said (and kept as a figure), not judged.
    verdict = "slower than the link" if slower > 1 and narrower > 1 else "not slower than the link"
    return "00.own_cores", verdict, text, {
        "own_latency_s": own.latency, "emulated_latency_s": emulated.latency.median, "latency_ratio": slower,
        "own_bandwidth_Bps": own.bandwidth, "emulated_bandwidth_Bps": emulated.bandwidth,
        "bandwidth_ratio": narrower, "two_levels": levels is not None}


# ---------------------------------------------------------------------------------------------
# The all-reduce: torch's and our ring, against the ring's cost model
# ---------------------------------------------------------------------------------------------


@dataclass
class AllReduceRun:
    """The all-reduce sweep's rows (one per tensor size) and the ring model's prediction of each."""

    rows: list[AllReduceTime]
    predicted: list[float]  # seconds, from the ping-pong's latency and bandwidth
    emulate: str | None = None  # the emulated node it ran on (modelled time), or None: this machine

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
                               for r in rows], cfg.emulate)


def ring_model_verdict(run: AllReduceRun, tolerance: float = 0.05) -> tuple[str, str, str, dict]:
    """The largest all-reduce against the ring model (and the smallest, where only latency counts):
    "fits" when every round lies within `tolerance` of the prediction."""
    (big, big_predicted), (small, small_predicted) = (run.rows[-1], run.predicted[-1]), (run.rows[0], run.predicted[0])
    big_ratio = big.torch.scaled(1 / big_predicted)  # per round: measured / predicted
    small_ratio = small.torch.scaled(1 / small_predicted)
    verdict = {"higher": "slower than the model", "lower": "faster than the model",
               "within noise": "fits"}[compare(big_ratio, Measured.of([1 - tolerance, 1 + tolerance]))]
    explain = {
        "slower than the model": "slower in every round, so here the model is a lower bound; it leaves out what a "
                                 "ring step costs beyond one message (see the answer above).",
        "faster than the model": "faster in every round: the ping-pong's bandwidth underestimates what a ring step "
                                 "moves.",
        "fits": f"within {tolerance:.0%} of the prediction"
                + (": on the emulated node every message lasts latency + bytes / bandwidth, and a ring step is one "
                   "message each way at once, so the formula is what the ring costs." if run.emulate else
                   " in some round."),
    }[verdict]
    latency_only = ("T ≈ 2α holds" if abs(small_ratio.median - 1) <= tolerance else
                    "so T ≈ 2α does not hold on this run")
    text = (f"a {human_bytes(big.bytes)} all-reduce took {big.torch.scaled(1e6):.1f} µs, {big_ratio:.2f}x the "
            f"{big_predicted * 1e6:.1f} µs the model predicts from the ping-pong: {explain} "
            f"At {human_bytes(small.bytes)}, where only the latency term counts, it took {small_ratio:.2f}x the "
            f"model's {small_predicted * 1e6:.1f} µs: {latency_only}.")
    return "00.ring_model", verdict, text, {
        "bytes": big.bytes, "measured_s": big.torch, "predicted_s": big_predicted, "ratio": big_ratio,
        "small_ratio": small_ratio}


# ---------------------------------------------------------------------------------------------
# A step on the timeline
# ---------------------------------------------------------------------------------------------


def step_worker(ctx: RankContext, cfg: Config) -> Timeline:
    """`compute_then_communicate` for `cfg.steps` steps of `cfg.matrix_size` matrices (modelled at
    `cfg.emulated_matrix` on an emulated node); this rank's spans."""
    if ctx.emulator is None:
        return compute_then_communicate(ctx, cfg.matrix_size, cfg.steps)
    import torch

    from pipelab.collectives import matmuls, work_of
    from pipelab.emulate.cost import count
    from pipelab.emulate.table import CostTable

    # The math runs at matrix_size; the compute lasts what the device model gives for the emulated
    # matrices (counted on the meta device), the all-reduce what the link gives for their bytes.
    big = torch.empty(*(2 * [cfg.emulated_matrix or cfg.matrix_size]), device="meta")
    ctx.emulator.use(CostTable({("F",): count(matmuls, big, big, work_of(ctx.rank))}))
    ctx.emulator.scale_messages(big.numel() * 4, cfg.matrix_size ** 2 * 4)
    timeline = compute_then_communicate(ctx, cfg.matrix_size, cfg.steps)
    ctx.emulator.scale_messages(1, 1)  # later messages at their own size again
    ctx.emulator.use(None)
    return timeline


def step_flops(matrix_size: int, steps: int, world_size: int = 2) -> float:
    """FLOPs of the compute-then-communicate step's matrix products on all ranks, its warm-up step
    included, counted on the meta device: what the `gpu` profile's budget is estimated from."""
    import torch

    from pipelab.collectives import matmuls, work_of
    from pipelab.emulate.cost import count

    meta = torch.empty(matrix_size, matrix_size, device="meta")
    return (steps + 1) * sum(count(matmuls, meta, meta, work_of(rank)).flops for rank in range(world_size))


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
    text = (f"rank {fastest}'s all-reduce box was {extra:.2f} ms longer than rank {slowest}'s "
            f"({spread_words(extra, f'{steps} steps')}): "
            + {"higher": f"in {'every' if every else 'the typical'} step rank {fastest}, with less work, waited inside "
                         f"the all-reduce for rank {slowest}.",
               "lower": f"in the typical step rank {slowest} waited longer, though it had more work: the machine's "
                        "noise was larger than the difference in work on this run.",
               "within noise": "the typical boxes were about as long: the machine's noise was as large as the "
                               "difference in work."}[verdict])
    return "00.fast_rank_waits", verdict, text, {"extra_wait_ms": extra, "steps": steps}

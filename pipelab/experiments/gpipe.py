"""Lesson 06's conclusions, each computed from the runs it speaks of (`experiments.pipeline` runs
them): GPipe's bubble against (p-1)/(m+p-1) and against m, the stash each rank keeps, and what
activation checkpointing trades. Each verdict returns (key, verdict, text, figures) for
`pipelab.conclude`; tables carry the other figures."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from torch import nn

from pipelab.emulate import Emulated, anchors, node_of
from pipelab.experiments.pipeline import Config, PipelineRun, pooled_bubble, run
from pipelab.pipeline.waits import recv_waits, send_waits
from pipelab.measure import Measured, compare, ratios
from pipelab.pipeline.simulate import SimResult, gpipe_bubble

# How far the bubble may stand from (p-1)/(m+p-1) at every m of the sweep on an emulated node: the
# messages' link time is all the formula leaves out there.
FORMULA_TOLERANCE = 0.03

Verdict = tuple[str, str, str, dict]  # (key, verdict, text, figures): a cell calls pipelab.conclude(*it)


def how(run: PipelineRun) -> str:
    """How the run's times came about: "modelled" (on an emulated node) or "measured"."""
    return "modelled" if run.modelled else "measured"


def typical_step(run: PipelineRun) -> str:
    """Which timed step a picture of `run.timeline` shows, and how its length compares."""
    shown = run.steps.typical_index
    return (f"The figure shows timed step {shown + 1} of {len(run.steps.seconds)} (the one of median length), "
            f"{run.steps.seconds[shown] * 1e3:.1f} ms ({how(run)}) from the barrier to the slowest rank's end.")


def bubble_vs_formula(run: PipelineRun, fitted: SimResult) -> Verdict:
    """06: the run's bubble against (p-1)/(m+p-1); `bubble_rows` gives the simulation and the waits."""
    p, m = run.schedule.num_ranks, run.schedule.num_microbatches
    bubble, formula = run.bubble_fraction, gpipe_bubble(p, m)
    verdict = "above" if bubble.low > formula else "below" if bubble.high < formula else "at"
    return ("06.bubble_vs_formula", f"{verdict} the formula",
            f"at p={p}, m={m} the run's {how(run)} bubble was {bubble.median:.3f}, {verdict} the formula's "
            f"(p-1)/(m+p-1) = {formula:.3f}.", dict(bubble=bubble, formula=formula, simulated=fitted.bubble_fraction))


def bubble_rows(run: PipelineRun, fitted: SimResult) -> list[dict]:
    """06: the bubble beside the formula and the simulation, and what the recv boxes waited for (ms)."""
    for_sender, for_message = recv_waits(run.timeline)
    p, m = run.schedule.num_ranks, run.schedule.num_microbatches
    return [{f"bubble ({how(run)})": f"{run.bubble_fraction:.3f}", "(p-1)/(m+p-1)": round(gpipe_bubble(p, m), 3),
             "simulated, free messages": round(fitted.bubble_fraction, 3),
             "recv waiting for the sender (ms)": round(for_sender * 1e3, 2),
             "recv waiting for the message (ms)": round(for_message * 1e3, 2)}]


def bubble_vs_m(runs: Sequence[PipelineRun], largest: Measured) -> tuple[Verdict, float]:
    """06: how the bubble moved from the sweep's smallest m (`runs[0]`) to its largest (`largest`:
    every repeat there); also the largest distance between a median and the formula."""
    first, p = runs[0].bubble_fraction, runs[0].schedule.num_ranks
    m0, m1 = runs[0].schedule.num_microbatches, runs[-1].schedule.num_microbatches
    medians = [r.bubble_fraction.median for r in runs[:-1]] + [largest.median]
    gap = max(abs(b - gpipe_bubble(p, r.schedule.num_microbatches)) for b, r in zip(medians, runs))
    direction = compare(largest, first)
    return (("06.bubble_vs_m", direction,
             f"from m={m0} to m={m1} the run's {how(runs[0])} bubble went from {first.median:.3f} to "
             f"{largest.median:.3f}: {direction}.", dict(first=first, last=largest, largest_gap=gap)), gap)


def same_run_twice(first: PipelineRun, again: PipelineRun) -> Verdict:
    """06: the first run and the sweep's run of the same schedule at the same m, side by side."""
    a, b = first.bubble_fraction.median, again.bubble_fraction.median
    same = f"{a:.3f}" == f"{b:.3f}"  # the same to the printed digit
    why = (f"the same, {a:.3f}: on the emulated node every span lasts its modelled time, whatever else the machine "
           f"runs" if same else f"{a:.3f} and {b:.3f}: this machine's load moved between the two runs")
    return ("06.same_run_twice", "same" if same else "different",
            f"at m={first.schedule.num_microbatches} the first run's bubble and the sweep's identical run's were "
            f"{why}.", dict(first=first.bubble_fraction, again=again.bubble_fraction))


def send_time(run: PipelineRun) -> Verdict:
    """06: whether the sends of the typical step held their senders up (`send_waits`; `send_rows`: the split)."""
    w = send_waits(run.timeline)
    where = ("never" if w["blocked"] <= 1e-9 else "only at the end of the step"
             if w["blocked at the end"] >= w["blocked"] - 1e-9 else "within the step")
    verdict = "sends never held their senders up" if where == "never" else f"sends held their senders up {where}"
    return ("06.send_time", verdict,
            f"in the step shown, messages flew {w['in flight'] * 1e3:.2f} ms ({how(run)}), "
            f"{w['computing'] * 1e3:.2f} ms of it while the sender computed: {verdict}.",
            {f"{k.replace(' ', '_')}_ms": v * 1e3 for k, v in w.items()})


def send_rows(run: PipelineRun) -> list[dict]:
    """06: the typical step's message time (ms, summed over ranks) by what the sender did meanwhile."""
    return [{f"{k} (ms, {how(run)})": round(v * 1e3, 3) for k, v in send_waits(run.timeline).items()}]


def memory_estimates(cfg: Config, microbatches: int, checkpoint: bool = False) -> list[str]:
    """06: before anything runs, what each stage would hold at its peak on the emulated device with
    GPipe's `microbatches` in flight, and the activation-sized tensors a micro-batch stashes there
    (every stage's input counted, stage 0's batch slice too, which the real model's counter leaves out)."""
    tensors = {s: e.stash_bytes / e.output_bytes for s, e in cfg.emulated.stages.items()}
    return [f"at the emulated size, {cfg.emulated.memory(s, microbatches, checkpoint).sentence()}" for s in tensors] + [
        "activation-sized tensors stashed per micro-batch at the emulated size (every input counted): "
        + ", ".join(f"stage {s} {n:g}" for s, n in tensors.items())]


def memory_measured(cfg: Config, runs: Sequence[PipelineRun]) -> tuple[Verdict, float]:
    """06: every rank's memory meter peak at the emulated size in every run against the estimate made
    before it ran (GPipe: all m micro-batches in flight); also the largest relative difference."""
    worst, highest = 0.0, 0.0
    for run in runs:
        for rank, peak in run.peak_bytes.items():
            estimate = cfg.emulated.memory(rank, run.schedule.num_microbatches, run.checkpoint).total
            worst, highest = max(worst, abs(peak - estimate) / estimate), max(highest, peak)
    device = cfg.emulated.node.device
    verdict = "as estimated" if worst < 1e-6 else "not as estimated"
    return (("06.emulated_memory", verdict,
             f"the ranks' memory meters at the emulated size peaked {verdict}; the highest held "
             f"{highest / 1e9:.2f} GB of the {device.memory_bytes / 1e9:g} GB {device.name}.",
             dict(largest_relative_difference=worst, highest_GB=highest / 1e9)), worst)


def throughput_ratio(run: PipelineRun, base: PipelineRun) -> float:
    """Samples per second of `run` over `base`'s (typical steps)."""
    return (run.schedule.num_microbatches / run.step_time.median) / (base.schedule.num_microbatches / base.step_time.median)


def on_published_hardware(cfg: Config, key: str = "torchgpipe_amoebanet_n2_m4", ms: Sequence[int] = (1, 4),
                          dtype: str = "float32") -> dict[int, PipelineRun]:
    """06: GPipe at each m of `ms` again, the same stages at the emulated size and the same batches as
    `cfg`'s runs, on the hardware anchor `key` was published on (torchgpipe's Tesla P40s, in float32:
    a P40 has no bfloat16), by m, in one warm-up and one timed step (modelled time: every step alike);
    {} where nothing is emulated or that hardware is not modelled."""
    node = anchors.published_node(key, cfg.world_size)
    jobs = {j.schedule.num_microbatches: j for j in cfg.jobs if not j.checkpoint}
    if cfg.emulate is None or node is None or not set(ms) <= set(jobs):
        return {}
    again = dataclasses.replace(cfg, schedules=["gpipe"] * len(ms), num_microbatches=list(ms),
                                x=[jobs[m].x for m in ms], y=[jobs[m].y for m in ms], checkpoint=False,
                                steps=min(cfg.steps, 2), emulate=Emulated(node, **{**cfg.emulate.size, "dtype": dtype}))
    return dict(zip(ms, run(again)))


def published_beside(runs: Sequence[PipelineRun], again: dict[int, PipelineRun] | None = None) -> list[dict]:
    """06: torchgpipe's and GPipe's two-partition speed-ups at m = 4 (and 32) over m = 1 beside this
    sweep's and, where given, the same on the published hardware (`on_published_hardware`); each
    column names its hardware, and each row gives the bubble of this sweep's run at that m."""
    by_m = {r.schedule.num_microbatches: r for r in runs}
    here = f"here ({how(runs[0])}, {node_of(runs[0].node) if runs[0].node else 'this machine'})"
    first = next(iter(again.values())) if again else None
    there = f"on the published hardware ({how(first)}, {node_of(first.node)})" if first else "on the published hardware"
    rows = []
    for m in (4, 32):
        if m not in by_m or 1 not in by_m or runs[0].schedule.num_ranks != 2:
            continue
        for who in ("torchgpipe", "gpipe"):
            key = f"{who}_amoebanet_n2_m{m}"
            on_it = anchors.published_node(key, 2) and again and {1, m} <= set(again)
            rows.append({"what": anchors.anchor(key).what, "published": anchors.anchor(key).value,
                         "published on": anchors.published_hardware(key),
                         here: round(throughput_ratio(by_m[m], by_m[1]), 3),
                         there: round(throughput_ratio(again[m], again[1]), 3) if on_it else "-",
                         f"bubble here ({how(by_m[m])})": round(by_m[m].bubble_fraction.median, 3)})
    return rows


def negligible_bubble(runs: Sequence[PipelineRun]) -> Verdict:
    """06: the bubble GPipe calls negligible (from M = 4K micro-batches), and why GPipe could: it
    re-materialises, and a re-computation need not wait for the gradient."""
    p = runs[0].schedule.num_ranks
    formula = gpipe_bubble(p, 4 * p)
    return ("06.published", "beside",
            f"at M = 4K the formula still leaves {formula:.3f} of the step idle at K={p}: GPipe calls it negligible "
            "because its re-computations can run in that idle time.", dict(formula=formula))


def speedup_vs_published(runs: Sequence[PipelineRun]) -> Verdict | None:
    """06: the throughput at m = 4 over m = 1 on 2 partitions against a balanced pipe with free
    messages (None unless the sweep ran both on 2 ranks)."""
    by_m = {r.schedule.num_microbatches: r for r in runs}
    if runs[0].schedule.num_ranks != 2 or not {1, 4} <= set(by_m):
        return None
    ideal, ours = (4 / 5) / (1 / 2), throughput_ratio(by_m[4], by_m[1])
    verdict = "above the ideal" if ours > ideal else "below the ideal"
    return ("06.speedup_vs_ideal", verdict, f"m = 4 over m = 1 gained {ours:.2f}x ({how(runs[0])}), {verdict} "
            f"{ideal:.2f}x of a balanced pipe with free messages.", dict(ideal=ideal, this_run=ours))


def stashed_tensors(stages: Sequence[nn.Module]) -> dict[int, int]:
    """Per stage of an MLP, the micro-batch-sized tensors its forward stashes for the backward:
    each ReLU's output (the next Linear's input: one tensor, counted once), the activation it
    received (not on stage 0, whose input is the batch, which lives anyway), and on the last stage
    the output its loss needs."""
    last = len(stages) - 1
    return {s: sum(isinstance(layer, nn.ReLU) for layer in stage) + (s > 0) + (s == last)
            for s, stage in enumerate(stages)}


def stash_per_rank(run: PipelineRun, stages: Sequence[nn.Module], activation_bytes: int) -> tuple[Verdict, dict]:
    """06: the tensors of `activation_bytes` each rank of a GPipe run (one stage per rank) of the
    small real model stashed per micro-batch at its peak; also those counts by rank."""
    m = run.schedule.num_microbatches
    per_mb = {rank: round(b / m / activation_bytes, 6) for rank, b in run.peak_stash_bytes.items()}
    return (("06.stash_per_rank", "as counted",
             "per micro-batch of the small real model (its batch left out: it lives anyway), "
             + ", ".join(f"rank {rank} kept {n:g}" for rank, n in per_mb.items()) + " activations, as counted.",
             {f"rank{rank}_tensors_per_microbatch": n for rank, n in per_mb.items()}), per_mb)


def step_ms(rounds: Sequence[PipelineRun]) -> Measured:
    """The typical step time (ms) of each of several rounds of one run, as repeats."""
    return Measured.of(r.step_time.median * 1e3 for r in rounds)


def checkpoint_rows(stored: Sequence[PipelineRun], recomputed: Sequence[PipelineRun]) -> list[dict]:
    """Rounds with activations stored and recomputed, a row each way: the step and bubble, and each
    rank's peak memory at the emulated size beside the small real model's stash, each labelled."""
    return [{"activations": way, "m": group[0].schedule.num_microbatches,
             f"step ms ({how(group[0])})": f"{step_ms(group):.1f}", "bubble": f"{pooled_bubble(group):.3f}",
             **{f"rank {rank} peak GB, emulated size": round(b / 1e9, 2) for rank, b in group[0].peak_bytes.items()},
             **{f"rank {rank} peak stash MiB, small real model": round(mib, 2)
                for rank, mib in group[0].peak_stash_mib.items()}}
            for way, group in (("stored", stored), ("recomputed", recomputed))]


def checkpoint_memory(stored: PipelineRun, recomputed: PipelineRun) -> Verdict:
    """06: the peak stash of every rank with activations recomputed against stored (`checkpoint_rows`)."""
    before, after = stored.peak_stash_mib, recomputed.peak_stash_mib
    smaller = all(after[rank] < before[rank] for rank in before)
    least = min(before[rank] / after[rank] for rank in before)
    return ("06.checkpoint_memory", "smaller" if smaller else "not smaller",
            f"recomputing activations cut every rank's peak stash of the small real model at least {least:.1f}x: "
            "one micro-batch's stash plus the other inputs, as predicted.",
            {f"rank{rank}_{way}_MiB": mib[rank] for way, mib in (("stored", before), ("recomputed", after))
             for rank in before})


def checkpoint_time(stored: Sequence[PipelineRun], recomputed: Sequence[PipelineRun],
                    sim_stored: SimResult, sim_recomputed: SimResult) -> Verdict:
    """06: how much longer a step with recomputed activations took, round by round (the rounds ran
    by turns), against the simulator's prediction with the same costs."""
    slowdown = ratios([r.step_time.median for r in recomputed], [r.step_time.median for r in stored])
    expected = sim_recomputed.makespan_ms / sim_stored.makespan_ms
    verdict = "slower" if slowdown.low > 1 else "faster" if slowdown.high < 1 else "within noise"
    return ("06.checkpoint_time", verdict,
            f"with recomputed activations a step took {slowdown.median:.2f} times as long ({how(stored[0])}): "
            f"{verdict}; the simulation with these costs predicts {expected:.2f} times.",
            dict(slowdown=slowdown, simulated=expected))


# The parameters cell's defaults that `run_flops` reads.
DEFAULTS = dict(width=256, layers=8, microbatch_size=32, microbatches=4, sweep=[1, 2, 4, 8], steps=3, repeats=2)


def run_flops(params: dict) -> float:
    """FLOPs of lesson 06 at the notebook parameters `params` (missing names: the notebook's
    defaults), counted on the meta device: `steps` steps of the first run and of every run of the
    sweep, the `repeats` rounds at the sweep's largest m stored and recomputed (one more forward
    per micro-batch), each run's one-process reference, and the hand-written worker's step."""
    import torch

    from pipelab.emulate.cost import forward_backward_counts
    from pipelab.models import mlp

    p = {**DEFAULTS, **params}
    with torch.device("meta"):
        model, x = mlp([p["width"]] * (p["layers"] + 1)), torch.empty(p["microbatch_size"], p["width"])
    forward, b_in, b_w = (c.flops for c in forward_backward_counts(model, x))
    m, sweep, largest, steps, repeats = p["microbatches"], p["sweep"], max(p["sweep"]), p["steps"], p["repeats"]
    pipelined = steps * (m + sum(sweep) + 2 * repeats * largest) + m
    return (forward + b_in + b_w) * (pipelined + m + sum(sweep)) + forward * steps * repeats * largest

"""Lesson 06's conclusions, each computed from the runs it speaks of (`experiments.pipeline`
runs them): GPipe's measured bubble against (p-1)/(m+p-1) and against m, the stash each rank keeps,
and what activation checkpointing trades. Each verdict function states its conclusion with
`pipelab.conclude`."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from pipelab.display import conclude
from pipelab.emulate import anchors
from pipelab.experiments.pipeline import Config, PipelineRun, pooled_bubble, recv_waits, send_waits
from pipelab.measure import Measured, compare, ratios, spread_words
from pipelab.pipeline.simulate import SimResult, gpipe_bubble
from pipelab.timeline import Timeline

# How far the bubble may stand from (p-1)/(m+p-1) at every m of the sweep on an emulated node: the
# messages' link time is all the formula leaves out there.
FORMULA_TOLERANCE = 0.03


def typical_step(run: PipelineRun) -> str:
    """Which timed step a picture of `run.timeline` shows, and how its length compares."""
    shown = run.steps.typical_index
    return (f"The figure shows timed step {shown + 1} of {len(run.steps.seconds)} (the one of median length): "
            f"its boxes span {run.timeline.makespan * 1e3:.1f} ms, and the step took "
            f"{run.steps.seconds[shown] * 1e3:.1f} ms from the barrier to the slowest rank's end. The table's "
            "step_ms is the median of all timed steps' times.")


def bubble_vs_formula(run: PipelineRun, fitted: SimResult) -> None:
    """06: the measured bubble against (p-1)/(m+p-1), beside the simulation with the typical
    step's measured costs (`fitted`), and what the recv boxes of that step waited for."""
    p, m = run.schedule.num_ranks, run.schedule.num_microbatches
    bubble, formula = run.bubble_fraction, gpipe_bubble(p, m)
    for_sender, for_message = recv_waits(run.timeline)
    verdict = "above" if bubble.low > formula else "below" if bubble.high < formula else "at"
    conclude(
        "06.bubble_vs_formula", f"{verdict} the formula",
        f"the run's bubble at p={p}, m={m} was {bubble:.3f} ({spread_words(bubble)}), "
        f"{verdict} the formula's (p-1)/(m+p-1) = {formula:.3f}. The simulation with this run's per-stage "
        f"costs and free messages gives {fitted.bubble_fraction:.3f}. In the step shown, the ranks spent "
        f"{for_sender * 1e3:.1f} ms in recv boxes waiting for the sender to finish its action and "
        f"{for_message * 1e3:.1f} ms waiting for messages already sent.",
        measured=bubble, formula=formula, simulated=fitted.bubble_fraction,
        recv_waiting_for_sender_ms=for_sender * 1e3, recv_waiting_for_message_ms=for_message * 1e3)


def bubble_vs_m(runs: Sequence[PipelineRun], largest: Measured) -> float:
    """06: how the measured bubble moved from the sweep's smallest m (`runs[0]`) to its largest
    (`largest`: every repeat at that m), beside the formula and the simulation; returns the
    largest distance between a median and the formula over the sweep."""
    first, p = runs[0].bubble_fraction, runs[0].schedule.num_ranks
    m0, m1 = runs[0].schedule.num_microbatches, runs[-1].schedule.num_microbatches
    medians = [r.bubble_fraction.median for r in runs[:-1]] + [largest.median]
    gap = max(abs(b - gpipe_bubble(p, r.schedule.num_microbatches)) for b, r in zip(medians, runs))
    falls = all(b > c for b, c in zip(medians, medians[1:]))
    direction = compare(largest, first)
    conclude(
        "06.bubble_vs_m", direction,
        f"from m={m0} to m={m1} the run's bubble went from {first:.3f} to {largest:.3f} "
        f"({spread_words(largest)}): {direction}. The formula goes from {gpipe_bubble(p, m0):.3f} to {gpipe_bubble(p, m1):.3f}, "
        f"the simulation with each step's own costs from {runs[0].simulated_bubble.median:.3f} to "
        f"{runs[-1].simulated_bubble.median:.3f}. The run's bubble " + ("fell at every step of the sweep" if falls
        else "did not fall at every step of the sweep") + f" and stood at most {gap:.3f} from the formula "
        + (f"(within {FORMULA_TOLERANCE})." if gap <= FORMULA_TOLERANCE else
           f"(more than {FORMULA_TOLERANCE}: something beside fill and drain took time)."),
        first=first, last=largest, largest_gap=gap)
    return gap


def same_run_twice(first: PipelineRun, again: PipelineRun) -> None:
    """06: the first run and the sweep's run of the same schedule at the same m, side by side."""
    a, b = first.bubble_fraction, again.bubble_fraction
    m = first.schedule.num_microbatches
    same = a.median == b.median
    why = ("the same: on an emulated node every span lasts what the cost model gives, on a logical clock, "
           "whatever else the machine runs" if same else
           f"{abs(a.median - b.median):.3f} apart: the ranks ran on this machine's cores, whose load moved between "
           "the two runs")
    conclude("06.same_run_twice", "same" if same else "different",
             f"at m={m} the first run's bubble was {a:.3f} and the sweep's identical run's {b:.3f}: {why}.",
             first=a, again=b)


def send_time(run: PipelineRun) -> None:
    """06: what the send boxes of the typical step stand for: how long messages were in flight,
    and what their senders did meanwhile (`send_waits`): computed, waited in a recv box for
    another message, or waited for the send itself (and whether only at the end of the step)."""
    w = send_waits(run.timeline)
    hatched = w["in recv"] + w["blocked"]
    if w["blocked"] <= 1e-9:
        verdict = "sends never held their senders up"
    elif w["blocked at the end"] >= w["blocked"] - 1e-9:
        verdict = "sends held their senders up only at the end of the step"
    else:
        verdict = "sends held their senders up within the step"
    conclude(
        "06.send_time", verdict,
        f"in the step shown, messages were in flight for {w['in flight'] * 1e3:.2f} ms in all (send boxes, from "
        f"the issue to the arrival), {w['computing'] * 1e3:.2f} ms of it while the sender computed its next action. "
        f"The hatched {hatched * 1e3:.2f} ms are message time while the sender computed nothing: "
        f"{w['in recv'] * 1e3:.2f} ms waiting in a recv box for another message (its bubble) and "
        f"{w['blocked'] * 1e3:.2f} ms waiting for a send to leave, {w['blocked at the end'] * 1e3:.2f} ms of them "
        f"after its last action, where P2P.finish waits for the step's last messages: {verdict}.",
        **{f"{k.replace(' ', '_')}_ms": v * 1e3 for k, v in w.items()})


def memory_estimates(cfg: Config, microbatches: int, checkpoint: bool = False) -> list[str]:
    """06: before anything runs, what each stage would hold on the emulated node's device at its
    peak with GPipe's `microbatches` micro-batches in flight (`emulate.memory`)."""
    return [cfg.memory_estimate(s, microbatches, checkpoint).sentence() for s in range(len(cfg.stages))]


def memory_measured(cfg: Config, runs: Sequence[PipelineRun]) -> float:
    """06: the emulated memory meter's peak of every rank in every run against the estimate made
    before it ran (GPipe: all m micro-batches in flight); returns the largest relative difference."""
    worst, rows = 0.0, []
    for run in runs:
        m = run.schedule.num_microbatches
        for rank, peak in run.emulated_peak_bytes.items():
            estimate = cfg.memory_estimate(rank, m, run.checkpoint).total
            worst = max(worst, abs(peak - estimate) / estimate)
            rows.append((m, run.checkpoint, rank, peak))
    m, _, rank, peak = max(rows, key=lambda r: r[3])
    device = cfg.memory_estimate(0, 1).device
    verdict = "as estimated" if worst < 1e-6 else "not as estimated"
    conclude("06.emulated_memory", verdict,
             f"the ranks' memory meters (every stash and release of the runs, at the emulated size) peaked within "
             f"{worst:.1e} of the estimates made before the runs; the highest, rank {rank} at m={m}, "
             f"{peak / 1e9:.2f} GB of the {device.memory_bytes / 1e9:g} GB {device.name}.",
             largest_relative_difference=worst, highest_GB=peak / 1e9)
    return worst


def throughput_ratio(run: PipelineRun, base: PipelineRun) -> float:
    """Samples per second of `run` over `base`'s (typical steps)."""
    return (run.schedule.num_microbatches / run.step_time.median) / (base.schedule.num_microbatches / base.step_time.median)


def published_beside(runs: Sequence[PipelineRun]) -> list[dict]:
    """06: the GPipe paper's bubble statement and torchgpipe's two-partition speed-ups beside this
    sweep's figures (`emulate.anchors.beside`): the m/p of the sweep's run at m = 4p and the
    throughput at m = 4 (and 32) over m = 1, each with the bubble measured at that m."""
    by_m = {r.schedule.num_microbatches: r for r in runs}
    p = runs[0].schedule.num_ranks
    rows = []
    if 4 * p in by_m:
        rows.append((anchors.beside("gpipe_negligible_bubble_m_over_p", 4.0), by_m[4 * p]))
    for m in (4, 32):
        if m in by_m and 1 in by_m and p == 2:
            for who in ("torchgpipe", "gpipe"):
                rows.append((anchors.beside(f"{who}_amoebanet_n2_m{m}", throughput_ratio(by_m[m], by_m[1])), by_m[m]))
    return [{**{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "source"},
             "emulated bubble there": round(run.bubble_fraction.median, 3)} for row, run in rows]


def why_published_differ(runs: Sequence[PipelineRun]) -> None:
    """06: why the published figures differ from the emulated ones, from the figures themselves:
    the bubble GPipe calls negligible at M = 4K, and the ideal speed-up of a balanced pipe against
    the emulated and torchgpipe's."""
    by_m = {r.schedule.num_microbatches: r for r in runs}
    p = runs[0].schedule.num_ranks
    text = (f"GPipe calls the bubble negligible from M = 4K micro-batches; there the formula leaves "
            f"{gpipe_bubble(p, 4 * p):.3f} of the step idle at K = {p} (it tends to 0.2 as K grows)")
    if 4 * p in by_m:
        text += f", and this run {by_m[4 * p].bubble_fraction.median:.3f}"
    figures = {}
    if p == 2 and 4 in by_m and 1 in by_m:
        ideal = (4 / (4 + p - 1)) / (1 / p)  # a balanced pipe, messages free, the same work per micro-batch
        ours, theirs = throughput_ratio(by_m[4], by_m[1]), anchors.anchor("torchgpipe_amoebanet_n2_m4").value
        gpipes = anchors.anchor("gpipe_amoebanet_n2_m4").value
        extra = {m: by_m[m].bubble_fraction.median - gpipe_bubble(p, m) for m in (1, 4)}
        why = ("above it: the messages' link time added more to the m = 1 step's bubble "
               f"(+{extra[1]:.3f}) than to the m = 4 step's (+{extra[4]:.3f})" if ours > ideal else
               f"below it: the messages' link time and waits (+{extra[4]:.3f} of bubble at m = 4)")
        text += (f". At m = 4 over m = 1 on 2 partitions, a balanced pipe with free messages gains {ideal:.2f}x; "
                 f"this run {ours:.3f}x, {why}; torchgpipe {theirs:.2f}x ({theirs / ideal:.0%} of the ideal) and "
                 f"GPipe's own table {gpipes:.2f}x ({gpipes / ideal:.0%}). Theirs are AmoebaNet-D on real "
                 "accelerators (Tesla P40s for torchgpipe): unequal partitions, re-materialisation, copies between "
                 "devices and how efficiently a GPU runs each micro-batch all cost time that this cost "
                 "model, with equal MLP stages and the same work per micro-batch, does not have")
        figures = {"ideal": ideal, "this run": ours, "torchgpipe": theirs, "gpipe": gpipes}
    conclude("06.published", "beside", text + ".", **figures)


def stashed_tensors(stages: Sequence[nn.Module]) -> dict[int, int]:
    """Per stage of an MLP, the micro-batch-sized tensors its forward stashes for the backward:
    each ReLU's output (the next Linear's input: one tensor, counted once), the activation it
    received (not on stage 0, whose input is the batch, which lives anyway), and on the last stage
    the output its loss needs."""
    last = len(stages) - 1
    return {s: sum(isinstance(layer, nn.ReLU) for layer in stage) + (s > 0) + (s == last)
            for s, stage in enumerate(stages)}


def stash_per_rank(run: PipelineRun, stages: Sequence[nn.Module], activation_bytes: int) -> dict[int, float]:
    """06: the tensors of `activation_bytes` each rank of a GPipe run (one stage per rank) stashed
    per micro-batch, as measured at its peak; concluded with what each stage keeps and the peak's bytes."""
    m, last = run.schedule.num_microbatches, len(stages) - 1
    per_mb = {rank: b / m / activation_bytes for rank, b in run.peak_stash_bytes.items()}

    def why(s: int) -> str:
        relus = sum(isinstance(layer, nn.ReLU) for layer in stages[s])
        return (f"{relus} ReLU outputs" + (", the activation it received" if s > 0 else "")
                + (", the output its loss needs" if s == last else ""))

    conclude(
        "06.stash_per_rank", "as counted",
        f"per micro-batch, each stashing {activation_bytes / 1024:.0f} KiB tensors: "
        + "; ".join(f"rank {rank} kept {n:.0f} ({why(rank)})" for rank, n in per_mb.items())
        + f". At m={m}: " + ", ".join(f"rank {rank} {mib:.1f} MiB" for rank, mib in run.peak_stash_mib.items()) + ".",
        **{f"rank{rank}_tensors_per_microbatch": n for rank, n in per_mb.items()})
    return per_mb


def step_ms(rounds: Sequence[PipelineRun]) -> Measured:
    """The typical step time (ms) of each of several rounds of one run, as repeats."""
    return Measured.of(r.step_time.median * 1e3 for r in rounds)


def checkpoint_rows(stored: Sequence[PipelineRun], recomputed: Sequence[PipelineRun]) -> list[dict]:
    """Rounds with activations stored and recomputed, a table row each way: step time, bubble and
    memory at one size. On an emulated node: the modelled step and the memory meter's peak at the
    emulated size (parameters, gradients and optimizer state included); elsewhere the measured step
    and the real stash's peak (the small model's: `stash_rows` gives it on an emulated node too)."""
    emulated = bool(stored[0].emulated_peak_bytes)
    step = "step_ms, modelled" if emulated else "step_ms"
    return [{"activations": how, "m": group[0].schedule.num_microbatches, step: f"{step_ms(group):.1f}",
             "bubble": f"{pooled_bubble(group):.3f}",
             **({f"rank {rank} peak GB at the emulated size": round(b / 1e9, 2)
                 for rank, b in group[0].emulated_peak_bytes.items()} if emulated else
                {f"rank {rank} peak stash MiB": round(mib, 2) for rank, mib in group[0].peak_stash_mib.items()})}
            for how, group in (("stored", stored), ("recomputed", recomputed))]


def stash_rows(stored: Sequence[PipelineRun], recomputed: Sequence[PipelineRun]) -> list[dict]:
    """The same rounds' real stash at the peak, per rank: what this machine's small model kept."""
    return [{"activations": how, **{f"rank {rank} peak stash MiB (real size)": round(mib, 2)
                                    for rank, mib in group[0].peak_stash_mib.items()}}
            for how, group in (("stored", stored), ("recomputed", recomputed))]


def checkpoint_memory(stored: PipelineRun, recomputed: PipelineRun) -> None:
    """06: the peak stash of every rank with activations recomputed against stored."""
    before, after = stored.peak_stash_mib, recomputed.peak_stash_mib
    smaller = all(after[rank] < before[rank] for rank in before)
    conclude(
        "06.checkpoint_memory", "smaller" if smaller else "not smaller",
        "with recomputed activations the peak stash was "
        + ", ".join(f"rank {rank} {after[rank]:.2f} MiB against {before[rank]:.2f} "
                    f"({before[rank] / after[rank]:.1f}x less)" for rank in before)
        + ": one micro-batch's stash plus the other inputs, as predicted.",
        **{f"rank{rank}_{how}_MiB": mib[rank] for how, mib in (("stored", before), ("recomputed", after))
           for rank in before})


def checkpoint_time(stored: Sequence[PipelineRun], recomputed: Sequence[PipelineRun],
                    sim_stored: SimResult, sim_recomputed: SimResult) -> str:
    """06: how much longer a step with recomputed activations took, round by round (the rounds
    ran by turns), against the simulator's prediction and against the work a rank adds: one more
    forward per micro-batch, F / (F + B) of its work with stored activations."""
    slowdown = ratios([r.step_time.median for r in recomputed], [r.step_time.median for r in stored])
    expected = sim_recomputed.makespan_ms / sim_stored.makespan_ms
    F, b_in, b_w = sim_stored.costs.per_stage.get(0, (sim_stored.costs.forward, sim_stored.costs.backward_input,
                                                      sim_stored.costs.backward_weight))[:3]
    more = F / (F + b_in + b_w)
    verdict = "slower" if slowdown.low > 1 else "faster" if slowdown.high < 1 else "within noise"
    text = (f"a step with recomputed activations took {slowdown:.2f} times as long as one with stored activations "
            f"({spread_words(slowdown, f'{len(stored)} rounds run by turns')}): {verdict}. Stage 0's forward costs {F:.2f} ms "
            f"and its backward {b_in + b_w:.2f} ms here, so one more forward adds F / (F + B) = {more:.0%} to a rank's "
            f"work; the simulation with these costs predicts {expected:.2f} times the step.")
    if verdict != "slower":
        text += " The machine's noise is as large as the effect here: the simulated figure is the cost to expect."
    conclude("06.checkpoint_time", verdict, text, slowdown=slowdown, simulated=expected, added_work=more)


def run_flops(width: int, layers: int, microbatch_size: int, microbatches: int, sweep: Sequence[int], steps: int,
              repeats: int) -> float:
    """FLOPs of lesson 06's runs at a profile's size, counted on the meta device: `steps` steps of the
    first run and of every run of the sweep, the `repeats` rounds at the sweep's largest m stored and
    recomputed (one more forward per micro-batch), each run's one-process reference, and the
    hand-written worker's step."""
    import torch

    from pipelab.emulate.cost import forward_backward_counts
    from pipelab.models import mlp

    with torch.device("meta"):
        model, rows = mlp([width] * (layers + 1)), torch.empty(microbatch_size, width)
    forward, b_in, b_w = (c.flops for c in forward_backward_counts(model, rows))
    per_mb = forward + b_in + b_w
    largest = max(sweep)
    pipelined = steps * (microbatches + sum(sweep) + 2 * repeats * largest) + microbatches
    return per_mb * (pipelined + microbatches + sum(sweep)) + forward * steps * repeats * largest

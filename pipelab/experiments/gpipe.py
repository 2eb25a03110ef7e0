"""Lesson 06's conclusions, each computed from the runs it speaks of (`experiments.pipeline`
runs them): GPipe's measured bubble against (p-1)/(m+p-1) and against m, the stash each rank keeps,
and what activation checkpointing trades. Each verdict function states its conclusion with
`pipelab.conclude`."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from pipelab.display import conclude
from pipelab.experiments.pipeline import PipelineRun, pooled_bubble, recv_waits
from pipelab.measure import Measured, compare, ratios
from pipelab.pipeline.simulate import SimResult, gpipe_bubble


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
        f"the measured bubble at p={p}, m={m} was {bubble:.3f} (median, min-max over the timed steps), "
        f"{verdict} the formula's (p-1)/(m+p-1) = {formula:.3f}. The simulation with this run's measured per-stage "
        f"costs and free messages gives {fitted.bubble_fraction:.3f}. In the step shown, the ranks spent "
        f"{for_sender * 1e3:.1f} ms in recv boxes waiting for the sender to finish its action and "
        f"{for_message * 1e3:.1f} ms waiting for messages already sent.",
        measured=bubble, formula=formula, simulated=fitted.bubble_fraction,
        recv_waiting_for_sender_ms=for_sender * 1e3, recv_waiting_for_message_ms=for_message * 1e3)


def bubble_vs_m(runs: Sequence[PipelineRun], largest: Measured) -> None:
    """06: how the measured bubble moved from the sweep's smallest m (`runs[0]`) to its largest
    (`largest`: every repeat at that m), beside the formula and the simulation."""
    first, p = runs[0].bubble_fraction, runs[0].schedule.num_ranks
    m0, m1 = runs[0].schedule.num_microbatches, runs[-1].schedule.num_microbatches
    direction = compare(largest, first)
    conclude(
        "06.bubble_vs_m", direction,
        f"from m={m0} to m={m1} the measured bubble went from {first:.3f} to {largest:.3f} (median, min-max over "
        f"the timed steps): {direction}. The formula goes from {gpipe_bubble(p, m0):.3f} to {gpipe_bubble(p, m1):.3f}, "
        f"the simulation with each step's measured costs from {runs[0].simulated_bubble.median:.3f} to "
        f"{runs[-1].simulated_bubble.median:.3f}.",
        first=first, last=largest)


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
    """Rounds with activations stored and recomputed, a table row each way."""
    return [{"activations": how, "m": group[0].schedule.num_microbatches, "step_ms": f"{step_ms(group):.1f}",
             "bubble": f"{pooled_bubble(group):.3f}",
             **{f"rank {rank} peak MiB": round(mib, 2) for rank, mib in group[0].peak_stash_mib.items()}}
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
    ran by turns), against the simulator's prediction."""
    slowdown = ratios([r.step_time.median for r in recomputed], [r.step_time.median for r in stored])
    expected = sim_recomputed.makespan_ms / sim_stored.makespan_ms
    verdict = "slower" if slowdown.low > 1 else "faster" if slowdown.high < 1 else "within noise"
    text = (f"a step with recomputed activations took {slowdown:.2f} times as long as one with stored activations "
            f"(median, min-max of {len(stored)} rounds run by turns): {verdict}. The simulation with the measured "
            f"costs predicts {expected:.2f} times.")
    if verdict != "slower":
        text += " The machine's noise is as large as the effect here: the simulated figure is the cost to expect."
    conclude("06.checkpoint_time", verdict, text, slowdown=slowdown, simulated=expected)

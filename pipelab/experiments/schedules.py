"""Lesson 07's conclusions, each computed from the runs it speaks of (`experiments.pipeline` runs
them): 1F1B's stash and interleaving's messages against the predictions, the schedules' bubbles
against each other and against the simulator, ZB-H1's memory, and torch's zero-bubble first stage.
Each verdict function states its conclusion with `pipelab.conclude`."""

from __future__ import annotations

from typing import Mapping

from pipelab import hardware
from pipelab.display import conclude
from pipelab.experiments.pipeline import PipelineRun
from pipelab.measure import compare, compare_medians
from pipelab.pipeline.schedules import messages_per_step

Runs = Mapping[str, PipelineRun]  # by schedule name: "gpipe", "1f1b", "interleaved", "zb-h1"


def predict_1f1b_stash(runs: Runs) -> None:
    """07: the peak stash of 1F1B's rank 0 against min(m, p), beside GPipe's."""
    schedule = runs["1f1b"].schedule
    stash0, predicted = runs["1f1b"].peak_stash[0], min(schedule.num_microbatches, schedule.num_ranks)
    verdict = "fits" if stash0 == predicted else "does not fit"
    conclude("07.predict_1f1b_stash", verdict,
             f"1F1B's rank 0 kept at most {stash0} micro-batches' activations at once (predicted min(m, p) = "
             f"{predicted}); GPipe's rank 0 kept {runs['gpipe'].peak_stash[0]} (m = {schedule.num_microbatches}).",
             measured=stash0, predicted=predicted, gpipe=runs["gpipe"].peak_stash[0])


def predict_messages(runs: Runs) -> None:
    """07: the messages each schedule sent in a step against 2m(S-1), interleaved's against 1F1B's."""
    sent = {n: run.messages_sent for n, run in runs.items()}
    counted = {n: messages_per_step(run.schedule) for n, run in runs.items()}
    s = runs["interleaved"].schedule
    m, p, v = s.num_microbatches, s.num_ranks, s.stages_per_rank
    verdict = "fits" if sent == counted else "does not fit"
    conclude("07.predict_messages", verdict,
             f"interleaved 1F1B sent {sent['interleaved']} messages in a step and 1F1B {sent['1f1b']}, "
             f"{sent['interleaved'] / sent['1f1b']:.3g}x (predicted 2m(vp-1) = {2 * m * (v * p - 1)} against "
             f"2m(p-1) = {2 * m * (p - 1)}: (vp-1)/(p-1) = {(v * p - 1) / (p - 1):.3g}x, not v = {v}x).",
             interleaved=sent["interleaved"], one_f_one_b=sent["1f1b"])


def bubble_against(key: str, runs: Runs, a: str, b: str, theory: str) -> None:
    """07: how schedule `a`'s measured bubble stands against `b`'s, beside the theory's answer
    (`theory`: "within noise" for equal bubbles, or "lower"). A direction only when the typical
    steps differ by more than a whole run's noise (`measure.compare_medians`); "in every step"
    when the repeats' ranges do not overlap either (`measure.compare`)."""
    measured = {n: runs[n].bubble_fraction for n in (a, b)}
    simulated = {n: runs[n].simulated_bubble for n in (a, b)}
    label = {n: runs[n].schedule.name for n in (a, b)}
    verdict = compare_medians(measured[a], measured[b])
    said = {"lower": "lower than", "higher": "higher than", "within noise": "within noise of"}[verdict]
    every = compare(measured[a], measured[b]) == verdict != "within noise"
    text = (f"{label[a]}'s measured bubble {measured[a]:.3f} was {said} {label[b]}'s {measured[b]:.3f} "
            f"(median, min-max of {len(measured[a].values)} steps; {measured[a].median / measured[b].median:.2f}x "
            f"by the medians" + (", and in every step" if every else "") + "). With this run's measured costs and "
            f"free messages the simulator gives {simulated[a]:.3f} against {simulated[b]:.3f}")
    words = {"within noise": "equal bubbles", "lower": f"a lower bubble for {label[a]}"}[theory]
    if verdict == theory:
        text += f"; as the theory says ({words})."
    elif verdict == "within noise":
        text += f"; the theory says {words}, a difference this machine's noise hides: read the simulated figures."
    else:
        agree = compare(simulated[a], simulated[b]) == verdict
        text += (f"; the theory says {words}. " + (
            "The simulator agrees with the measurement, so the measured compute costs themselves (unequal or "
            "noisy stages) make the difference." if agree else
            "The simulator, with the measured compute costs but free messages, does not show it, so it comes "
            "from what the simulator leaves out: messages, and waiting for a core."))
    conclude(key, verdict, text, **{a: measured[a], b: measured[b],
                                    f"{a} simulated": simulated[a], f"{b} simulated": simulated[b]})


def measured_vs_simulated(name: str, run: PipelineRun) -> None:
    """07: the measured bubble against the simulated one. The simulator leaves messages and waiting
    for a core out, so it should be a lower bound: "below" only when the typical step is clearly under it."""
    measured, simulated = run.bubble_fraction, run.simulated_bubble
    verdict = "below" if measured.median < 0.9 * simulated.median else "at or above"
    conclude(f"07.measured_vs_simulated.{name}", verdict,
             f"{run.schedule.name}: measured bubble {measured:.3f}, {measured.median / simulated.median:.2f}x the "
             f"simulated {simulated:.3f} (medians): " + (
                 "the simulator, without messages, is a lower bound." if verdict == "at or above"
                 else "below the simulator's bound: this run's measured costs moved between steps."),
             measured=measured, simulated=simulated)


def ranks_and_cores(ranks: int) -> str:
    """Whether the ranks had a core each: the other thing ranks on a CPU machine wait for."""
    cores = hardware.cpu_cores()
    return f"{ranks} ranks on {cores} CPU cores: " + (
        "more ranks than cores, so ranks also wait for a core." if ranks > cores else
        "a core per rank, shared with this notebook's process and anything else the machine runs.")


def zb_memory(zb: PipelineRun, one: PipelineRun) -> None:
    """07: ZB-H1's peak stash (count and bytes) against 1F1B's, and why it holds more."""
    kib = {n: max(r.peak_stash_bytes.values()) / 1024 for n, r in (("zb", zb), ("1f1b", one))}
    per_stash = {n: r.peak_stash_bytes[0] / r.peak_stash[0] / 1024 for n, r in (("zb", zb), ("1f1b", one))}
    more = kib["zb"] > kib["1f1b"]
    text = (f"ZB-H1 kept at most {zb.peak_stash} micro-batches per rank against 1F1B's {one.peak_stash}, "
            f"and {kib['zb']:.0f} KiB at its peak against 1F1B's {kib['1f1b']:.0f} KiB ({kib['zb'] / kib['1f1b']:.2g}x).")
    if more:
        text += (f" One stash of rank 0 holds {per_stash['zb']:.0f} KiB against 1F1B's {per_stash['1f1b']:.0f} KiB: "
                 "the forward also keeps every layer's output, where W needs the gradient, and a stash lives until its W.")
    if any(zb.peak_stash[r] > one.peak_stash[r] for r in zb.peak_stash):
        text += " Rank r holds back its first r W's, so every rank keeps p micro-batches, not p - r."
    verdict = "more bytes than 1F1B" if more else "not more bytes than 1F1B"
    conclude("07.zb_memory", verdict, text, zb_kib=kib["zb"], one_f_one_b_kib=kib["1f1b"])


def executed(run: PipelineRun, rank: int) -> list[tuple[str, int, int]]:
    """The (kind, stage, micro-batch) of every compute box `rank` ran in the typical step, in order."""
    return [(s.kind, s.meta["stage"], s.mb) for s in run.timeline.filter(rank=rank, lane="compute")]


def planned(run: PipelineRun, rank: int) -> list[tuple[str, int, int]]:
    """The (kind, stage, micro-batch) of every action `rank`'s list holds, in order."""
    return [(a.kind, a.stage, a.mb) for a in run.schedule.actions[rank]]


def mean_ms(run: PipelineRun, kind: str, rank: int = 0) -> float:
    """Mean duration (ms) of `kind` boxes on `rank` over every timed step of `run`."""
    d = [s.duration for tl in run.steps.timelines for s in tl.filter(rank=rank, lane="compute", kind=kind)]
    return 1e3 * sum(d) / len(d)


def torch_zb_first_stage(ours: PipelineRun, theirs: PipelineRun) -> None:
    """07: what torch's I and W do on the first stage of its zero-bubble schedule, against ours."""
    i_torch, w_torch = mean_ms(theirs, "I"), mean_ms(theirs, "W")
    i_ours, w_ours = mean_ms(ours, "I"), mean_ms(ours, "W")
    empty = i_torch < 0.1 * w_torch
    verdict = "torch's stage-0 I is empty" if empty else "torch's stage-0 I does work"
    conclude("07.torch_zb_first_stage", verdict,
             f"on rank 0 (stage 0) torch's I took {i_torch:.3f} ms and its W {w_torch:.2f} ms on average; "
             f"ours took {i_ours:.2f} ms and {w_ours:.2f} ms. "
             + ("Torch's I boxes there are too thin to see: its W does the whole backward."
                if empty else "Torch's I does part of the backward there too."),
             torch_i_ms=i_torch, torch_w_ms=w_torch, ours_i_ms=i_ours, ours_w_ms=w_ours)


def side_by_side(ours: PipelineRun, theirs: PipelineRun) -> dict:
    """One table row: a schedule's loss, step time and bubble, ours beside torch's."""
    return {"schedule": ours.schedule.name, "loss (ours)": round(ours.loss, 6), "loss (torch)": round(theirs.loss, 6),
            "step_ms (ours)": f"{ours.step_time.scaled(1e3):.1f}", "step_ms (torch)": f"{theirs.step_time.scaled(1e3):.1f}",
            "bubble (ours)": f"{ours.bubble_fraction:.3f}", "bubble (torch)": f"{theirs.bubble_fraction:.3f}"}

"""Lesson 07's conclusions, each computed from the runs it speaks of (`experiments.pipeline` runs
them): 1F1B's stash and interleaving's messages against the predictions, the schedules' bubbles
against each other and against the simulator, ZB-H1's memory, and torch's zero-bubble first stage.
Each verdict function states its conclusion with `pipelab.conclude`."""

from __future__ import annotations

from typing import Mapping

from pipelab import hardware
from pipelab.display import conclude
from pipelab.experiments.pipeline import PipelineRun, recv_waits
from pipelab.measure import compare, compare_medians, spread_words
from pipelab.pipeline.schedules import messages_per_step
from pipelab.pipeline.simulate import SimResult

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
    text = (f"{label[a]}'s bubble {measured[a]:.3f} was {said} {label[b]}'s {measured[b]:.3f} "
            f"({spread_words(measured[a], f'{len(measured[a].values)} steps')}; {measured[a].median / measured[b].median:.2f}x "
            f"by the medians" + (", and in every step" if every else "") + "). With this run's own costs and "
            f"free messages the simulator gives {simulated[a]:.3f} against {simulated[b]:.3f}")
    words = {"within noise": "equal bubbles", "lower": f"a lower bubble for {label[a]}"}[theory]
    if verdict == theory:
        text += f"; as the theory says ({words})."
    elif verdict == "within noise":
        text += f"; the theory says {words}, a difference this machine's noise hides: read the simulated figures."
    else:
        agree = compare(simulated[a], simulated[b]) == verdict
        text += (f"; the theory says {words}. " + (
            "The simulator agrees with the run, so the compute costs themselves (unequal or "
            "noisy stages) make the difference." if agree else
            "The simulator, with the run's compute costs but free messages, does not show it, so it comes "
            "from what the simulator leaves out: messages, and waiting for a core."))
    conclude(key, verdict, text, **{a: measured[a], b: measured[b],
                                    f"{a} simulated": simulated[a], f"{b} simulated": simulated[b]})


def measured_vs_simulated(name: str, run: PipelineRun) -> None:
    """07: the measured bubble against the simulated one. The simulator leaves messages and waiting
    for a core out, so it should be a lower bound: "below" only when the typical step is clearly under it."""
    measured, simulated = run.bubble_fraction, run.simulated_bubble
    verdict = "below" if measured.median < 0.9 * simulated.median else "at or above"
    conclude(f"07.measured_vs_simulated.{name}", verdict,
             f"{run.schedule.name}: the run's bubble {measured:.3f}, {measured.median / simulated.median:.2f}x the "
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


def runtime_adds(name: str, run: PipelineRun, free: SimResult, linked: SimResult) -> None:
    """07: what the runtime adds to the simulator playing the same costs: `free` with free
    messages, `linked` with each message taking its link time. The step beyond `free` is what
    messages and their waits cost; beyond `linked`, waits the simulator does not have (a pair of
    ranks carries one message at a time, in issue order, as NCCL runs them; the simulator lets
    every message travel at once)."""
    step = run.step_time.median * 1e3
    messages, waits = linked.makespan_ms - free.makespan_ms, step - linked.makespan_ms
    conclude(f"07.runtime_adds.{name}", "adds" if step > free.makespan_ms * (1 + 1e-9) else "adds nothing",
             f"{run.schedule.name}: the step took {step:.2f} ms against the simulator's {free.makespan_ms:.2f} ms with the "
             f"same F, I and W costs and free messages ({step / free.makespan_ms:.3f}x): the messages' link time "
             f"adds {messages:.2f} ms in the simulator, " + (
                 f"and the runtime {waits:.2f} ms more: messages waiting behind others on the same pair of ranks, "
                 "which carry one message at a time in the order they were issued, as NCCL runs them." if waits >= 0.005 else
                 "and the runtime nothing more: no message waited behind another."),
             step_ms=step, free_ms=free.makespan_ms, linked_ms=linked.makespan_ms)


def cores_against_emulated(cpu: PipelineRun, emulated: PipelineRun) -> None:
    """07: one schedule's bubble on this machine's own cores against the emulated node's, and why
    they differ: how much the cores' F boxes varied, and how long the ranks waited for messages."""
    durations = [s.duration for tl in cpu.steps.timelines for s in tl.filter(lane="compute", kind="F")]
    spread = (max(durations) - min(durations)) / (sum(durations) / len(durations))
    _, for_message = recv_waits(cpu.timeline)
    cores = hardware.cpu_cores()
    verdict = compare_medians(cpu.bubble_fraction, emulated.bubble_fraction)
    conclude("07.cores_against_emulated", verdict,
             f"{cpu.schedule.name} on this machine's {cores} CPU cores: bubble {cpu.bubble_fraction:.3f} against "
             f"{emulated.bubble_fraction:.3f} on the emulated node ({verdict}). On the cores the forward boxes "
             f"varied by {spread:.0%} of their mean from one to the next (the emulated ones last the same every "
             f"time), and in the step shown the ranks waited {for_message * 1e3:.2f} ms for messages already sent: "
             f"{cpu.schedule.num_ranks} ranks, gloo's threads and this notebook share {cores} cores.",
             cpu=cpu.bubble_fraction, emulated=emulated.bubble_fraction, forward_spread=spread)


def zb_memory(zb: PipelineRun, one: PipelineRun) -> None:
    """07: ZB-H1's peak stash (count and bytes) against 1F1B's, and why it holds more."""
    kib = {n: max(r.peak_stash_bytes.values()) / 1024 for n, r in (("zb", zb), ("1f1b", one))}
    per_stash = {n: r.peak_stash_bytes[0] / r.peak_stash[0] / 1024 for n, r in (("zb", zb), ("1f1b", one))}
    more = kib["zb"] > kib["1f1b"]
    counts = {n: ", ".join(f"rank {k} {v}" for k, v in r.peak_stash.items()) for n, r in (("zb", zb), ("1f1b", one))}
    text = (f"ZB-H1 kept at most {counts['zb']} micro-batches against 1F1B's {counts['1f1b']}, "
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
    """One table row: a schedule's loss, ours beside torch's, and torch's step time and bubble on
    the clock it ran on."""
    return {"schedule": ours.schedule.name, "loss (ours)": round(ours.loss, 6), "loss (torch)": round(theirs.loss, 6),
            "step_ms (torch)": f"{theirs.step_time.scaled(1e3):.1f}", "bubble (torch)": f"{theirs.bubble_fraction:.3f}"}


def run_flops(width: int, layers: int, microbatch_size: int, microbatches: int, steps: int, cpu_steps: int) -> float:
    """FLOPs of lesson 07's runs at a profile's size, counted on the meta device: `steps` steps of
    the four schedules, `cpu_steps` of torch's four and of our ZB-H1 beside them, and the two
    one-process references, each on `microbatches` micro-batches of `microbatch_size` rows."""
    import torch

    from pipelab.emulate.cost import step_flops
    from pipelab.models import mlp

    with torch.device("meta"):
        model, batch = mlp([width] * (layers + 1)), torch.empty(microbatches * microbatch_size, width)
    return step_flops(model, batch) * (4 * steps + 5 * cpu_steps + 2)

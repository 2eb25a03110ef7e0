"""Lesson 07's conclusions, each computed from the runs it speaks of (`experiments.pipeline` runs
them): 1F1B's stash and interleaving's messages against the predictions, the schedules' bubbles
against each other and against the simulator, ZB-H1's memory, and torch's zero-bubble first stage.
Each verdict function returns `(key, verdict, text, figures)`; the notebook concludes it."""

from __future__ import annotations

from typing import Mapping

from pipelab import hardware
from pipelab.experiments.pipeline import PipelineRun
from pipelab.measure import Measured, compare_medians
from pipelab.pipeline.schedules import messages_per_step
from pipelab.pipeline.simulate import SimResult

Runs = Mapping[str, PipelineRun]  # by schedule name: "gpipe", "1f1b", "interleaved", "zb-h1"
Verdict = tuple[str, str, str, dict]


def versus(a: Measured, b: Measured, exact: bool) -> str:
    """'lower', 'higher', or 'equal' (modelled: exact) / 'within noise' (measured: beyond the run-to-run noise)."""
    if not exact:
        return compare_medians(a, b)
    return "lower" if a.median < b.median - 1e-12 else "higher" if a.median > b.median + 1e-12 else "equal"


def predict_1f1b_stash(runs: Runs) -> Verdict:
    """The peak stash of 1F1B's rank 0 against min(m, p), beside GPipe's."""
    schedule = runs["1f1b"].schedule
    stash0, predicted = runs["1f1b"].peak_stash[0], min(schedule.num_microbatches, schedule.num_ranks)
    verdict = "fits" if stash0 == predicted else "does not fit"
    return ("07.predict_1f1b_stash", verdict,
            f"1F1B's rank 0 kept at most {stash0} micro-batches' activations (min(m, p) = {predicted} predicted), "
            f"GPipe's rank 0 {runs['gpipe'].peak_stash[0]}",
            {"measured": stash0, "predicted": predicted, "gpipe": runs["gpipe"].peak_stash[0]})


def predict_messages(runs: Runs) -> Verdict:
    """The messages each schedule sent in a step against 2m(S-1), interleaved's against 1F1B's."""
    sent = {n: run.messages_sent for n, run in runs.items()}
    verdict = "fits" if all(sent[n] == messages_per_step(r.schedule) for n, r in runs.items()) else "does not fit"
    said = "as 2m(vp-1) and 2m(p-1) predict" if verdict == "fits" else "not what 2m(vp-1) and 2m(p-1) predict"
    return ("07.predict_messages", verdict,
            f"interleaved 1F1B sent {sent['interleaved']} messages a step and 1F1B {sent['1f1b']}, {said}: "
            "(vp-1)/(p-1) times as many, not v times", {"interleaved": sent["interleaved"], "1f1b": sent["1f1b"]})


def bubble_against(key: str, runs: Runs, a: str, b: str, theory: str) -> Verdict:
    """How schedule `a`'s bubble stands against `b`'s, beside the theory (`theory`: "equal" or
    "lower"). Modelled bubbles compare exactly; measured ones only beyond the run-to-run noise.
    Where the run and theory part, the simulator (same costs, free messages) says why."""
    exact = runs[a].modelled  # modelled times repeat exactly: no noise
    verdict = versus(runs[a].bubble_fraction, runs[b].bubble_fraction, exact)
    name = {n: runs[n].schedule.name for n in (a, b)}
    said = {"lower": "lower than", "higher": "higher than", "equal": "equal to", "within noise": "within noise of"}
    text = (f"{name[a]}'s {'modelled' if exact else 'measured'} bubble {runs[a].bubble_fraction.median:.3f} was "
            f"{said[verdict]} {name[b]}'s {runs[b].bubble_fraction.median:.3f}")
    if verdict == theory or (verdict == "within noise" and theory == "equal"):
        text += ", as the theory says"
    elif verdict == "within noise":
        text += "; the machine's noise hides what the theory predicts"
    else:
        agrees = versus(runs[a].simulated_bubble, runs[b].simulated_bubble, True) == verdict
        text += ("; the simulator with these costs and free messages agrees: unequal stage costs make it" if agrees else
                 "; the simulator with free messages does not: messages and their waits make it")
    return key, verdict, text, {a: runs[a].bubble_fraction, b: runs[b].bubble_fraction,
                                f"{a} simulated": runs[a].simulated_bubble, f"{b} simulated": runs[b].simulated_bubble}


def measured_vs_simulated(name: str, run: PipelineRun) -> Verdict:
    """The run's bubble against the simulated one. The simulator leaves messages and waiting for a
    core out, so it should be a lower bound: "below" only when the typical step is clearly under it."""
    ran, simulated = run.bubble_fraction, run.simulated_bubble
    verdict = "below" if ran.median < 0.9 * simulated.median else "at or above"
    return (f"07.measured_vs_simulated.{name}", verdict,
            f"{run.schedule.name}'s run left {ran.median / simulated.median:.2f}x the simulator's bubble: " + (
                "the simulator, without messages, is a lower bound" if verdict == "at or above"
                else "below its bound, so this run's costs moved between steps"),
            {"measured": ran, "simulated": simulated})


def ranks_and_cores(ranks: int) -> str:
    """Whether the ranks had a core each: the other thing ranks on a CPU machine wait for."""
    cores = hardware.cpu_cores()
    return f"{ranks} ranks on {cores} CPU cores: " + (
        "more ranks than cores, so ranks also wait for a core." if ranks > cores else
        "a core per rank, shared with this notebook's process and anything else the machine runs.")


def runtime_row(run: PipelineRun, free: SimResult, linked: SimResult) -> dict:
    """One table row: the modelled step beside the simulator's with free messages and with each
    message taking its link time (the same F, I and W costs)."""
    return {"schedule": run.schedule.name, "step (ms, modelled)": round(run.step_time.median * 1e3, 3),
            "simulator, free messages (ms)": round(free.makespan_ms, 3),
            "simulator, messages at link time (ms)": round(linked.makespan_ms, 3)}


def runtime_adds(name: str, run: PipelineRun, free: SimResult, linked: SimResult) -> Verdict:
    """What the runtime adds to the simulator playing the same costs: beyond `free`, what messages
    cost; beyond `linked`, waits the simulator does not have (a pair of ranks carries one message
    at a time, in issue order, as NCCL runs them; the simulator lets every message travel at once)."""
    step = run.step_time.median * 1e3
    messages, waits = linked.makespan_ms - free.makespan_ms, step - linked.makespan_ms
    return (f"07.runtime_adds.{name}", "adds" if step > free.makespan_ms * (1 + 1e-9) else "adds nothing",
            f"{run.schedule.name}: messages' link time adds {messages:.2f} ms to the simulator's step, and waiting "
            f"behind other messages on the same pair of ranks {max(waits, 0):.2f} ms more",
            {"step_ms": step, "free_ms": free.makespan_ms, "linked_ms": linked.makespan_ms})


def cores_against_modelled(cpu: PipelineRun, node: PipelineRun) -> Verdict:
    """One schedule's bubble on this machine's own cores against the modelled one on the node, and
    why they differ: the cores' F boxes vary in length, modelled ones do not."""
    durations = [s.duration for tl in cpu.steps.timelines for s in tl.filter(lane="compute", kind="F")]
    spread = (max(durations) - min(durations)) / (sum(durations) / len(durations))
    verdict = compare_medians(cpu.bubble_fraction, node.bubble_fraction)
    return ("07.cores_against_emulated", verdict,
            f"{cpu.schedule.name} on this machine's cores left a measured bubble of {cpu.bubble_fraction.median:.3f} "
            f"against {node.bubble_fraction.median:.3f} modelled ({verdict}): there forward boxes vary, modelled ones do not",
            {"cpu": cpu.bubble_fraction, "modelled": node.bubble_fraction, "forward_spread": spread})


def zb_memory(zb: PipelineRun, one: PipelineRun) -> Verdict:
    """ZB-H1's peak stash (count and bytes) against 1F1B's, and why it holds more."""
    kib = {n: max(r.peak_stash_bytes.values()) / 1024 for n, r in (("zb", zb), ("1f1b", one))}
    more = kib["zb"] > kib["1f1b"]
    counts = "more" if any(zb.peak_stash[r] > one.peak_stash[r] for r in zb.peak_stash) else "as many"
    return ("07.zb_memory", "more bytes than 1F1B" if more else "not more bytes than 1F1B",
            f"ZB-H1 kept {kib['zb'] / kib['1f1b']:.2g}x 1F1B's peak stash bytes with {counts} micro-batches" + (
                ": a forward also keeps each layer's output for W, and a stash lives until its W" if more else ""),
            {"zb_kib": kib["zb"], "one_f_one_b_kib": kib["1f1b"], "zb_stash": zb.peak_stash, "1f1b_stash": one.peak_stash})


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


def torch_zb_first_stage(ours: PipelineRun, theirs: PipelineRun) -> Verdict:
    """What torch's I and W do on the first stage of its zero-bubble schedule, against ours."""
    i_torch, w_torch = mean_ms(theirs, "I"), mean_ms(theirs, "W")
    empty = i_torch < 0.1 * w_torch
    return ("07.torch_zb_first_stage", "torch's stage-0 I is empty" if empty else "torch's stage-0 I does work",
            f"on stage 0 torch's measured I took {i_torch:.3f} ms against its W's {w_torch:.2f} ms: " + (
                "its W does the whole backward there" if empty else "its I does part of the backward there too"),
            {"torch_i_ms": i_torch, "torch_w_ms": w_torch, "ours_i_ms": mean_ms(ours, "I"), "ours_w_ms": mean_ms(ours, "W")})


def side_by_side(ours: PipelineRun, theirs: PipelineRun) -> dict:
    """One table row: a schedule's loss, ours beside torch's, and torch's measured step time and
    bubble on this machine's cores."""
    return {"schedule": ours.schedule.name, "loss (ours)": round(ours.loss, 6), "loss (torch)": round(theirs.loss, 6),
            "step_ms (torch, measured)": f"{theirs.step_time.scaled(1e3):.1f}",
            "bubble (torch, measured)": f"{theirs.bubble_fraction:.3f}"}


def run_flops(params: dict) -> float:
    """FLOPs of lesson 07 at the notebook parameters `params` (missing names take the defaults),
    counted on the meta device: `steps` steps of the four schedules, `cpu_steps` of torch's four
    and of our ZB-H1 beside them, and the two one-process references."""
    import torch

    from pipelab.emulate.cost import step_flops
    from pipelab.models import mlp

    p = {"width": 256, "layers": 8, "microbatch_size": 32, "microbatches": 4, "steps": 3, "cpu_steps": 3, **params}
    with torch.device("meta"):
        model = mlp([p["width"]] * (p["layers"] + 1))
        batch = torch.empty(p["microbatches"] * p["microbatch_size"], p["width"])
    return step_flops(model, batch) * (4 * p["steps"] + 5 * p["cpu_steps"] + 2)

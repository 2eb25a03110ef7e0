"""Lesson 10's comparisons: the one-process baseline the grid's speed is set against, and the
verdicts, each returning (key, verdict, text, figures) for the notebook to conclude."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

import torch

from pipelab import hardware
from pipelab.data import Corpus, batchify
from pipelab.display import human_bytes
from pipelab.experiments.capstone import Config, LMRun, modelled_step, one_device_tokens_per_second
from pipelab.lm_training import reference_device, sgd_steps, single_process_losses, windows
from pipelab.measure import Measured, compare_medians


# --- One process: the reference and the speed to compare with ---

LOSS_TOLERANCE = 1e-4  # float32 without TF32: the grid sums in another order, which moves a loss of ~8 by ~1e-6 a step


def one_process_rates(corpus: Corpus, cfg: Config, steps: int, repeats: int, device=None) -> list[float]:
    """Tokens/s of `repeats` runs of `steps` steps of the whole model in this process, after one
    warm-up step: on `device` (default `reference_device()`), else on one CPU thread as a worker."""
    device = torch.device(device) if device is not None else reference_device()
    model, train_ids = cfg.model(len(corpus.vocab)).to(device), batchify(corpus.train, cfg.batch_size)
    opt, starts = torch.optim.SGD(model.parameters(), lr=cfg.lr), windows(train_ids, cfg.bptt, steps + 1)
    threads, rates = torch.get_num_threads(), []
    torch.set_num_threads(1 if device.type == "cpu" else threads)
    try:
        sgd_steps(model, opt, train_ids, cfg, starts[:1])  # warm-up: first allocations, kernel choices
        for _ in range(repeats):
            hardware.synchronize(device)
            start = time.perf_counter()
            sgd_steps(model, opt, train_ids, cfg, starts[1:])
            hardware.synchronize(device)  # a GPU's clock stops when its queued kernels end
            rates.append((len(starts) - 1) * cfg.batch_size * cfg.bptt / (time.perf_counter() - start))
        return rates
    finally:
        torch.set_num_threads(threads)


BASELINE_DEVICES = (None, "cpu", "cuda")  # the notebook's `baseline_device`


def check_baseline_device(device: str | None) -> None:
    """Refuse a `baseline_device` this machine cannot time on, naming the value and the fix, before anything runs."""
    if device not in BASELINE_DEVICES:
        raise ValueError(f"baseline_device={device!r}: use None (as the grid: modelled on an emulated node, "
                         "else timed here), 'cuda' (timed on this machine's GPU) or 'cpu'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("baseline_device='cuda': this machine has no CUDA GPU; use baseline_device=None")


def baseline_tokens_per_second(corpus: Corpus, cfg: Config, device: str | None = None) -> Measured:
    """The rate the grid is compared with: on a modelled node ONE device's modelled rate for the
    whole model on the whole batch; elsewhere one process's on `device` (default `reference_device()`),
    timed `cfg.speed_repeats` times."""
    if cfg.node is not None:
        return Measured.of([one_device_tokens_per_second(cfg, len(corpus.vocab))])
    return Measured.of(one_process_rates(corpus, cfg, cfg.speed_steps, cfg.speed_repeats, device))


def gpu_baseline(corpus: Corpus, cfg: Config, device: str | None) -> Measured | None:
    """Beside a modelled grid, with `device="cuda"`: one process's tokens/s timed on this GPU at the real
    math's size (measured, one GPU's part of the lesson); None where the baseline is already timed."""
    if cfg.node is None or device != "cuda":
        return None
    return Measured.of(one_process_rates(corpus, cfg, cfg.speed_steps, cfg.speed_repeats, device))


def lr_experiment(corpus: Corpus, cfg: Config, rates: Sequence[float]) -> dict[float, list[float]]:
    """One process's training losses over `cfg.max_batches` steps at each rate in `rates`."""
    return {rate: single_process_losses(corpus, replace(cfg, lr=rate), cfg.max_batches) for rate in rates}


# --- Verdicts: each returns (key, verdict, text, figures); the notebook concludes them ---


def loss_at_step_0_verdict(loss: float, logit_spread: float, vocab_size: int) -> tuple[str, str, str, dict]:
    """Is the untrained model's first loss near ln(vocab), guessing evenly?"""
    guess = math.log(vocab_size)
    near = abs(loss - guess) < 0.5
    text = f"Before training the first loss is {loss:.2f}, against ln V = {guess:.2f} for guessing evenly"
    return "10.loss_at_step_0", "near ln(vocab)" if near else "far from ln(vocab)", text + (
        "." if near else ": the initial weights already guess confidently."), {
        "loss": loss, "ln_vocab": guess, "logit_spread": logit_spread, "ln_vocab_plus_spread2_over_2": guess + logit_spread ** 2 / 2}


def first_losses_verdict(run: LMRun, one: Sequence[float]) -> tuple[str, str, str, dict]:
    """Do the grid's first losses equal one process's, to float rounding?"""
    gap = max(abs(a - b) for a, b in zip(run.losses, one))
    equal = gap < LOSS_TOLERANCE
    text = (f"The grid's first losses differ from one process's by at most {gap:.1e}, "
            + ("float rounding: the same computation." if equal else f"beyond the tolerance {LOSS_TOLERANCE:.0e}."))
    return "10.first_losses", "equal" if equal else "differ", text, {"max_difference": gap, "tolerance": LOSS_TOLERANCE}


def perplexity_verdict(run: LMRun, vocab_size: int) -> tuple[str, str, str, dict]:
    """Did the valid perplexity end well below guessing evenly (a quarter of the vocabulary)?"""
    first, last = run.curve[0][2], run.curve[-1][2]
    verdict = "well below guessing" if last < vocab_size / 4 else "not well below guessing"
    text = f"Valid perplexity ended at {last:.1f}, {vocab_size / last:.1f} times below guessing evenly among the vocabulary."
    return "10.valid_perplexity", verdict, text, {"first": first, "last": last, "vocab": vocab_size}


def stash_table(plan: list[dict], run: LMRun) -> list[dict]:
    """Per stage: the peak stash simulated and measured, the activations' bytes estimated and measured."""
    return [{"stage": r["stage"], "peak stash: simulated": r["peak stash"], "measured": count,
             "activations: estimated": human_bytes(r["activations"]), "measured ": human_bytes(nbytes)}
            for r, (count, nbytes) in zip(plan, run.stash)]


def stash_verdict(plan: list[dict], run: LMRun) -> tuple[str, str, str, dict]:
    """Does every stage's measured stash match the estimate made before the run?"""
    off = max(abs(nbytes / r["activations"] - 1) for r, (_, nbytes) in zip(plan, run.stash))
    counts_agree = all(count == r["peak stash"] for r, (count, _) in zip(plan, run.stash))
    ok = counts_agree and off < 0.05
    text = ("Every stage stashed the micro-batches the simulator said" if counts_agree else
            "The stashed micro-batches differ from the simulator's") + f", and its bytes are within {off:.1%} of the estimate."
    return "10.stash_estimate", "matches" if ok else "differs", text, {"worst_relative_error": off, "counts_agree": counts_agree}


def speed_table(run: LMRun, one_rate: Measured, vocab_size: int, on_gpu: Measured | None = None,
                device: str | None = None) -> list[dict]:
    """The grid's tokens/s beside one device's (modelled) or one process's (timed on `device`); modelled,
    where its step goes, and `on_gpu` (`gpu_baseline`) in a column of its own: measured on this GPU."""
    cfg, grid = run.cfg, run.tokens_per_second
    if not run.modelled:
        return [{"": "the grid", "tokens/s": f"{grid:,.0f}"},
                {"": "one process, timed" + (f" on {device}" if device else ""), "tokens/s": f"{one_rate:,.0f}"}]
    model, step = modelled_step(cfg, vocab_size), cfg.step_tokens(modelled=True) / grid.median
    rest = step - model["schedule_s"] - model["update_s"]
    rows = [{"": f"parameters at the tutorial's size ({vocab_size:,}-word vocabulary)", "modelled": f"{model['parameters'] / 1e9:.2f} B"},
            {"": "tokens/s, the grid", "modelled": f"{grid.median:,.0f}"},
            {"": f"tokens/s, one {cfg.node.device.name} alone", "modelled": f"{one_rate.median:,.0f}"},
            {"": f"step: the {cfg.schedule} schedule's compute (bubble {model['bubble']:.2f})", "modelled": f"{model['schedule_s'] * 1e3:.1f} ms"},
            {"": "step: clipping and the SGD step", "modelled": f"{model['update_s'] * 1e3:.1f} ms"},
            {"": f"step: messages and the all-reduce (up to {human_bytes(model['gradient_bytes'])})", "modelled": f"{rest * 1e3:.1f} ms"}]
    if on_gpu is None:
        return rows
    gpu = torch.cuda.get_device_name(0)
    return ([{**r, f"measured on {gpu}": "-"} for r in rows]
            + [{"": f"tokens/s, one process at the real math's size (emsize {cfg.emsize}, {cfg.nlayers} layers)",
                "modelled": "-", f"measured on {gpu}": f"{on_gpu:,.0f}"}])


def speed_verdict(run: LMRun, one_rate: Measured) -> tuple[str, str, str, dict]:
    """How the grid's tokens/s compares with one device's (modelled) or one process's (timed)."""
    grid, ratio = run.tokens_per_second, run.tokens_per_second.median / one_rate.median
    if run.modelled:
        verdict = "faster" if ratio > 1 else "slower"
        text = f"On the emulated node the {run.cfg.world_size}-device grid trains {ratio:.2f}x the tokens/s of one device alone (modelled)."
    else:
        enough = min(len(grid.values), len(one_rate.values)) >= 3  # a range needs a few repeats
        verdict = compare_medians(grid, one_rate) if enough else "too few repeats"  # beyond a run's noise
        text = f"The grid trained {ratio:.2f}x one process's tokens/s by the medians: " + {
            "lower": "slower.", "higher": "faster.", "within noise": "within this machine's run-to-run noise.",
            "too few repeats": "too few repeats to tell a direction."}[verdict]
    return "10.grid_vs_one_process", verdict, text, {"grid": grid, "one": one_rate, "speedup": ratio}


def evaluate_verdict(figures: dict) -> tuple[str, str, str, dict]:
    """Does the tutorial's `evaluate` (`tutorial_evaluate_figures`) give a perplexity below the right one?"""
    f = figures
    verdict = "tutorial's too low" if f["tutorial"] < f["right"] else "tutorial's not too low"
    text = (f"The tutorial's evaluate gives {f['tutorial']:.2f} where the right perplexity is {f['right']:.1f}: "
            "it weighs each window by its columns and divides by rows, not tokens.")
    return "10.tutorial_evaluate", verdict, text, {k: f[k] for k in ("tutorial", "right", "divisor", "tokens scored")}


def late_losses(by_rate: dict[float, list[float]]) -> dict[float, Measured]:
    """Each rate's training losses over the last half of the steps: what `lr_verdict` reads."""
    return {rate: Measured.of(losses[len(losses) // 2:]) for rate, losses in by_rate.items()}


def lr_table(by_rate: dict[float, list[float]], vocab_size: int) -> list[dict]:
    """One row per rate: its loss over the last half of the steps beside ln(vocab)."""
    return [{"lr": rate, "loss, last half of the steps (median, min-max)": f"{late:.2f}",
             "ln(vocab)": f"{math.log(vocab_size):.2f}"} for rate, late in late_losses(by_rate).items()]


def lr_verdict(by_rate: dict[float, list[float]], vocab_size: int, width: int) -> tuple[str, str, str, dict]:
    """On which side of ln(vocab) did the loss stay over the last half of the steps at the
    tutorial's rate (the first of `by_rate`) and at ours (the second)?"""
    guess = math.log(vocab_size)
    late = late_losses(by_rate)
    (tutorial, t), (ours, o) = ((rate, "above" if m.median > guess else "below") for rate, m in late.items())
    text = f"Over the last half of the steps the loss at lr {tutorial} stayed {t} ln(vocab), at lr {ours} {o} it."
    return "10.lr5_wide_model", f"tutorial's rate {t}, ours {o}", text, {
        "lr5": late[tutorial], "ours": late[ours], "ln_vocab": guess, "width": width}

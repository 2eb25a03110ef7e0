"""Lesson 10 from a notebook: train the Transformer LM over a pipe x data grid of processes.

    cfg = capstone.Config(pipe=2, data=2, num_microbatches=2, schedule="1f1b", ...)  # refuses a bad recipe here
    run = capstone.train(cfg, load_corpus())  # refuses a recipe that will not fit, then the grid trains

`train` starts pipe x data processes (`experiments.run(worker, cfg, gather)`). Each finds its place
with lesson 05's `grid_place`, builds the whole model from the seed, keeps its stage
(`partition_layers`), and for every `bptt` window of its replica's columns runs `run_grid_step`
(the schedule, plus the data-parallel all-reduce of its stage), clips with the global norm over
its pipeline, and steps SGD. The last stage of the first pipeline writes the tutorial's log line
and its progress to a small file that a bar in the caller's process follows; validation uses the
whole model, gathered from the stages of the first pipeline, and the right normalisation. Before
any process starts, `memory_plan` estimates each stage's memory and a recipe that does not fit is
refused. An `LMRun` holds every step's loss and each micro-batch's, as the last stages computed
them; the verdict functions below turn it into the lesson's conclusions.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
import torch.distributed as dist

from pipelab import experiments, hardware
from pipelab.checks import positive_number, whole_number
from pipelab.data import Corpus, batchify, data_columns, get_batch
from pipelab.display import conclude, human_bytes
from pipelab.hybrid import check_grid, grid_place, microbatch_losses, run_grid_step
from pipelab.lm import TransformerLM, check_fits, clip_grad_norm_, lm_loss, stage_memory, stages_of
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, compare_medians, gather_steps, time_steps
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.partition import partition_layers
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import simulate
from pipelab.progress import ProgressFile, progress_bar
from pipelab.worker import RankContext

LOG_LINE = ("| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | ms/batch {:5.2f} | loss {:5.2f} | ppl {:8.2f}")
CAPSTONE_SCHEDULES = ("gpipe", "1f1b")  # one stage per process, whole backwards


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """The recipe. The tutorial's: emsize=nhid=4096, nhead=16, nlayers=8, dropout=0.2, bptt=35,
    batch_size=20, lr=5.0, gamma=0.95, clip=0.5, num_microbatches=8, schedule='gpipe'. Dropout is 0
    here so that the parallel run can be checked step for step against one process. The grid's
    processes are pipe x data (`world_size`). `check_steps`, `speed_steps` and `speed_repeats` say
    how the lesson compares the run with one process. `train` sets `corpus` (the text; with it the
    recipe is also checked against the memory there is) and `progress` (the file its bar follows)."""

    emsize: int = 64
    nhead: int = 2
    nhid: int = 128
    nlayers: int = 4
    dropout: float = 0.0
    bptt: int = 35
    batch_size: int = 20
    eval_batch_size: int = 10
    lr: float = 1.0
    gamma: float = 0.95
    clip: float = 0.5
    epochs: int = 1
    max_batches: int | None = None  # per epoch (None: the whole training split)
    pipe: int = 2
    data: int = 2
    num_microbatches: int = 2
    schedule: str = "1f1b"
    partition: str = "parameters"
    log_interval: int = 20
    seed: int = 0
    timeline_steps: int = 3  # steps timed after training, on copies: the Gantt
    check_steps: int = 3  # first steps compared with one process
    speed_steps: int = 10  # one-process steps per timing repeat
    speed_repeats: int = 3
    timeout: float = 600.0
    corpus: Corpus | None = field(default=None, repr=False)
    progress: str | None = None
    world_size: int = field(init=False, default=0)  # the grid's processes: pipe x data

    def __post_init__(self) -> None:
        check_grid(self.pipe, self.data)
        object.__setattr__(self, "world_size", self.pipe * self.data)
        super().__post_init__()

    def check(self) -> None:
        super().check()
        for name in ("emsize", "nhead", "nhid", "nlayers", "bptt", "batch_size", "eval_batch_size", "epochs",
                     "num_microbatches", "log_interval", "timeline_steps", "check_steps", "speed_steps", "speed_repeats"):
            whole_number(name, getattr(self, name), example=f"{name}=4")
        whole_number("seed", self.seed, minimum=0, example="seed=0")
        if self.max_batches is not None:
            whole_number("max_batches", self.max_batches, example="max_batches=20 (or None: the whole split)")
        for name in ("lr", "gamma", "clip"):
            positive_number(name, getattr(self, name), example=f"{name}=0.5")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}; use dropout=0.0 (as here, so "
                             "that the grid can be checked step for step against one process)")
        if self.batch_size % (self.data * self.num_microbatches):
            raise ValueError(f"batch_size={self.batch_size} must split over data={self.data} x num_microbatches="
                             f"{self.num_microbatches}; use a multiple of {self.data * self.num_microbatches}")
        if str(self.schedule).lower() not in CAPSTONE_SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: the capstone runs 'gpipe' (the tutorial's) or '1f1b' (one "
                             "stage per process, whose stash `lm.activation_bytes` counts)")
        with torch.device("meta"):  # sizes only: refuses emsize % nhead, an unknown partition, too many stages
            layers = TransformerLM(2, self.emsize, self.nhead, self.nhid, self.nlayers, self.dropout)
        parts = partition_layers(list(layers), self.pipe, self.partition)
        if any(hi == lo for lo, hi in zip(parts[:-1], parts[1:])):
            raise ValueError(f"pipe={self.pipe} stages cut by {self.partition!r} leave a stage without layers (cuts at "
                             f"{parts}; the model has {len(layers)} layers: embedding, positional encoding, "
                             f"{self.nlayers} encoder layers, decoder); use fewer stages (pipe) or more nlayers")
        if self.corpus is not None:
            check_memory(self, len(self.corpus.vocab))

    def model(self, ntoken: int):
        """The model of this recipe for a vocabulary of `ntoken` words, its weights from the seed."""
        torch.manual_seed(self.seed)
        return TransformerLM(ntoken, self.emsize, self.nhead, self.nhid, self.nlayers, self.dropout)

    def microbatch_tokens(self) -> int:
        """Tokens in one micro-batch of one replica: its columns x bptt."""
        return self.batch_size // self.data // self.num_microbatches * self.bptt

    def batches(self, corpus: Corpus) -> int:
        """Training steps of the whole run: windows per epoch times epochs."""
        return self.epochs * len(windows(batchify(corpus.train, self.batch_size), self.bptt, self.max_batches))


def windows(source: torch.Tensor, bptt: int, limit: int | None = None) -> list[int]:
    """Start rows of the full `bptt`-long windows (the short last one is left out: one message shape)."""
    starts = list(range(0, source.shape[0] - 1 - bptt + 1, bptt))
    return starts[:limit] if limit is not None else starts


def window_losses(model, source: torch.Tensor, bptt: int) -> list[tuple[float, int]]:
    """(mean token loss, seq_len) of every window of `source`, the short last one included."""
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, source.shape[0] - 1, bptt):
            x, y = get_batch(source, i, bptt)
            out.append((float(lm_loss(model(x), y)), x.shape[1]))
    model.train()
    return out


def perplexity(losses: list[tuple[float, int]]) -> float:
    """exp of the mean loss per token: each window weighted by its length, divided by all of them."""
    return math.exp(sum(loss * n for loss, n in losses) / sum(n for _, n in losses))


def tutorial_perplexity(losses: list[tuple[float, int]], rows: int, bptt: int, max_windows: int = 50) -> float:
    """The tutorial's `evaluate`: the loss summed over at most 50 windows, divided by the length of
    the whole validation set (`len(data_source) - 1` rows): too small when the set is longer."""
    return math.exp(sum(loss * n for loss, n in losses[:max_windows]) / (rows - 1))


def gather_model(model, stage, group):
    """The whole model, its stages' weights gathered from the pipeline `group` (every stage calls)."""
    pieces = [None] * (dist.get_world_size(group) if group is not None else 1)
    mine = {k: v.detach().cpu() for k, v in stage.state_dict().items()}
    if group is not None:
        dist.all_gather_object(pieces, mine, group=group)
    else:
        pieces = [mine]
    model.load_state_dict({k: v for piece in pieces for k, v in piece.items()})
    return model


# ---------------------------------------------------------------------------------------------
# On each process
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainingLog:
    """What the training loop wrote down as it went."""

    mb_losses: list[list[float] | None] = field(default_factory=list)  # per step: the last stage's micro-batch losses
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train ppl of the interval, valid ppl)
    intervals: list[tuple[int, float]] = field(default_factory=list)  # (batches, seconds) per log line


class GridTrainer:
    """One process of the grid: its stage, its replica's columns, its optimizer."""

    def __init__(self, ctx: RankContext, cfg: Config, corpus: Corpus, progress: str | None = None):
        self.ctx, self.cfg, self.corpus = ctx, cfg, corpus
        topology = check_grid(cfg.pipe, cfg.data, ctx.world_size)
        self.place = grid_place(ctx, topology)
        self.pipe_group = self.place.groups["pipe"]
        self.replica = topology.get_coord(ctx.rank).data
        self.model = cfg.model(len(corpus.vocab))
        self.parts = partition_layers(list(self.model), cfg.pipe, cfg.partition)
        stages = stages_of(self.model, self.parts)
        self.stage = copy.deepcopy(stages[self.place.rank]).to(ctx.device)
        self.modules = {self.place.rank: self.stage}
        self.opt = torch.optim.SGD(self.stage.parameters(), lr=cfg.lr)
        self.lr_steps = torch.optim.lr_scheduler.StepLR(self.opt, 1.0, gamma=cfg.gamma)
        self.train = data_columns(batchify(corpus.train, cfg.batch_size), self.replica, cfg.data)
        self.schedule = make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches)
        self.specs = message_specs(stages, get_batch(self.train, 0, cfg.bptt)[0], cfg.num_microbatches)
        self.logger = self.place.rank == cfg.pipe - 1 and self.replica == 0
        self.progress = ProgressFile(progress) if progress and self.logger else None
        self.stash_peak = (0, 0)  # the most micro-batches stashed at once, and their bytes, any step

    def step(self, i: int) -> list[float] | None:
        """One SGD step on the window at row `i`: the pipeline, the clip over it, the update. The
        micro-batch losses where this process holds the last stage."""
        x, y = (t.to(self.ctx.device) for t in get_batch(self.train, i, self.cfg.bptt))
        self.opt.zero_grad(set_to_none=True)
        runner = run_grid_step(self.place, self.schedule, self.modules, lm_loss, x, y, self.specs)
        self.stash_peak = max(self.stash_peak, (runner.meter.peak, runner.meter.peak_bytes))
        with self.ctx.rec.span("clip", lane="comm"):
            clip_grad_norm_(self.stage.parameters(), self.cfg.clip, self.pipe_group)
        with self.ctx.rec.span("optimizer"):
            self.opt.step()
        return microbatch_losses(runner) or None

    def validate(self) -> float | None:
        """Valid perplexity of the whole model, on the first pipeline's last stage (None elsewhere)."""
        model = gather_model(self.model, self.stage, self.pipe_group)
        if not self.logger:
            return None
        valid = batchify(self.corpus.valid, self.cfg.eval_batch_size)
        return perplexity(window_losses(model, valid, self.cfg.bptt))

    def say(self, line: str) -> None:
        """A log line: above the caller's progress bar, or printed (tagged with this rank)."""
        if self.progress is not None:
            self.progress.say(line)
        else:
            print(line, flush=True)

    def epoch(self, epoch: int, log: TrainingLog) -> None:
        starts = windows(self.train, self.cfg.bptt, self.cfg.max_batches)
        clock, interval = time.perf_counter(), []
        for batch, i in enumerate(starts, 1):
            self.ctx.rec.clear()  # the Gantt comes from time_steps below
            losses = self.step(i)
            log.mb_losses.append(losses)
            loss = sum(losses) / len(losses) if losses else None
            interval.append(loss)
            if self.progress is not None:  # one line per batch: the caller's progress bar follows it
                self.progress.advance(f"{loss:.4f}")
            if batch % self.cfg.log_interval == 0 or batch == len(starts):
                seconds = time.perf_counter() - clock
                log.intervals.append((len(interval), seconds))
                ms = seconds * 1e3 / len(interval)
                valid = self.validate()
                if self.logger:
                    mean = sum(interval) / len(interval)
                    self.say(LOG_LINE.format(epoch, batch, len(starts), self.lr_steps.get_last_lr()[0], ms, mean,
                                             math.exp(min(mean, 50))))
                    log.curve.append((len(log.mb_losses), math.exp(mean), valid))
                clock, interval = time.perf_counter(), []
        self.lr_steps.step()


@dataclass
class Result:
    """What one process brings back."""

    stage: int  # its pipe coordinate: the stage it holds
    replica: int  # its data coordinate
    parts: list[int]  # the partition's boundaries
    weights: dict[str, torch.Tensor]  # its stage's weights after training
    seconds: float  # the whole training, validations included
    steps: RankSteps  # the steps timed after training (on copies)
    stash: tuple[int, int]  # the most micro-batches stashed at once, and their bytes
    log: TrainingLog


def worker(ctx: RankContext, cfg: Config) -> Result:
    """Worker: train for `cfg.epochs` on `cfg.corpus`; then time `cfg.timeline_steps` steps on a copy (the Gantt)."""
    torch.set_num_threads(1)
    trainer = GridTrainer(ctx, cfg, cfg.corpus, cfg.progress)
    log = TrainingLog()
    start = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        trainer.epoch(epoch, log)
    seconds = time.perf_counter() - start
    weights = {k: v.detach().cpu() for k, v in trainer.stage.state_dict().items()}
    trainer.stage, trainer.opt = copy.deepcopy(trainer.stage), torch.optim.SGD([torch.zeros(1)], lr=0.0)
    trainer.modules = {trainer.place.rank: trainer.stage}
    steps = time_steps(ctx, lambda k: trainer.step(k * cfg.bptt), cfg.timeline_steps)
    return Result(trainer.place.rank, trainer.replica, trainer.parts, weights, seconds, steps, trainer.stash_peak, log)


# ---------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------


@dataclass
class LMRun(TimedSteps):
    """What the grid brought back: losses per step (mean over replicas) and per micro-batch, the
    logged curve, the stages' weights, the log intervals' times, the measured peak stash per
    stage, and the steps timed after training."""

    cfg: Config
    losses: list[float]  # per step: the batch's loss, the mean of its micro-batches'
    mb_losses: list[list[float]]  # per step: each micro-batch's loss as its last stage computed it, replica by replica
    curve: list[tuple[int, float, float]]  # (step, train ppl of the interval, valid ppl)
    weights: list[dict[str, torch.Tensor]]  # one per stage (first replica)
    parts: list[int]
    seconds: float  # the whole training, validations included
    steps: Steps = field(repr=False)  # the steps timed after training
    intervals: list[tuple[int, float]] = field(default_factory=list)  # (batches, seconds) per log line
    stash: list[tuple[int, int]] = field(default_factory=list)  # per stage: peak micro-batches, bytes
    name: str = "pipe x data grid"

    @property
    def tokens_per_second(self) -> Measured:
        """Training tokens/s of each log interval, the first one (warm-up) dropped when there are more."""
        rates = [n * self.cfg.batch_size * self.cfg.bptt / sec for n, sec in self.intervals]
        return Measured.of(rates[1:] if len(rates) > 1 else rates)

    def load_into(self, model):
        """Load the stages' weights into one unsplit model: the model the pipeline trained."""
        model.load_state_dict({k: v for w in self.weights for k, v in w.items()})
        return model


def gather(cfg: Config, results: Sequence[Result]) -> LMRun:
    """The run, from every process's `Result` (by rank)."""
    last = sorted((r for r in results if r.stage == cfg.pipe - 1), key=lambda r: r.replica)  # one per pipeline
    mb_losses = [[loss for step in per_replica for loss in step] for per_replica in zip(*(r.log.mb_losses for r in last))]
    logger = last[0]
    stages = sorted((r for r in results if r.replica == 0), key=lambda r: r.stage)
    return LMRun(cfg, [sum(step) / len(step) for step in mb_losses], mb_losses, logger.log.curve,
                 [r.weights for r in stages], results[0].parts, max(r.seconds for r in results),
                 gather_steps([r.steps for r in results]), logger.log.intervals, [r.stash for r in stages])


def available_memory(world_size: int) -> tuple[int | None, str]:
    """Bytes one process may use, and where: with a GPU per process, the free memory of the
    fullest GPU (`torch.cuda.mem_get_info`); on CPU, the memory available now
    (`hardware.available_memory`) shared by the processes; None where the machine does not say."""
    if hardware.choose_backend(world_size) == "nccl":
        return min(torch.cuda.mem_get_info(i)[0] for i in range(world_size)), "the fullest GPU"
    free = hardware.available_memory()
    return (free // world_size if free is not None else None), f"1/{world_size} of the available RAM"


def memory_plan(cfg: Config, ntoken: int) -> list[dict]:
    """`lm.stage_memory` for this recipe: the model built on the "meta" device (sizes, no memory),
    cut as the workers cut it, with the schedule's peak stash; SGD keeps no optimizer state."""
    with torch.device("meta"):
        model = cfg.model(ntoken)
    parts = partition_layers(list(model), cfg.pipe, cfg.partition)
    schedule = make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches)
    on_cpu = hardware.choose_backend(cfg.world_size) != "nccl"
    return stage_memory(model, parts, schedule, cfg.microbatch_tokens(), optimizer_states=0, host_copy=on_cpu)


def check_memory(cfg: Config, ntoken: int) -> None:
    """Refuse a recipe whose largest stage will not fit in what one process may use."""
    available, where = available_memory(cfg.world_size)
    if available is not None:
        check_fits(memory_plan(cfg, ntoken), available, where)


def train(cfg: Config, corpus: Corpus, progress: bool = True) -> LMRun:
    """Train over cfg.pipe x cfg.data processes on `corpus`, with a progress bar here; refuses a
    recipe whose stages will not fit in memory before starting any."""
    cfg = replace(cfg, corpus=corpus, progress=None)  # checks the memory, before any process starts
    with progress_bar(cfg.batches(corpus), f"{cfg.pipe} x {cfg.data} grid") if progress else nullcontext() as path:
        return experiments.run(worker, replace(cfg, progress=path), gather)


# ---------------------------------------------------------------------------------------------
# One process: the reference and the speed to compare with
# ---------------------------------------------------------------------------------------------


def single_process_losses(corpus: Corpus, cfg: Config, steps: int) -> list[float]:
    """The same model, batches, SGD, clipping and rate on one process, for `steps` steps: the
    losses the grid must reproduce."""
    model = cfg.model(len(corpus.vocab))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    train_ids = batchify(corpus.train, cfg.batch_size)
    losses = []
    for i in windows(train_ids, cfg.bptt, steps):
        x, y = get_batch(train_ids, i, cfg.bptt)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train_one_process(corpus: Corpus, cfg: Config, steps: int) -> float:
    """Tokens/s of `steps` training steps of the whole model on this process, one thread (as a worker)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        single_process_losses(corpus, cfg, steps)
        return steps * cfg.batch_size * cfg.bptt / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def one_process_tokens_per_second(corpus: Corpus, cfg: Config) -> Measured:
    """`train_one_process` repeated: tokens/s of each of `cfg.speed_repeats` runs of `cfg.speed_steps` steps."""
    return Measured.of(train_one_process(corpus, cfg, cfg.speed_steps) for _ in range(cfg.speed_repeats))


def lr_experiment(corpus: Corpus, cfg: Config, rates: Sequence[float]) -> dict[float, list[float]]:
    """One process's training losses over `cfg.max_batches` steps at each rate in `rates`."""
    return {rate: single_process_losses(corpus, replace(cfg, lr=rate), cfg.max_batches) for rate in rates}


# ---------------------------------------------------------------------------------------------
# Verdicts: what the notebook concludes, computed from the runs
# ---------------------------------------------------------------------------------------------


def loss_at_step_0_verdict(loss: float, logit_spread: float, vocab_size: int) -> str:
    """Conclude whether the untrained model's first loss is near ln(vocab), guessing evenly."""
    guess = math.log(vocab_size)
    near = abs(loss - guess) < 0.5
    verdict = "near ln(vocab)" if near else "far from ln(vocab)"
    conclude("10.loss_at_step_0", verdict,
             f"before training, the first batch's loss is {loss:.3f} against ln({vocab_size:,}) = {guess:.3f} for "
             f"guessing evenly; the logits spread {logit_spread:.2f}, and ln V + spread²/2 = "
             f"{guess + logit_spread ** 2 / 2:.3f}" + ("." if near else ": the initial weights already make confident guesses."),
             loss=loss, ln_vocab=guess, logit_spread=logit_spread)
    return verdict


def first_losses_verdict(run: LMRun, one: Sequence[float]) -> str:
    """Conclude whether the grid's first losses equal one process's."""
    gap = max(abs(a - b) for a, b in zip(run.losses, one))
    verdict = "equal" if gap < 1e-4 else "differ"
    conclude("10.first_losses", verdict,
             f"the grid's first {len(one)} losses differ from one process's by at most {gap:.1e}: "
             + ("equal to float rounding, as predicted." if gap < 1e-4 else "not the same computation."),
             max_difference=gap)
    return verdict


def perplexity_verdict(run: LMRun, vocab_size: int) -> str:
    """Conclude whether the valid perplexity ended well below guessing evenly (a quarter of the vocabulary)."""
    steps_at, _, valid = zip(*run.curve)
    verdict = "well below guessing" if valid[-1] < vocab_size / 4 else "not well below guessing"
    conclude("10.valid_perplexity", verdict,
             f"valid perplexity went from {valid[0]:.1f} after {steps_at[0]} steps to {valid[-1]:.1f} after "
             f"{steps_at[-1]}: {vocab_size / valid[-1]:.1f} times below guessing evenly among {vocab_size:,} words.",
             first=valid[0], last=valid[-1], vocab=vocab_size)
    return verdict


def stash_table(plan: list[dict], run: LMRun) -> list[dict]:
    """Per stage: the peak stash simulated and measured, the activations' bytes estimated and measured."""
    return [{"stage": r["stage"], "peak stash: simulated": r["peak stash"], "measured": count,
             "activations: estimated": human_bytes(r["activations"]), "measured ": human_bytes(nbytes)}
            for r, (count, nbytes) in zip(plan, run.stash)]


def stash_verdict(plan: list[dict], run: LMRun) -> str:
    """Conclude whether every stage's measured stash matches the estimate made before the run."""
    off = max(abs(nbytes / r["activations"] - 1) for r, (_, nbytes) in zip(plan, run.stash))
    counts_agree = all(count == r["peak stash"] for r, (count, _) in zip(plan, run.stash))
    simulated = [r["peak stash"] for r in plan]
    if counts_agree and off < 0.05:
        verdict, text = "matches", (f"every stage stashed at most the micro-batches the simulator said ({simulated}), "
                                    f"and the bytes measured are within {off:.1%} of the estimate.")
    else:
        verdict, text = "differs", (f"the stash differs from the estimate: at most {[c for c, _ in run.stash]} micro-batches "
                                    f"against the simulator's {simulated}, bytes off by up to {off:.0%} (another attention "
                                    "kernel, e.g. on a GPU, may keep other tensors than activation_bytes counts).")
    conclude("10.stash_estimate", verdict, text, worst_relative_error=off, counts_agree=counts_agree)
    return verdict


def speed_verdict(run: LMRun, one_rate: Measured) -> str:
    """Conclude how the grid's tokens/s compares with one process's, beside the bound the
    simulated schedule allows with one device per process (equal costs, free messages)."""
    cfg, grid_rate = run.cfg, run.tokens_per_second
    ideal = simulate(make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches))
    work = cfg.pipe * cfg.num_microbatches * (ideal.costs.forward + ideal.costs.backward_input + ideal.costs.backward_weight)
    bound = cfg.data * work / ideal.makespan_ms  # one process's time over the grid's, in cost units
    enough = min(len(grid_rate.values), len(one_rate.values)) >= 3  # a range needs a few repeats
    verdict = compare_medians(grid_rate, one_rate) if enough else "too few repeats"  # beyond a run's noise (30 %)
    ratio = grid_rate.median / one_rate.median
    text = (f"the grid trained {grid_rate:,.0f} tokens/s (median, min-max over {len(grid_rate.values)} log interval(s)), "
            f"one process on one thread {one_rate:,.0f} (over {len(one_rate.values)} repeat(s)): ")
    text += {"lower": f"the grid was slower, {ratio:.2f}x.", "higher": f"the grid was faster, {ratio:.2f}x.",
             "within noise": f"within this machine's run-to-run noise ({ratio:.2f}x by the medians).",
             "too few repeats": f"{ratio:.2f}x by the medians, too few repeats to tell a direction from noise "
                                "(more log intervals: a smaller log_interval)."}[verdict]
    cores = hardware.cpu_cores()
    if hardware.choose_backend(cfg.world_size) == "gloo" and cores < cfg.world_size:
        text += f" Its {cfg.world_size} processes share {cores} CPU cores, so they take turns."
    text += (f" With one device per process the simulated {cfg.schedule} schedule (bubble {ideal.bubble_fraction:.2f}) "
             f"allows up to {bound:.2f}x one process.")
    conclude("10.grid_vs_one_process", verdict, text, grid=grid_rate, one_process=one_rate, simulated_bound=bound)
    return verdict


def evaluate_verdict(right: float, wrong: float, windows_summed: int, bptt: int, rows: int) -> str:
    """Conclude whether the tutorial's `evaluate` gives a perplexity below the right one."""
    verdict = "tutorial's too low" if wrong < right else "tutorial's not too low"
    conclude("10.tutorial_evaluate", verdict,
             f"on the same trained model the tutorial's `evaluate` gives {wrong:.2f}, the right perplexity is {right:.1f}: "
             f"it divides {min(windows_summed, 50) * bptt} tokens' loss by {rows - 1} tokens. "
             "A perplexity near 1 would mean knowing every next word for sure.", tutorial=wrong, right=right)
    return verdict


def lr_verdict(by_rate: dict[float, list[float]], vocab_size: int, width: int) -> str:
    """Conclude on which side of ln(vocab) the loss stayed over the last half of the steps at the
    tutorial's rate (5.0, the first of `by_rate`) and at ours (the second)."""
    (tutorial, tutorial_losses), (ours, our_losses) = by_rate.items()
    guess, steps = math.log(vocab_size), len(tutorial_losses)
    late = {tutorial: Measured.of(tutorial_losses[steps // 2:]), ours: Measured.of(our_losses[steps // 2:])}
    side = {rate: "above" if late[rate].median > guess else "below" for rate in late}
    text = (f"over the last {len(late[tutorial].values)} of {steps} steps the loss at lr {tutorial} was "
            f"{late[tutorial]:.2f} (median, min-max), {side[tutorial]} ln(vocab) = {guess:.2f}; at lr {ours} it was "
            f"{late[ours]:.2f}, {side[ours]}.")
    text += {("above", "below"): " The tutorial's rate keeps the wide model worse than guessing evenly, as its log shows; ours trains it.",
             ("below", "below"): " Both rates got below guessing at this width, where lr x 0.5 x sqrt(emsize) is smaller; try a larger `wide`.",
             ("above", "above"): f" Neither rate gets below guessing in {steps} steps at this width.",
             ("below", "above"): " The tutorial's rate did better here than ours."}[side[tutorial], side[ours]]
    verdict = f"tutorial's rate {side[tutorial]}, ours {side[ours]}"
    conclude("10.lr5_wide_model", verdict, text, lr5=late[tutorial], ours=late[ours], ln_vocab=guess, width=width)
    return verdict


def run_flops(cfg: Config, vocab: int, train_tokens: int, valid_tokens: int) -> float:
    """FLOPs of the recipe's whole run at its size, counted on the meta device (no memory): each
    training window's forward and backward (`epochs` x the training split, or `max_batches`
    windows), the validation's forwards, and the one-process baseline's timed steps. What a GPU
    profile's time budget is estimated from (`pipelab profiles`)."""
    from pipelab.emulate.cost import count, forward_backward_counts

    model = TransformerLM(vocab, cfg.emsize, cfg.nhead, cfg.nhid, cfg.nlayers).to("meta")
    ids = torch.zeros(cfg.batch_size, cfg.bptt, dtype=torch.long, device="meta")
    forward, grad_in, grad_w = forward_backward_counts(model, ids)
    step = forward.flops + grad_in.flops + grad_w.flops
    windows_per_epoch = train_tokens // (cfg.batch_size * cfg.bptt)
    steps = cfg.epochs * min(windows_per_epoch, cfg.max_batches or windows_per_epoch)
    steps += cfg.speed_steps * cfg.speed_repeats + cfg.check_steps + cfg.timeline_steps
    valid = count(model, torch.zeros(cfg.eval_batch_size, cfg.bptt, dtype=torch.long, device="meta")).flops
    valid_windows = valid_tokens // (cfg.eval_batch_size * cfg.bptt)
    return steps * step + cfg.epochs * valid_windows * valid

"""Lesson 10 from a notebook: train the Transformer LM over a pipe x data grid of processes.

`train_lm(corpus, cfg)` starts pipe x data processes. Each finds its place with lesson 05's
`grid_place`, builds the whole model from the seed, keeps its stage (`partition_layers`), and for
every `bptt` window of its replica's columns runs `run_grid_step` (the schedule, plus the
data-parallel all-reduce of its stage), clips with the global norm over its pipeline, and steps
SGD. The last stage of the first pipeline prints the tutorial's log line and, through a small
file, feeds a progress bar in the caller's process; validation uses the whole model, gathered from
the stages of the first pipeline, and the right normalisation. Before any process starts,
`memory_plan` estimates each stage's memory and `train_lm` refuses a recipe that does not fit.
"""

from __future__ import annotations

import copy
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipelab import hardware
from pipelab.checks import positive_number, whole_number
from pipelab.data import Corpus, batchify, data_columns, get_batch
from pipelab.hybrid import check_grid, grid_place, run_grid_step
from pipelab.launch import spawn
from pipelab.lm import TransformerLM, check_fits, clip_grad_norm_, lm_loss, stage_memory, stages_of
from pipelab.measure import Measured, Steps, gather_steps, time_steps
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.partition import partition_layers
from pipelab.pipeline.schedules import make_schedule
from pipelab.progress import progress_bar
from pipelab.pipeline.topology import axis_groups

LOG_LINE = ("| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | ms/batch {:5.2f} | loss {:5.2f} | ppl {:8.2f}")


@dataclass
class LMConfig:
    """The recipe. The tutorial's: emsize=nhid=4096, nhead=16, nlayers=8, dropout=0.2, bptt=35,
    batch_size=20, lr=5.0, gamma=0.95, clip=0.5, microbatches=8, schedule='gpipe'. Dropout is 0 here
    so that the parallel run can be checked step for step against one process."""

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
    microbatches: int = 2
    schedule: str = "1f1b"
    partition: str = "parameters"
    log_interval: int = 20
    seed: int = 0

    def model(self, ntoken: int):
        torch.manual_seed(self.seed)
        return TransformerLM(ntoken, self.emsize, self.nhead, self.nhid, self.nlayers, self.dropout)

    def check(self) -> None:
        for name in ("bptt", "batch_size", "eval_batch_size", "epochs", "microbatches", "log_interval"):
            whole_number(name, getattr(self, name), example=f"{name}=4")
        positive_number("lr", self.lr, example="lr=1.0")
        check_grid(self.pipe, self.data)
        if self.batch_size % (self.data * self.microbatches):
            raise ValueError(f"batch_size={self.batch_size} must split over data={self.data} x microbatches="
                             f"{self.microbatches}; use a multiple of {self.data * self.microbatches}")
        if str(self.schedule).lower() not in ("gpipe", "1f1b"):  # one stage per process, whole backwards
            raise ValueError(f"schedule={self.schedule!r}: the capstone runs 'gpipe' (the tutorial's) or '1f1b' (one "
                             "stage per process, whose stash `lm.activation_bytes` counts)")

    def microbatch_tokens(self) -> int:
        """Tokens in one micro-batch of one replica: its columns x bptt."""
        return self.batch_size // self.data // self.microbatches * self.bptt


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


class GridTrainer:
    """One process of the grid: its stage, its replica's columns, its optimizer."""

    def __init__(self, ctx, corpus: Corpus, cfg: LMConfig, progress: str | None = None):
        self.ctx, self.cfg, self.corpus = ctx, cfg, corpus
        topology = check_grid(cfg.pipe, cfg.data, ctx.world_size)
        self.place = grid_place(ctx, topology)
        self.pipe_group = axis_groups(topology, "pipe", ctx.rank) if cfg.pipe > 1 else None
        self.replica = topology.get_coord(ctx.rank).data
        self.model = cfg.model(len(corpus.vocab))
        self.parts = partition_layers(list(self.model), cfg.pipe, cfg.partition)
        stages = stages_of(self.model, self.parts)
        self.stage = copy.deepcopy(stages[self.place.rank]).to(ctx.device)
        self.modules = {self.place.rank: self.stage}
        self.opt = torch.optim.SGD(self.stage.parameters(), lr=cfg.lr)
        self.lr_steps = torch.optim.lr_scheduler.StepLR(self.opt, 1.0, gamma=cfg.gamma)
        self.train = data_columns(batchify(corpus.train, cfg.batch_size), self.replica, cfg.data)
        self.schedule = make_schedule(cfg.schedule, cfg.pipe, cfg.microbatches)
        self.specs = message_specs(stages, get_batch(self.train, 0, cfg.bptt)[0], cfg.microbatches)
        self.logger = self.place.rank == cfg.pipe - 1 and self.replica == 0
        self.progress = open(progress, "a") if progress and self.logger else None  # noqa: SIM115
        self.stash_peak = (0, 0)  # the most micro-batches stashed at once, and their bytes, any step

    def step(self, i: int) -> float | None:
        """One SGD step on the window at row `i`: the pipeline, the clip over it, the update."""
        x, y = (t.to(self.ctx.device) for t in get_batch(self.train, i, self.cfg.bptt))
        self.opt.zero_grad(set_to_none=True)
        runner = run_grid_step(self.place, self.schedule, self.modules, lm_loss, x, y, self.specs)
        self.stash_peak = max(self.stash_peak, (runner.meter.peak, runner.meter.peak_bytes))
        with self.ctx.rec.span("clip", lane="comm"):
            clip_grad_norm_(self.stage.parameters(), self.cfg.clip, self.pipe_group)
        with self.ctx.rec.span("optimizer"):
            self.opt.step()
        return float(sum(runner.losses)) if runner.losses else None

    def validate(self) -> float | None:
        """Valid perplexity of the whole model, on the first pipeline's last stage (None elsewhere)."""
        model = gather_model(self.model, self.stage, self.pipe_group)
        if not self.logger:
            return None
        valid = batchify(self.corpus.valid, self.cfg.eval_batch_size)
        return perplexity(window_losses(model, valid, self.cfg.bptt))

    def epoch(self, epoch: int, log: dict) -> None:
        starts = windows(self.train, self.cfg.bptt, self.cfg.max_batches)
        clock, interval = time.perf_counter(), []
        for batch, i in enumerate(starts, 1):
            self.ctx.rec.clear()  # the Gantt comes from time_steps below
            loss = self.step(i)
            log["losses"].append(loss)
            interval.append(loss)
            if self.progress is not None:  # one line per batch: the caller's progress bar follows it
                self.progress.write(f"{loss:.4f}\n")
                self.progress.flush()
            if batch % self.cfg.log_interval == 0 or batch == len(starts):
                seconds = time.perf_counter() - clock
                log["intervals"].append((len(interval), seconds))
                ms = seconds * 1e3 / len(interval)
                valid = self.validate()
                if self.logger:
                    mean = sum(interval) / len(interval)
                    print(LOG_LINE.format(epoch, batch, len(starts), self.lr_steps.get_last_lr()[0], ms, mean,
                                          math.exp(min(mean, 50))), flush=True)
                    log["curve"].append((len(log["losses"]), math.exp(mean), valid))
                clock, interval = time.perf_counter(), []
        self.lr_steps.step()


def lm_worker(ctx, corpus: Corpus, cfg: LMConfig, progress: str | None = None, timeline_steps: int = 3) -> dict:
    """Worker: train for cfg.epochs; then time `timeline_steps` steps on a copy (the Gantt)."""
    torch.set_num_threads(1)
    trainer = GridTrainer(ctx, corpus, cfg, progress)
    log = {"losses": [], "curve": [], "intervals": []}
    start = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        trainer.epoch(epoch, log)
    seconds = time.perf_counter() - start
    weights = {k: v.detach().cpu() for k, v in trainer.stage.state_dict().items()}
    trainer.stage, trainer.opt = copy.deepcopy(trainer.stage), torch.optim.SGD([torch.zeros(1)], lr=0.0)
    trainer.modules = {trainer.place.rank: trainer.stage}
    steps = time_steps(ctx, lambda k: trainer.step(k * cfg.bptt), timeline_steps)
    return {"rank": ctx.rank, "stage": trainer.place.rank, "replica": trainer.replica, "parts": trainer.parts,
            "weights": weights, "seconds": seconds, "steps": steps, "stash": trainer.stash_peak, **log}


@dataclass
class LMRun:
    """What the grid brought back: losses per step (mean over replicas), the logged curve, the
    stages' weights, the log intervals' times, the measured peak stash per stage, and the timed
    steps' timelines."""

    cfg: LMConfig
    losses: list[float]
    curve: list[tuple[int, float, float]]  # (step, train ppl of the interval, valid ppl)
    weights: list[dict[str, torch.Tensor]]  # one per stage (first replica)
    parts: list[int]
    seconds: float  # the whole training, validations included
    steps: Steps
    intervals: list[tuple[int, float]] = field(default_factory=list)  # (batches, seconds) per log line
    stash: list[tuple[int, int]] = field(default_factory=list)  # per stage: peak micro-batches, bytes
    name: str = "pipe x data grid"

    @property
    def tokens_per_second(self) -> float:
        """Training tokens/s over the whole run (the validations left out)."""
        batches, seconds = (sum(column) for column in zip(*self.intervals))
        return batches * self.cfg.batch_size * self.cfg.bptt / seconds

    def interval_tokens_per_second(self) -> Measured:
        """Tokens/s of each log interval, the first one (warm-up) dropped when there are more."""
        rates = [n * self.cfg.batch_size * self.cfg.bptt / sec for n, sec in self.intervals]
        return Measured.of(rates[1:] if len(rates) > 1 else rates)

    def load_into(self, model):
        """Load the stages' weights into one unsplit model: the model the pipeline trained."""
        model.load_state_dict({k: v for w in self.weights for k, v in w.items()})
        return model


def available_memory(world_size: int) -> tuple[int, str]:
    """Bytes one process may use, and where: with a GPU per process, the free memory of the
    fullest GPU (`torch.cuda.mem_get_info`); on CPU, the RAM available now shared by the processes."""
    if hardware.choose_backend(world_size) == "nccl":
        return min(torch.cuda.mem_get_info(i)[0] for i in range(world_size)), "the fullest GPU"
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):  # not Linux: the pages free now
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return free // world_size, f"1/{world_size} of the available RAM"


def memory_plan(cfg: LMConfig, ntoken: int) -> list[dict]:
    """`lm.stage_memory` for this recipe: the model built on the "meta" device (sizes, no memory),
    cut as the workers cut it, with the schedule's peak stash; SGD keeps no optimizer state."""
    with torch.device("meta"):
        model = cfg.model(ntoken)
    parts = partition_layers(list(model), cfg.pipe, cfg.partition)
    schedule = make_schedule(cfg.schedule, cfg.pipe, cfg.microbatches)
    on_cpu = hardware.choose_backend(cfg.pipe * cfg.data) != "nccl"
    return stage_memory(model, parts, schedule, cfg.microbatch_tokens(), optimizer_states=0, host_copy=on_cpu)


def train_lm(corpus: Corpus, cfg: LMConfig, timeout: float = 600.0, progress: bool = True) -> LMRun:
    """Train over cfg.pipe x cfg.data processes, with a progress bar here; refuses a bad recipe, or
    one whose stages will not fit in memory, before starting any."""
    cfg.check()
    world = cfg.pipe * cfg.data
    check_fits(memory_plan(cfg, len(corpus.vocab)), *available_memory(world))
    batches = cfg.epochs * len(windows(batchify(corpus.train, cfg.batch_size), cfg.bptt, cfg.max_batches))
    with progress_bar(batches, f"{cfg.pipe} x {cfg.data} grid") if progress else nullcontext() as path:
        per_rank = spawn(lm_worker, world, corpus, cfg, path, timeout=timeout)
    last = [r for r in per_rank if r["stage"] == cfg.pipe - 1]
    losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in last))]
    logger = next(r for r in last if r["replica"] == 0)
    stages = sorted((r for r in per_rank if r["replica"] == 0), key=lambda r: r["stage"])
    return LMRun(cfg, losses, logger["curve"], [r["weights"] for r in stages], per_rank[0]["parts"],
                 max(r["seconds"] for r in per_rank), gather_steps([r["steps"] for r in per_rank]),
                 logger["intervals"], [r["stash"] for r in stages])


def single_process_losses(corpus: Corpus, cfg: LMConfig, steps: int) -> list[float]:
    """The same model, batches, SGD, clipping and rate on one process, for `steps` steps: the
    losses the grid must reproduce."""
    model = cfg.model(len(corpus.vocab))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    train = batchify(corpus.train, cfg.batch_size)
    losses = []
    for i in windows(train, cfg.bptt, steps):
        x, y = get_batch(train, i, cfg.bptt)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train_one_process(corpus: Corpus, cfg: LMConfig, steps: int) -> float:
    """Tokens/s of `steps` training steps of the whole model on this process, one thread (as a worker)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        single_process_losses(corpus, cfg, steps)
        return steps * cfg.batch_size * cfg.bptt / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def one_process_tokens_per_second(corpus: Corpus, cfg: LMConfig, steps: int, repeats: int) -> Measured:
    """`train_one_process` repeated: tokens/s of each of `repeats` runs of `steps` steps."""
    return Measured.of(train_one_process(corpus, cfg, steps) for _ in range(repeats))

"""Training the language model over a pipe x data grid (lesson 10): what one process does.

Each process finds its place with lesson 05's `grid_place`, builds the whole model on the meta
device (shapes, no storage), cuts it (`partition_layers`) and makes only its own stage real
(`pipelab.build`: the weights the seed gives that stage in the whole model). For every `bptt` window
of its replica's columns it runs `run_grid_step` (the schedule, plus the data-parallel all-reduce of
its stage), clips with the global norm over its pipeline, and steps SGD. The last stage of the first
pipeline writes the tutorial's log line and validates the whole model, gathered from the stages.
`single_process_losses` is the same training in one process: the reference the grid must equal.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from pipelab.build import materialize
from pipelab.data import Corpus, batchify, data_columns, get_batch
from pipelab.hybrid import check_grid, grid_place, microbatch_losses, run_grid_step
from pipelab.lm import clip_grad_norm_, gather_model, lm_loss, perplexity, stages_of, window_losses
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.partition import partition_layers
from pipelab.pipeline.schedules import make_schedule
from pipelab.progress import ProgressFile
from pipelab.reference import exact_fp32
from pipelab.worker import RankContext

LOG_LINE = ("| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | ms/batch {:5.2f} | loss {:5.2f} | ppl {:8.2f}")


def windows(source: torch.Tensor, bptt: int, limit: int | None = None) -> list[int]:
    """Start rows of the full `bptt`-long windows (the short last one is left out: one message shape)."""
    starts = list(range(0, source.shape[0] - 1 - bptt + 1, bptt))
    return starts[:limit] if limit is not None else starts


@dataclass
class TrainingLog:
    """What the training loop wrote down as it went."""

    mb_losses: list[list[float] | None] = field(default_factory=list)  # per step: the last stage's micro-batch losses
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train ppl of the interval, valid ppl)
    intervals: list[tuple[int, float]] = field(default_factory=list)  # (batches, seconds) per log line


class GridTrainer:
    """One process of the grid: its stage, its replica's columns, its optimizer (`cfg`: the lesson's
    recipe, `experiments.capstone.Config`)."""

    def __init__(self, ctx: RankContext, cfg, corpus: Corpus, progress: str | None = None):
        self.ctx, self.cfg, self.corpus = ctx, cfg, corpus
        topology = check_grid(cfg.pipe, cfg.data, ctx.world_size)
        self.place = grid_place(ctx, topology)
        self.pipe_group, self.replica = self.place.groups["pipe"], topology.get_coord(ctx.rank).data
        self.model = cfg.model(len(corpus.vocab), meta=True)  # shapes only: the whole model is never real here
        self.parts = partition_layers(list(self.model), cfg.pipe, cfg.partition)
        stages = stages_of(self.model, self.parts)
        self.stage = materialize(copy.deepcopy(stages[self.place.rank]), ctx.device)  # on meta: this stage only
        self.modules = {self.place.rank: self.stage}
        self.opt = torch.optim.SGD(self.stage.parameters(), lr=cfg.lr)
        self.lr_steps = torch.optim.lr_scheduler.StepLR(self.opt, 1.0, gamma=cfg.gamma)
        self.train = data_columns(batchify(corpus.train, cfg.batch_size), self.replica, cfg.data)
        self.schedule = make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches)
        self.specs = message_specs(stages, get_batch(self.train, 0, cfg.bptt)[0], cfg.num_microbatches)
        self.logger = self.place.rank == cfg.pipe - 1 and self.replica == 0
        self.progress = ProgressFile(progress) if progress and self.logger else None
        self.stash_peak = (0, 0)  # the most micro-batches stashed at once, and their bytes, any step
        self.ms_label = "ms/batch"  # what the log line calls its step time ("modelled ms/batch" on a modelled clock)

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
        model = gather_model(self.model, self.stage, self.pipe_group, keep=self.logger)  # real on the logger only
        if model is None:
            return None
        valid = batchify(self.corpus.valid, self.cfg.eval_batch_size)
        return perplexity(window_losses(model.to(self.ctx.device), valid, self.cfg.bptt))

    def epoch(self, epoch: int, log: TrainingLog) -> None:
        starts = windows(self.train, self.cfg.bptt, self.cfg.max_batches)
        clock, interval = self.ctx.now(), []  # the rank's clock
        for batch, i in enumerate(starts, 1):
            self.ctx.rec.clear()  # the Gantt comes from time_steps after training
            losses = self.step(i)
            log.mb_losses.append(losses)
            loss = sum(losses) / len(losses) if losses else None
            interval.append(loss)
            if self.progress is not None:  # one line per batch: the caller's progress bar follows it
                self.progress.advance(f"{loss:.4f}")
            if batch % self.cfg.log_interval == 0 or batch == len(starts):
                seconds = self.ctx.now() - clock
                log.intervals.append((len(interval), seconds))
                valid = self.validate()
                if self.logger:
                    mean = sum(interval) / len(interval)
                    line = LOG_LINE.format(epoch, batch, len(starts), self.lr_steps.get_last_lr()[0],
                                           seconds * 1e3 / len(interval), mean, math.exp(min(mean, 50)))
                    line = line.replace("ms/batch", self.ms_label)
                    self.progress.say(line) if self.progress is not None else print(line, flush=True)
                    log.curve.append((len(log.mb_losses), math.exp(mean), valid))
                clock, interval = self.ctx.now(), []
        self.lr_steps.step()


def sgd_steps(model, opt, source: torch.Tensor, cfg, starts: list[int]) -> list[torch.Tensor]:
    """One process's training steps on the windows at rows `starts` of `source`: the model's loss,
    its backward, clipping with the whole model's norm, SGD. The losses, left on the model's device."""
    device = next(model.parameters()).device
    losses = []
    for i in starts:
        x, y = (t.to(device) for t in get_batch(source, i, cfg.bptt))
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(loss.detach())
    return losses


def reference_device() -> torch.device:
    """Where one process checks and times the baseline: the first GPU when there is one (where a
    grid rank computes), else the CPU."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def single_process_losses(corpus: Corpus, cfg, steps: int, device=None) -> list[float]:
    """The same model, batches, SGD, clipping and rate in one process for `steps` steps, on `device`
    (default `reference_device()`), with TF32 off: the losses the grid must reproduce."""
    device = torch.device(device) if device is not None else reference_device()
    model = cfg.model(len(corpus.vocab)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    train_ids = batchify(corpus.train, cfg.batch_size)
    with exact_fp32():
        return [float(loss) for loss in sgd_steps(model, opt, train_ids, cfg, windows(train_ids, cfg.bptt, steps))]

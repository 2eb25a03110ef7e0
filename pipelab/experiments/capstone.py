"""Lesson 10 from a notebook: train the Transformer LM over a pipe x data grid of processes.

    cfg = capstone.Config(pipe=2, data=2, num_microbatches=2, schedule="1f1b", ...)  # refuses a bad recipe here
    run = capstone.train(cfg, load_corpus())  # refuses a recipe that will not fit, then the grid trains

Each process runs `lm_training.GridTrainer`. On a modelled node (e.g. "4xH100-nvlink") the
processes, their math and every loss stay real and small while each rank's clock gives its stage
what an H100 takes for the same stage at `Config.SIZE`, the tutorial's model.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, ClassVar, Mapping, Sequence

import torch

from pipelab import experiments, hardware
from pipelab.build import materialize, on_meta
from pipelab.checks import positive_number, whole_number
from pipelab.data import Corpus, batchify
from pipelab.emulate import cost, training as modelled
from pipelab.hybrid import check_grid
from pipelab.lm import TransformerLM, check_fits, lm_loss, load_whole, stage_memory, stages_of
from pipelab.lm_training import GridTrainer, TrainingLog, windows
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, gather_steps, time_steps
from pipelab.pipeline.partition import partition_layers
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, simulate
from pipelab.progress import progress_bar
from pipelab.reference import exact_fp32
from pipelab.worker import RankContext

CAPSTONE_SCHEDULES = ("gpipe", "1f1b")  # one stage per process, whole backwards
INTEGERS = ("emsize", "nhead", "nhid", "nlayers", "bptt", "batch_size", "eval_batch_size", "epochs", "num_microbatches",
            "log_interval", "timeline_steps", "check_steps", "speed_steps", "speed_repeats")


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """The recipe (the tutorial's: emsize=nhid=4096, nhead=16, nlayers=8, dropout=0.2, bptt=35, batch_size=20,
    lr=5.0, gamma=0.95, clip=0.5, num_microbatches=8, 'gpipe'; dropout 0 here, so the grid can be checked
    against one process). A modelled node times each stage as the same stage of the model at `SIZE`
    (`columns` columns of `bptt` tokens per micro-batch). `train` sets `corpus` and `progress`."""

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
    SIZE: ClassVar[Mapping[str, Any]] = {"emsize": 4096, "nhid": 4096, "nhead": 16, "nlayers": 8, "columns": 128,
                                         "dtype": "bfloat16"}

    @cached_property
    def stage_costs(self) -> list[dict] | None:
        """On a modelled node with a corpus: each stage at `SIZE`, modelled (`big_stages`). `train`
        counts it once, before the ranks start; the counted value travels with the Config."""
        return None if self.node is None or self.corpus is None else big_stages(self, len(self.corpus.vocab))

    def __post_init__(self) -> None:
        check_grid(self.pipe, self.data)
        object.__setattr__(self, "world_size", self.pipe * self.data)
        super().__post_init__()

    def check(self) -> None:
        super().check()
        for name in INTEGERS:
            whole_number(name, getattr(self, name), example=f"{name}=4")
        for name, value in vars(self.size).items():
            if name != "dtype":
                whole_number(name, value, example=f"{name}=4 at the modelled size")
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
        check_stages(layers, self.pipe, self.partition, "nlayers")
        if self.node is not None:  # the model at SIZE is cut the same way
            check_stages(big_model(self, 2), self.pipe, self.partition, "nlayers at the modelled size")
        if self.corpus is not None:
            check_memory(self, len(self.corpus.vocab))

    def model(self, ntoken: int, meta: bool = False):
        """The recipe's model for `ntoken` words, its weights from the seed: on the meta device with
        `meta` (a rank makes its own stage real), else real and whole, the same weights either way."""
        model = on_meta(lambda: TransformerLM(ntoken, self.emsize, self.nhead, self.nhid, self.nlayers, self.dropout),
                        seed=self.seed)
        return model if meta else materialize(model)

    def microbatch_tokens(self) -> int:
        """Tokens in one micro-batch of one replica: its columns x bptt."""
        return self.batch_size // self.data // self.num_microbatches * self.bptt

    def batches(self, corpus: Corpus) -> int:
        """Training steps of the whole run: windows per epoch times epochs."""
        return self.epochs * len(windows(batchify(corpus.train, self.batch_size), self.bptt, self.max_batches))

    def step_tokens(self, modelled: bool = False) -> int:
        """Tokens one step takes in over the grid: `batch_size` columns of `bptt` tokens; with
        `modelled`, SIZE's `columns` per micro-batch of each replica."""
        return (self.data * self.num_microbatches * self.size.columns if modelled else self.batch_size) * self.bptt


def check_stages(model, pipe: int, partition: str, layers_name: str) -> None:
    """Refuse a cut of `model` into `pipe` stages by `partition` that leaves a stage empty."""
    parts = partition_layers(list(model), pipe, partition)
    if any(hi == lo for lo, hi in zip(parts[:-1], parts[1:])):
        raise ValueError(f"pipe={pipe} stages cut by {partition!r} leave a stage without layers (cuts at {parts}; "
                         f"the model has {len(model)} layers: embedding, positional encoding, {len(model) - 3} "
                         f"encoder layers, decoder); use fewer stages (pipe) or more {layers_name}")


# --- The model at SIZE, where each rank's time is modelled ---


def big_model(cfg: Config, ntoken: int):
    """The model at `cfg.size`, on the meta device: sizes, no memory."""
    s = cfg.size
    with torch.device("meta"):
        return TransformerLM(ntoken, s.emsize, s.nhead, s.nhid, s.nlayers)


def emulated_size(cfg: Config) -> str:
    """The modelled size in words, for the lesson's first line."""
    s = cfg.size
    return (f"the tutorial's model (emsize {s.emsize}, nhid {s.nhid}, {s.nhead} heads, {s.nlayers} encoder layers) "
            f"on micro-batches of {s.columns} columns x {cfg.bptt} tokens, in {s.dtype}")


def big_stages(cfg: Config, ntoken: int) -> list[dict]:
    """Per stage of the model at SIZE, cut as the real one: parameters, modelled F, I, W, B, clip and SGD seconds."""
    model = big_model(cfg, ntoken)
    ids = torch.zeros(cfg.size.columns, cfg.bptt, dtype=torch.long, device="meta")
    return modelled.stage_rows(stages_of(model, partition_layers(list(model), cfg.pipe, cfg.partition)), ids,
                               lm_loss, cfg.node, cfg.size.dtype)


def big_stage_table(cfg: Config, ntoken: int) -> list[dict]:
    """`big_stages` as the rows the lesson prints, beside the real stages' bytes."""
    model, s = cfg.model(ntoken, meta=True), cfg.size
    real = [sum(p.numel() * p.element_size() for p in stage.parameters())
            for stage in stages_of(model, partition_layers(list(model), cfg.pipe, cfg.partition))]
    big = s.columns * cfg.bptt * s.emsize * modelled.itemsize(s.dtype)
    return modelled.stage_table_rows(big_stages(cfg, ntoken), real, cfg.microbatch_tokens() * cfg.emsize * 4,
                                     big, s.dtype)  # float32 activations


def one_device_tokens_per_second(cfg: Config, ntoken: int) -> float:
    """Tokens/s of ONE device of `cfg.node` training the whole model at SIZE on the whole step's batch."""
    ids = torch.zeros(cfg.data * cfg.num_microbatches * cfg.size.columns, cfg.bptt, dtype=torch.long, device="meta")
    seconds = modelled.one_device_seconds(big_model(cfg, ntoken), ids, lm_loss, cfg.node, cfg.size.dtype)
    return cfg.step_tokens(modelled=True) / seconds


def modelled_step(cfg: Config, ntoken: int) -> dict:
    """The grid's modelled step from its ranks' costs: the schedule simulated (free messages), the slowest
    stage's clipping and SGD step, the largest stage's gradient bytes (its all-reduce's message)."""
    stages = big_stages(cfg, ntoken)
    costs = Costs(per_stage={r["stage"]: (r["F"] * 1e3, r["B"] * 1e3, 0.0) for r in stages})  # whole backwards
    sim = simulate(make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches), costs)
    return {"schedule_s": sim.makespan_ms / 1e3, "bubble": sim.bubble_fraction,
            "update_s": max(r["clip"] + r["optimizer"] for r in stages), "parameters": sum(r["parameters"] for r in stages),
            "gradient_bytes": max(r["parameters"] for r in stages) * modelled.itemsize(cfg.size.dtype)}


# --- On each process ---


@dataclass
class Result:
    """What one process brings back."""

    stage: int  # its pipe coordinate: the stage it holds
    replica: int  # its data coordinate
    parts: list[int]  # the partition's boundaries
    weights: dict[str, torch.Tensor]  # its stage's weights after training
    seconds: float  # the whole training, validations included, on the rank's clock
    steps: RankSteps  # the steps timed after training (on copies)
    stash: tuple[int, int]  # the most micro-batches stashed at once, and their bytes
    log: TrainingLog


def worker(ctx: RankContext, cfg: Config) -> Result:
    """Train for `cfg.epochs` on `cfg.corpus`; then time `cfg.timeline_steps` steps on a copy (the Gantt)."""
    torch.set_num_threads(1)
    with exact_fp32():  # on a GPU, full float32 products: the losses are compared with one process's
        trainer = GridTrainer(ctx, cfg, cfg.corpus, cfg.progress)
        if cfg.stage_costs is not None:  # on a modelled node (`train`): this stage's costs at SIZE
            modelled.time_stage(ctx.emulator, cfg.stage_costs[trainer.place.rank],
                                sum(p.numel() * p.element_size() for p in trainer.stage.parameters()), trainer.place.rank,
                                cfg.size.dtype)
            trainer.ms_label = "modelled ms/batch"  # the bar beside it runs at this machine's real pace
        log, start = TrainingLog(), ctx.now()
        for epoch in range(1, cfg.epochs + 1):
            trainer.epoch(epoch, log)
        seconds = ctx.now() - start
        weights = {k: v.detach().cpu() for k, v in trainer.stage.state_dict().items()}
        trainer.stage, trainer.opt = copy.deepcopy(trainer.stage), torch.optim.SGD([torch.zeros(1)], lr=0.0)
        trainer.modules = {trainer.place.rank: trainer.stage}
        steps = time_steps(ctx, lambda k: trainer.step(k * cfg.bptt), cfg.timeline_steps)
    return Result(trainer.place.rank, trainer.replica, trainer.parts, weights, seconds, steps, trainer.stash_peak, log)


# --- The parent side ---


@dataclass
class LMRun(TimedSteps):
    """What the grid brought back: losses, the logged curve, the stages' weights, timings, the peak stashes."""

    cfg: Config
    losses: list[float]  # per step: the batch's loss, the mean of its micro-batches'
    mb_losses: list[list[float]]  # per step: each micro-batch's loss as its last stage computed it, replica by replica
    curve: list[tuple[int, float, float]]  # (step, train ppl of the interval, valid ppl)
    weights: list[dict[str, torch.Tensor]]  # one per stage (first replica)
    parts: list[int]
    seconds: float  # the whole training, validations included, on the rank's clock
    steps: Steps = field(repr=False)  # the steps timed after training
    intervals: list[tuple[int, float]] = field(default_factory=list)  # (batches, seconds) per log line
    stash: list[tuple[int, int]] = field(default_factory=list)  # per stage: peak micro-batches, bytes
    name: str = "pipe x data grid"

    @property
    def modelled(self) -> bool:
        """Whether its clocks were modelled: time at SIZE."""
        return self.cfg.node is not None

    @property
    def tokens_per_second(self) -> Measured:
        """Tokens/s of each log interval but the first (warm-up); modelled: SIZE's step tokens over modelled time."""
        rates = [n * self.cfg.step_tokens(self.modelled) / sec for n, sec in self.intervals]
        return Measured.of(rates[1:] if len(rates) > 1 else rates)

    def load_into(self, model):
        """The stages' weights in one unsplit model (real, or built on meta): the model the grid trained."""
        return load_whole(model, self.weights)


def gather(cfg: Config, results: Sequence[Result]) -> LMRun:
    """The run, from every process's `Result` (by rank)."""
    last = sorted((r for r in results if r.stage == cfg.pipe - 1), key=lambda r: r.replica)  # one per pipeline
    mb_losses = [[loss for step in per_replica for loss in step] for per_replica in zip(*(r.log.mb_losses for r in last))]
    stages = sorted((r for r in results if r.replica == 0), key=lambda r: r.stage)
    return LMRun(cfg, [sum(step) / len(step) for step in mb_losses], mb_losses, last[0].log.curve,
                 [r.weights for r in stages], results[0].parts, max(r.seconds for r in results),
                 gather_steps([r.steps for r in results]), last[0].log.intervals, [r.stash for r in stages])


def available_memory(world_size: int) -> tuple[int | None, str]:
    """Bytes one process may use, and where: the fullest GPU's free memory, else its share of the RAM (or None)."""
    if hardware.choose_backend(world_size) == "nccl":
        return min(torch.cuda.mem_get_info(i)[0] for i in range(world_size)), "the fullest GPU"
    free = hardware.available_memory()
    return (free // world_size if free is not None else None), f"1/{world_size} of the available RAM"


def memory_plan(cfg: Config, ntoken: int) -> list[dict]:
    """`lm.stage_memory` for this recipe, cut as the workers cut it (SGD: no state; a validator holds the whole)."""
    model = cfg.model(ntoken, meta=True)
    schedule = make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches)
    return stage_memory(model, partition_layers(list(model), cfg.pipe, cfg.partition), schedule,
                        cfg.microbatch_tokens(), optimizer_states=0, host_copy=True)


def check_memory(cfg: Config, ntoken: int) -> None:
    """Refuse a recipe whose largest stage will not fit in what one process may use."""
    available, where = available_memory(cfg.world_size)
    if available is not None:
        check_fits(memory_plan(cfg, ntoken), available, where)


def train(cfg: Config, corpus: Corpus, progress: bool = True) -> LMRun:
    """Train over cfg.pipe x cfg.data processes on `corpus` with a progress bar; a recipe that will not fit is refused first."""
    cfg = replace(cfg, corpus=corpus, progress=None)  # checks the memory, before any process starts
    desc = f"{cfg.pipe} x {cfg.data} grid" + (" (the bar: real batch/s on this machine)" if cfg.node else "")
    with progress_bar(cfg.batches(corpus), desc) if progress else nullcontext() as path:
        cfg = replace(cfg, progress=path)
        cfg.stage_costs  # the stages at SIZE counted once here, not on every rank
        return experiments.run(worker, cfg, gather)


# The parameters cell's defaults that `run_flops` reads.
DEFAULTS = dict(emsize=64, nhid=128, nhead=2, nlayers=4, bptt=35, batch_size=20, epochs=2, max_batches=None,
                log_interval=40, check_steps=3, speed_steps=10, speed_repeats=3, vocab=3455, train_tokens=None,
                valid_tokens=None)


def run_flops(params: dict) -> float:
    """FLOPs of lesson 10 at the notebook parameters `params` (missing: the defaults; `vocab`,
    `train_tokens`, `valid_tokens`: the corpus's, Python's documentation by default), counted on the
    meta device: the training, the one-process baseline, the reference, the Gantt, the validations."""
    p = {**DEFAULTS, **params}
    if p["train_tokens"] is None or p["valid_tokens"] is None:
        from pipelab.data import load_corpus

        corpus = load_corpus()
        p.update(vocab=len(corpus.vocab), train_tokens=corpus.train.numel(), valid_tokens=corpus.valid.numel())
    cfg = Config(**{k: v for k, v in p.items() if k in Config.__dataclass_fields__})
    with torch.device("meta"):  # sizes only: a 1B-parameter recipe costs no memory here
        model = TransformerLM(p["vocab"], cfg.emsize, cfg.nhead, cfg.nhid, cfg.nlayers)
    forward, grad_in, grad_w = cost.forward_backward_counts(model, torch.zeros(cfg.batch_size, cfg.bptt, dtype=torch.long, device="meta"))
    train_windows = len(windows(torch.empty(p["train_tokens"] // cfg.batch_size, 0), cfg.bptt, cfg.max_batches))
    log_lines = -(-train_windows // cfg.log_interval)  # a validation every log_interval windows and at the end
    steps = cfg.epochs * train_windows + cfg.speed_repeats * cfg.speed_steps + 1 + cfg.check_steps + cfg.timeline_steps
    valid = cost.count(model, torch.zeros(cfg.eval_batch_size, cfg.bptt, dtype=torch.long, device="meta")).flops
    valid_windows = len(range(0, p["valid_tokens"] // cfg.eval_batch_size - 1, cfg.bptt))
    return steps * (forward.flops + grad_in.flops + grad_w.flops) + (cfg.epochs * log_lines + 1) * valid_windows * valid + forward.flops

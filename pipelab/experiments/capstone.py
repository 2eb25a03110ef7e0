"""Lesson 10 from a notebook: train the Transformer LM over a pipe x data grid of processes.

    cfg = capstone.Config(pipe=2, data=2, num_microbatches=2, schedule="1f1b", ...)  # refuses a bad recipe here
    run = capstone.train(cfg, load_corpus())  # refuses a recipe that will not fit, then the grid trains

`train` starts pipe x data processes (`experiments.run(worker, cfg, gather)`). Each finds its place
with lesson 05's `grid_place`, builds the whole model on the meta device (shapes, no storage),
cuts it (`partition_layers`) and makes only its own stage real (`pipelab.build`: the weights the
seed gives that stage in the whole model, so a process's memory follows its stage), and for
every `bptt` window of its replica's columns runs `run_grid_step` (the schedule, plus the
data-parallel all-reduce of its stage), clips with the global norm over its pipeline, and steps
SGD. The last stage of the first pipeline writes the tutorial's log line
and its progress to a small file that a bar in the caller's process follows; validation uses the
whole model, gathered from the stages of the first pipeline, and the right normalisation. Before
any process starts, `memory_plan` estimates each stage's memory and a recipe that does not fit is
refused. An `LMRun` holds every step's loss and each micro-batch's, as the last stages computed
them; the verdict functions below turn it into the lesson's conclusions.

On an emulated node (`Config(emulate="4xH100-nvlink")`, what the notebook runs where the machine
lacks the GPUs) the processes, their math and messages stay real and small, and each rank's clock
is modelled: its stage's forward and backward last what an H100 takes for the same stage of the
tutorial's model (`emulated_stages`, counted on the meta device), its messages what the link takes
at that size. The tokens/s then come from the modelled clocks, and the one-process baseline is
one emulated device's modelled time for the whole model on the whole batch
(`one_device_seconds`): both deterministic. Losses and perplexities are the real training's.
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
from pipelab.build import is_meta, materialize, on_meta
from pipelab.checks import positive_number, whole_number
from pipelab.data import Corpus, batchify, data_columns, get_batch
from pipelab.display import conclude, human_bytes
from pipelab.emulate.cost import Counts, compute_seconds
from pipelab.emulate.specs import torch_dtype
from pipelab.hybrid import check_grid, grid_place, microbatch_losses, run_grid_step
from pipelab.lm import TransformerLM, check_fits, clip_grad_norm_, lm_loss, stage_memory, stages_of
from pipelab.measure import Measured, RankSteps, Steps, TimedSteps, compare_medians, gather_steps, time_steps
from pipelab.pipeline.p2p import message_specs
from pipelab.emulate.stages import emulated_stages as count_stages
from pipelab.pipeline.partition import partition_layers
from pipelab.reference import exact_fp32
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, simulate
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
    # On an emulated node (`emulate`) each stage's F and B last what the device takes for the same
    # stage of the tutorial's model (these sizes, cut by `partition` into `pipe` stages) on
    # micro-batches of `emulated_columns` columns of `bptt` tokens, in bfloat16.
    emulated_emsize: int = 4096
    emulated_nhid: int = 4096
    emulated_nhead: int = 16
    emulated_nlayers: int = 8
    emulated_columns: int = 128
    timeout: float = 600.0
    corpus: Corpus | None = field(default=None, repr=False)
    progress: str | None = None
    stage_costs: list[dict] | None = field(default=None, repr=False)  # `emulated_stages`, counted once by `train`
    world_size: int = field(init=False, default=0)  # the grid's processes: pipe x data

    def __post_init__(self) -> None:
        check_grid(self.pipe, self.data)
        object.__setattr__(self, "world_size", self.pipe * self.data)
        super().__post_init__()

    def check(self) -> None:
        super().check()
        for name in ("emsize", "nhead", "nhid", "nlayers", "bptt", "batch_size", "eval_batch_size", "epochs",
                     "num_microbatches", "log_interval", "timeline_steps", "check_steps", "speed_steps", "speed_repeats",
                     "emulated_emsize", "emulated_nhid", "emulated_nhead", "emulated_nlayers", "emulated_columns"):
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
        check_stages(layers, self.pipe, self.partition, "nlayers")
        if self.emulate is not None:  # the emulated model is cut the same way
            check_stages(emulated_model(self, 2), self.pipe, self.partition, "emulated_nlayers")
        if self.corpus is not None:
            check_memory(self, len(self.corpus.vocab))

    def model(self, ntoken: int, meta: bool = False):
        """The model of this recipe for a vocabulary of `ntoken` words, its weights from the seed:
        built on the meta device with `meta` (shapes, no storage: a rank makes its own stage real),
        else real and whole (one process: the baseline, the reference), the same weights either way."""
        model = on_meta(lambda: TransformerLM(ntoken, self.emsize, self.nhead, self.nhid, self.nlayers, self.dropout),
                        seed=self.seed)
        return model if meta else materialize(model)

    def microbatch_tokens(self) -> int:
        """Tokens in one micro-batch of one replica: its columns x bptt."""
        return self.batch_size // self.data // self.num_microbatches * self.bptt

    def batches(self, corpus: Corpus) -> int:
        """Training steps of the whole run: windows per epoch times epochs."""
        return self.epochs * len(windows(batchify(corpus.train, self.batch_size), self.bptt, self.max_batches))

    def step_tokens(self, emulated: bool = False) -> int:
        """Tokens one training step takes in over the whole grid: `batch_size` columns of `bptt`
        tokens; on an emulated node, `emulated_columns` per micro-batch of each replica."""
        columns = self.data * self.num_microbatches * self.emulated_columns if emulated else self.batch_size
        return columns * self.bptt


def check_stages(model, pipe: int, partition: str, layers_name: str) -> None:
    """Refuse a cut of `model` into `pipe` stages by `partition` that leaves a stage empty."""
    parts = partition_layers(list(model), pipe, partition)
    if any(hi == lo for lo, hi in zip(parts[:-1], parts[1:])):
        raise ValueError(f"pipe={pipe} stages cut by {partition!r} leave a stage without layers (cuts at {parts}; "
                         f"the model has {len(model)} layers: embedding, positional encoding, {len(model) - 3} "
                         f"encoder layers, decoder); use fewer stages (pipe) or more {layers_name}")


def windows(source: torch.Tensor, bptt: int, limit: int | None = None) -> list[int]:
    """Start rows of the full `bptt`-long windows (the short last one is left out: one message shape)."""
    starts = list(range(0, source.shape[0] - 1 - bptt + 1, bptt))
    return starts[:limit] if limit is not None else starts


def window_losses(model, source: torch.Tensor, bptt: int) -> list[tuple[float, int]]:
    """(mean token loss, seq_len) of every window of `source`, the short last one included."""
    model.eval()
    out = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for i in range(0, source.shape[0] - 1, bptt):
            x, y = (t.to(device) for t in get_batch(source, i, bptt))
            out.append((float(lm_loss(model(x), y)), x.shape[1]))
    model.train()
    return out


def perplexity(losses: list[tuple[float, int]]) -> float:
    """exp of the mean loss per token: each window weighted by its length, divided by all of them."""
    return math.exp(sum(loss * n for loss, n in losses) / sum(n for _, n in losses))


def tutorial_windows(rows: int, bptt: int, max_windows: int = 50) -> int:
    """How many windows the tutorial's `evaluate` scores: `range(0, min(50 * bptt, rows - 1), bptt)`."""
    return len(range(0, min(max_windows * bptt, rows - 1), bptt))


def tutorial_perplexity(losses: list[tuple[float, int]], rows: int, bptt: int, columns: int, max_windows: int = 50) -> float:
    """The tutorial's `evaluate`, exactly. Its `get_batch` returns `data.t()`, (columns, seq_len), so
    `len(data)` is the number of COLUMNS (its eval batch size, 10):

        nbatches = min(50 * bptt, data_source.size(0) - 1)
        for i in range(0, nbatches, bptt):
            data, targets = get_batch(data_source, i)
            total_loss += len(data) * criterion(output_flat, targets).item()
        return total_loss / (len(data_source) - 1)       # then math.exp of it

    `losses` are (mean token loss, seq_len) of the windows of a `rows` x `columns` set, in order
    (`window_losses`). Each window weighs `columns`, not its columns x seq_len tokens, and the sum
    is divided by the set's rows less one, not by the tokens scored."""
    scored = tutorial_windows(rows, bptt, max_windows)
    if len(losses) < scored:
        raise ValueError(f"the tutorial's evaluate scores {scored} windows of a {rows}-row set with bptt={bptt}; "
                         f"got the losses of {len(losses)}: pass every window's (`window_losses`)")
    return math.exp(sum(columns * loss for loss, _ in losses[:scored]) / (rows - 1))


def tutorial_evaluate_figures(losses: list[tuple[float, int]], rows: int, bptt: int, columns: int) -> dict:
    """The tutorial's `evaluate` taken apart on the same windows: what it adds up and divides by,
    beside what the mean loss per token adds up and divides by."""
    scored = losses[:tutorial_windows(rows, bptt)]
    return {"windows": len(losses), "windows scored": len(scored), "columns": columns, "rows": rows,
            "weight per window": columns, "tokens per window": columns * bptt,
            "divisor": rows - 1, "tokens scored": columns * sum(n for _, n in scored),
            "tutorial": tutorial_perplexity(losses, rows, bptt, columns),
            "right, same windows": perplexity(scored), "right": perplexity(losses)}


def tutorial_evaluate_table(figures: dict) -> list[dict]:
    """`tutorial_evaluate_figures` as rows: what the tutorial's formula adds up and divides by,
    beside the mean loss per token's."""
    f = figures
    return [{"": "each window's mean loss weighted by", "the tutorial's evaluate": f"len(data) = {f['columns']} (columns)",
             "the loss per token": f"its tokens: {f['columns']} x {f['tokens per window'] // f['columns']} = {f['tokens per window']}"},
            {"": "the sum divided by", "the tutorial's evaluate": f"len(data_source) - 1 = {f['divisor']:,} (rows - 1)",
             "the loss per token": f"the tokens scored: {f['tokens scored']:,}"},
            {"": "perplexity", "the tutorial's evaluate": f"{f['tutorial']:.2f}",
             "the loss per token": (f"{f['right']:.1f}" if f["windows scored"] == f["windows"] else
                                    f"{f['right, same windows']:.1f} ({f['windows scored']} windows), {f['right']:.1f} (all {f['windows']})")}]


def gather_model(model, stage, group, keep: bool = True):
    """The whole model, its stages' weights gathered from the pipeline `group` (every stage calls;
    only where `keep` is the model loaded, elsewhere None: the others hold their stage only)."""
    pieces = [None] * (dist.get_world_size(group) if group is not None else 1)
    mine = {k: v.detach().cpu() for k, v in stage.state_dict().items()}
    if group is not None:
        dist.all_gather_object(pieces, mine, group=group)
    else:
        pieces = [mine]
    return load_whole(model, pieces) if keep else None


def load_whole(model, pieces: Sequence[dict]):
    """`model` (real, or built on the meta device) with the stages' weights `pieces` loaded. A meta
    model takes the tensors as its own (`assign=True`: no second copy), and `materialize` computes
    what no state dict holds (the positional encoding's buffer)."""
    state = {k: v for piece in pieces for k, v in piece.items()}
    if not is_meta(model):
        model.load_state_dict(state)
        return model
    model.load_state_dict(state, assign=True)
    return materialize(model)


# ---------------------------------------------------------------------------------------------
# On an emulated node: what each operation costs at the emulated size
# ---------------------------------------------------------------------------------------------

EMULATED_DTYPE = "bfloat16"  # what the emulated node computes and communicates in
EMULATED_ITEMSIZE = torch.empty((), dtype=torch_dtype(EMULATED_DTYPE)).element_size()  # bytes per value


def emulated_model(cfg: Config, ntoken: int):
    """The tutorial's model at the emulated size (`cfg.emulated_*`), on the meta device: sizes, no memory."""
    with torch.device("meta"):
        return TransformerLM(ntoken, cfg.emulated_emsize, cfg.emulated_nhead, cfg.emulated_nhid, cfg.emulated_nlayers)


def emulated_size(cfg: Config) -> str:
    """The emulated size in words, for the lesson's first line."""
    return (f"the tutorial's model (emsize {cfg.emulated_emsize}, nhid {cfg.emulated_nhid}, {cfg.emulated_nhead} heads, "
            f"{cfg.emulated_nlayers} encoder layers) on micro-batches of {cfg.emulated_columns} columns x {cfg.bptt} "
            f"tokens, in {EMULATED_DTYPE}")


def update_seconds(params: int, device) -> dict[str, float]:
    """Modelled seconds of clipping and the SGD step over `params` parameters on `device`, both
    memory-bound: clipping's norm reads every gradient and its scaling reads and writes it; SGD
    reads each weight and its gradient and writes the weight."""
    clip = Counts(flops=3 * params, bytes=3 * params * EMULATED_ITEMSIZE, kernels=2)
    sgd = Counts(flops=2 * params, bytes=3 * params * EMULATED_ITEMSIZE, kernels=1)
    return {"clip": compute_seconds(clip, device, EMULATED_DTYPE), "optimizer": compute_seconds(sgd, device, EMULATED_DTYPE)}


def emulated_stages(cfg: Config, ntoken: int, node) -> list[dict]:
    """Per stage of the emulated model, cut into `cfg.pipe` stages by `cfg.partition` as the real
    one is: its parameters, the modelled seconds on `node`'s device of its F, I, W and B (= I + W,
    as the simulator prices it; the last stage with its loss) on one micro-batch of
    `cfg.emulated_columns` x `cfg.bptt` tokens, counted on the meta device by the pipeline lessons'
    `emulate.stages.emulated_stages`, and of its clipping and SGD step (`update_seconds`)."""
    key = (cfg.emulated_emsize, cfg.emulated_nhid, cfg.emulated_nhead, cfg.emulated_nlayers, cfg.emulated_columns,
           cfg.bptt, cfg.pipe, cfg.partition, ntoken, node.device.name)
    if key not in _COUNTED:  # the notebook asks more than once: count once
        model = emulated_model(cfg, ntoken)
        stages = stages_of(model, partition_layers(list(model), cfg.pipe, cfg.partition))
        ids = torch.zeros(cfg.emulated_columns, cfg.bptt, dtype=torch.long, device="meta")
        counted = count_stages(stages, ids, lm_loss, node, EMULATED_DTYPE, optimizer="sgd")
        rows = []
        for s, stage in enumerate(stages):
            params = sum(p.numel() for p in stage.parameters())
            rows.append({"stage": s, "parameters": params, **counted[s].seconds, **update_seconds(params, node.device)})
        _COUNTED[key] = rows
    return copy.deepcopy(_COUNTED[key])


_COUNTED: dict[tuple, list] = {}  # emulated_stages' rows by sizes and device


def emulated_stage_table(cfg: Config, ntoken: int) -> list[dict]:
    """`emulated_stages` on `cfg.emulate`'s device as table rows: what each rank's spans last, and
    how its messages are timed. One factor scales all of a rank's messages (`emulate_stage`): the
    gradients' (exact for the all-reduce), so an activation sent between stages is timed at its
    real bytes times that factor, beside its size at the emulated size."""
    model = cfg.model(ntoken, meta=True)  # the real model's stages, as the ranks cut them: sizes only
    real = stages_of(model, partition_layers(list(model), cfg.pipe, cfg.partition))
    activation = cfg.batch_size // (cfg.data * cfg.num_microbatches) * cfg.bptt * cfg.emsize * 4  # float32, one micro-batch
    rows = []
    for r, stage in zip(emulated_stages(cfg, ntoken, cfg.node), real):
        scale = r["parameters"] * EMULATED_ITEMSIZE / sum(p.numel() * p.element_size() for p in stage.parameters())
        rows.append({"stage": r["stage"], "parameters": f"{r['parameters'] / 1e6:,.0f} M",
                     "F (ms per micro-batch)": f"{r['F'] * 1e3:.2f}", "B (ms)": f"{r['B'] * 1e3:.2f}",
                     "clip + SGD (ms per step)": f"{(r['clip'] + r['optimizer']) * 1e3:.2f}",
                     "gradients": human_bytes(r["parameters"] * EMULATED_ITEMSIZE),
                     "an activation, timed as": human_bytes(activation * scale),
                     "its emulated size": human_bytes(cfg.emulated_columns * cfg.bptt * cfg.emulated_emsize * EMULATED_ITEMSIZE)})
    return rows


def emulate_stage(ctx: RankContext, cfg: Config, ntoken: int, stage: int, real: torch.nn.Module) -> dict | None:
    """On an emulated node, this rank's stage costs at the emulated size (`emulated_stages`, as
    `train` counted them), and its messages timed at that size: every message scaled by the stage's
    emulated gradient bytes over its real ones, so its data-parallel all-reduce, the largest
    message, lasts what it would. None elsewhere."""
    if ctx.emulator is None:
        return None
    row = (cfg.stage_costs or emulated_stages(cfg, ntoken, ctx.emulator.node))[stage]
    real_bytes = sum(p.numel() * p.element_size() for p in real.parameters())
    ctx.emulator.scale_messages(row["parameters"] * EMULATED_ITEMSIZE, real_bytes)
    from pipelab.emulate.table import stage_table

    ctx.emulator.use(stage_table({stage: {kind: row[kind] for kind in ("F", "B", "I", "W") if kind in row}}))
    return row


def one_device_seconds(cfg: Config, ntoken: int, node) -> float:
    """Modelled seconds of one training step on ONE emulated device of `node`: the whole emulated
    model's forward and backward with its loss on the whole step's columns (every replica's
    micro-batches at once), then clipping and the SGD step over all its parameters. No messages:
    nothing to send."""
    model = emulated_model(cfg, ntoken)
    ids = torch.zeros(cfg.data * cfg.num_microbatches * cfg.emulated_columns, cfg.bptt, dtype=torch.long, device="meta")
    seconds = count_stages([model], ids, lm_loss, node, EMULATED_DTYPE, optimizer="sgd")[0].seconds
    update = update_seconds(sum(p.numel() for p in model.parameters()), node.device)
    return seconds["F"] + seconds["B"] + update["clip"] + update["optimizer"]


def one_device_tokens_per_second(cfg: Config, ntoken: int) -> float:
    """Tokens/s of one emulated device of `cfg.emulate`'s node training the whole model alone."""
    return cfg.step_tokens(emulated=True) / one_device_seconds(cfg, ntoken, cfg.node)


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
        # On an emulated node: this stage's modelled seconds at the emulated size (None: real time)
        self.emulated = emulate_stage(ctx, cfg, len(corpus.vocab), self.place.rank, self.stage)

    def step(self, i: int) -> list[float] | None:
        """One SGD step on the window at row `i`: the pipeline, the clip over it, the update. The
        micro-batch losses where this process holds the last stage."""
        x, y = (t.to(self.ctx.device) for t in get_batch(self.train, i, self.cfg.bptt))
        self.opt.zero_grad(set_to_none=True)
        runner = run_grid_step(self.place, self.schedule, self.modules, lm_loss, x, y, self.specs)
        self.stash_peak = max(self.stash_peak, (runner.meter.peak, runner.meter.peak_bytes))
        with self.ctx.rec.span("clip", lane="comm", cost=self.emulated and self.emulated["clip"]):
            clip_grad_norm_(self.stage.parameters(), self.cfg.clip, self.pipe_group)
        with self.ctx.rec.span("optimizer", cost=self.emulated and self.emulated["optimizer"]):
            self.opt.step()
        return microbatch_losses(runner) or None

    def validate(self) -> float | None:
        """Valid perplexity of the whole model, on the first pipeline's last stage (None elsewhere),
        computed on that process's device (its GPU on a GPU node)."""
        model = gather_model(self.model, self.stage, self.pipe_group, keep=self.logger)  # real on the logger only
        if model is None:
            return None
        valid = batchify(self.corpus.valid, self.cfg.eval_batch_size)
        return perplexity(window_losses(model.to(self.ctx.device), valid, self.cfg.bptt))

    def say(self, line: str) -> None:
        """A log line: above the caller's progress bar, or printed (tagged with this rank)."""
        if self.progress is not None:
            self.progress.say(line)
        else:
            print(line, flush=True)

    def epoch(self, epoch: int, log: TrainingLog) -> None:
        starts = windows(self.train, self.cfg.bptt, self.cfg.max_batches)
        clock, interval = self.ctx.now(), []  # the rank's clock: modelled on an emulated node
        for batch, i in enumerate(starts, 1):
            self.ctx.rec.clear()  # the Gantt comes from time_steps below
            losses = self.step(i)
            log.mb_losses.append(losses)
            loss = sum(losses) / len(losses) if losses else None
            interval.append(loss)
            if self.progress is not None:  # one line per batch: the caller's progress bar follows it
                self.progress.advance(f"{loss:.4f}")
            if batch % self.cfg.log_interval == 0 or batch == len(starts):
                seconds = self.ctx.now() - clock
                log.intervals.append((len(interval), seconds))
                ms = seconds * 1e3 / len(interval)
                valid = self.validate()
                if self.logger:
                    mean = sum(interval) / len(interval)
                    line = LOG_LINE.format(epoch, batch, len(starts), self.lr_steps.get_last_lr()[0], ms, mean,
                                           math.exp(min(mean, 50)))
                    # on an emulated node the step time is modelled; the progress bar below is this machine's
                    self.say(line.replace("ms/batch", "ms/batch modelled") if self.cfg.emulate else line)
                    log.curve.append((len(log.mb_losses), math.exp(mean), valid))
                clock, interval = self.ctx.now(), []
        self.lr_steps.step()


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
    """Worker: train for `cfg.epochs` on `cfg.corpus`; then time `cfg.timeline_steps` steps on a copy (the Gantt)."""
    torch.set_num_threads(1)
    with exact_fp32():  # on a GPU, full float32 products: the losses are compared with one process's
        trainer = GridTrainer(ctx, cfg, cfg.corpus, cfg.progress)
        log = TrainingLog()
        start = ctx.now()
        for epoch in range(1, cfg.epochs + 1):
            trainer.epoch(epoch, log)
        seconds = ctx.now() - start
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
    seconds: float  # the whole training, validations included, on the rank's clock
    steps: Steps = field(repr=False)  # the steps timed after training
    intervals: list[tuple[int, float]] = field(default_factory=list)  # (batches, seconds) per log line
    stash: list[tuple[int, int]] = field(default_factory=list)  # per stage: peak micro-batches, bytes
    name: str = "pipe x data grid"

    @property
    def emulated(self) -> bool:
        """Whether its clocks were an emulated node's (`cfg.emulate`): modelled time at the emulated size."""
        return self.cfg.emulate is not None

    @property
    def tokens_per_second(self) -> Measured:
        """Training tokens/s of each log interval, the first one (warm-up) dropped when there are more;
        on an emulated node, the emulated step's tokens over the modelled time."""
        tokens = self.cfg.step_tokens(self.emulated)
        rates = [n * tokens / sec for n, sec in self.intervals]
        return Measured.of(rates[1:] if len(rates) > 1 else rates)

    def load_into(self, model):
        """Load the stages' weights into one unsplit model (real, or built on the meta device): the
        model the pipeline trained."""
        return load_whole(model, self.weights)


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
    cut as the workers cut it, with the schedule's peak stash; SGD keeps no optimizer state. The
    last stage's process also holds the whole model when it validates (on its device)."""
    model = cfg.model(ntoken, meta=True)
    parts = partition_layers(list(model), cfg.pipe, cfg.partition)
    schedule = make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches)
    return stage_memory(model, parts, schedule, cfg.microbatch_tokens(), optimizer_states=0, host_copy=True)


def check_memory(cfg: Config, ntoken: int) -> None:
    """Refuse a recipe whose largest stage will not fit in what one process may use."""
    available, where = available_memory(cfg.world_size)
    if available is not None:
        check_fits(memory_plan(cfg, ntoken), available, where)


def train(cfg: Config, corpus: Corpus, progress: bool = True) -> LMRun:
    """Train over cfg.pipe x cfg.data processes on `corpus`, with a progress bar here; refuses a
    recipe whose stages will not fit in memory before starting any."""
    cfg = replace(cfg, corpus=corpus, progress=None)  # checks the memory, before any process starts
    if cfg.emulate is not None:  # counted once here, not on every rank
        cfg = replace(cfg, stage_costs=emulated_stages(cfg, len(corpus.vocab), cfg.node))
    where = ", real time on this machine" if cfg.emulate else ""
    with progress_bar(cfg.batches(corpus), f"{cfg.pipe} x {cfg.data} grid{where}") if progress else nullcontext() as path:
        return experiments.run(worker, replace(cfg, progress=path), gather)


# ---------------------------------------------------------------------------------------------
# One process: the reference and the speed to compare with
# ---------------------------------------------------------------------------------------------


LOSS_TOLERANCE = 1e-4  # float32 on CPU, or on a GPU with TF32 off: the grid sums in another order (micro-batches,
# replicas), which moves a loss of ~8 by ~1e-6 a step; TF32 (10-bit mantissas) would move it by ~1e-3.


def reference_device() -> torch.device:
    """Where this process checks and times the one-process baseline: the first GPU when there is
    one (the device a grid rank computes on), else the CPU."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def sgd_steps(model, opt, source: torch.Tensor, cfg: Config, starts: Sequence[int]) -> list[torch.Tensor]:
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


def single_process_losses(corpus: Corpus, cfg: Config, steps: int, device=None) -> list[float]:
    """The same model, batches, SGD, clipping and rate on one process, for `steps` steps: the
    losses the grid must reproduce. On `device` (default `reference_device()`: the GPU where the
    grid's ranks compute on GPUs), with TF32 off."""
    device = torch.device(device) if device is not None else reference_device()
    model = cfg.model(len(corpus.vocab)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    train_ids = batchify(corpus.train, cfg.batch_size)
    with exact_fp32():
        return [float(loss) for loss in sgd_steps(model, opt, train_ids, cfg, windows(train_ids, cfg.bptt, steps))]


def one_process_rates(corpus: Corpus, cfg: Config, steps: int, repeats: int, device=None) -> list[float]:
    """Tokens/s of `repeats` runs of `steps` training steps of the whole model on this process,
    after one step of warm-up, the model built once: on `device` (default `reference_device()`:
    the first GPU when there is one, timed to the end of its queued work), else on one CPU thread,
    as a worker computes."""
    device = torch.device(device) if device is not None else reference_device()
    model = cfg.model(len(corpus.vocab)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    train_ids = batchify(corpus.train, cfg.batch_size)
    starts = windows(train_ids, cfg.bptt, steps + 1)
    threads, rates = torch.get_num_threads(), []
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        sgd_steps(model, opt, train_ids, cfg, starts[:1])  # warm-up: first allocations, kernel choices
        for _ in range(repeats):
            hardware.synchronize(device)
            start = time.perf_counter()
            sgd_steps(model, opt, train_ids, cfg, starts[1:])
            hardware.synchronize(device)  # a GPU's clock stops when its queued kernels end, not when they are launched
            rates.append((len(starts) - 1) * cfg.batch_size * cfg.bptt / (time.perf_counter() - start))
        return rates
    finally:
        torch.set_num_threads(threads)


def train_one_process(corpus: Corpus, cfg: Config, steps: int, device=None) -> float:
    """Tokens/s of `steps` training steps of the whole model on this process (`one_process_rates`, once)."""
    return one_process_rates(corpus, cfg, steps, 1, device)[0]


def one_process_tokens_per_second(corpus: Corpus, cfg: Config) -> Measured:
    """Tokens/s of each of `cfg.speed_repeats` runs of `cfg.speed_steps` steps (`one_process_rates`)."""
    return Measured.of(one_process_rates(corpus, cfg, cfg.speed_steps, cfg.speed_repeats))


def baseline_tokens_per_second(corpus: Corpus, cfg: Config) -> Measured:
    """The one-process rate the grid's tokens/s is compared with. On an emulated node, ONE emulated
    device's modelled rate for the whole model on the whole batch (`one_device_tokens_per_second`):
    one deterministic figure. Elsewhere, `one_process_tokens_per_second`: timed on the first GPU
    when there is one, else on one CPU thread."""
    if cfg.emulate is not None:
        return Measured.of([one_device_tokens_per_second(cfg, len(corpus.vocab))])
    return one_process_tokens_per_second(corpus, cfg)


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
    verdict = "equal" if gap < LOSS_TOLERANCE else "differ"
    conclude("10.first_losses", verdict,
             f"the grid's first {len(one)} losses differ from one process's by at most {gap:.1e} (tolerance "
             f"{LOSS_TOLERANCE:.0e}, float32 without TF32): "
             + ("equal to float rounding, as predicted." if gap < LOSS_TOLERANCE else "not the same computation."),
             max_difference=gap, tolerance=LOSS_TOLERANCE)
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


def speed_verdict(run: LMRun, one_rate: Measured, vocab_size: int | None = None) -> str:
    """Conclude how the grid's tokens/s compares with one process's (`baseline_tokens_per_second`):
    on an emulated node from the modelled clocks (`emulated_speed_verdict`, which needs
    `vocab_size`), else from the measured rates, beside the bound the simulated schedule allows
    with one device per process (equal costs, free messages)."""
    if run.emulated:
        if vocab_size is None:
            raise ValueError("an emulated run's speed verdict counts the emulated model: pass vocab_size=len(corpus.vocab)")
        return emulated_speed_verdict(run, one_rate, vocab_size)
    cfg, grid_rate = run.cfg, run.tokens_per_second
    ideal = simulate(make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches))
    work = cfg.pipe * cfg.num_microbatches * (ideal.costs.forward + ideal.costs.backward_input + ideal.costs.backward_weight)
    bound = cfg.data * work / ideal.makespan_ms  # one process's time over the grid's, in cost units
    enough = min(len(grid_rate.values), len(one_rate.values)) >= 3  # a range needs a few repeats
    verdict = compare_medians(grid_rate, one_rate) if enough else "too few repeats"  # beyond a run's noise (30 %)
    ratio = grid_rate.median / one_rate.median
    where = "on the first GPU" if reference_device().type == "cuda" else "on one thread"
    text = (f"the grid trained {grid_rate:,.0f} tokens/s (median, min-max over {len(grid_rate.values)} log interval(s)), "
            f"one process {where} {one_rate:,.0f} (over {len(one_rate.values)} repeat(s)): ")
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


def emulated_step(cfg: Config, vocab_size: int) -> dict:
    """What the grid's step should take on the emulated node, from the same costs its ranks spend:
    the schedule played by the simulator with each stage's modelled F and B (free messages), the
    slowest stage's clipping and SGD step, and each stage's gradient bytes (what its data-parallel
    all-reduce carries)."""
    stages = emulated_stages(cfg, vocab_size, cfg.node)
    costs = Costs(per_stage={r["stage"]: (r["F"] * 1e3, r["B"] * 1e3, 0.0) for r in stages})  # whole backwards
    sim = simulate(make_schedule(cfg.schedule, cfg.pipe, cfg.num_microbatches), costs)
    return {"schedule_s": sim.makespan_ms / 1e3, "bubble": sim.bubble_fraction,
            "update_s": max(r["clip"] + r["optimizer"] for r in stages),
            "parameters": sum(r["parameters"] for r in stages),
            "gradient_bytes": max(r["parameters"] for r in stages) * EMULATED_ITEMSIZE}


def emulated_speed_verdict(run: LMRun, one_rate: Measured, vocab_size: int) -> str:
    """Conclude how the grid's modelled tokens/s compares with one emulated device's, and where
    the grid's modelled step goes: the schedule's compute and bubble (the simulator, same costs),
    clipping and the SGD step, and the rest (the messages and the data-parallel all-reduce). Both
    rates come from logical clocks: the same figures on every run."""
    cfg, node = run.cfg, run.cfg.node
    grid, one = run.tokens_per_second.median, one_rate.median
    tokens, ratio = cfg.step_tokens(emulated=True), grid / one
    step, one_step, model = tokens / grid, tokens / one, emulated_step(cfg, vocab_size)
    rest = step - model["schedule_s"] - model["update_s"]
    verdict = "faster" if ratio > 1 else "slower"
    text = (f"on the emulated node ({node}), training {model['parameters'] / 1e9:.2f} B parameters on {tokens:,} tokens "
            f"a step, the {cfg.pipe} x {cfg.data} grid trained {grid:,.0f} tokens/s and one {node.device.name} alone "
            f"{one:,.0f} (its modelled step: {one_step * 1e3:.1f} ms for the whole model on the whole batch): the grid is "
            f"{ratio:.2f}x {verdict} with {cfg.world_size} devices. Of the grid's {step * 1e3:.1f} ms step, the "
            f"{cfg.schedule} schedule's compute takes {model['schedule_s'] * 1e3:.1f} ms as the simulator plays it with "
            f"the same stage costs (bubble {model['bubble']:.2f}), clipping and the SGD step "
            f"{model['update_s'] * 1e3:.1f} ms, and the messages and each stage's data-parallel all-reduce (up to "
            f"{human_bytes(model['gradient_bytes'])} of {EMULATED_DTYPE} gradients) the remaining {rest * 1e3:.1f} ms.")
    conclude("10.grid_vs_one_process", verdict, text, grid=grid, one_device=one, speedup=ratio,
             schedule_ms=model["schedule_s"] * 1e3, update_ms=model["update_s"] * 1e3, rest_ms=rest * 1e3)
    return verdict


def evaluate_verdict(figures: dict) -> str:
    """Conclude whether the tutorial's `evaluate` (`tutorial_evaluate_figures`) gives a perplexity
    below the right one, and by which two mistakes."""
    f = figures
    verdict = "tutorial's too low" if f["tutorial"] < f["right"] else "tutorial's not too low"
    scored = (f"it scores all {f['windows']} windows" if f["windows scored"] == f["windows"] else
              f"{f['right, same windows']:.1f} over the {f['windows scored']} of {f['windows']} windows it scores")
    conclude("10.tutorial_evaluate", verdict,
             f"on the same trained model and the same {f['rows']:,} x {f['columns']} validation set, the tutorial's "
             f"`evaluate` gives {f['tutorial']:.2f}; the right perplexity is {f['right']:.1f} ({scored}). "
             f"Mistake 1, the weight: `len(data)` is the {f['weight per window']} columns of `data.t()`, not the "
             f"{f['tokens per window']} tokens of a full window, so each window's loss counts "
             f"{f['tokens per window'] // f['weight per window']}x too little. Mistake 2, the divisor: "
             f"`len(data_source) - 1` is the set's {f['divisor']:,} rows less one, not the {f['tokens scored']:,} tokens "
             f"it scored. A perplexity near 1 would mean knowing every next word for sure.",
             tutorial=f["tutorial"], right=f["right"], weight=f["weight per window"], tokens_per_window=f["tokens per window"],
             divisor=f["divisor"], tokens_scored=f["tokens scored"])
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
    """FLOPs of the lesson's whole run at the recipe's size, counted on the meta device (no memory):
    each training window's forward and backward (`epochs` x the training split, or `max_batches`
    windows), the validation's forwards at every log line and once more for section 4 (each window
    counted full), the one-process baseline's timed steps and their warm-up, the reference's
    first steps, the steps timed for the Gantt, and the untrained model's first forward. What a GPU
    profile's time budget is estimated from (`pipelab profiles`)."""
    from pipelab.emulate.cost import count, forward_backward_counts

    with torch.device("meta"):  # sizes only: a 1B-parameter recipe costs no memory here
        model = TransformerLM(vocab, cfg.emsize, cfg.nhead, cfg.nhid, cfg.nlayers)
    ids = torch.zeros(cfg.batch_size, cfg.bptt, dtype=torch.long, device="meta")
    forward, grad_in, grad_w = forward_backward_counts(model, ids)
    step = forward.flops + grad_in.flops + grad_w.flops
    train_windows = len(windows(torch.empty(train_tokens // cfg.batch_size, 0), cfg.bptt, cfg.max_batches))
    log_lines = -(-train_windows // cfg.log_interval)  # a validation every log_interval windows and at the end
    steps = cfg.epochs * train_windows + cfg.speed_repeats * cfg.speed_steps + 1 + cfg.check_steps + cfg.timeline_steps
    valid = count(model, torch.zeros(cfg.eval_batch_size, cfg.bptt, dtype=torch.long, device="meta")).flops
    valid_windows = len(range(0, valid_tokens // cfg.eval_batch_size - 1, cfg.bptt))
    return steps * step + (cfg.epochs * log_lines + 1) * valid_windows * valid + forward.flops

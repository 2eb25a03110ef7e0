"""Lesson 12, part 4: lesson 10's language model over pipe x data x tensor processes.

The processes are laid out by lesson 08's `PipeModelDataParallelTopology`: each belongs to one
pipeline (the "pipe" group: it holds one stage), one set of replicas of that stage's shard (the
"data" group: they average its gradients) and one tensor-parallel group (the "model" group: they
share every matrix of the stage). A process runs lesson 05's grid step (`hybrid.run_grid_step`)
over its pipeline, with its stage's encoder layers cut over its tensor-parallel group; the messages
between stages go to the process of the next stage with the same data and tensor coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Mapping

import torch

from pipelab import experiments, lm
from pipelab.emulate.tensor_stage import time_tensor_parallel_stage
from pipelab.checks import divides, whole_number
from pipelab.data import batchify, get_batch, load_corpus
from pipelab.hybrid import microbatch_losses, run_grid_step
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.partition import partition_uniform
from pipelab.pipeline.schedules import Schedule1F1B
from pipelab.pipeline.topology import PipeModelDataParallelTopology, axis_groups
from pipelab.tensor_parallel.comm import TensorParallelGroup
from pipelab.tensor_parallel.encoder import parallel_stage
from pipelab.timeline import Timeline
from pipelab.worker import RankContext

AXES = ("pipe", "data", "model")


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """A small lesson-10 model (`emsize`, `nhead`, `nhid`, `nlayers`) on `batch` columns of
    `seq_len` tokens of the built-in text, trained `steps` SGD steps over `pipe` x `data` x `tensor`
    processes with 1F1B on `num_microbatches` micro-batches per pipeline."""

    world_size: int = 8
    pipe: int = 2
    data: int = 2
    tensor: int = 2
    emsize: int = 32
    nhead: int = 4
    nhid: int = 64
    nlayers: int = 2
    seq_len: int = 16
    batch: int = 8
    num_microbatches: int = 2
    steps: int = 3
    lr: float = 0.5
    max_lines: int = 400
    # On an emulated node each stage lasts what the same layers take at this size (divided by `tensor`,
    # as its matrices are). Messages are timed at one scale, right for both kinds at these sizes: an
    # activation grows by (4096/32) x (2 x 2048 tokens / 32 tokens) = 128^2, a weight matrix by 128^2.
    SIZE: ClassVar[Mapping[str, Any]] = {"emsize": 4096, "seq_len": 2048, "columns": 2}  # columns: sequences per micro-batch

    def check(self) -> None:
        super().check()
        for name in ("pipe", "data", "tensor", "emsize", "nhead", "nhid", "nlayers", "seq_len", "batch",
                     "num_microbatches", "steps", "max_lines"):
            whole_number(name, getattr(self, name))
        for name, value in vars(self.size).items():
            whole_number(name, value)
        if self.pipe * self.data * self.tensor != self.world_size:
            raise ValueError(f"a grid of pipe={self.pipe} x data={self.data} x tensor={self.tensor} holds "
                             f"{self.pipe * self.data * self.tensor} processes, not world_size={self.world_size}; "
                             f"pick axes whose product is {self.world_size}, e.g. 2 x 2 x 2 for 8")
        divides("emsize", self.emsize, "nhead", self.nhead)
        divides("nhead", self.nhead, "tensor", self.tensor)
        divides("nhid", self.nhid, "tensor", self.tensor)
        divides("batch", self.batch, "data x num_microbatches", self.data * self.num_microbatches)
        if self.nlayers + 3 < self.pipe:
            raise ValueError(f"{self.nlayers + 3} layers (embedding, positions, {self.nlayers} encoder layers, "
                             f"decoder) cannot fill pipe={self.pipe} stages; use pipe <= {self.nlayers + 3}")

    def corpus(self):
        return load_corpus(max_lines=self.max_lines)

    def model(self, ntoken: int) -> torch.nn.Sequential:
        torch.manual_seed(0)
        return lm.TransformerLM(ntoken, self.emsize, self.nhead, self.nhid, self.nlayers)

    def batches(self) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The vocabulary size and `steps` (inputs, targets) windows of the training text."""
        corpus = self.corpus()
        source = batchify(corpus.train, self.batch)
        return len(corpus.vocab), [get_batch(source, i * self.seq_len, self.seq_len) for i in range(self.steps)]

    def topology(self) -> PipeModelDataParallelTopology:
        return PipeModelDataParallelTopology(num_pp=self.pipe, num_mp=self.tensor, num_dp=self.data)


@dataclass
class Result:
    rank: int
    coord: tuple[int, int, int]  # (pipe, data, model)
    losses: list[float]  # per step, the mean of this pipeline's micro-batch losses (last stage only)
    timeline: Timeline = field(repr=False)  # the last step


def place(ctx: RankContext, cfg: Config) -> tuple[RankContext, TensorParallelGroup]:
    """This process's pipeline (as lesson 06's runner sees it: its pipe coordinate is its rank),
    its groups, and its tensor-parallel group. Every process creates every group (collective)."""
    topo = cfg.topology()
    coord = topo.get_coord(ctx.rank)
    groups = {axis: axis_groups(topo, axis, ctx.rank) for axis in AXES}
    pipeline = replace(ctx, rank=coord.pipe, world_size=cfg.pipe,
                       groups={"pipe": groups["pipe"], "data": groups["data"] if cfg.data > 1 else None,
                               "model": groups["model"]})
    return pipeline, TensorParallelGroup(groups["model"], coord.model, cfg.tensor, rec=ctx.rec)


def worker(ctx: RankContext, cfg: Config) -> Result:
    pipeline, tp = place(ctx, cfg)
    coord = cfg.topology().get_coord(ctx.rank)
    ntoken, batches = cfg.batches()
    model = cfg.model(ntoken)
    stages = lm.stages_of(model, partition_uniform(len(model), cfg.pipe))
    stage = parallel_stage(stages[coord.pipe], tp)
    optimizer = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
    schedule = Schedule1F1B(cfg.pipe, cfg.num_microbatches)
    if cfg.node is not None:
        time_tensor_parallel_stage(ctx, coord.pipe, *big_stage(cfg, ntoken, coord.pipe), cfg.tensor, message_scale(cfg))
    losses = []
    for x, y in batches:
        x, y = (t.chunk(cfg.data)[coord.data] for t in (x, y))  # this replica's columns
        optimizer.zero_grad(set_to_none=True)
        ctx.rec.clear()
        runner = run_grid_step(pipeline, schedule, {coord.pipe: stage}, lm.lm_loss, x, y,
                               message_specs(stages, x, cfg.num_microbatches))
        optimizer.step()
        mb = microbatch_losses(runner)
        losses.append(sum(mb) / len(mb) if mb else float("nan"))
    return Result(ctx.rank, (coord.pipe, coord.data, coord.model), losses, ctx.rec.timeline())


def big_stage(cfg: Config, ntoken: int, stage: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """Stage `stage` of the same model at the size the node times (`cfg.size`), on meta, and one micro-batch for it."""
    size = cfg.size
    with torch.device("meta"):
        big = lm.TransformerLM(ntoken, size.emsize, cfg.nhead, int(cfg.nhid * size.emsize / cfg.emsize), cfg.nlayers)
    module = lm.stages_of(big, partition_uniform(len(big), cfg.pipe))[stage]
    rows = size.columns, size.seq_len
    return module, (torch.zeros(rows, dtype=torch.long, device="meta") if stage == 0
                    else torch.empty(*rows, size.emsize, device="meta"))


def message_scale(cfg: Config) -> float:
    """How many times larger a micro-batch's activation is at `cfg.size` than here."""
    mb_rows = cfg.batch // (cfg.data * cfg.num_microbatches)
    return cfg.size.columns * cfg.size.seq_len * cfg.size.emsize / (mb_rows * cfg.seq_len * cfg.emsize)


@dataclass
class GridRun:
    cfg: Config
    results: list[Result]
    one_process_losses: list[float]

    @property
    def losses(self) -> list[float]:
        """Per step, the batch's loss: the mean over the data replicas' last stages."""
        last = [r for r in self.results if r.coord[0] == self.cfg.pipe - 1 and r.coord[2] == 0]
        return [sum(r.losses[i] for r in last) / len(last) for i in range(self.cfg.steps)]

    @property
    def timeline(self) -> Timeline:
        return Timeline.merge(r.timeline for r in self.results)

    def groups(self) -> dict[str, list[list[int]]]:
        """Which processes talk in which group, per axis."""
        topo = self.cfg.topology()
        return {axis: topo.get_axis_comm_lists(axis) for axis in AXES}


def run(cfg: Config) -> GridRun:
    return experiments.run(worker, cfg, gather)


def gather(cfg: Config, results: list[Result]) -> GridRun:
    """The processes' results beside the same steps in this process."""
    return GridRun(cfg, results, reference(cfg))


def reference(cfg: Config) -> list[float]:
    """The losses of the same model, batches and SGD steps in this process."""
    ntoken, batches = cfg.batches()
    model = cfg.model(ntoken)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = lm.lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def same_losses(run: GridRun, tolerance: float = 1e-5) -> tuple[str, str, str, dict]:
    """Whether the grid's losses are one process's."""
    grid, one = run.losses, run.one_process_losses
    worst = max(abs(a - b) for a, b in zip(grid, one))
    verdict = "same" if worst <= tolerance else "different"
    c = run.cfg
    text = (f"over {c.pipe} x {c.data} x {c.tensor} processes the first {len(grid)} losses "
            f"{'matched' if verdict == 'same' else 'differed from'} one process's (largest difference {worst:.1e})")
    return "12.grid3d_losses", verdict, text, {"grid": grid, "one_process": one}


def axis_costs(run: GridRun) -> tuple[str, str, str, dict]:
    """What each axis cost on the last step's timeline, summed over processes: compute, the
    tensor-parallel collectives, the data groups' gradient all-reduce, and the pipeline's messages
    (a receive's span includes waiting for its sender: the pipeline's bubble shows there)."""
    tl = run.timeline
    busy = {"compute": sum(s.duration for s in tl.filter(lane="compute")),
            "tensor": sum(s.duration for s in tl.filter(lane="tensor")),
            "data": sum(s.duration for s in tl.filter(lane="comm", kind="allreduce")),
            "pipeline": sum(s.duration for s in tl.filter(lane="comm") if s.kind != "allreduce")}
    total = sum(busy.values()) or 1.0
    share = {axis: busy[axis] / total for axis in busy}
    clock = f"on the emulated node ({run.cfg.node_name})" if run.cfg.node else "on this machine's CPU cores"
    names = {"tensor": "tensor parallelism's collectives", "data": "the data groups' gradient all-reduce",
             "pipeline": "the pipeline's messages, waits for the sender included"}
    top = max(names, key=share.get)
    text = (f"{clock}, compute took {share['compute']:.0%} of the processes' time in spans; the largest "
            f"communication share, {share[top]:.0%}, went to {names[top]}")
    return "12.grid3d_axis_costs", "shares", text, {k: round(v, 4) for k, v in share.items()}

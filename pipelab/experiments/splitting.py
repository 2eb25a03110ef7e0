"""Lesson 09 from a notebook: the Transformer cut by hand, by torch's tracer (`pipeline()`) and by
pipelab's (`pipeline.trace.split`), each run on real processes; the standalone torchrun script; the
verdicts. Every `SplitRun` carries its micro-batches' losses and each stage's gradients, named as in
the whole model, for `reference.assert_same(run, reference_run(model, x, y, token_loss, lr=None))`.

    manual, torch_traced = experiments.run(splitting.worker, splitting.Config(model=model, x=x, y=y), splitting.gather)
    cfg = splitting.TracedConfig(model=model, split_points=["layers.2"], x=x, y=y, schedules=["1f1b"])
    runs = experiments.run(splitting.traced_worker, cfg, splitting.gather_traced)  # pipelab's tracer
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Sequence

import torch
from torch import nn

from pipelab import experiments
from pipelab.checks import divides, mean_loss, same_batch, whole_number
from pipelab.experiments import pipeline
from pipelab.launch import _free_port
from pipelab.pipeline.manual_split import example_io, layer_split_points, manual_stage
from pipelab.pipeline.packed import Packed, packed_stages  # noqa: F401 - the lesson shows Packed
from pipelab.pipeline.schedules import Schedule
from pipelab.pipeline.trace import Split, check_stages, split
from pipelab.transformer import ModelArgs, Transformer, token_loss
from pipelab.worker import RankContext


def make_batch(args: ModelArgs, batch: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets (the same for the same seed, anywhere)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def stage_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().cpu() for n, p in module.named_parameters()}


@contextlib.contextmanager
def quiet_tracer():
    """Silence the FutureWarning torch's tracer gives for its own `isinstance(treespec, LeafSpec)`
    calls: a note to torch's developers, nothing a reader can act on. Just that warning, just here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        yield


def torch_pipe(model: nn.Module, mb: torch.Tensor, split_points: list[str] | None = None):
    """torch's tracer here: `pipeline(model, mb_args=(mb,), split_spec=...)` on a copy (it rewrites the
    forwards it splits at). Without split points the model marks them (`pipe_split()`, `annotate_split_points`)."""
    from torch.distributed.pipelining import SplitPoint, pipeline as trace_pipeline

    spec = {name: SplitPoint.BEGINNING for name in split_points} if split_points else None
    with quiet_tracer():
        return trace_pipeline(copy.deepcopy(model), mb_args=(mb,), split_spec=spec)


# --- By hand and by torch's tracer, run with torch's ScheduleGPipe ---


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """The Transformer `model` split by hand and by torch's tracer into one stage per rank (layers
    shared out evenly), one GPipe step each on the batch `x`, `y` in `num_microbatches`."""

    model: Transformer = field(repr=False)
    x: torch.Tensor = field(repr=False)
    y: torch.Tensor = field(repr=False)
    num_microbatches: int = 4
    loss_fn: Callable = token_loss

    def check(self) -> None:
        super().check()
        if not isinstance(self.model, Transformer):
            raise ValueError(f"model must be a pipelab.transformer.Transformer (its split by hand deletes its "
                             f"layers), got {type(self.model).__name__}; use TracedConfig for any traceable model")
        whole_number("world_size", self.world_size, minimum=2, example="world_size=2 (one stage per rank)")
        layers = len(self.model.layers)
        if self.world_size > layers:
            raise ValueError(f"world_size={self.world_size} stages but the model has {layers} layers: use at "
                             f"most world_size={layers}")
        mean_loss(self.loss_fn)
        whole_number("num_microbatches", self.num_microbatches, example="num_microbatches=4")
        for name, t in (("x", self.x), ("y", self.y)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor of token ids, one row per sequence, got {type(t).__name__}")
        divides("batch", same_batch(self.x, self.y), "num_microbatches", self.num_microbatches)


@dataclass
class StageResult:
    """One split's step on one rank."""

    mb_losses: list[float]  # each micro-batch's loss on the last stage; empty elsewhere
    grads: dict[str, torch.Tensor | None]  # this stage's, named as in the whole model


def run_gpipe(ctx: RankContext, cfg: Config, stage) -> StageResult:
    """One GPipe step of a torch `PipelineStage`; ScheduleGPipe divides each micro-batch's loss by
    their number, so the gradients are the batch mean's."""
    from torch.distributed.pipelining import ScheduleGPipe

    schedule = ScheduleGPipe(stage, cfg.num_microbatches, loss_fn=cfg.loss_fn)
    last = stage.stage_index == stage.num_stages - 1
    inputs = (cfg.x.to(ctx.device),) if stage.stage_index == 0 else ()
    losses: list = []
    schedule.step(*inputs, target=cfg.y.to(ctx.device) if last else None, losses=losses if last else None)
    return StageResult([loss.item() for loss in losses], stage_grads(stage.submod))


def worker(ctx: RankContext, cfg: Config) -> tuple[StageResult, StageResult]:
    """This rank's stage split by hand, then by torch's tracer: one GPipe step each."""
    from torch.distributed.pipelining import PipelineStage

    mb = cfg.x.chunk(cfg.num_microbatches)[0]
    module = manual_stage(cfg.model, ctx.rank, ctx.world_size).to(ctx.device)
    inputs, outputs = example_io(cfg.model, ctx.rank, ctx.world_size, mb)
    stage = PipelineStage(module, ctx.rank, ctx.world_size, ctx.device, input_args=inputs.to(ctx.device),
                          output_args=outputs.to(ctx.device))  # shapes given, not inferred: see example_io
    manual = run_gpipe(ctx, cfg, stage)
    pipe = torch_pipe(cfg.model, mb, layer_split_points(cfg.model, ctx.world_size))
    with quiet_tracer():
        stage = pipe.build_stage(ctx.rank, ctx.device)
    return manual, run_gpipe(ctx, cfg, stage)


@dataclass
class SplitRun:
    """One split run on real processes: each micro-batch's loss and every stage's gradients."""

    name: str
    mb_losses: list[float]  # each micro-batch's loss, as the last stage computed it
    grads: list[dict[str, torch.Tensor | None]]  # one per stage, named as in the whole model

    @property
    def losses(self) -> list[float]:  # the batch's: the mean of its equal micro-batches'
        return [sum(self.mb_losses) / len(self.mb_losses)]


def gather(cfg: Config, results: list[tuple[StageResult, StageResult]]) -> list[SplitRun]:
    """[the split by hand, torch's pipeline()], each gathered from every rank."""
    return [SplitRun(name, results[-1][i].mb_losses, [r[i].grads for r in results])
            for i, name in enumerate(("manual", "torch pipeline()"))]


# --- pipelab's tracer, run with pipelab's runtime ---


@dataclass(frozen=True, kw_only=True)
class TracedConfig(experiments.Config):
    """`model` cut before each of `split_points` by pipelab's tracer (one stage per rank), run by
    pipelab's runtime with each of `schedules` for `steps` steps on `x`, `y` in `num_microbatches`."""

    model: nn.Module = field(repr=False)
    split_points: Sequence[str]
    x: torch.Tensor = field(repr=False)
    y: torch.Tensor = field(repr=False)
    schedules: Sequence[str | Schedule] = ("gpipe",)
    num_microbatches: int = 4
    loss_fn: Callable = token_loss
    steps: int = 2

    def check(self) -> None:
        super().check()
        if isinstance(self.split_points, str):
            raise ValueError(f"split_points must be a list of submodule names, got {self.split_points!r}; "
                             f"e.g. split_points=[{self.split_points!r}]")
        check_stages(len(self.split_points) + 1, self.world_size)
        self.pipeline  # noqa: B018 - traces, cuts, and checks the rest (loss, sizes, schedules)

    @cached_property
    def parts(self) -> Split:
        """The model traced and cut: one module per stage."""
        return split(self.model, list(self.split_points))

    @cached_property
    def pipeline(self) -> pipeline.Config:
        """Lesson 07's pipeline run of the traced stages (several values across a cut packed into one)."""
        stages = packed_stages(self.parts.stages, self.x.chunk(self.num_microbatches)[0])
        return pipeline.Config(stages=stages, x=self.x, y=self.y, schedules=list(self.schedules),
                               num_microbatches=self.num_microbatches, loss_fn=self.loss_fn, steps=self.steps,
                               world_size=self.world_size, backend=self.backend, timeout=self.timeout)


def traced_worker(ctx: RankContext, cfg: TracedConfig) -> list[pipeline.Result]:
    """Lesson 07's pipeline worker on the traced stages."""
    return pipeline.worker(ctx, cfg.pipeline)


def gather_traced(cfg: TracedConfig, results: list[list[pipeline.Result]]) -> list[SplitRun]:
    """One SplitRun per schedule, its gradients renamed as in the model."""
    return [SplitRun(f"pipelab trace, {run.name}", run.mb_losses, unprefixed(run.grads))
            for run in pipeline.gather(cfg.pipeline, results)]


def unprefixed(grads: list[dict[str, torch.Tensor | None]]) -> list[dict[str, torch.Tensor | None]]:
    """Stage s's "s.layers.0.weight" (packed: "s.stage.layers.0.weight") as the model's "layers.0.weight"."""
    return [{name.split(".", 1)[1].removeprefix("stage."): g for name, g in stage.items()} for stage in grads]


def skip_verdict(parts: Split, run: SplitRun, worst: float) -> tuple[str, str, str, dict]:
    """Did a value made on stage 0 cross every cut (forwarded between), the ranks still giving one
    process's losses and gradients (`worst`: the largest difference)?"""
    skipping = set(parts.receives[1]).intersection(*parts.receives[2:]) if len(parts) > 2 else set()
    verdict = "forwarded, same" if skipping and worst <= 1e-5 else "not shown"
    names = ", ".join(sorted(skipping)) or "no value"
    return ("09.skip", verdict, f"{names} skipped stage 1, forwarded through it, and {len(parts)} ranks gave one "
            f"process's losses and gradients within {worst:.1e}", {"skipping": names, "largest_difference": worst})


# --- Reading the cuts, and the verdicts ---


def pipe_crossings(pipe) -> list[list[str]]:
    """What each of torch's stages receives: its call's arguments in `pipe.split_gm`."""
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
    return [[str(a) for a in n.args] for n in calls]


def predicted_stage(name: str, cut_layers: list[int]) -> int:
    """The stage a Transformer parameter should land on, cut before each of `cut_layers`: the embedding
    on the first, a layer one further per cut at or before it, the norm and output on the last."""
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith("layers."):
        return sum(int(name.split(".")[1]) >= c for c in cut_layers)
    return len(cut_layers)


def cut_rows(model: Transformer, pipe, split_points: list[str]) -> list[dict]:
    """Per torch stage: its parameters, those `predicted_stage` counts, the tensors crossing into it."""
    cut_layers = [int(p.split(".")[1]) for p in split_points]  # "layers.2" -> 2
    crossing = pipe_crossings(pipe)
    return [{"stage": s, "parameters": sum(p.numel() for p in pipe.get_stage_module(s).parameters()),
             "predicted": sum(p.numel() for n, p in model.named_parameters() if predicted_stage(n, cut_layers) == s),
             "tensors in": len(crossing[s])} for s in range(pipe.num_stages)]


def cut_verdict(model: Transformer, pipe, split_points: list[str]) -> tuple[str, str, str, dict]:
    """Did torch's tracer give each stage the parameters `predicted_stage` counts, one tensor per cut?"""
    rows = cut_rows(model, pipe, split_points)
    as_predicted = all(r["parameters"] == r["predicted"] for r in rows) and all(r["tensors in"] == 1 for r in rows[1:])
    text = ("torch's tracer gave every stage the parameters its modules predict, and one tensor crosses each cut"
            if as_predicted else "torch's tracer did not cut as predicted; compare the table with the stages' code")
    return "09.cut", "as predicted" if as_predicted else "not as predicted", text, {
        "traced": str([r["parameters"] for r in rows]), "predicted": str([r["predicted"] for r in rows])}


def compare_with_torch(parts: Split, pipe, mb: torch.Tensor) -> float:
    """Assert pipelab's stages hold the same parameters as torch's and compute the same outputs, stage
    by stage on micro-batch `mb` (one tensor crossing each cut); return the largest output difference."""
    if len(parts) != pipe.num_stages:
        raise AssertionError(f"pipelab cut {len(parts)} stages, torch {pipe.num_stages}")
    worst, ours, theirs = 0.0, mb, mb
    with torch.no_grad():
        for s, stage in enumerate(parts.stages):
            torch_stage = pipe.get_stage_module(s)
            mine, its = ({n for n, _ in m.named_parameters()} for m in (stage, torch_stage))
            assert mine == its, f"stage {s}: pipelab alone holds {sorted(mine - its)}, torch alone {sorted(its - mine)}"
            ours, theirs = stage(ours), torch_stage(theirs)
            torch.testing.assert_close(ours, theirs, msg=lambda m, s=s: f"stage {s}'s output: {m}")
            worst = max(worst, (ours - theirs).abs().max().item())
    return worst


def single_process_losses(model: nn.Module, x, y, num_microbatches: int, loss_fn: Callable = token_loss) -> list[float]:
    """The per-micro-batch losses of the unsplit model, in this process."""
    with torch.no_grad():
        return [float(loss_fn(model(xm), ym)) for xm, ym in zip(x.chunk(num_microbatches), y.chunk(num_microbatches))]


def tied_gradient(grads: list[dict[str, torch.Tensor | None]], names: list[str]) -> torch.Tensor:
    """A weight tied across stages: the sum of its copies' gradients, each named in `names` on the
    stage holding it (what DeepSpeed's ReduceTiedGrads all-reduces)."""
    parts = [g[n] for g in grads for n in names if g.get(n) is not None]
    if not parts:
        raise ValueError(f"no stage holds a gradient named in {names}")
    return sum(parts)


# --- Outside Jupyter: the worker as a torchrun script ---

SCRIPT = '''\
"""Lesson 09's worker on its own: the Transformer split by hand, one stage per process, one GPipe step.
Run: python -m torch.distributed.run --nproc-per-node 2 {name}  (torchrun's own module: no executable needed)"""
import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

{source}

def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    if use_cuda:  # one GPU per process, made current before NCCL binds its communicator to one
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    args = {args!r}
    torch.manual_seed({seed})
    model = Transformer(args)
    x, y = make_batch(args, {batch}, {seq_len}, seed={seed})
    inputs, outputs = example_io(model, rank, world, x.chunk({num_microbatches})[0])
    stage = PipelineStage(manual_stage(model, rank, world).to(device), rank, world, device,
                          input_args=inputs.to(device), output_args=outputs.to(device))
    last, losses = rank == world - 1, []
    ScheduleGPipe(stage, {num_microbatches}, loss_fn=token_loss).step(
        *([x.to(device)] if rank == 0 else []), target=y.to(device) if last else None, losses=losses if last else None)
    for mb, loss in enumerate(losses):
        print(f"micro-batch {{mb}} loss {{loss.item():.6f}}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def standalone_script(args: ModelArgs, batch: int, seq_len: int, num_microbatches: int, seed: int = 0,
                      name: str = "lesson09_worker.py") -> str:
    """A torchrun script building the same model and batch and running the manual split (the model
    code copied in: it needs torch only)."""
    source = "\n\n".join(inspect.getsource(obj) for obj in (ModelArgs, Transformer, token_loss, make_batch,
                                                             manual_stage, example_io))
    return SCRIPT.format(name=name, source=source,
                         args=args, seed=seed, batch=batch, seq_len=seq_len, num_microbatches=num_microbatches)


def write_script(path: str, text: str) -> str:
    """Write the script to `path` (its folder made if needed); return the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def torchrun_command(script: str, nproc: int = 2) -> list[str]:
    """torchrun as this Python's `-m torch.distributed.run` (no executable on a path), on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(_free_port()), script]


def run_torchrun(command: list[str], timeout: float = 120.0) -> str:
    """Run a torchrun command; return what it printed, or raise with its output if it failed."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def parse_losses(output: str) -> list[float]:
    """The per-micro-batch losses the standalone script printed."""
    return [float(line.split()[-1]) for line in output.splitlines() if line.startswith("micro-batch ")]


# --- What the lesson costs at a profile's size ---

# The notebook's parameters run_flops reads, with their defaults (the parameters cell's).
DEFAULTS = dict(dim=32, n_layers=4, n_heads=4, vocab_size=100, batch=8, seq_len=16)


def run_flops(params: dict) -> float:
    """FLOPs of lesson 09 at the notebook parameters `params` (missing: the defaults), counted on the
    meta device: the batch's forward and backward nine times (the references, the manual, torch's and
    the script's GPipe steps, pipelab's tracer under four schedules) and four forwards (the micro-batch
    losses; tracing and comparing the splits)."""
    from pipelab.emulate.cost import count, forward_backward_counts

    p = {**DEFAULTS, **params}
    args = ModelArgs(dim=p["dim"], n_layers=p["n_layers"], n_heads=p["n_heads"], vocab_size=p["vocab_size"])
    with torch.device("meta"):
        model = Transformer(args)
    tokens = torch.zeros(p["batch"], p["seq_len"], dtype=torch.long, device="meta")
    forward, grad_input, grad_weight = forward_backward_counts(model, tokens)
    return 9 * (forward.flops + grad_input.flops + grad_weight.flops) + 4 * count(model, tokens).flops

"""Running lesson 09 (automatic splitting) from a notebook: the Transformer cut by hand, by torch's
tracer (`torch.distributed.pipelining.pipeline`) and by pipelab's (`pipeline.trace.split`), each run
on real processes, and the standalone torchrun script.

Every run carries `losses` (the batch's loss) and `grads` (one dict per stage, named as in the whole
model), so `reference.assert_same(run, reference_run(model, x, y, token_loss, lr=None))` checks it.
"""

from __future__ import annotations

import copy
import inspect
import os
import sys
from dataclasses import dataclass

import torch
from torch import nn

from pipelab.checks import whole_number
from pipelab.pipeline.trace import Split, check_stages, split
from pipelab.transformer import ModelArgs, Transformer, token_loss


def make_batch(args: ModelArgs, batch: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets (the same for the same seed, anywhere)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def manual_stage(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """The example's split by hand: keep this stage's share of the layers (names unchanged), the
    embedding on the first stage only, the norm and output on the last only."""
    mod = copy.deepcopy(model)
    n = len(mod.layers)
    keep = range(stage * n // num_stages, (stage + 1) * n // num_stages)
    for i in range(n):
        if i not in keep:
            del mod.layers[str(i)]
    if stage > 0:
        mod.tok_embeddings = None
    if stage < num_stages - 1:
        mod.norm, mod.output = None, None
    return mod


def split_spec(model: Transformer, num_stages: int) -> dict:
    """torch's split_spec: a `SplitPoint.BEGINNING` before the first layer of each stage but the first."""
    from torch.distributed.pipelining import SplitPoint

    return {name: SplitPoint.BEGINNING for name in layer_split_points(model, num_stages)}


def layer_split_points(model: Transformer, num_stages: int) -> list[str]:
    """The names of the layers that start stages 1, 2, ...: the layers shared out evenly."""
    n = len(model.layers)
    return [f"layers.{s * n // num_stages}" for s in range(1, num_stages)]


def stage_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().cpu() for n, p in module.named_parameters()}


def run_torch_schedule(ctx, module: nn.Module, stage_index: int, num_stages: int, x, y, microbatches: int,
                       stage=None) -> tuple[list[float], dict]:
    """One GPipe step through torch.distributed.pipelining: `PipelineStage` (or a `stage` built by
    `pipe.build_stage`) and `ScheduleGPipe` with the token loss. Returns the per-micro-batch losses
    (on the last stage) and this stage's gradients."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    module = module.to(ctx.device)
    stage = stage or PipelineStage(module, stage_index, num_stages, ctx.device)
    schedule = ScheduleGPipe(stage, microbatches, loss_fn=token_loss)  # grads scaled by 1/m: the batch mean
    last = stage_index == num_stages - 1
    losses: list = []
    if stage_index == 0:
        schedule.step(x.to(ctx.device), target=y.to(ctx.device) if last else None)
    else:
        schedule.step(target=y.to(ctx.device) if last else None, losses=losses if last else None)
    return [l.item() for l in losses], stage_grads(module)


def example_io(model: Transformer, stage: int, num_stages: int, mb: torch.Tensor) -> tuple:
    """Example input and output of a manual stage on micro-batch `mb` (run in a row, no gradients).
    Given to `PipelineStage`, they fix the shapes up front ("static mode") with contiguous buffers:
    inferred from a backward, the gradient buffer of a decoder layer's input is not contiguous and
    gloo refuses to receive into it."""
    h = mb
    with torch.no_grad():
        for s in range(stage + 1):
            inputs, h = h, manual_stage(model, s, num_stages)(h)
    # Floating-point tensors are marked as wanting gradients: torch sizes the gradient buffers after them.
    return tuple(t.contiguous().requires_grad_(t.is_floating_point()) for t in (inputs, h))


def torch_splits_worker(ctx, model: Transformer, x, y, microbatches: int) -> dict:
    """Worker: the manual split and torch's tracer split, one GPipe step each, on this rank's stage."""
    from torch.distributed.pipelining import PipelineStage, pipeline

    module = manual_stage(model, ctx.rank, ctx.world_size).to(ctx.device)
    inputs, outputs = example_io(model, ctx.rank, ctx.world_size, x.chunk(microbatches)[0])
    stage = PipelineStage(module, ctx.rank, ctx.world_size, ctx.device, input_args=inputs.to(ctx.device),
                          output_args=outputs.to(ctx.device))  # shapes given, not inferred: see example_io
    out = {"manual": run_torch_schedule(ctx, module, ctx.rank, ctx.world_size, x, y, microbatches, stage=stage)}
    traced = copy.deepcopy(model)
    pipe = pipeline(traced, mb_args=(x.chunk(microbatches)[0],), split_spec=split_spec(traced, ctx.world_size))
    stage = pipe.build_stage(ctx.rank, ctx.device)
    out["torch pipeline()"] = run_torch_schedule(ctx, stage.submod, ctx.rank, ctx.world_size, x, y,
                                                 microbatches, stage=stage)
    return out


@dataclass
class SplitRun:
    """One split run on real processes: per-micro-batch losses and every stage's gradients."""

    name: str
    mb_losses: list[float]
    grads: list[dict[str, torch.Tensor | None]]  # one per stage, named as in the whole model

    @property
    def losses(self) -> list[float]:
        """The batch's loss: the mean of the micro-batches' (equal sizes, mean loss)."""
        return [sum(self.mb_losses) / len(self.mb_losses)]


def check_run(model: Transformer, x: torch.Tensor, num_stages: int, microbatches: int, world_size: int) -> None:
    """Refuse what cannot run, before any process starts."""
    whole_number("num_stages", num_stages, minimum=2)
    whole_number("microbatches", microbatches)
    check_stages(num_stages, world_size)
    if num_stages > len(model.layers):
        raise ValueError(f"{num_stages} stages but {len(model.layers)} layers: use at most {len(model.layers)} stages")
    if x.shape[0] % microbatches:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {microbatches} equal micro-batches; "
                         f"use a divisor of {x.shape[0]}")


def run_torch_splits(model: Transformer, x, y, microbatches: int = 4, world_size: int = 2,
                     timeout: float = 120.0) -> list[SplitRun]:
    """The manual split and torch's tracer split of `model`, each run with ScheduleGPipe on
    `world_size` processes (one stage each)."""
    from pipelab.launch import spawn

    check_run(model, x, world_size, microbatches, world_size)
    per_rank = spawn(torch_splits_worker, world_size, model, x, y, microbatches, timeout=timeout)
    return [SplitRun(name, per_rank[-1][name][0], [r[name][1] for r in per_rank]) for name in per_rank[0]]


def run_traced(model: nn.Module, split_points: list[str], schedules: list, x, y, steps: int = 2,
               timeout: float = 120.0) -> tuple[Split, list[SplitRun]]:
    """pipelab's tracer cuts `model` at `split_points`; pipelab's runtime runs the stages with each
    of `schedules` (lesson 07's) on real processes. Gradients are renamed as in `model`."""
    from pipelab.experiments.pipeline import run_pipelines

    parts = split(model, split_points)
    for schedule in schedules:
        check_stages(len(parts), schedule.num_ranks * schedule.stages_per_rank)
    runs = run_pipelines(parts.stages, schedules, x, y, token_loss, steps=steps, timeout=timeout)
    return parts, [SplitRun(f"pipelab trace, {run.name}", [run.loss], unprefixed(run.grads)) for run in runs]


def unprefixed(grads: list[dict[str, torch.Tensor | None]]) -> list[dict[str, torch.Tensor | None]]:
    """Stage s's "s.layers.0.weight" as "layers.0.weight": the traced stages keep the model's names."""
    return [{name.split(".", 1)[1]: g for name, g in stage.items()} for stage in grads]


def torch_pipe(model: nn.Module, mb: torch.Tensor, split_points: list[str] | None = None):
    """torch's tracer in this process: `pipeline(model, mb_args=(mb,), split_spec=...)` on a copy
    (it rewrites the forwards of the modules it splits at). Without split points, the model must
    mark them itself (`pipe_split()` in its forward, or `annotate_split_points`)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {name: SplitPoint.BEGINNING for name in split_points} if split_points else None
    return pipeline(copy.deepcopy(model), mb_args=(mb,), split_spec=spec)


def pipe_crossings(pipe) -> list[list[str]]:
    """What each of torch's stages receives: the arguments of its call in `pipe.split_gm`."""
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
    return [[str(a) for a in n.args] for n in calls]


def compare_with_torch(parts: Split, pipe, mb: torch.Tensor) -> float:
    """Assert pipelab's stages hold the same parameters as torch's and compute the same outputs, stage
    by stage on micro-batch `mb` (one tensor crossing each cut); return the largest output difference."""
    if len(parts) != pipe.num_stages:
        raise AssertionError(f"pipelab cut {len(parts)} stages, torch {pipe.num_stages}")
    worst, ours, theirs = 0.0, mb, mb
    with torch.no_grad():
        for s, stage in enumerate(parts.stages):
            torch_stage = pipe.get_stage_module(s)
            mine = sorted(n for n, _ in stage.named_parameters())
            its = sorted(n for n, _ in torch_stage.named_parameters())
            if mine != its:
                raise AssertionError(f"stage {s}: pipelab holds {sorted(set(mine) - set(its))} that torch "
                                     f"does not, torch {sorted(set(its) - set(mine))}")
            ours, theirs = stage(ours), torch_stage(theirs)
            torch.testing.assert_close(ours, theirs, msg=lambda m, s=s: f"stage {s}'s output: {m}")
            worst = max(worst, (ours - theirs).abs().max().item())
    return worst


def single_process_losses(model: nn.Module, x, y, microbatches: int) -> list[float]:
    """The per-micro-batch losses of the unsplit model, in this process."""
    with torch.no_grad():
        return [float(token_loss(model(xm), ym)) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))]


def tied_gradient(grads: list[dict[str, torch.Tensor | None]], names: list[str]) -> torch.Tensor:
    """The gradient of a weight tied across stages: the sum of its copies' gradients, each named
    in `names` on the stage that holds it (what DeepSpeed's ReduceTiedGrads all-reduces)."""
    parts = [g[n] for g in grads for n in names if g.get(n) is not None]
    if not parts:
        raise ValueError(f"no stage holds a gradient named in {names}")
    return sum(parts)


SCRIPT = '''\
"""Lesson 09's worker on its own: the Transformer split by hand into one stage per process, one
GPipe step with torch.distributed.pipelining. Run: torchrun --nproc-per-node 2 {name}"""
import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

{source}

def main():
    use_cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    args = {args!r}
    torch.manual_seed({seed})
    model = Transformer(args)
    x, y = make_batch(args, {batch}, {seq_len}, seed={seed})
    inputs, outputs = example_io(model, rank, world, x.chunk({microbatches})[0])
    stage = PipelineStage(manual_stage(model, rank, world).to(device), rank, world, device,
                          input_args=inputs.to(device), output_args=outputs.to(device))
    schedule = ScheduleGPipe(stage, {microbatches}, loss_fn=token_loss)
    last = rank == world - 1
    losses = []
    if rank == 0:
        schedule.step(x.to(device), target=y.to(device) if last else None)
    else:
        schedule.step(target=y.to(device) if last else None, losses=losses if last else None)
    if last:
        for mb, loss in enumerate(losses):
            print(f"micro-batch {{mb}} loss {{loss.item():.6f}}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def standalone_script(args: ModelArgs, batch: int, seq_len: int, microbatches: int, seed: int = 0,
                      name: str = "lesson09_worker.py") -> str:
    """The text of a torchrun script that builds the same model and batch and runs the manual split:
    the model code is copied in, so the script needs torch only."""
    source = "\n\n".join(inspect.getsource(obj) for obj in (ModelArgs, Transformer, token_loss, make_batch,
                                                             manual_stage, example_io))
    return SCRIPT.format(name=name, source=source,
                         args=args, seed=seed, batch=batch, seq_len=seq_len, microbatches=microbatches)


def write_script(path: str, text: str) -> str:
    """Write the script to `path` (its folder made if needed); return the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def torchrun_command(script: str, nproc: int = 2) -> list[str]:
    """`torchrun --nproc-per-node N --master-port PORT script`, with the torchrun of this Python's
    environment and a port free right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--nproc-per-node", str(nproc), "--master-port", str(port), script]


def run_torchrun(command: list[str], timeout: float = 120.0) -> str:
    """Run a torchrun command; return what it printed, or raise with its output if it failed."""
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def parse_losses(output: str) -> list[float]:
    """The per-micro-batch losses the standalone script printed."""
    return [float(line.split()[-1]) for line in output.splitlines() if line.startswith("micro-batch ")]

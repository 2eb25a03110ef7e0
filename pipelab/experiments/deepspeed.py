"""Training with the DeepSpeed-style engine from a notebook (lesson 08), and the real DeepSpeed
beside it.

`train(module, x, y, micro_batches, steps)` checks the input, starts `num_stages x data_parallel`
processes and has each one train `steps` batches with its `PipelineEngine`. The `TrainRun` it
returns names gradients and weights as `module.build_reference()` does, so
`assert_same(run, reference_run(module.build_reference(), x, y, module.loss_fn, steps, lr))`
checks it against one process. Where DeepSpeed is installed, `deepspeed_partitions` and
`train_deepspeed` ask the real `deepspeed.pipe` for the same partitions and the same training.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipelab.checks import positive_number, whole_number
from pipelab.launch import spawn
from pipelab.measure import Measured, Steps, compare, gather_steps, time_steps
from pipelab.pipeline.engine import PipelineEngine
from pipelab.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from pipelab.pipeline.partition import check_method
from pipelab.pipeline.stage import sums_over_samples
from pipelab.pipeline.topology import PipeDataParallelTopology, ProcessTopology
from pipelab.timeline import Timeline


def engine_worker(ctx, module: PipelineModule, topology: ProcessTopology, inputs: torch.Tensor,
                  targets: torch.Tensor, micro_batches: int, steps: int, lr: float) -> dict:
    """Worker: build this rank's stage, train ``steps`` batches, return what the notebook checks."""
    engine = PipelineEngine(ctx, module, topology, micro_batches, lr)
    replica = topology.get_coord(ctx.rank).data
    x = inputs.chunk(topology.get_dim("data"))[replica]
    y = targets.chunk(topology.get_dim("data"))[replica]
    data = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
    measured = time_steps(ctx, lambda _: engine.train_batch(data), steps)
    weights = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return {"rank": ctx.rank, "stage": engine.stage_id, "losses": measured.results,
            "grads": engine.step_grads, "weights": weights, "steps": measured}


@dataclass
class TrainRun:
    """A pipelined training run, gathered from every rank. Gradients and weights are named as in
    ``module.build_reference()`` (layer index first: ``"2.weight"``)."""

    parts: list[int]
    topology: ProcessTopology
    losses: list[float]  # mean loss of each batch, before its optimizer step
    grads: list[dict[str, torch.Tensor]]  # per rank: the gradients of the first batch
    weights: list[dict[str, torch.Tensor]]  # per rank: the weights after the last step
    steps: Steps = field(repr=False)  # timed batches (the first warms up), all ranks

    @property
    def timeline(self) -> Timeline:
        """The last batch's timeline, all ranks."""
        return self.steps.timelines[-1]

    @property
    def step_time(self) -> float:
        """Seconds per batch: median over the timed batches of the slowest rank."""
        return self.steps.step_time


def peak_in_flight(timeline: Timeline) -> dict[int, int]:
    """Per rank, the most micro-batches it held at once: forwards begun whose backward had not
    yet ended (each one fills a pipe buffer until its backward frees it), read off the timeline."""
    peaks = {}
    for rank in timeline.ranks:
        held = peak = 0
        for span in sorted(timeline.filter(rank=rank, lane="compute"), key=lambda s: s.start):
            held += {"F": 1, "B": -1}.get(span.kind, 0)
            peak = max(peak, held)
        peaks[rank] = peak
    return peaks


def speedup_verdict(speedup: Measured, new: str = "new cut", same_cut: bool = False,
                    min_rounds: int = 3) -> tuple[str, str]:
    """(verdict, phrase) for a round-by-round ratio "old cut's slowest stage / `new`'s": 'faster'
    only when every round says so, 'slower' likewise, else 'within noise' (or 'same cut')."""
    rounds = len(speedup.values)
    direction = compare(speedup, Measured.of([1.0]))  # 'higher': every round above 1
    if same_cut:
        return "same cut", "both methods chose the same cut, so there is nothing to compare"
    if rounds < min_rounds:
        return "within noise", (f"{rounds} round(s) ({speedup:.2f}x) are too few to tell a direction; "
                                f"measure at least {min_rounds}")
    if direction == "higher":
        return "faster", (f"in every one of the {rounds} rounds the {new}'s slowest stage was the faster, "
                          f"by {speedup:.2f}x (median, min-max over the rounds)")
    if direction == "lower":
        return "slower", (f"in every one of the {rounds} rounds the {new}'s slowest stage was the slower "
                          f"({speedup:.2f}x)")
    return "within noise", (f"the {rounds} rounds do not all agree ({speedup:.2f}x, median and min-max): this "
                            "machine's noise is as large as the effect, so read the prediction instead")


def train(module: PipelineModule, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int,
          steps: int = 1, lr: float = 0.1, world_size: int | None = None, backend: str = "auto",
          timeout: float = 120.0) -> TrainRun:
    """Train ``steps`` batches (the same batch each time) with SGD on a pipe x data grid.

    ``world_size`` defaults to the module's topology, else to one rank per stage; a larger
    multiple of ``num_stages`` adds data-parallel replicas, each taking an equal share of the batch."""
    topology = check_train(module, inputs, targets, micro_batches, steps, lr, world_size)
    per_rank = spawn(engine_worker, topology.world_size(), module, topology, inputs, targets,
                     micro_batches, steps, lr, backend=backend, timeout=timeout)
    last = topology.get_rank(pipe=topology.get_dim("pipe") - 1, data=0)
    return TrainRun(module.partitions(), topology, per_rank[last]["losses"],
                    [r["grads"] for r in per_rank], [r["weights"] for r in per_rank],
                    gather_steps([r["steps"] for r in per_rank]))


def check_train(module, inputs, targets, micro_batches, steps, lr, world_size) -> ProcessTopology:
    """Refuse what cannot run, before any worker starts; return the process grid."""
    if not isinstance(module, PipelineModule):
        raise ValueError(f"train needs a PipelineModule, got {type(module).__name__}; "
                         "wrap the layers: PipelineModule(layers, num_stages=2, loss_fn=...)")
    if module.loss_fn is None:
        raise ValueError("the last stage needs a loss; build the module with loss_fn=, "
                         "e.g. PipelineModule(layers, num_stages=2, loss_fn=torch.nn.MSELoss())")
    if getattr(module.loss_fn, "reduction", None) == "none":
        raise ValueError(f"loss_fn {module.loss_fn} returns one loss per sample (reduction='none'), but each "
                         "micro-batch needs one number; use reduction='mean' (or 'sum')")
    whole_number("micro_batches", micro_batches, example="micro_batches=4")
    whole_number("steps", steps, example="steps=2")
    positive_number("lr", lr, example="lr=0.1")
    S = module.num_stages
    topology = module._topo
    if topology is not None and "data" not in topology.get_axis_names():
        raise ValueError(f"the engine runs a pipe x data grid, but the module's topology has axes "
                         f"{topology.get_axis_names()}; build it with PipeDataParallelTopology("
                         f"num_pp={S}, num_dp=1) for a pipeline alone")
    if world_size is None:
        world_size = topology.world_size() if topology is not None else S
    whole_number("world_size", world_size, example=f"world_size={S}")
    if world_size % S:
        raise ValueError(f"num_stages={S} does not divide world_size={world_size!r}: every stage needs "
                         f"the same number of data-parallel ranks; use a world size that is a multiple "
                         f"of {S} (e.g. {S} or {2 * S}), or fewer stages")
    if topology is None:
        topology = PipeDataParallelTopology(num_pp=S, num_dp=world_size // S)
    elif topology.world_size() != world_size:
        raise ValueError(f"world_size={world_size} but the module's topology has {topology.world_size()} "
                         "ranks; leave world_size out, or build the module with a matching topology")
    dp = topology.get_dim("data")
    batch = inputs.shape[0]
    if batch == 0:
        raise ValueError(f"the batch is empty (0 samples); pass at least {dp * micro_batches} "
                         f"(data-parallel replicas {dp} x micro_batches={micro_batches})")
    if targets.shape[0] != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {targets.shape[0]}; "
                         "give one target per input")
    if batch % (dp * micro_batches):
        raise ValueError(f"a batch of {batch} does not split into {dp} data-parallel replica(s) x "
                         f"micro_batches={micro_batches}; use a batch that is a multiple of "
                         f"{dp * micro_batches}")
    return topology


# ---------------------------------------------------------------------------------------------
# The real DeepSpeed, beside ours
# ---------------------------------------------------------------------------------------------

@dataclass
class DeepSpeedRun:
    """What ``train`` measures, done by DeepSpeed: its partition, losses and final weights."""

    parts: list[int]
    losses: list[float]
    weights: list[dict[str, torch.Tensor]]  # per rank, named as our stages name them


def deepspeed_available() -> bool:
    """True when ``import deepspeed`` works here (``pip install -e ".[deepspeed]"``)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def to_deepspeed_layers(layers: list) -> list:
    """Our layer list with each LayerSpec / TiedLayerSpec rewritten as DeepSpeed's own."""
    from deepspeed.pipe import LayerSpec as DSLayerSpec, TiedLayerSpec as DSTiedLayerSpec

    out = []
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            out.append(DSTiedLayerSpec(layer.key, layer.typename, *layer.module_args, forward_fn=layer.forward_fn,
                                       tied_weight_attr=layer.tied_weight_attr, **layer.module_kwargs))
        elif isinstance(layer, LayerSpec):
            out.append(DSLayerSpec(layer.typename, *layer.module_args, **layer.module_kwargs))
        else:
            out.append(layer)
    return out


def _import_deepspeed(ctx):
    """Import DeepSpeed in a worker, quietly, and have it adopt the process group we started."""
    import logging
    import os
    import warnings

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, rather than have DeepSpeed warn
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    # DeepSpeed broadcasts tied weights that require grad; autograd warns about it, harmlessly.
    warnings.filterwarnings("ignore", message="c10d::broadcast_")
    deepspeed.init_distributed(dist_backend=ctx.backend)
    return deepspeed


def _deepspeed_module(layers: list, num_stages: int, method: str, like: PipelineModule):
    """``deepspeed.pipe.PipelineModule`` on our layers, with ``like``'s loss, seeds and checkpointing."""
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    return DSPipelineModule(
        to_deepspeed_layers(layers), num_stages=num_stages, loss_fn=like.loss_fn, partition_method=method,
        base_seed=like.base_seed, seed_layers=like.seed_layers,
        activation_checkpoint_interval=like.activation_checkpoint_interval,
        # DeepSpeed's own seeding passes a numpy integer to random.seed, which Python 3.11 refuses.
        seed_fn=lambda seed: torch.manual_seed(int(seed)))


def deepspeed_partition_worker(ctx, layers: list, cuts: list[tuple[int, str]]) -> dict:
    """Worker: build ``deepspeed.pipe.PipelineModule`` for each (num_stages, method); its boundaries."""
    import contextlib
    import io

    _import_deepspeed(ctx)
    like = PipelineModule(layers, num_stages=1, partition_method="uniform", verbose=False)
    parts = {}
    for num_stages, method in cuts:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints every stage table
            parts[num_stages, method] = [int(p) for p in _deepspeed_module(layers, num_stages, method, like).parts]
    return parts


def deepspeed_partitions(layers: list, cuts: list[tuple[int, str]], world_size: int | None = None,
                         timeout: float = 300.0) -> dict[tuple[int, str], list[int]]:
    """The boundaries the real ``deepspeed.pipe.PipelineModule`` computes for each (num_stages,
    method) on ``layers`` ('uniform', 'parameters' or 'type:REGEX'), on ``world_size`` ranks
    (by default the least common multiple of the stage counts)."""
    import math

    check_cuts(cuts)
    if world_size is not None:
        whole_number("world_size", world_size, example="world_size=2")
    if not deepspeed_available():
        raise ValueError('deepspeed is not installed; pip install -e ".[deepspeed]" to compare with it')
    world_size = world_size or math.lcm(*(s for s, _ in cuts))
    return spawn(deepspeed_partition_worker, world_size, layers, cuts, timeout=timeout)[0]


def check_cuts(cuts) -> None:
    """Each cut is (num_stages, method) with a method DeepSpeed implements."""
    if isinstance(cuts, (str, tuple)) or not cuts:
        raise ValueError(f"cuts must be a list of (num_stages, partition_method) pairs, got {cuts!r}; "
                         "e.g. [(2, 'uniform'), (2, 'parameters')]")
    for cut in cuts:
        if not isinstance(cut, tuple) or len(cut) != 2:
            raise ValueError(f"each cut is a (num_stages, partition_method) pair, got {cut!r}; e.g. (2, 'uniform')")
        whole_number("num_stages", cut[0], example="(2, 'uniform')")
        no_profile(check_method(cut[1]))


def no_profile(method: str) -> None:
    if method.lower() == "profile":
        raise ValueError("DeepSpeed does not implement partition_method='profile'; compare another method "
                         "('uniform', 'parameters' or 'type:REGEX')")


def deepspeed_worker(ctx, module: PipelineModule, inputs: torch.Tensor, targets: torch.Tensor,
                     micro_batches: int, steps: int, lr: float) -> dict:
    """Worker: the same layers, partition method, seeds, data and SGD through
    ``deepspeed.pipe.PipelineModule`` and DeepSpeed's pipeline engine."""
    deepspeed = _import_deepspeed(ctx)
    ds_module = _deepspeed_module(module._layer_specs, module.num_stages, module.partition_method, module)
    optimizer = torch.optim.SGD(ds_module.parameters(), lr=lr)
    dp = ctx.world_size // module.num_stages
    micro = inputs.shape[0] // (dp * micro_batches)
    config = {"train_batch_size": micro * micro_batches * dp, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": micro_batches, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=ds_module, optimizer=optimizer, config=config)
    replica = engine.grid.get_data_parallel_rank()
    x, y = inputs.chunk(dp)[replica], targets.chunk(dp)[replica]
    data = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
    losses = [float(engine.train_batch(iter(data))) for _ in range(steps)]
    weights = {n: p.detach().cpu().clone() for n, p in ds_module.named_parameters()}
    return {"rank": ctx.rank, "parts": [int(p) for p in ds_module.parts], "losses": losses, "weights": weights}


def train_deepspeed(module: PipelineModule, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int,
                    steps: int = 1, lr: float = 0.1, world_size: int | None = None, backend: str = "auto",
                    timeout: float = 300.0) -> DeepSpeedRun:
    """What ``train`` does, done by DeepSpeed: its partition, losses and final weights."""
    topology = check_train(module, inputs, targets, micro_batches, steps, lr, world_size)
    no_profile(module.partition_method)
    if sums_over_samples(module.loss_fn):
        raise ValueError("DeepSpeed divides every micro-batch's loss by the number of micro-batches and "
                         "averages the replicas, so with reduction='sum' it would not train as `train` "
                         "does; compare with a mean loss (reduction='mean')")
    if not deepspeed_available():
        raise ValueError('deepspeed is not installed; pip install -e ".[deepspeed]" to compare with it')
    per_rank = spawn(deepspeed_worker, topology.world_size(), module, inputs, targets, micro_batches, steps,
                     lr, backend=backend, timeout=timeout)
    last = topology.get_rank(pipe=topology.get_dim("pipe") - 1, data=0)
    return DeepSpeedRun(per_rank[0]["parts"], per_rank[last]["losses"], [r["weights"] for r in per_rank])

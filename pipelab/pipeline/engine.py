"""Execute DeepSpeed's TrainSchedule on real ranks: a pipe x data grid of processes.

``train(module, x, y, micro_batches, steps)`` runs in the notebook: it checks the input, starts
``num_stages x data_parallel`` processes and has each one train ``steps`` batches. On every rank a
``PipelineEngine`` builds only its stage's layers from the ``PipelineModule`` and walks the
instruction stream of ``TrainSchedule``, one method per instruction, named as in DeepSpeed's
``deepspeed.runtime.pipe.engine.PipelineEngine`` (``_exec_forward_pass``, ``_exec_send_grads``,
...). Every instruction is recorded on the rank's timeline.

``reference_train`` trains the same layers in one process, and ``assert_matches_reference``
checks that the pipeline computed the same losses, gradients and weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipelab.launch import spawn
from pipelab.pipeline.instructions import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep,
                                           RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads,
                                           SendActivation, SendGrad, TrainSchedule)
from pipelab.pipeline.module import PipelineModule
from pipelab.pipeline.topology import PipeDataParallelTopology, ProcessTopology, axis_groups
from pipelab.timeline import Timeline

# The dtypes an activation may have; its index travels in the tensor meta message.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------

class PipelineEngine:
    """One rank of the pipe x data grid: its stage's layers, its groups, and the instruction executors."""

    def __init__(self, ctx, module: PipelineModule, topology: ProcessTopology, micro_batches: int,
                 lr: float):
        self.ctx, self.device, self.global_rank = ctx, ctx.device, ctx.rank
        coord = topology.get_coord(ctx.rank)
        self.stage_id, self.num_stages = coord.pipe, topology.get_dim("pipe")
        self.dp_world_size = topology.get_dim("data")
        self.is_first_stage, self.is_last_stage = self.stage_id == 0, self.stage_id == self.num_stages - 1
        # Neighbours in the pipe: same data-parallel replica, one stage before / after.
        self.prev_rank = topology.get_rank(pipe=self.stage_id - 1, data=coord.data) if not self.is_first_stage else None
        self.next_rank = topology.get_rank(pipe=self.stage_id + 1, data=coord.data) if not self.is_last_stage else None
        self.micro_batches, self.loss_fn = micro_batches, module.loss_fn

        self.module = module.build_stage(self.stage_id).to(self.device)  # only this stage's layers
        # new_group is collective: every rank creates every group, in the same order.
        self.tied_comms = self._tied_groups(module, topology)
        self.dp_group = axis_groups(topology, "data", ctx.rank) if self.dp_world_size > 1 else None
        self._synchronize_tied_weights()
        self._broadcast_model()
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(params, lr=lr) if params else None

        self.schedule = TrainSchedule(micro_batches, self.num_stages, self.stage_id)
        self.recv_meta = None  # shape and dtype of the activations this stage receives
        self.first_output_send = True
        self.step_grads: dict[str, torch.Tensor] | None = None  # gradients of the first step
        self.pending_sends: list = []

    # ---- a batch ----------------------------------------------------------------------------
    def train_batch(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Run one batch (``micro_batches`` pairs of inputs and labels) through the schedule and
        take the optimizer step. Returns the batch's mean loss on the last stage, else None."""
        n = self.schedule.num_pipe_buffers()
        self.pipe_buffers = {"inputs": [None] * n, "labels": [None] * n, "outputs": [None] * n,
                             "grads": [None] * n, "mb": [None] * n}
        self.data, self.forwards = iter(data), 0
        self.total_loss = torch.zeros((), device=self.device)
        for step_cmds in self.schedule.steps():
            for cmd in step_cmds:
                self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)
        for work, _ in self.pending_sends:  # the last sends must land before the next batch
            work.wait()
        self.pending_sends.clear()
        return self._aggregate_total_loss()

    def _aggregate_total_loss(self) -> float | None:
        """Mean loss over the micro-batches, and over the data-parallel replicas."""
        if not self.is_last_stage:
            return None
        loss = self.total_loss / self.micro_batches
        if self.dp_group is not None:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.dp_world_size
        return loss.item()

    # ---- the instruction executors ----------------------------------------------------------
    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        x, y = next(self.data)
        if self.is_first_stage:
            self.pipe_buffers["inputs"][buffer_id] = x.to(self.device)
        if self.is_last_stage:
            self.pipe_buffers["labels"][buffer_id] = y.to(self.device)

    def _exec_forward_pass(self, buffer_id: int) -> None:
        mb = self.forwards
        self.forwards += 1
        self.pipe_buffers["mb"][buffer_id] = mb
        # A clone, as in DeepSpeed: an in-place first layer (ReLU(inplace=True)) must not overwrite
        # the received buffer, whose .grad the backward fills.
        inputs = self.pipe_buffers["inputs"][buffer_id].clone()
        with self.ctx.rec.span("F", lane="compute", mb=mb, stage=self.stage_id):
            outputs = self.module(inputs)
            if self.is_last_stage:  # the last stage keeps the micro-batch loss as its output
                outputs = self.loss_fn(outputs, self.pipe_buffers["labels"][buffer_id])
                self.total_loss += outputs.detach()
        self.pipe_buffers["outputs"][buffer_id] = outputs

    def _exec_backward_pass(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        with self.ctx.rec.span("B", lane="compute", mb=self.pipe_buffers["mb"][buffer_id], stage=self.stage_id):
            if self.is_last_stage:
                # Each micro-batch loss counts 1/M, so the M backwards add up to the batch mean's.
                (outputs / self.micro_batches).backward()
            elif outputs.requires_grad:
                outputs.backward(self.pipe_buffers["grads"][buffer_id])
        self.pipe_buffers["outputs"][buffer_id] = self.pipe_buffers["grads"][buffer_id] = None

    def _exec_send_activations(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id].detach()
        if self.first_output_send:  # the receiver learns the shape once, then reuses it
            self._send_tensor_meta(outputs, self.next_rank)
            self.first_output_send = False
        self._send(outputs, self.next_rank, self.pipe_buffers["mb"][buffer_id])

    def _exec_recv_activations(self, buffer_id: int) -> None:
        if self.recv_meta is None:
            self.recv_meta = self._recv_tensor_meta(self.prev_rank)
        shape, dtype = self.recv_meta
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv(buffer, self.prev_rank, mb=self.forwards)  # it feeds the next forward
        # A leaf that wants its gradient: SendGrad sends buffer.grad back to the previous stage.
        self.pipe_buffers["inputs"][buffer_id] = buffer.requires_grad_(buffer.is_floating_point())

    def _exec_send_grads(self, buffer_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        grad = inputs.grad if inputs.grad is not None else torch.zeros_like(inputs)
        self._send(grad, self.prev_rank, self.pipe_buffers["mb"][buffer_id])
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id: int) -> None:
        grad = torch.empty_like(self.pipe_buffers["outputs"][buffer_id])
        self._recv(grad, self.next_rank, self.pipe_buffers["mb"][buffer_id])
        self.pipe_buffers["grads"][buffer_id] = grad

    def _exec_reduce_tied_grads(self) -> None:
        """Sum each tied weight's gradient over the stages that hold a copy of it."""
        if not self.tied_comms:
            return
        with self.ctx.rec.span("tied-allreduce", lane="comm"):
            for weight, group, _ in self.tied_comms:
                if weight.grad is not None:
                    dist.all_reduce(weight.grad, group=group)

    def _exec_reduce_grads(self) -> None:
        """Average every gradient over the data-parallel replicas of this stage (one flat message)."""
        if self.dp_group is None or self.optimizer is None:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        with self.ctx.rec.span("allreduce", lane="comm"):
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.dp_world_size
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def _exec_optimizer_step(self) -> None:
        if self.step_grads is None:  # keep the first step's gradients for the reference check
            self.step_grads = {n: p.grad.detach().cpu().clone()
                               for n, p in self.module.named_parameters() if p.grad is not None}
        if self.optimizer is None:
            return
        with self.ctx.rec.span("optimizer", lane="compute"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    # ---- point to point ---------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, dst: int, mb: int | None) -> None:
        tensor = tensor.contiguous()
        with self.ctx.rec.span("send", lane="comm", mb=mb, to=dst, bytes=tensor.nbytes):
            # isend never blocks; keep the tensor alive until the message has left.
            self.pending_sends.append((dist.isend(tensor, dst), tensor))

    def _recv(self, buffer: torch.Tensor, src: int, mb: int | None) -> None:
        with self.ctx.rec.span("recv", lane="comm", mb=mb, frm=src):
            dist.irecv(buffer, src).wait()

    def _send_tensor_meta(self, tensor: torch.Tensor, dst: int) -> None:
        """Tell the next stage the dtype and shape of what follows: [dtype index, ndim], then shape."""
        head = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim()], device=self.device)
        shape = torch.tensor(list(tensor.shape), device=self.device)
        self.pending_sends += [(dist.isend(head, dst), head), (dist.isend(shape, dst), shape)]

    def _recv_tensor_meta(self, src: int) -> tuple[list[int], torch.dtype]:
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.irecv(head, src).wait()
        shape = torch.empty(int(head[1]), dtype=torch.int64, device=self.device)
        dist.irecv(shape, src).wait()
        return shape.tolist(), _DTYPES[int(head[0])]

    # ---- groups and start-up ----------------------------------------------------------------
    def _tied_groups(self, module: PipelineModule, topology: ProcessTopology) -> list:
        """(weight, group, ranks) for each tied weight this rank shares with other stages."""
        mine = {key: [w for k, _, w in self.module.tied_weights() if k == key] for key in self.module.tied_modules}
        comms = []
        for key, stages in module.tied_stages().items():
            if len(stages) < 2:
                continue  # held by one stage only: nothing to sum
            for d in range(topology.get_dim("data")):  # one group per data-parallel replica
                ranks = [topology.get_rank(pipe=s, data=d) for s in stages]
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    comms += [(w, group, ranks) for w in mine[key]]
        return comms

    def _synchronize_tied_weights(self) -> None:
        """Every copy of a tied weight starts as the first stage's copy."""
        for weight, group, ranks in self.tied_comms:
            dist.broadcast(weight.data, src=min(ranks), group=group)

    def _broadcast_model(self) -> None:
        """Data-parallel replicas of a stage start from replica 0's weights."""
        if self.dp_group is None:
            return
        src = min(dist.get_process_group_ranks(self.dp_group))
        for p in self.module.parameters():
            dist.broadcast(p.data, src=src, group=self.dp_group)

    # Which executor runs which instruction (DeepSpeed keeps the same table).
    _INSTRUCTION_MAP = {
        LoadMicroBatch: _exec_load_micro_batch,
        ForwardPass: _exec_forward_pass,
        BackwardPass: _exec_backward_pass,
        SendActivation: _exec_send_activations,
        RecvActivation: _exec_recv_activations,
        SendGrad: _exec_send_grads,
        RecvGrad: _exec_recv_grads,
        ReduceTiedGrads: _exec_reduce_tied_grads,
        ReduceGrads: _exec_reduce_grads,
        OptimizerStep: _exec_optimizer_step,
    }




def engine_worker(ctx, module: PipelineModule, topology: ProcessTopology, inputs: torch.Tensor,
                  targets: torch.Tensor, micro_batches: int, steps: int, lr: float) -> dict:
    """Worker: build this rank's stage, train ``steps`` batches, return what the notebook checks."""
    engine = PipelineEngine(ctx, module, topology, micro_batches, lr)
    replica = topology.get_coord(ctx.rank).data
    x = inputs.chunk(topology.get_dim("data"))[replica]
    y = targets.chunk(topology.get_dim("data"))[replica]
    data = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
    losses, timelines = [], []
    for _ in range(steps):
        ctx.barrier()  # every rank starts the batch together, so the timeline shows the pipe
        ctx.rec.clear()
        losses.append(engine.train_batch(data))
        timelines.append(ctx.timeline())
    params = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return {"rank": ctx.rank, "stage": engine.stage_id, "losses": losses, "grads": engine.step_grads,
            "params": params, "timelines": timelines}


# ---------------------------------------------------------------------------------------------
# The notebook side
# ---------------------------------------------------------------------------------------------

@dataclass
class TrainRun:
    """A pipelined training run, gathered from every rank."""

    parts: list[int]
    topology: ProcessTopology
    losses: list[float]  # mean loss of each batch, before its optimizer step
    grads: dict[int, dict[str, torch.Tensor]]  # rank -> parameter name -> gradient of the first batch
    params: dict[int, dict[str, torch.Tensor]]  # rank -> parameter name -> weight after the last step
    timelines: list[Timeline] = field(repr=False)  # one per batch, all ranks merged

    @property
    def timeline(self) -> Timeline:
        """The last batch's timeline."""
        return self.timelines[-1]


def train(module: PipelineModule, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int,
          steps: int = 1, lr: float = 0.1, world_size: int | None = None, backend: str = "auto",
          timeout: float = 120.0) -> TrainRun:
    """Train ``steps`` batches (the same batch each time) with SGD on a pipe x data grid.

    ``world_size`` defaults to the module's topology, else to one rank per stage; a larger
    multiple of ``num_stages`` adds data-parallel replicas, each taking an equal share of the batch."""
    topology = _check_run(module, inputs, targets, micro_batches, steps, lr, world_size)
    per_rank = spawn(engine_worker, topology.world_size(), module, topology, inputs, targets,
                     micro_batches, steps, lr, backend=backend, timeout=timeout)
    last = topology.get_rank(pipe=topology.get_dim("pipe") - 1, data=0)
    return TrainRun(module.partitions(), topology, per_rank[last]["losses"],
                    {r["rank"]: r["grads"] for r in per_rank}, {r["rank"]: r["params"] for r in per_rank},
                    [Timeline.merge(tls) for tls in zip(*(r["timelines"] for r in per_rank))])


def _check_run(module, inputs, targets, micro_batches, steps, lr, world_size) -> ProcessTopology:
    """Refuse what cannot run, before any worker starts; return the process grid."""
    if not isinstance(module, PipelineModule):
        raise ValueError(f"train needs a PipelineModule, got {type(module).__name__}; "
                         "wrap the layers: PipelineModule(layers, num_stages=2, loss_fn=...)")
    if module.loss_fn is None:
        raise ValueError("the last stage needs a loss; build the module with loss_fn=, "
                         "e.g. PipelineModule(layers, num_stages=2, loss_fn=torch.nn.MSELoss())")
    for name, value in (("micro_batches", micro_batches), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be > 0, e.g. lr=0.1")
    S = module.num_stages
    topology = module._topo
    if world_size is None:
        world_size = topology.world_size() if topology is not None else S
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1 or world_size % S:
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
    if targets.shape[0] != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {targets.shape[0]}; "
                         "give one target per input")
    if batch % (dp * micro_batches):
        raise ValueError(f"a batch of {batch} does not split into {dp} data-parallel replica(s) x "
                         f"micro_batches={micro_batches}; use a batch that is a multiple of "
                         f"{dp * micro_batches}")
    return topology


@dataclass
class Reference:
    """The same training in one process: what every pipelined run must reproduce."""

    losses: list[float]
    grads: dict[str, torch.Tensor]  # of the first batch
    params: dict[str, torch.Tensor]  # after the last step


def reference_train(module: PipelineModule, inputs: torch.Tensor, targets: torch.Tensor,
                    steps: int = 1, lr: float = 0.1) -> Reference:
    """Train the whole layer list in this process: same weights, same batch, same SGD steps."""
    model = module.build_reference()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = module.loss_fn(model(inputs), targets)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Reference(losses, grads, params)


def assert_matches_reference(run: TrainRun, ref: Reference, atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """Assert the run's losses, every rank's gradients and final weights equal the reference's;
    return the largest difference seen."""
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), atol=atol, rtol=rtol)
    worst, seen = 0.0, set()
    for kind, per_rank, want in (("gradient", run.grads, ref.grads), ("weight", run.params, ref.params)):
        for rank, tensors in per_rank.items():
            for name, got in tensors.items():
                torch.testing.assert_close(got, want[name], atol=atol, rtol=rtol,
                                           msg=lambda m, r=rank, n=name, k=kind: f"rank {r} {k} {n}: {m}")
                worst = max(worst, (got - want[name]).abs().max().item())
                seen.add((kind, name))
        missing = {n for n in want if (kind, n) not in seen}
        if missing:
            raise AssertionError(f"no rank holds the {kind}s of {sorted(missing)}")
    return worst


# ---------------------------------------------------------------------------------------------
# The real DeepSpeed, beside ours
# ---------------------------------------------------------------------------------------------

def deepspeed_available() -> bool:
    """True when ``import deepspeed`` works here (``pip install -e ".[deepspeed]"``)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def to_deepspeed_layers(layers: list) -> list:
    """Our layer list with each LayerSpec / TiedLayerSpec rewritten as DeepSpeed's own."""
    from deepspeed.pipe import LayerSpec as DSLayerSpec, TiedLayerSpec as DSTiedLayerSpec

    from pipelab.pipeline.module import LayerSpec, TiedLayerSpec

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

    if not deepspeed_available():
        raise ValueError('deepspeed is not installed; pip install -e ".[deepspeed]" to compare with it')
    if any(m.lower() == "profile" for _, m in cuts):
        raise ValueError("DeepSpeed does not implement partition_method='profile'; compare another method")
    world_size = world_size or math.lcm(*(s for s, _ in cuts))
    return spawn(deepspeed_partition_worker, world_size, layers, cuts, timeout=timeout)[0]


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
    params = {n: p.detach().cpu().clone() for n, p in ds_module.named_parameters()}
    return {"rank": ctx.rank, "parts": [int(p) for p in ds_module.parts], "losses": losses, "params": params}


def train_deepspeed(module: PipelineModule, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int,
                    steps: int = 1, lr: float = 0.1, world_size: int | None = None, backend: str = "auto",
                    timeout: float = 300.0) -> dict:
    """What ``train`` does, done by DeepSpeed: returns its partition, losses and final weights
    (rank -> name -> tensor; the names are the ones our stages use)."""
    if not deepspeed_available():
        raise ValueError('deepspeed is not installed; pip install -e ".[deepspeed]" to compare with it')
    topology = _check_run(module, inputs, targets, micro_batches, steps, lr, world_size)
    if module.partition_method.lower() == "profile":
        raise ValueError("DeepSpeed does not implement partition_method='profile'; compare another method")
    per_rank = spawn(deepspeed_worker, topology.world_size(), module, inputs, targets, micro_batches, steps,
                     lr, backend=backend, timeout=timeout)
    last = topology.get_rank(pipe=topology.get_dim("pipe") - 1, data=0)
    return {"parts": per_rank[0]["parts"], "losses": per_rank[last]["losses"],
            "params": {r["rank"]: r["params"] for r in per_rank}}

"""DeepSpeed's pipeline engine, one rank of it: execute the TrainSchedule instruction stream.

A ``PipelineEngine`` builds only its stage's layers from the ``PipelineModule`` and walks the
instructions ``TrainSchedule`` yields for its stage, one method per instruction, named as in
DeepSpeed's ``deepspeed.runtime.pipe.engine.PipelineEngine`` (``_exec_forward_pass``,
``_exec_send_grads``, ...). Every instruction is recorded on the rank's timeline (a forward or a
backward as one span named by its kind, stage and micro-batch). Starting the
ranks and checking the training against one process is ``pipelab.experiments.deepspeed``'s job.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipelab.ddp.flat import average_gradients, write_back
from pipelab.models import trainable_parameters
from pipelab.pipeline.instructions import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep,
                                           RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads,
                                           SendActivation, SendGrad, TrainSchedule)
from pipelab.pipeline.module import PipelineModule
from pipelab.pipeline.topology import ProcessTopology, axis_groups
from pipelab.worker import RankContext

# The dtypes an activation may have; its index travels in the tensor meta message.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


class PipelineEngine:
    """One rank of the pipe x data grid: its stage's layers, its groups, and the instruction executors.

    The loss is a mean over its samples (``experiments.deepspeed.Config`` refuses any other), so, as
    in DeepSpeed, each micro-batch's loss counts 1/``micro_batches`` and each replica's gradient
    1/``dp_world_size``: together, the batch's mean."""

    def __init__(self, ctx: RankContext, module: PipelineModule, topology: ProcessTopology, micro_batches: int,
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
        params = [p for _, p in trainable_parameters(self.module)]
        self.optimizer = torch.optim.SGD(params, lr=lr) if params else None

        self.schedule = TrainSchedule(micro_batches, self.num_stages, self.stage_id)
        self.recv_meta = None  # shape and dtype of the activations this stage receives
        self.sent_meta = None  # ... and of those it sends
        self.step_grads: dict[str, torch.Tensor] | None = None  # gradients of the first step
        # Each micro-batch's loss on the last stage (kept as tensors during a batch: reading one
        # would wait for the device; made floats at its end).
        self.micro_batch_losses: list = []
        self.pending_sends: list = []

    # ---- a batch ----------------------------------------------------------------------------
    def train_batch(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Run one batch (``micro_batches`` pairs of inputs and labels) through the schedule and
        take the optimizer step. Returns the batch's mean loss on the last stage, else None; each
        micro-batch's loss is then in ``micro_batch_losses``."""
        n = self.schedule.num_pipe_buffers()
        self.pipe_buffers = {"inputs": [None] * n, "labels": [None] * n, "outputs": [None] * n,
                             "grads": [None] * n, "mb": [None] * n}
        self.data, self.forwards = iter(data), 0
        self.total_loss = torch.zeros((), device=self.device)
        self.micro_batch_losses = []
        for step_cmds in self.schedule.steps():
            for cmd in step_cmds:
                self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)
        for work, _ in self.pending_sends:  # the last sends must land before the next batch
            work.wait()
        self.pending_sends.clear()
        return self._aggregate_total_loss()

    def _aggregate_total_loss(self) -> float | None:
        """The batch's loss: the mean over the micro-batches and the data-parallel replicas."""
        if not self.is_last_stage:
            return None
        self.micro_batch_losses = [float(loss) for loss in self.micro_batch_losses]
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
                self.micro_batch_losses.append(outputs.detach())
        self.pipe_buffers["outputs"][buffer_id] = outputs

    def _exec_backward_pass(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        with self.ctx.rec.span("B", lane="compute", mb=self.pipe_buffers["mb"][buffer_id], stage=self.stage_id):
            if self.is_last_stage:
                # Each micro-batch loss counts 1/M (a mean loss), so the M backwards add up to the batch's.
                (outputs / self.micro_batches).backward()
            elif outputs.requires_grad:
                outputs.backward(self.pipe_buffers["grads"][buffer_id])
        self.pipe_buffers["outputs"][buffer_id] = self.pipe_buffers["grads"][buffer_id] = None

    def _exec_send_activations(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id].detach()
        mb = self.pipe_buffers["mb"][buffer_id]
        if self.sent_meta is None:  # the receiver learns the shape once, then reuses it
            self._send_tensor_meta(outputs, self.next_rank)
            self.sent_meta = (outputs.shape, outputs.dtype)
        elif (outputs.shape, outputs.dtype) != self.sent_meta:
            raise ValueError(f"stage {self.stage_id} output {list(outputs.shape)} {outputs.dtype} on micro-batch "
                             f"{mb}, but {list(self.sent_meta[0])} {self.sent_meta[1]} on the first: like "
                             "DeepSpeed's, this engine tells the next stage the shape once; give every "
                             "micro-batch the same shape (e.g. pad sequences to one length)")
        self._send(outputs, self.next_rank, mb)

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
        """Average every gradient over the data-parallel replicas of this stage: one flat message
        (`pipelab.ddp.flat`, as BucketedDDP's buckets), waited for at once, as DeepSpeed does."""
        if self.dp_group is None or self.optimizer is None:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        write_back(average_gradients(params, self.dp_group, rec=self.ctx.rec).wait(), params)

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

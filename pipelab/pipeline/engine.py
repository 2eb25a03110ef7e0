"""Execute DeepSpeed's TrainSchedule instruction stream on real ranks, one pipeline stage per rank."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from pipelab.launch import spawn
from pipelab.pipeline.instructions import (BackwardPass, ForwardPass, LoadMicroBatch, RecvActivation,
                                           RecvGrad, SendActivation, SendGrad, TrainSchedule)
from pipelab.pipeline.partition import partition_layers


def train_step(model: nn.Sequential, inputs: torch.Tensor, targets: torch.Tensor, num_stages: int,
               micro_batches: int, partition_method: str = "parameters", loss_fn=nn.functional.mse_loss):
    """One pipelined training step on ``num_stages`` ranks; returns each rank's (loss, grads, timeline)."""
    if inputs.shape[0] % micro_batches:
        raise ValueError(f"batch of {inputs.shape[0]} does not split into micro_batches={micro_batches}")
    if num_stages > len(model):
        raise ValueError(f"num_stages={num_stages} exceeds the {len(model)} layers; use fewer stages")
    parts = partition_layers(list(model), num_stages, partition_method)
    return spawn(_stage_worker, num_stages, model, parts, inputs, targets, micro_batches, loss_fn)


def _stage_worker(ctx, model, parts, inputs, targets, micro_batches, loss_fn):
    stage_id, S = ctx.rank, ctx.world_size
    stage = nn.Sequential(*list(model)[parts[stage_id]:parts[stage_id + 1]])
    stage.zero_grad(set_to_none=True)  # gradients come only from this step's micro-batches
    xs, ys = inputs.chunk(micro_batches), targets.chunk(micro_batches)
    # Every micro-batch has the same shapes, so the reference forward tells each stage what to receive.
    with torch.no_grad():
        act = xs[0]
        for layer in list(model)[:parts[stage_id]]:
            act = layer(act)
    in_shape = act.shape
    buf_in, buf_out, buf_loss, pending = {}, {}, {}, []
    loads = total_loss = 0
    for cmds in TrainSchedule(micro_batches, S, stage_id).steps():
        for cmd in cmds:
            b = cmd.buffer_id
            if isinstance(cmd, LoadMicroBatch):
                buf_in[b] = xs[loads].clone() if stage_id == 0 else buf_in.get(b)
                buf_loss[b] = ys[loads]  # labels, used on the last stage
                loads += 1
            elif isinstance(cmd, RecvActivation):
                t = torch.empty(in_shape)
                dist.recv(t, src=stage_id - 1)
                buf_in[b] = t.requires_grad_()
            elif isinstance(cmd, ForwardPass):
                with ctx.rec.span("F", lane="compute"):
                    buf_out[b] = stage(buf_in[b])
                    if stage_id == S - 1:
                        buf_out[b] = loss_fn(buf_out[b], buf_loss[b]) / micro_batches
                        total_loss += buf_out[b].item()
            elif isinstance(cmd, SendActivation):
                t = buf_out[b].detach().contiguous()
                pending.append((dist.isend(t, dst=stage_id + 1), t))
            elif isinstance(cmd, RecvGrad):
                g = torch.empty_like(buf_out[b])
                dist.recv(g, src=stage_id + 1)
                buf_loss[b] = g
            elif isinstance(cmd, BackwardPass):
                with ctx.rec.span("B", lane="compute"):
                    if stage_id == S - 1:
                        buf_out[b].backward()
                    else:
                        buf_out[b].backward(buf_loss[b])
            elif isinstance(cmd, SendGrad):
                t = buf_in[b].grad.contiguous()
                pending.append((dist.isend(t, dst=stage_id - 1), t))
    for work, _ in pending:
        work.wait()
    grads = [p.grad.clone() for p in stage.parameters()]
    return total_loss, grads, ctx.timeline()

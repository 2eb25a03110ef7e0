"""Four silent bugs from the trackers, each in miniature: a distributed step with the bug, and
`fixed=True` with its fix. Every step has the signature `compare_with_one_process` runs,
`step(ctx, model, loss_fn, x, y) -> this rank's share of the loss`, gets the whole batch and a
copy of the model, and takes its own share. With the bug, every loss looks right; the gradients
do not.

* `zero_bubble_w_pass` -- pytorch#144530: zero bubble's W pass computes weight gradients with
  `torch.autograd.grad`, which never accumulates into `.grad`, so DDP's hooks never all-reduce them.
* `shard_group_of_one` -- verl#7493: with a shard group of 1, FSDP clamps hybrid sharding to
  "no shard" but still reduces over the shard group, so data-parallel replicas never sync.
* `expert_gradients` -- pytorch#160285: expert gradients exactly 2x with two expert-parallel
  ranks. An expert's gradient already sums every rank's tokens; averaging it needs a division
  (megablocks PR #20 scales expert gradients by 1/world_size).
* `pipeline_accumulation` -- NeMo PR #3530: a pipeline stage that discards the gradients it
  accumulated over micro-batches; the loss is computed over every micro-batch and looks fine.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def my_rows(ctx, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the batch (data parallel): its contiguous chunk of rows."""
    return x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]


def average_gradients(params, group=None) -> None:
    """Data parallel's sync: every gradient becomes the mean over the group's ranks."""
    size = dist.get_world_size(group)
    for p in params:
        dist.all_reduce(p.grad, group=group)
        p.grad /= size


def zero_bubble_w_pass(ctx, model: nn.Module, loss_fn, x, y, fixed: bool = False) -> float:
    """The last stage of a zero-bubble pipeline under torch DDP: I, then W, as separate passes."""
    ddp = nn.parallel.DistributedDataParallel(model)
    xs, ys = my_rows(ctx, x, y)
    xs = xs.clone().requires_grad_()  # the activation the previous stage sent
    loss = loss_fn(ddp, xs, ys)
    # I: the input's gradient, which the previous stage waits for; keep the graph for W
    torch.autograd.grad(loss, [xs], retain_graph=True)
    weights = list(model.parameters())
    if fixed:
        # W as a backward restricted to the weights: it accumulates into .grad, so DDP's hooks fire
        loss.backward(inputs=weights)
    else:
        # W by autograd.grad: nothing is accumulated, so DDP's all-reduce hooks never run
        for w, g in zip(weights, torch.autograd.grad(loss, weights)):
            w.grad = g
    return loss.item()


def mesh_groups(ctx, shard_size: int) -> tuple:
    """A (replicate, shard) mesh: consecutive ranks form a shard group; the ranks at the same place
    of every shard group form a replicate group. Every rank creates every group, as torch asks."""
    n = ctx.world_size
    shard = [dist.new_group(list(range(s, s + shard_size))) for s in range(0, n, shard_size)]
    replicate = [dist.new_group(list(range(i, n, shard_size))) for i in range(shard_size)]
    return shard[ctx.rank // shard_size], replicate[ctx.rank % shard_size]


def shard_group_of_one(ctx, model: nn.Module, loss_fn, x, y, fixed: bool = False, shard_size: int = 1) -> float:
    """Hybrid sharding's gradient sync (FSDP's HYBRID_SHARD), the shards kept whole for brevity."""
    shard_group, replicate_group = mesh_groups(ctx, shard_size)
    xs, ys = my_rows(ctx, x, y)
    loss = loss_fn(model, xs, ys)
    loss.backward()
    params = list(model.parameters())
    if shard_size == 1:
        # Nothing to shard: hybrid sharding becomes "no shard", plain data parallel, whose
        # gradients must be averaged over every replica...
        average_gradients(params, group=None if fixed else shard_group)  # the bug: the shard group of 1
    else:
        average_gradients(params, group=shard_group)  # within the shard group (FSDP's reduce-scatter)
        average_gradients(params, group=replicate_group)  # then across the replicas
    return loss.item()


class TinyMoE(nn.Module):
    """A dense layer, then one expert layer per expert-parallel rank; a fixed router sends rows in
    blocks of `block`: block i goes to expert i mod (number of experts)."""

    def __init__(self, width: int = 8, experts: int = 2, block: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(width, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model in one process: every block of rows through its expert."""
        h = torch.tanh(self.dense(x))
        blocks = h.split(self.block)
        return torch.cat([self.experts[i % len(self.experts)](b) for i, b in enumerate(blocks)])


def expert_gradients(ctx, model: TinyMoE, loss_fn, x, y, fixed: bool = False) -> float:
    """Expert parallel: rank r holds expert r; an all-to-all sends each expert its rows, another
    brings the outputs back; the dense layer is data parallel."""
    from torch.distributed.nn.functional import all_to_all_single

    xs, ys = my_rows(ctx, x, y)
    h = torch.tanh(model.dense(xs))
    with warnings.catch_warnings():  # torch calls this autograd all-to-all deprecated; its successor is private
        warnings.simplefilter("ignore", FutureWarning)
        mine = all_to_all_single(torch.empty_like(h), h)  # block q of every rank's rows goes to rank q
        out = all_to_all_single(torch.empty_like(mine), model.experts[ctx.rank](mine))
    loss = F.mse_loss(out, ys)  # this rank's mean; the batch's loss is the mean over ranks
    loss.backward()
    average_gradients(model.dense.parameters())
    # The expert's gradient already sums the gradients of every rank's loss (its rows came from all
    # of them): the sum of world_size means, world_size times the gradient of the batch's mean.
    if fixed:
        for p in model.experts[ctx.rank].parameters():
            p.grad /= ctx.world_size
    return loss.item()


def two_stage_gpipe(ctx, stage: nn.Module, x, y, rows: int, microbatches: int, width: int,
                    zero_each_microbatch: bool = False) -> float | None:
    """Two pipeline stages (rank 0 the first, rank 1 the last), GPipe: every micro-batch's forward
    (`rows` rows each; rank 1 receives `width` features), then every backward, each stage
    accumulating its gradients. Returns the loss on rank 1, None on rank 0."""
    peer = 1 - ctx.rank
    outputs, inputs, losses = [], [], []
    for i in range(microbatches):
        xm, ym = x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]
        if ctx.rank == 0:
            out = stage(xm)
            dist.send(out.detach(), peer)
        else:
            a = torch.empty(rows, width)
            dist.recv(a, peer)
            a.requires_grad_()
            out = F.mse_loss(stage(a), ym) / microbatches
            losses.append(float(out.detach()))
            inputs.append(a)
        outputs.append(out)
    stage.zero_grad()
    for i, out in enumerate(outputs):
        if zero_each_microbatch:
            stage.zero_grad()  # the bug: each micro-batch's backward starts from zero again
        if ctx.rank == 0:
            g = torch.empty_like(out)
            dist.recv(g, peer)
            out.backward(g)
        else:
            out.backward()
            dist.send(inputs[i].grad, peer)
    return sum(losses) if ctx.rank == 1 else None


def pipeline_accumulation(ctx, model: nn.Sequential, loss_fn, x, y, fixed: bool = False,
                          num_microbatches: int = 4) -> float | None:
    """Two pipeline stages of `model` (the first half of its layers on rank 0, the rest on rank 1);
    the bug zeroes the gradients before each micro-batch's backward."""
    cut = len(model) // 2
    stage = model[:cut] if ctx.rank == 0 else model[cut:]
    return two_stage_gpipe(ctx, stage, x, y, len(x) // num_microbatches, num_microbatches, model[cut].in_features,
                           zero_each_microbatch=not fixed)

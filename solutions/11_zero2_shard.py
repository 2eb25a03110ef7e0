"""Lesson 11: ZeRO-2 keeps only its shard of the averaged gradient. One reduce-scatter sums the
ranks' flat gradients and leaves chunk `rank` of the sum here; dividing by the world size makes it
the average, as DDP's all-reduce does."""

import torch
import torch.distributed as dist


def my_gradient_shard(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    dist.reduce_scatter_single(shard, flat_grad.div(world_size))
    return shard

"""Lesson 17: find the bug. `broken_step` zeroed the gradients at every micro-batch, so only the
last micro-batch's gradient reached the all-reduce while the loss (summed over every micro-batch)
looked right. Zero once, before the micro-batches; the rest was right."""

import torch.distributed as dist


def my_step(ctx, model, loss_fn, x, y, num_microbatches=4):
    xs, ys = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
    model.zero_grad()
    total = 0.0
    for xm, ym in zip(xs.chunk(num_microbatches), ys.chunk(num_microbatches)):
        loss = loss_fn(model, xm, ym) / num_microbatches
        loss.backward()
        total += loss.item()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= ctx.world_size
    return total

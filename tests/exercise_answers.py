"""Answers a student could write to each exercise: wrong ones (each with words its grade must
contain, naming the mistake) and right ones written differently from solutions/. Used by
tests/test_exercises.py and benchmarks/exercise_sweep.py."""

from __future__ import annotations

import itertools
import math
import sys

import cloudpickle
import torch
import torch.distributed as dist

from pipelab.model_parallel import cut_shape, second_half
from pipelab.pipeline.actions import B, F
from pipelab.pipeline.schedules import Schedule1F1B
from pipelab.streams import Event

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need these functions by value

# ---- 00: broadcast ------------------------------------------------------------------------------


def broadcast_with_collective(ctx, tensor, src):
    dist.broadcast(tensor, src=src)


def broadcast_isend_never_waited(ctx, tensor, src):
    if ctx.rank == src:
        for peer in range(ctx.world_size):
            if peer != src:
                dist.isend(tensor, dst=peer)
    else:
        dist.recv(tensor, src=src)


def broadcast_into_new_tensor(ctx, tensor, src):
    if ctx.rank == src:
        for peer in range(ctx.world_size):
            if peer != src:
                dist.send(tensor, dst=peer)
        return tensor
    out = torch.empty_like(tensor)
    dist.recv(out, src=src)
    return out


def broadcast_from_rank0(ctx, tensor, src):  # assumes src is rank 0
    if ctx.rank == 0:
        for peer in range(1, ctx.world_size):
            dist.send(tensor, dst=peer)
    else:
        dist.recv(tensor, src=0)


def broadcast_irecv_read_before_wait(ctx, tensor, src):
    if ctx.rank == src:
        for peer in range(ctx.world_size):
            if peer != src:
                dist.send(tensor, dst=peer)
    else:
        buf = torch.zeros_like(tensor)
        req = dist.irecv(buf, src=src)
        tensor.copy_(buf)  # read before the wait: the values may not have arrived
        req.wait()


def broadcast_ring(ctx, tensor, src):  # right: each rank passes it on to the next
    n, me = ctx.world_size, (ctx.rank - src) % ctx.world_size
    if me > 0:
        dist.recv(tensor, src=(ctx.rank - 1) % n)
    if me < n - 1:
        req = dist.isend(tensor, dst=(ctx.rank + 1) % n)
        req.wait()


# ---- 01: DDP's average --------------------------------------------------------------------------


def average_on_temporary(params, world_size):
    for p in params:
        dist.all_reduce(p.grad / world_size)


def average_async_never_waited(params, world_size):
    for p in params:
        p.grad /= world_size
        dist.all_reduce(p.grad, async_op=True)


def average_flat_offset_stuck(params, world_size):
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat)
    flat /= world_size
    for p in params:
        p.grad.copy_(flat[:p.numel()].view_as(p.grad))  # the offset never advances


def average_divided_twice(params, world_size):
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= world_size * world_size


def average_max_op(params, world_size):
    for p in params:
        dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)


def average_first_param_only(params, world_size):
    dist.all_reduce(params[0].grad)
    params[0].grad /= world_size


def average_flat_right(params, world_size):  # right: one flat buffer, offsets advancing, async and waited
    flat = torch.cat([p.grad.flatten() for p in params]).div_(world_size)
    dist.all_reduce(flat, async_op=True).wait()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


# ---- 02: the naive forward ----------------------------------------------------------------------


def forward_on_one_device(model, x, devs):
    return devs[0].stream("compute").submit(model, devs[0].own(x)).result()


def forward_without_fc(model, x, devs):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    h = s0.submit(model.seq1, devs[0].own(x), kind="F", mb=0)
    return s1.submit(model.seq2, s1.copy(h, mb=0), kind="F", mb=0).result()


def forward_all_on_device1(model, x, devs):
    s1 = devs[1].stream("compute")
    h = s1.copy(devs[0].own(x), mb=0)
    return s1.submit(model, h, kind="F", mb=0).result()


def forward_no_copy(model, x, devs):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    h = s0.submit(model.seq1, devs[0].own(x), kind="F", mb=0)
    return s1.submit(second_half, model, h, kind="F", mb=0).result()


def forward_on_the_host(model, x, devs):
    return model(x)


def forward_naive_blocking(model, x, devs):  # right: waits for each result on the host
    h = devs[0].stream("compute").submit(model.seq1, devs[0].own(x), kind="F", mb=0).result()
    s1 = devs[1].stream("compute")
    landed = s1.copy(h, mb=0).result()
    return s1.submit(second_half, model, landed, kind="F", mb=0).result()


# ---- 03: pipelining over splits -----------------------------------------------------------------


def pipelined_drops_remainder(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i in range(len(x) // split_size):
        h = s0.submit(model.seq1, devs[0].own(x[i * split_size:(i + 1) * split_size]), kind="F", mb=i)
        outs.append(s1.submit(second_half, model, s1.copy(h, mb=i), kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


def pipelined_each_waited(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        outs.append(s1.submit(second_half, model, s1.copy(h, mb=i), kind="F", mb=i).result())
    return torch.cat(outs)


def pipelined_reversed(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        outs.append(s1.submit(second_half, model, s1.copy(h, mb=i), kind="F", mb=i))
    return torch.cat([o.result() for o in reversed(outs)])


def pipelined_one_mb(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for xs in x.split(split_size):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=0)
        outs.append(s1.submit(second_half, model, s1.copy(h, mb=0), kind="F", mb=0))
    return torch.cat([o.result() for o in outs])


def pipelined_chunks_not_splits(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i, xs in enumerate(x.chunk(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        outs.append(s1.submit(second_half, model, s1.copy(h, mb=i), kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


def pipelined_no_copy(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        outs.append(s1.submit(second_half, model, h.result(), kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


def pipelined_two_loops(model, x, devs, split_size):  # right: all of device 0 first, then device 1
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    firsts = [s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i) for i, xs in enumerate(x.split(split_size))]
    outs = [s1.submit(second_half, model, s1.copy(h, mb=i), kind="F", mb=i) for i, h in enumerate(firsts)]
    return torch.cat([o.result() for o in outs])


# ---- 04: the event ------------------------------------------------------------------------------


def _dual(model, x, devs, split_size, order):
    s0, s1, copy_stream = devs[0].stream("compute"), devs[1].stream("compute"), devs[1].stream("copy")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        buf = copy_stream.empty(cut_shape(model, xs), xs.dtype, fill=float("nan"))
        order(s0, s1, copy_stream, h, buf, i)
        outs.append(s1.submit(second_half, model, buf, kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


def dual_stream_without_event(model, x, devs, split_size):
    return _dual(model, x, devs, split_size, lambda s0, s1, cs, h, buf, i: cs.copy(h, out=buf, mb=i))


def dual_stream_event_before_copy(model, x, devs, split_size):
    def order(s0, s1, cs, h, buf, i):
        landed = Event()
        landed.record(cs)
        cs.copy(h, out=buf, mb=i)
        s1.wait(landed)
    return _dual(model, x, devs, split_size, order)


def dual_stream_waits_on_copy_stream(model, x, devs, split_size):
    def order(s0, s1, cs, h, buf, i):
        cs.copy(h, out=buf, mb=i)
        landed = Event()
        landed.record(cs)
        cs.wait(landed)  # the copy stream waits for itself; compute is not ordered
    return _dual(model, x, devs, split_size, order)


def dual_stream_event_after_seq1(model, x, devs, split_size):
    def order(s0, s1, cs, h, buf, i):
        cs.copy(h, out=buf, mb=i)
        done = Event()
        done.record(s0)  # after seq1 on device 0, not after the copy
        s1.wait(done)
    return _dual(model, x, devs, split_size, order)


def dual_stream_synchronize(model, x, devs, split_size):  # right: the host waits for each copy
    def order(s0, s1, cs, h, buf, i):
        cs.copy(h, out=buf, mb=i)
        cs.synchronize()
    return _dual(model, x, devs, split_size, order)


# ---- 05: the grid's groups ----------------------------------------------------------------------


def groups_pipe_fastest(pipe, data):
    return {"pipe": [[s + r * pipe for s in range(pipe)] for r in range(data)],
            "data": [[s + r * pipe for r in range(data)] for s in range(pipe)]}


def groups_out_of_stage_order(pipe, data):
    return {"pipe": [[s * data + r for s in reversed(range(pipe))] for r in range(data)],
            "data": [[s * data + r for r in range(data)] for s in range(pipe)]}


def groups_swapped(pipe, data):
    return {"data": [[s * data + r for s in range(pipe)] for r in range(data)],
            "pipe": [[s * data + r for r in range(data)] for s in range(pipe)]}


def groups_first_pipeline_only(pipe, data):
    return {"pipe": [[s * data for s in range(pipe)]],
            "data": [[s * data + r for r in range(data)] for s in range(pipe)]}


def groups_by_division(pipe, data):  # right: from each rank's coordinates
    ranks = range(pipe * data)
    return {"pipe": [[r for r in ranks if r % data == replica] for replica in range(data)],
            "data": [[r for r in ranks if r // data == stage] for stage in range(pipe)]}


# ---- 06: gradient accumulation ------------------------------------------------------------------


def backward_divided_on_every_stage(output, grad_output, num_microbatches):
    (output / num_microbatches).backward(grad_output)


def backward_multiplied(output, grad_output, num_microbatches):
    if grad_output is None:
        (output * num_microbatches).backward()
    else:
        output.backward(grad_output)


def backward_autograd_grad(output, grad_output, num_microbatches):
    if grad_output is None:
        torch.autograd.grad(output / num_microbatches, [output])
    else:
        torch.autograd.grad(output, [output], grad_output)


def backward_ignores_grad_output(output, grad_output, num_microbatches):
    if grad_output is None:
        (output / num_microbatches).backward()
    else:
        (output.sum() / num_microbatches).backward()


def backward_divides_received_gradient(output, grad_output, num_microbatches):
    if grad_output is None:
        output.backward()
    else:
        output.backward(grad_output / num_microbatches)


def backward_never_divided(output, grad_output, num_microbatches):
    output.backward(grad_output)


def backward_with_ones(output, grad_output, num_microbatches):  # right: the 1/m as the seed gradient
    seed = torch.full_like(output, 1 / num_microbatches) if grad_output is None else grad_output
    torch.autograd.backward([output], [seed])


# ---- 07: the 1F1B refusal -----------------------------------------------------------------------


def one_f_one_b_accepting_anything(rank, num_ranks, num_microbatches):
    return Schedule1F1B(num_ranks, num_microbatches).rank_actions(rank)


def one_f_one_b_refused_on_rank0_only(rank, num_ranks, num_microbatches):
    if rank == 0 and num_microbatches < num_ranks:
        raise ValueError(f"{num_microbatches} micro-batches < {num_ranks} stages")
    return Schedule1F1B(num_ranks, num_microbatches).rank_actions(rank) if num_microbatches >= num_ranks else []


def one_f_one_b_off_by_one(rank, num_ranks, num_microbatches):
    if num_microbatches <= num_ranks:
        raise ValueError(f"{num_microbatches} micro-batches <= {num_ranks} stages")
    return Schedule1F1B(num_ranks, num_microbatches).rank_actions(rank)


def one_f_one_b_gpipe_order(rank, num_ranks, num_microbatches):
    if num_microbatches < num_ranks:
        raise ValueError(f"need {num_ranks} micro-batches, got {num_microbatches}")
    return [F(rank, mb) for mb in range(num_microbatches)] + [B(rank, mb) for mb in range(num_microbatches)]


def one_f_one_b_assert(rank, num_ranks, num_microbatches):
    assert num_microbatches >= num_ranks, f"{num_microbatches} < {num_ranks}"
    return Schedule1F1B(num_ranks, num_microbatches).rank_actions(rank)


def one_f_one_b_from_queue(rank, num_ranks, num_microbatches):  # right: written as a queue of pending forwards
    if num_microbatches < num_ranks:
        raise ValueError(f"1F1B cannot fill {num_ranks} stages with {num_microbatches} micro-batches")
    forwards, backwards, actions = list(range(num_microbatches)), list(range(num_microbatches)), []
    for _ in range(num_ranks - rank):
        actions.append(F(rank, forwards.pop(0)))
    while backwards:
        actions.append(B(rank, backwards.pop(0)))
        if forwards:
            actions.append(F(rank, forwards.pop(0)))
    return actions


# ---- 07: the order of sends and receives --------------------------------------------------------


def loop_gpipe_order_deadlocks(rank, num_microbatches, stage, send, recv):
    if rank == 0:
        for mb in range(num_microbatches):
            send("activation", mb, stage.forward(mb))
        for mb in range(num_microbatches):
            stage.backward(mb, recv("gradient", mb))
    else:
        for mb in range(num_microbatches):
            stage.forward(mb, recv("activation", mb))
            send("gradient", mb, stage.backward(mb))


def loop_gradients_received_reversed(rank, num_microbatches, stage, send, recv):
    if rank == 0:  # backward in reverse micro-batch order, as some GPipe loops do
        for mb in range(num_microbatches):
            send("activation", mb, stage.forward(mb))
            last = num_microbatches - 1 - mb
            stage.backward(mb, recv("gradient", last))
    else:
        for mb in range(num_microbatches):
            stage.forward(mb, recv("activation", mb))
            send("gradient", mb, stage.backward(mb))


def loop_last_gradient_never_received(rank, num_microbatches, stage, send, recv):
    if rank == 0:
        for mb in range(num_microbatches):
            send("activation", mb, stage.forward(mb))
            if mb < num_microbatches - 1:
                stage.backward(mb, recv("gradient", mb))
    else:
        for mb in range(num_microbatches):
            stage.forward(mb, recv("activation", mb))
            send("gradient", mb, stage.backward(mb))


def loop_backward_before_forward(rank, num_microbatches, stage, send, recv):
    if rank == 0:
        for mb in range(num_microbatches):
            send("activation", mb, stage.forward(mb))
            stage.backward(mb, recv("gradient", mb))
    else:
        for mb in range(num_microbatches):
            send("gradient", mb, stage.backward(mb))
            stage.forward(mb, recv("activation", mb))


def loop_receives_before_sending(rank, num_microbatches, stage, send, recv):
    if rank == 0:
        for mb in range(num_microbatches):
            h = stage.forward(mb)
            g = recv("gradient", mb)
            send("activation", mb, h)
            stage.backward(mb, g)
    else:
        for mb in range(num_microbatches):
            stage.forward(mb, recv("activation", mb))
            send("gradient", mb, stage.backward(mb))


def loop_both_sides_reordered(rank, num_microbatches, stage, send, recv):
    if rank == 0:
        send("activation", 0, stage.forward(0))
        for mb in range(num_microbatches):
            h = stage.forward(mb + 1) if mb + 1 < num_microbatches else None
            stage.backward(mb, recv("gradient", mb))
            if h is not None:
                send("activation", mb + 1, h)
    else:  # rank 1 "reordered" too: every activation first, then the gradients
        for mb in range(num_microbatches):
            stage.forward(mb, recv("activation", mb))
        for mb in range(num_microbatches):
            send("gradient", mb, stage.backward(mb))


def loop_one_at_a_time(rank, num_microbatches, stage, send, recv):  # right: no overlap, no deadlock
    for mb in range(num_microbatches):
        if rank == 0:
            send("activation", mb, stage.forward(mb))
            stage.backward(mb, recv("gradient", mb))
        else:
            stage.forward(mb, recv("activation", mb))
            send("gradient", mb, stage.backward(mb))


# ---- 08: partition ------------------------------------------------------------------------------


def partition_by_layer_count(weights, num_stages):
    k = len(weights) // num_stages
    return [i * k for i in range(num_stages)] + [len(weights)]


def partition_lightest_heaviest(weights, num_stages):  # the smallest heaviest stage: another rule
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), num_stages - 1):
        bounds = [0, *cuts, len(weights)]
        heaviest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or heaviest < best[0]:
            best = (heaviest, bounds)
    return best[1]


def partition_empty_stage(weights, num_stages):
    return [0] * (num_stages - 1) + [0, len(weights)]


def partition_sorted_in_place(weights, num_stages):
    weights.sort()
    return partition_brute_force(weights, num_stages)


def partition_greedy_average(weights, num_stages):
    target, bounds, total = sum(weights) / num_stages, [0], 0
    for i, w in enumerate(weights):
        if total >= target and len(bounds) < num_stages:
            bounds.append(i)
            total = 0
        total += w
    while len(bounds) < num_stages:
        bounds.append(len(weights) - num_stages + len(bounds))
    return bounds + [len(weights)]


def partition_stage_sizes(weights, num_stages):  # the sizes of the best stages, not their boundaries
    best = min(itertools.combinations(range(1, len(weights)), num_stages - 1),
               key=lambda cut: _spread(weights, [0, *cut, len(weights)]))
    bounds = [0, *best, len(weights)]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _spread(weights, bounds):
    sums = [sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return max(sums) - min(sums)


def partition_brute_force(weights, num_stages):  # right: try every cut
    def spread(bounds):
        sums = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
        return max(sums) - min(sums)
    return min(([0, *c, len(weights)] for c in itertools.combinations(range(1, len(weights)), num_stages - 1)),
               key=spread)


def partition_lesson_rule(weights, num_stages):  # right: the lesson's own function
    from pipelab.pipeline.partition import partition_balanced
    return partition_balanced(weights, num_stages)


# ---- 08: tied weights ---------------------------------------------------------------------------


def tied_grads_averaged(weight, group):
    dist.all_reduce(weight.grad, op=dist.ReduceOp.AVG, group=group)


def tied_grads_world_group(weight, group):
    dist.all_reduce(weight.grad)


def tied_grads_on_temporary(weight, group):
    dist.all_reduce(weight.grad.clone(), group=group)


def tied_grads_broadcast(weight, group):
    dist.broadcast(weight.grad, src=0, group=group)


def tied_grads_async_never_waited(weight, group):
    dist.all_reduce(weight.grad, group=group, async_op=True)


def tied_grads_gathered(weight, group):  # right: gather both parts, add them
    parts = [torch.empty_like(weight.grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, weight.grad, group=group)
    weight.grad = torch.stack(parts).sum(0)


# ---- 09: split point ----------------------------------------------------------------------------


def split_in_the_middle(model):
    return "blocks.1"


def split_before_head(model):
    return "head"


def split_before_embed(model):
    return "embed"


def split_one_late(model):
    return "blocks.2"


def split_container(model):
    return "blocks"


def split_returns_module(model):
    return model.head


def split_by_trying(model):  # right: try every cut, count each side's parameters
    names = [n for n, m in model.named_modules() if n and not list(m.children())]
    sizes = [sum(p.numel() for p in dict(model.named_modules())[n].parameters()) for n in names]
    return min(names[1:], key=lambda n: max(sum(sizes[:names.index(n)]), sum(sizes[names.index(n):])))


# ---- 10: perplexity -----------------------------------------------------------------------------


def perplexity_mean_of_means(mb_losses, mb_tokens):
    return math.exp(sum(mb_losses) / len(mb_losses))


def perplexity_no_exp(mb_losses, mb_tokens):
    return sum(l * n for l, n in zip(mb_losses, mb_tokens)) / sum(mb_tokens)


def perplexity_divided_twice(mb_losses, mb_tokens):
    return math.exp(sum(mb_losses) / sum(mb_tokens))


def perplexity_pops_input(mb_losses, mb_tokens):
    total = 0.0
    while mb_losses:
        total += mb_losses.pop() * mb_tokens[len(mb_losses)]
    return math.exp(total / sum(mb_tokens))


def perplexity_base2(mb_losses, mb_tokens):
    return 2 ** (sum(l * n for l, n in zip(mb_losses, mb_tokens)) / sum(mb_tokens))


def perplexity_exp_then_average(mb_losses, mb_tokens):
    return sum(n * math.exp(l) for l, n in zip(mb_losses, mb_tokens)) / sum(mb_tokens)


def perplexity_drops_short_last(mb_losses, mb_tokens):
    full = [(l, n) for l, n in zip(mb_losses, mb_tokens) if n == max(mb_tokens)]
    return math.exp(sum(l * n for l, n in full) / sum(n for _, n in full))


def perplexity_geometric(mb_losses, mb_tokens):  # right: a product of per-micro-batch perplexities
    total = sum(mb_tokens)
    return math.prod(math.exp(l) ** (n / total) for l, n in zip(mb_losses, mb_tokens))


# ---- 11: ZeRO-2's shard -------------------------------------------------------------------------


def shard_by_all_reduce(flat_grad, rank, world_size):
    total = flat_grad / world_size
    dist.all_reduce(total)
    return total.chunk(world_size)[rank].clone()


def shard_interleaved(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size)
    dist.reduce_scatter_tensor(shard, flat_grad.view(-1, world_size).t().flatten() / world_size)
    return shard


def shard_summed_not_averaged(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size)
    dist.reduce_scatter_tensor(shard, flat_grad)
    return shard


def shard_never_reduced(flat_grad, rank, world_size):
    return flat_grad.chunk(world_size)[rank] / world_size


def shard_two_reduce_scatters(flat_grad, rank, world_size):
    halves = []
    for half in flat_grad.chunk(2):
        out = torch.empty(half.numel() // world_size)
        dist.reduce_scatter_tensor(out, half.contiguous() / world_size)
        halves.append(out)
    return torch.cat(halves)


def shard_async_never_waited(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size)
    dist.reduce_scatter_tensor(shard, flat_grad / world_size, async_op=True)
    return shard


def shard_list_form(flat_grad, rank, world_size):  # right: the list form, divided after
    shard = torch.empty(flat_grad.numel() // world_size)
    dist.reduce_scatter(shard, list(flat_grad.chunk(world_size)))
    return shard / world_size


# ---- 12: row parallel ---------------------------------------------------------------------------


def row_parallel_bias_on_every_rank(x_shard, weight_shard, bias):
    partial = x_shard @ weight_shard.T + bias
    dist.all_reduce(partial)
    return partial


def row_parallel_no_all_reduce(x_shard, weight_shard, bias):
    return x_shard @ weight_shard.T + bias


def row_parallel_on_temporary(x_shard, weight_shard, bias):
    partial = x_shard @ weight_shard.T
    dist.all_reduce(partial.clone())
    return partial + bias


def row_parallel_averaged(x_shard, weight_shard, bias):
    partial = x_shard @ weight_shard.T
    dist.all_reduce(partial, op=dist.ReduceOp.AVG)
    return partial + bias


def row_parallel_bias_in_place(x_shard, weight_shard, bias):  # right numbers, but the caller's bias is halved
    bias /= dist.get_world_size()
    partial = x_shard @ weight_shard.T + bias
    dist.all_reduce(partial)
    return partial


def row_parallel_gathered(x_shard, weight_shard, bias):  # right: gather the partials, add them
    parts = [torch.empty(x_shard.shape[0], weight_shard.shape[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x_shard @ weight_shard.T)
    return torch.stack(parts).sum(0) + bias


# ---- 13: split backward -------------------------------------------------------------------------


def split_backward_all_at_once(output, x, weights, grad_output):
    output.backward(grad_output)
    return x.grad, lambda: None


def split_backward_graph_freed(output, x, weights, grad_output):
    (x_grad,) = torch.autograd.grad(output, [x], grad_output)

    def weight_step():
        for w, g in zip(weights, torch.autograd.grad(output, weights, grad_output)):
            w.grad = w.grad + g
    return x_grad, weight_step


def split_backward_overwrites(output, x, weights, grad_output):
    (x_grad,) = torch.autograd.grad(output, [x], grad_output, retain_graph=True)

    def weight_step():
        for w, g in zip(weights, torch.autograd.grad(output, weights, grad_output)):
            w.grad = g
    return x_grad, weight_step


def split_backward_w_recomputes_input(output, x, weights, grad_output):
    (x_grad,) = torch.autograd.grad(output, [x], grad_output, retain_graph=True)

    def weight_step():
        grads = torch.autograd.grad(output, [x, *weights], grad_output)
        for w, g in zip(weights, grads[1:]):
            w.grad = w.grad + g
    return x_grad, weight_step


def split_backward_w_returns(output, x, weights, grad_output):
    (x_grad,) = torch.autograd.grad(output, [x], grad_output, retain_graph=True)
    return x_grad, lambda: torch.autograd.grad(output, weights, grad_output)


def split_backward_w_ignores_grad_output(output, x, weights, grad_output):
    (x_grad,) = torch.autograd.grad(output, [x], grad_output, retain_graph=True)
    def weight_step():
        for w, g in zip(weights, torch.autograd.grad(output.sum(), weights)):
            w.grad += g
    return x_grad, weight_step


def split_backward_i_ignores_grad_output(output, x, weights, grad_output):
    (x_grad,) = torch.autograd.grad(output.sum(), [x], retain_graph=True)
    def weight_step():
        for w, g in zip(weights, torch.autograd.grad(output, weights, grad_output)):
            w.grad += g
    return x_grad, weight_step


def split_backward_w_adds_to_copy(output, x, weights, grad_output):
    (x_grad,) = torch.autograd.grad(output, [x], grad_output, retain_graph=True)
    def weight_step():
        for w, g in zip(weights, torch.autograd.grad(output, weights, grad_output)):
            total = w.grad.clone()
            total += g
    return x_grad, weight_step


def split_backward_inputs_argument(output, x, weights, grad_output):  # right: backward(inputs=...)
    output.backward(grad_output, inputs=[x], retain_graph=True)
    return x.grad.clone(), lambda: output.backward(grad_output, inputs=list(weights))


# ---- the tables ---------------------------------------------------------------------------------

# (exercise, wrong answer, words its grade must contain: the mistake named)
WRONG = [
    ("00_broadcast", broadcast_with_collective, ["called dist.broadcast", "point-to-point messages only"]),
    ("00_broadcast", broadcast_isend_never_waited, ["never waited", "isend to rank"]),
    ("00_broadcast", broadcast_into_new_tensor, ["in a new tensor", "`tensor` itself was not filled"]),
    ("00_broadcast", broadcast_from_rank0, ["acted as the source", "use the `src` argument"]),
    ("00_broadcast", broadcast_irecv_read_before_wait, ["still holds zeros", "another buffer", "after the receive's wait()"]),
    ("01_ddp_average", average_on_temporary, ["temporary", "parameter 0.weight"]),
    ("01_ddp_average", average_async_never_waited, ["never waited", "all_reduce"]),
    ("01_ddp_average", average_flat_offset_stuck, ["layout", "advance the offset"]),
    ("01_ddp_average", average_divided_twice, ["0.50x the reference", "divided by the world size twice"]),
    ("01_ddp_average", average_max_op, ["differs from the reference by up to"]),
    ("01_ddp_average", average_first_param_only, ["parameter 0.bias", "no collective ever reduced it"]),
    ("02_naive_forward", forward_on_one_device, ["ran no forward"]),
    ("02_naive_forward", forward_without_fc, ["has shape (10, 16)", "the activation between the halves"]),
    ("02_naive_forward", forward_all_on_device1, ["ran no forward"]),
    ("02_naive_forward", forward_no_copy, ["nothing was copied to cpu:1"]),
    ("02_naive_forward", forward_on_the_host, ["cpu:0 ran no forward"]),
    ("03_split_forward", pipelined_drops_remainder, ["8 rows where the batch has 10", "last, shorter split"]),
    ("03_split_forward", pipelined_each_waited, ["waited for before the next was submitted"]),
    ("03_split_forward", pipelined_reversed, ["reverse order", "order mistake"]),
    ("03_split_forward", pipelined_one_mb, ["ran 1 split(s)"]),
    ("03_split_forward", pipelined_chunks_not_splits, ["ran 4 split(s)", "x.split(split_size)"]),
    ("03_split_forward", pipelined_no_copy, ["copy it first with stream.copy"]),
    ("04_event_wait", dual_stream_without_event, ["read-after-write race"]),
    ("04_event_wait", dual_stream_event_before_copy, ["read-after-write race"]),
    ("04_event_wait", dual_stream_waits_on_copy_stream, ["read-after-write race"]),
    ("04_event_wait", dual_stream_event_after_seq1, ["read-after-write race"]),
    ("05_grid_groups", groups_pipe_fastest, ["data-fastest", "not pipe-fastest"]),
    ("05_grid_groups", groups_out_of_stage_order, ["out of stage order"]),
    ("05_grid_groups", groups_swapped, ["swapped"]),
    ("05_grid_groups", groups_first_pipeline_only, ["1 of them", "the grid has 2"]),
    ("06_accumulation", backward_divided_on_every_stage, ["0.25x the reference", "on every stage"]),
    ("06_accumulation", backward_multiplied, ["16.00x the reference", "wrong scale"]),
    ("06_accumulation", backward_autograd_grad, ["no gradient at all flowed"]),
    ("06_accumulation", backward_ignores_grad_output, ["differs from the reference by up to", "with the gradient it received"]),
    ("06_accumulation", backward_divides_received_gradient, ["rank 1 (stage 1)", "4.00x the reference"]),
    ("06_accumulation", backward_never_divided, ["4.00x the reference", "divide each by num_microbatches"]),
    ("07_few_microbatches", one_f_one_b_accepting_anything, ["rank 0 accepted 2 micro-batch(es) on 4 ranks"]),
    ("07_few_microbatches", one_f_one_b_refused_on_rank0_only, ["rank 1 accepted", "every rank must raise"]),
    ("07_few_microbatches", one_f_one_b_off_by_one, ["refused 4 micro-batches on 4 ranks", "that is enough"]),
    ("07_few_microbatches", one_f_one_b_gpipe_order, ["activations", "at most"]),
    ("07_few_microbatches", one_f_one_b_assert, ["AssertionError, not a ValueError"]),
    ("07_send_recv_order", loop_gpipe_order_deadlocks, ["ranks 0 and 1 wait on each other"]),
    ("07_send_recv_order", loop_gradients_received_reversed, ["pair up in the order they are posted"]),
    ("07_send_recv_order", loop_last_gradient_never_received, ["never posts (it has finished)"]),
    ("07_send_recv_order", loop_backward_before_forward, ["backward of micro-batch 0 before its forward"]),
    ("07_send_recv_order", loop_receives_before_sending, ["ranks 0 and 1 wait on each other", "receive gradient 0"]),
    ("07_send_recv_order", loop_both_sides_reordered, ["wait on each other", "receive activation 1"]),
    ("08_partition", partition_by_layer_count, ["equal numbers of layers", "parameters, not layers"]),
    ("08_partition", partition_lightest_heaviest, ["heaviest stage is as light as it can be", "heaviest-minus-lightest"]),
    ("08_partition", partition_empty_stage, ["is empty"]),
    ("08_partition", partition_sorted_in_place, ["changed its input weights in place"]),
    ("08_partition", partition_greedy_average, ["heaviest minus lightest", "where the best split's is"]),
    ("08_partition", partition_stage_sizes, ["increasing boundaries from 0 to"]),
    ("08_tied_weights", tied_grads_averaged, ["0.50x the reference", "SUM of the stages' parts"]),
    ("08_tied_weights", tied_grads_world_group, ["wrong group", "every rank"]),
    ("08_tied_weights", tied_grads_on_temporary, ["temporary"]),
    ("08_tied_weights", tied_grads_broadcast, ["nothing summed the other stage's part", "broadcast"]),
    ("08_tied_weights", tied_grads_async_never_waited, ["never waited"]),
    ("09_split_point", split_in_the_middle, ["balancing the layers"]),
    ("09_split_point", split_before_head, ["the stages hold", "the best cut's heaviest stage holds"]),
    ("09_split_point", split_before_embed, ["would hold nothing"]),
    ("09_split_point", split_container, ["is not a submodule"]),
    ("09_split_point", split_returns_module, ["returned a module", "not its name"]),
    ("10_perplexity", perplexity_mean_of_means, ["mean loss", "weight each loss by its tokens ([24, 24, 12])"]),
    ("10_perplexity", perplexity_no_exp, ["perplexity is its exp"]),
    ("10_perplexity", perplexity_divided_twice, ["divided by the token count twice"]),
    ("10_perplexity", perplexity_pops_input, ["changed its input mb_losses in place"]),
    ("10_perplexity", perplexity_base2, ["2 to the loss per token", "exp"]),
    ("10_perplexity", perplexity_exp_then_average, ["mean of the micro-batches' perplexities", "then exp"]),
    ("10_perplexity", perplexity_drops_short_last, ["micro-batch 2 (12 tokens) is left out"]),
    ("11_zero2_shard", shard_by_all_reduce, ["called all_reduce", "one reduce-scatter"]),
    ("11_zero2_shard", shard_interleaved, ["interleaved layout"]),
    ("11_zero2_shard", shard_summed_not_averaged, ["2.00x the reference", "divide by the world size"]),
    ("11_zero2_shard", shard_never_reduced, ["0 reduce-scatter(s)"]),
    ("11_zero2_shard", shard_two_reduce_scatters, ["2 reduce-scatter(s)"]),
    ("11_zero2_shard", shard_async_never_waited, ["never waited"]),
    ("12_row_parallel", row_parallel_bias_on_every_rank, ["plus 1x the bias", "added 2 times"]),
    ("12_row_parallel", row_parallel_no_all_reduce, ["own partial product", "no collective ran"]),
    ("12_row_parallel", row_parallel_on_temporary, ["temporary"]),
    ("12_row_parallel", row_parallel_averaged, ["0.50x the reference", "averaged"]),
    ("12_row_parallel", row_parallel_bias_in_place, ["changed its input bias"]),
    ("13_split_backward", split_backward_all_at_once, ["after I, 0.weight's .grad changed"]),
    ("13_split_backward", split_backward_graph_freed, ["W raised RuntimeError", "retain_graph=True"]),
    ("13_split_backward", split_backward_overwrites, ["overwrote"]),
    ("13_split_backward", split_backward_w_recomputes_input, ["computed the input's gradient again"]),
    ("13_split_backward", split_backward_w_returns, ["unchanged", "missing part"]),
    ("13_split_backward", split_backward_w_ignores_grad_output, ["after W", "seed of ones", "grad_output"]),
    ("13_split_backward", split_backward_i_ignores_grad_output, ["the input's gradient", "seed of ones"]),
    ("13_split_backward", split_backward_w_adds_to_copy, ["is unchanged", "missing part"]),
]

# (exercise, a right answer written differently from its solution)
RIGHT = [
    ("00_broadcast", broadcast_ring),
    ("01_ddp_average", average_flat_right),
    ("02_naive_forward", forward_naive_blocking),
    ("03_split_forward", pipelined_two_loops),
    ("04_event_wait", dual_stream_synchronize),
    ("05_grid_groups", groups_by_division),
    ("06_accumulation", backward_with_ones),
    ("07_few_microbatches", one_f_one_b_from_queue),
    ("07_send_recv_order", loop_one_at_a_time),
    ("08_partition", partition_brute_force),
    ("08_partition", partition_lesson_rule),
    ("08_tied_weights", tied_grads_gathered),
    ("09_split_point", split_by_trying),
    ("10_perplexity", perplexity_geometric),
    ("11_zero2_shard", shard_list_form),
    ("12_row_parallel", row_parallel_gathered),
    ("13_split_backward", split_backward_inputs_argument),
]


# Lessons 14-17 keep their wrong and right answers beside their lesson's tests, which run them
# (WRONG_ANSWERS and RIGHT_ANSWERS in each of these modules).
ELSEWHERE = {"14_online_softmax_merge": "test_context_parallel", "15_dispatch": "test_expert_parallel",
             "16_loss_scale_update": "test_precision", "17_find_the_bug": "test_debug"}

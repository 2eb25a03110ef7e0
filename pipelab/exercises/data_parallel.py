"""Exercises of the lessons on collectives and data parallelism: a broadcast made of sends and
receives (00), DDP's gradient average (01), the grid's groups (05), ZeRO-2's gradient shard (11),
and a row-parallel layer's bias (12). Each runs the student's function on real ranks and compares
what every rank holds with the single-process reference."""

from __future__ import annotations

import torch
from torch import nn

from pipelab.exercises.core import Wrong, call, checker, how_far, on_ranks, same
from pipelab.worker import RankContext

# ---------------------------------------------------------------------------------------------
# 00: a broadcast from sends and receives
# ---------------------------------------------------------------------------------------------

BROADCAST_RANKS, BROADCAST_SRC = 3, 1


def _broadcast_rank(ctx: RankContext, fn, src: int) -> list[float]:
    values = torch.arange(3.0) + 10
    tensor = values.clone() if ctx.rank == src else torch.zeros(3)
    out = fn(ctx, tensor, src)
    return (tensor if out is None else out).tolist()


@checker("00_broadcast")
def check_broadcast(my_broadcast) -> str:
    """`my_broadcast(ctx, tensor, src)` must leave rank `src`'s values in `tensor` on every rank,
    with dist.send and dist.recv only. Run on 3 ranks with src=1."""
    held = on_ranks(_broadcast_rank, BROADCAST_RANKS, my_broadcast, BROADCAST_SRC)
    want = (torch.arange(3.0) + 10).tolist()
    for rank, got in enumerate(held):
        if got != want:
            hint = ("it sent nothing to this rank, or this rank never received" if got == [0.0] * 3
                    else "src's own tensor changed" if rank == BROADCAST_SRC else "the values are not src's")
            raise Wrong(f"rank {rank} holds {got} where a broadcast from rank {BROADCAST_SRC} gives {want}: {hint} "
                        f"(src is rank {BROADCAST_SRC} of {BROADCAST_RANKS}, not always 0)")
    return f"all {BROADCAST_RANKS} ranks hold rank {BROADCAST_SRC}'s {want}"


# ---------------------------------------------------------------------------------------------
# 01: DDP's average of the gradients
# ---------------------------------------------------------------------------------------------

DDP_RANKS = 2


def small_mlp(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A 2-layer MLP and a batch of 8: the model and data of the data-parallel checkers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.randn(8, 4), torch.randn(8, 2)


def _ddp_rank(ctx: RankContext, fn) -> dict[str, torch.Tensor]:
    model, x, y = small_mlp()
    mine = slice(ctx.rank * len(x) // ctx.world_size, (ctx.rank + 1) * len(x) // ctx.world_size)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    fn(list(model.parameters()), ctx.world_size)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def reference_grads() -> dict[str, torch.Tensor]:
    model, x, y = small_mlp()
    nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@checker("01_ddp_average")
def check_ddp_average(my_average) -> str:
    """`my_average(params, world_size)`: after each rank's backward on its half of the batch, make
    every `p.grad` the average over the ranks (what DDP does). Compared with one process's gradients."""
    want = reference_grads()
    hints = {0.5: "is it divided by the world size twice?", 2.0: "a sum, not an average: divide by the world size",
             1 / DDP_RANKS ** 2: "is it divided by the world size twice?"}
    for rank, grads in enumerate(on_ranks(_ddp_rank, DDP_RANKS, my_average)):
        for layer, (name, g) in enumerate(grads.items()):
            if not same(g, want[name]):
                extra = "" if "x the reference" in how_far(g, want[name], hints) else \
                    ": is every parameter's gradient all-reduced on every rank?"
                raise Wrong(f"rank {rank}, parameter {name}: your gradient {how_far(g, want[name], hints)}{extra}")
    return f"every gradient on both ranks equals one process's on the whole batch ({len(want)} parameters)"


# ---------------------------------------------------------------------------------------------
# 05: the grid's groups
# ---------------------------------------------------------------------------------------------


@checker("05_grid_groups")
def check_grid_groups(my_grid_groups) -> str:
    """`my_grid_groups(pipe, data)` -> {"pipe": [...], "data": [...]}: the ranks of each pipeline
    and of each data-parallel group in a pipe x data grid numbered data-fastest (DeepSpeed's order),
    checked against `PipeDataParallelTopology` for several grids."""
    from pipelab.pipeline.topology import PipeDataParallelTopology

    for pipe, data in [(2, 2), (3, 2), (2, 3)]:
        topo = PipeDataParallelTopology(num_pp=pipe, num_dp=data)
        got = call(my_grid_groups, pipe, data)
        for axis in ("pipe", "data"):
            want = topo.get_axis_comm_lists(axis)
            mine = got.get(axis) if isinstance(got, dict) else None
            if mine is None or sorted(map(sorted, mine)) != sorted(map(sorted, want)):
                what = "pipelines (one rank per stage)" if axis == "pipe" else "data-parallel groups (one stage's replicas)"
                raise Wrong(f"pipe={pipe} x data={data}: your {what} are {mine}, they should be {want}: ranks are "
                            f"numbered data-fastest, so ranks 0..{data - 1} are stage 0's {data} replicas")
    return "the pipelines and data-parallel groups match the topology's for grids 2x2, 3x2 and 2x3"


# ---------------------------------------------------------------------------------------------
# 11: ZeRO-2's gradient shard
# ---------------------------------------------------------------------------------------------

ZERO_RANKS, ZERO_NUMEL = 2, 12


def _rank_gradient(rank: int) -> torch.Tensor:
    return torch.randn(ZERO_NUMEL, generator=torch.Generator().manual_seed(100 + rank))


def _zero_rank(ctx: RankContext, fn) -> torch.Tensor:
    out = fn(_rank_gradient(ctx.rank), ctx.rank, ctx.world_size)
    return out.clone() if isinstance(out, torch.Tensor) else out


@checker("11_zero2_shard")
def check_zero2_shard(my_gradient_shard) -> str:
    """`my_gradient_shard(flat_grad, rank, world_size)` -> this rank's shard of the gradient
    averaged over the ranks, by one reduce-scatter (ZeRO-2 keeps only that shard)."""
    mean = torch.stack([_rank_gradient(r) for r in range(ZERO_RANKS)]).mean(0)
    shards = mean.chunk(ZERO_RANKS)
    hints = {float(ZERO_RANKS): "a sum: divide by the world size to average, as DDP does",
             1 / ZERO_RANKS: "divided by the world size twice?"}
    for rank, got in enumerate(on_ranks(_zero_rank, ZERO_RANKS, my_gradient_shard)):
        if not isinstance(got, torch.Tensor):
            raise Wrong(f"rank {rank}: my_gradient_shard returned {type(got).__name__}, not this rank's shard (a tensor)")
        if got.numel() == ZERO_NUMEL:
            raise Wrong(f"rank {rank} holds all {ZERO_NUMEL} elements: ZeRO-2 keeps only its shard "
                        f"({ZERO_NUMEL // ZERO_RANKS} = numel / world_size), the reduce-scatter's output")
        for other in range(ZERO_RANKS):
            if other != rank and same(got, shards[other]):
                raise Wrong(f"rank {rank} holds rank {other}'s shard: rank r keeps chunk r of the flat gradient")
        if not same(got, shards[rank]):
            scaled = "x the reference" in how_far(got, shards[rank], hints)
            raise Wrong(f"rank {rank}: your shard {how_far(got, shards[rank], hints)}"
                        + ("" if scaled else ": is it the reduce-scatter of every rank's gradient (their sum), "
                                             "divided by the world size?"))
    return f"each of {ZERO_RANKS} ranks holds its {ZERO_NUMEL // ZERO_RANKS} elements of the averaged gradient"


# ---------------------------------------------------------------------------------------------
# 12: a row-parallel layer
# ---------------------------------------------------------------------------------------------

TP_RANKS = 2


def row_parallel_case() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(12)
    layer = nn.Linear(8, 4)
    with torch.no_grad():
        layer.bias.add_(1.0)  # a bias far from zero, so a repeated one shows
    return layer, torch.randn(3, 8)


def _row_parallel_rank(ctx: RankContext, fn) -> torch.Tensor:
    layer, x = row_parallel_case()
    cols = x.shape[1] // ctx.world_size
    mine = slice(ctx.rank * cols, (ctx.rank + 1) * cols)
    with torch.no_grad():
        out = fn(x[:, mine].contiguous(), layer.weight[:, mine].contiguous(), layer.bias.clone())
    return out.clone() if isinstance(out, torch.Tensor) else out


@checker("12_row_parallel")
def check_row_parallel(my_row_parallel) -> str:
    """`my_row_parallel(x_shard, weight_shard, bias)`: this rank holds a slice of the input's
    features and the matching columns of the weight; return the layer's full output on every rank."""
    layer, x = row_parallel_case()
    with torch.no_grad():
        want = layer(x)
    for rank, got in enumerate(on_ranks(_row_parallel_rank, TP_RANKS, my_row_parallel)):
        if not isinstance(got, torch.Tensor):
            raise Wrong(f"rank {rank}: my_row_parallel returned {type(got).__name__}, not the output tensor")
        if same(got, want):
            continue
        if got.shape == want.shape:
            extra = (got - want) / layer.bias.detach()
            biases = float(extra.mean())  # how many extra biases the output holds, if it is that
            if torch.allclose(extra, torch.full_like(extra, biases), atol=1e-4) and abs(biases - round(biases)) < 1e-3:
                times = round(biases) + 1
                raise Wrong(f"rank {rank}: your output is the reference plus {times - 1}x the bias, so the bias is added "
                            f"{times} times (once per rank, before the all-reduce sums them): add it once, after")
        raise Wrong(f"rank {rank}: your output {how_far(got, want)}: is the partial product x_shard @ weight_shard.T "
                    "all-reduced over the ranks?")
    return f"both ranks hold the full output, bias added once ({tuple(want.shape)})"

"""Exercises of the lessons on collectives and data parallelism: a broadcast made of sends and
receives (00), DDP's gradient average (01), the grid's groups (05), ZeRO-2's gradient shard (11),
and a row-parallel layer's bias (12). Each runs the student's function on real ranks and compares
what every rank holds with the single-process reference."""

from __future__ import annotations

import torch
from torch import nn

from pipelab.exercises.core import Wrong, call, checker, how_far, on_ranks, same, scale_text, student_call, unchanged
from pipelab.exercises.recorder import COLLECTIVES
from pipelab.worker import RankContext

# ---------------------------------------------------------------------------------------------
# 00: a broadcast from sends and receives
# ---------------------------------------------------------------------------------------------

BROADCAST_RANKS, BROADCAST_SRC = 3, 1


def _only_p2p(call) -> str | None:
    if call.op in COLLECTIVES:
        return (f"your function called dist.{call.op}: the task is a broadcast made of point-to-point messages only "
                "(dist.send and dist.recv, or isend and irecv)")
    return None


def _broadcast_rank(ctx: RankContext, fn, src: int) -> dict:
    values = torch.arange(3.0) + 10
    tensor = values.clone() if ctx.rank == src else torch.zeros(3)
    out, rec = student_call(ctx, fn, ctx, tensor, src, refuse=_only_p2p)
    return {"tensor": tensor.tolist(), "out": out.tolist() if isinstance(out, torch.Tensor) else None,
            "received": [c.peer for c in rec.calls if c.op in ("recv", "irecv")],
            "sent": [c.peer for c in rec.calls if c.op in ("send", "isend")], "into_tensor": rec.touched(tensor)}


@checker("00_broadcast")
def check_broadcast(my_broadcast) -> str:
    """`my_broadcast(ctx, tensor, src)` must leave rank `src`'s values in `tensor` on every rank,
    with dist.send and dist.recv only. Run on 3 ranks with src=1."""
    held = on_ranks(_broadcast_rank, BROADCAST_RANKS, my_broadcast, BROADCAST_SRC, runs=2)
    want = (torch.arange(3.0) + 10).tolist()
    for rank, got in enumerate(held):
        if got["tensor"] == want:
            continue
        if rank == BROADCAST_SRC:
            why = "src's own tensor changed: src sends its values and keeps them"
        elif got["out"] == want:
            why = ("your function returned the right values in a new tensor, but `tensor` itself was not filled: "
                   "receive into `tensor` (in place), which is what the caller holds")
        elif not got["received"] and got["sent"]:
            why = (f"this rank sent (to rank(s) {got['sent']}) and received nothing: it acted as the source, but src is "
                   f"rank {BROADCAST_SRC}; use the `src` argument, not a fixed rank")
        elif not got["received"]:
            why = "this rank posted no receive at all"
        elif got["tensor"] == [0.0] * 3:
            why = f"it received from rank(s) {got['received']}, but its tensor still holds zeros" + (
                "" if got["into_tensor"] else ": the receive went into another buffer, so `tensor` got only what that "
                "buffer held when it was copied; receive into `tensor` itself, or copy after the receive's wait()")
        else:
            why = f"it received from rank(s) {got['received']}"
        raise Wrong(f"rank {rank} holds {got['tensor']} where a broadcast from rank {BROADCAST_SRC} of "
                    f"{BROADCAST_RANKS} gives {want}: {why}")
    return f"all {BROADCAST_RANKS} ranks hold rank {BROADCAST_SRC}'s {want}, by sends and receives only, every request waited for"


# ---------------------------------------------------------------------------------------------
# 01: DDP's average of the gradients
# ---------------------------------------------------------------------------------------------

DDP_RANKS = 2


def small_mlp(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A 2-layer MLP and a batch of 8: the model and data of the data-parallel checkers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.randn(8, 4), torch.randn(8, 2)


def _ddp_rank(ctx: RankContext, fn) -> dict:
    model, x, y = small_mlp()
    mine = slice(ctx.rank * len(x) // ctx.world_size, (ctx.rank + 1) * len(x) // ctx.world_size)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    named = list(model.named_parameters())
    local = {name: p.grad.clone() for name, p in named}
    before = {name: p.grad for name, p in named}  # the tensors themselves, to see what a collective touched
    _, rec = student_call(ctx, fn, [p for _, p in named], ctx.world_size)
    spans = [(g.untyped_storage().data_ptr(), g.untyped_storage().data_ptr() + g.untyped_storage().nbytes())
             for g in before.values()]
    stray = [c.op for c in rec.collectives() if not any(a <= c.ptr < b for a, b in spans)]
    return {"stray": stray, "grads": {name: None if p.grad is None else p.grad.clone() for name, p in named}, "local": local,
            "touched": {name: rec.touched(g) for name, g in before.items()},
            "collectives": [c.op for c in rec.collectives()]}


def reference_grads() -> dict[str, torch.Tensor]:
    model, x, y = small_mlp()
    nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def flat_offset(got: torch.Tensor, flat: torch.Tensor) -> int | None:
    """Where in `flat` the values of `got` sit, if they are a contiguous slice of it."""
    n = got.numel()
    for start in range(flat.numel() - n + 1):
        if torch.allclose(flat[start:start + n].double(), got.flatten().double(), rtol=1e-4, atol=1e-6):
            return start
    return None


@checker("01_ddp_average")
def check_ddp_average(my_average) -> str:
    """`my_average(params, world_size)`: after each rank's backward on its half of the batch, make
    every `p.grad` the average over the ranks (what DDP does). Compared with one process's gradients."""
    want = reference_grads()
    flat = torch.cat([g.flatten() for g in want.values()])
    offsets = dict(zip(want, [0, *torch.tensor([g.numel() for g in want.values()]).cumsum(0).tolist()]))
    hints = {0.5: "is it divided by the world size twice?", 2.0: "a sum, not an average: divide by the world size",
             1 / DDP_RANKS ** 2: "is it divided by the world size twice?"}
    for rank, r in enumerate(on_ranks(_ddp_rank, DDP_RANKS, my_average)):
        for name, g in r["grads"].items():
            where = f"rank {rank}, parameter {name}"
            if g is None:
                raise Wrong(f"{where}: .grad is None after your function: average it, do not drop it")
            if same(g, want[name]):
                continue
            if same(g, r["local"][name]):
                if r["stray"]:
                    raise Wrong(f"{where}: the gradient is still this rank's own: your {r['stray'][0]} ran on a "
                                "temporary (a new tensor such as p.grad / n), so p.grad never saw the result; reduce "
                                "p.grad itself, then divide it in place")
                raise Wrong(f"{where}: the gradient is still this rank's own: no collective ever reduced it "
                            f"(calls made: {r['collectives'] or 'none'})")
            start = flat_offset(g, flat)
            if start is not None and start != offsets[name]:
                raise Wrong(f"{where}: your gradient holds elements {start}..{start + g.numel() - 1} of the flattened "
                            f"average, where this parameter's are {offsets[name]}..{offsets[name] + g.numel() - 1}: "
                            "a layout mistake; copying back from one flat buffer, advance the offset by each "
                            "parameter's numel")
            raise Wrong(f"{where}: your gradient {how_far(g, want[name], hints)}")
    return f"every gradient on both ranks equals one process's on the whole batch ({len(want)} parameters)"


# ---------------------------------------------------------------------------------------------
# 05: the grid's groups
# ---------------------------------------------------------------------------------------------


def _as_lists(groups) -> list[list[int]] | None:
    try:
        return [[int(r) for r in g] for g in groups]
    except (TypeError, ValueError):
        return None


@checker("05_grid_groups")
def check_grid_groups(my_grid_groups) -> str:
    """`my_grid_groups(pipe, data)` -> {"pipe": [...], "data": [...]}: the ranks of each pipeline
    (in stage order) and of each data-parallel group in a pipe x data grid numbered data-fastest
    (DeepSpeed's order), checked against `PipeDataParallelTopology` for several grids."""
    from pipelab.pipeline.topology import PipeDataParallelTopology

    for pipe, data in [(3, 2), (2, 3), (2, 2), (4, 1), (1, 3)]:
        topo = PipeDataParallelTopology(num_pp=pipe, num_dp=data)
        got = call(my_grid_groups, pipe, data)
        grid = f"pipe={pipe} x data={data}"
        if not isinstance(got, dict) or set(got) != {"pipe", "data"}:
            raise Wrong(f"{grid}: you returned {got!r}; return a dict with the keys 'pipe' and 'data'")
        want = {axis: topo.get_axis_comm_lists(axis) for axis in ("pipe", "data")}
        mine = {axis: _as_lists(got[axis]) for axis in ("pipe", "data")}
        as_sets = {axis: sorted(map(sorted, mine[axis] or [])) for axis in mine}
        if as_sets["pipe"] == sorted(map(sorted, want["data"])) != sorted(map(sorted, want["pipe"])):
            raise Wrong(f"{grid}: your 'pipe' lists are the data-parallel groups and your 'data' lists the pipelines: "
                        "the two are swapped")
        for axis, what in (("pipe", "pipelines (one rank per stage)"), ("data", "data-parallel groups")):
            if mine[axis] is None or len(mine[axis]) != len(want[axis]):
                count = "not a list of lists" if mine[axis] is None else f"{len(mine[axis])} of them"
                raise Wrong(f"{grid}: your {what} are {got[axis]!r} ({count}); the grid has {len(want[axis])}: "
                            f"{want[axis]}")
            if as_sets[axis] != sorted(map(sorted, want[axis])):
                pipe_fastest = [[s + r * pipe for s in range(pipe)] for r in range(data)] if axis == "pipe" else \
                    [[s + r * pipe for r in range(data)] for s in range(pipe)]
                why = (": ranks are numbered data-fastest (rank = stage * data + replica), not pipe-fastest"
                       if as_sets[axis] == sorted(map(sorted, pipe_fastest)) else "")
                raise Wrong(f"{grid}: your {what} are {mine[axis]}, they should be {want[axis]}{why}")
        for line in mine["pipe"]:
            ordered = next(w for w in want["pipe"] if sorted(w) == sorted(line))
            if line != ordered:
                raise Wrong(f"{grid}: your pipeline {line} lists its ranks out of stage order; it is {ordered} "
                            "(stage 0 first: a pipeline's order is the order activations travel)")
    return "the pipelines (in stage order) and data-parallel groups match the topology's for grids 3x2, 2x3, 2x2, 4x1 and 1x3"


# ---------------------------------------------------------------------------------------------
# 11: ZeRO-2's gradient shard
# ---------------------------------------------------------------------------------------------

ZERO_RANKS, ZERO_NUMEL = 2, 12
REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter")


def _rank_gradient(rank: int) -> torch.Tensor:
    return torch.randn(ZERO_NUMEL, generator=torch.Generator().manual_seed(100 + rank))


def _zero_rank(ctx: RankContext, fn) -> dict:
    out, rec = student_call(ctx, fn, _rank_gradient(ctx.rank), ctx.rank, ctx.world_size)
    return {"out": out.clone() if isinstance(out, torch.Tensor) else out,
            "collectives": [c.op for c in rec.collectives()]}


@checker("11_zero2_shard")
def check_zero2_shard(my_gradient_shard) -> str:
    """`my_gradient_shard(flat_grad, rank, world_size)` -> this rank's shard of the gradient
    averaged over the ranks, by one reduce-scatter (ZeRO-2 keeps only that shard)."""
    mean = torch.stack([_rank_gradient(r) for r in range(ZERO_RANKS)]).mean(0)
    shards = mean.chunk(ZERO_RANKS)
    hints = {float(ZERO_RANKS): "a sum: divide by the world size to average, as DDP does",
             1 / ZERO_RANKS: "divided by the world size twice?"}
    for rank, r in enumerate(on_ranks(_zero_rank, ZERO_RANKS, my_gradient_shard)):
        got, ops = r["out"], r["collectives"]
        scatters = [op for op in ops if op in REDUCE_SCATTERS]
        if "all_reduce" in ops:
            raise Wrong(f"rank {rank} called all_reduce (calls: {ops}) where the task asks for one reduce-scatter: an "
                        "all-reduce brings the whole gradient to every rank; dist.reduce_scatter_tensor leaves each "
                        "rank only its shard, with half the traffic")
        if len(scatters) != 1:
            raise Wrong(f"rank {rank} made {len(scatters)} reduce-scatter(s) (calls: {ops or 'none'}): the task is one "
                        "reduce-scatter of the whole flat gradient")
        if not isinstance(got, torch.Tensor):
            raise Wrong(f"rank {rank}: my_gradient_shard returned {type(got).__name__}, not this rank's shard (a tensor)")
        if got.numel() == ZERO_NUMEL:
            raise Wrong(f"rank {rank} holds all {ZERO_NUMEL} elements: ZeRO-2 keeps only its shard "
                        f"({ZERO_NUMEL // ZERO_RANKS} = numel / world_size), the reduce-scatter's output")
        if same(got, shards[rank]):
            continue
        for other in range(ZERO_RANKS):
            if other != rank and same(got, shards[other]):
                raise Wrong(f"rank {rank} holds rank {other}'s shard: rank r keeps chunk r of the flat gradient")
        for factor in (1.0, float(ZERO_RANKS)):
            if same(got, mean[rank::ZERO_RANKS] * factor):
                raise Wrong(f"rank {rank} holds elements {rank}, {rank + ZERO_RANKS}, {rank + 2 * ZERO_RANKS}, ... of the "
                            f"{'sum' if factor > 1 else 'average'} (an interleaved layout): rank r keeps the contiguous "
                            f"chunk r, elements {rank * ZERO_NUMEL // ZERO_RANKS}..{(rank + 1) * ZERO_NUMEL // ZERO_RANKS - 1}")
        if same(got, _rank_gradient(rank).chunk(ZERO_RANKS)[rank] / ZERO_RANKS):
            raise Wrong(f"rank {rank}'s shard is its own gradient's chunk divided by the world size: the reduce-scatter's "
                        "result was not used (it ran on a temporary, or its output was not returned)")
        raise Wrong(f"rank {rank}: your shard {how_far(got, shards[rank], hints)}")
    return f"each of {ZERO_RANKS} ranks holds its {ZERO_NUMEL // ZERO_RANKS} elements of the averaged gradient, by one reduce-scatter"


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


def _row_parallel_rank(ctx: RankContext, fn) -> dict:
    layer, x = row_parallel_case()
    cols = x.shape[1] // ctx.world_size
    mine = slice(ctx.rank * cols, (ctx.rank + 1) * cols)
    args = (x[:, mine].contiguous(), layer.weight[:, mine].detach().contiguous(), layer.bias.detach().clone())
    kept = [a.clone() for a in args]
    with torch.no_grad():
        out, rec = student_call(ctx, fn, *args)
    for name, before, after in zip(("x_shard", "weight_shard", "bias"), kept, args):
        unchanged(f"{name} (rank {ctx.rank})", before, after)
    with torch.no_grad():
        partial = kept[0] @ kept[1].T
    return {"out": out.clone() if isinstance(out, torch.Tensor) else out, "partial": partial,
            "collectives": [c.op for c in rec.collectives()]}


@checker("12_row_parallel")
def check_row_parallel(my_row_parallel) -> str:
    """`my_row_parallel(x_shard, weight_shard, bias)`: this rank holds a slice of the input's
    features and the matching columns of the weight; return the layer's full output on every rank."""
    layer, x = row_parallel_case()
    bias = layer.bias.detach()
    with torch.no_grad():
        want = layer(x)
    for rank, r in enumerate(on_ranks(_row_parallel_rank, TP_RANKS, my_row_parallel)):
        got = r["out"]
        if not isinstance(got, torch.Tensor):
            raise Wrong(f"rank {rank}: my_row_parallel returned {type(got).__name__}, not the output tensor")
        if same(got, want):
            continue
        if got.shape == want.shape:
            if same(got, r["partial"] + bias) or same(got, r["partial"]):
                ran = r["collectives"]
                raise Wrong(f"rank {rank}'s output is its own partial product x_shard @ weight_shard.T"
                            + (" (bias added)" if same(got, r["partial"] + bias) else "") + ": "
                            + (f"your {ran[0]} ran on a temporary or its result was not used"
                               if ran else "no collective ran: the ranks' partial products must be summed (all-reduce)"))
            extra = (got - want) / bias
            biases = float(extra.mean())  # how many extra biases the output holds, if it is that
            if torch.allclose(extra, torch.full_like(extra, biases), atol=1e-4) and abs(biases - round(biases)) < 1e-3:
                times = round(biases) + 1
                where = "missing" if times == 0 else f"added {times} times"
                raise Wrong(f"rank {rank}: your output is the reference plus {times - 1}x the bias, so the bias is "
                            f"{where} (each rank's, before the all-reduce sums them, counts once per rank): add it once, after")
            scaled = scale_text(got - bias, want - bias, {1 / TP_RANKS: "the partial products are averaged: an "
                                                                        "all-reduce with SUM adds them"})
            if scaled:
                raise Wrong(f"rank {rank}: without the bias, your output {scaled}")
        raise Wrong(f"rank {rank}: your output {how_far(got, want)}")
    return f"both ranks hold the full output, bias added once ({tuple(want.shape)})"

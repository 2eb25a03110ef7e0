"""Exercises of the pipeline lessons (06-08), each one a bug the field keeps reporting: gradients
scaled wrong under gradient accumulation (06), a 1F1B that accepts fewer micro-batches than stages
(07), tied weights whose gradients are not summed across the stages holding them (08), and the
partition by parameters (08). The two-stage pipeline here is small and written out: rank 0 holds
stage 0, rank 1 stage 1, activations go right and gradients left."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipelab.exercises.core import Wrong, call, checker, first_line, how_far, on_ranks, same
from pipelab.worker import RankContext

NUM_MICROBATCHES, BATCH = 4, 8


def two_stage_case():
    """A 3-layer MLP cut after its first block, a batch of 8 and its targets."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.randn(BATCH, 4), torch.randn(BATCH, 2)


def stage_module(model: nn.Sequential, rank: int) -> nn.Sequential:
    return model[:2] if rank == 0 else model[2:]


def reference_grads(model: nn.Module, x, y) -> dict[str, torch.Tensor]:
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def compare_stage_grads(results: list[dict], want: dict, hints: dict[int, dict[float, str]], tip: str) -> None:
    """Raise Wrong at the first parameter of the first rank whose gradient differs."""
    for rank, grads in enumerate(results):
        for name, g in grads.items():
            if g is None:
                raise Wrong(f"rank {rank} (stage {rank}), parameter {name}: no gradient at all: was backward called?")
            if not same(g, want[name]):
                text = how_far(g, want[name], hints.get(rank))
                raise Wrong(f"rank {rank} (stage {rank}), parameter {name}: your gradient {text}"
                            + ("" if "?" in text or ": " in text else f": {tip}"))


# ---------------------------------------------------------------------------------------------
# 06: gradient accumulation over micro-batches
# ---------------------------------------------------------------------------------------------


def _gpipe_rank(ctx: RankContext, fn) -> dict[str, torch.Tensor]:
    """GPipe on two ranks: all forwards, then all backwards, each through the student's backward."""
    model, x, y = two_stage_case()
    stage, m = stage_module(model, ctx.rank), NUM_MICROBATCHES
    kept = []
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        if ctx.rank == 0:
            out = stage(xs)
            dist.send(out.detach(), dst=1)
        else:
            inp = torch.empty(len(xs), 8)
            dist.recv(inp, src=0)
            inp.requires_grad_()
            out = nn.functional.mse_loss(stage(inp), ys)  # the micro-batch's loss: a mean over its samples
        kept.append((out, inp if ctx.rank == 1 else None))
    for out, inp in kept:
        if ctx.rank == 0:
            grad = torch.empty_like(out)
            dist.recv(grad, src=1)
            fn(out, grad, m)
        else:
            fn(out, None, m)
            dist.send(inp.grad, dst=0)
    # a slice of a Sequential keeps the layers' names, so these are the whole model's names
    return {name: None if p.grad is None else p.grad.clone() for name, p in stage.named_parameters()}


@checker("06_accumulation")
def check_accumulation(my_backward) -> str:
    """`my_backward(output, grad_output, num_microbatches)`: one micro-batch's backward on one
    stage. On the last stage `output` is the micro-batch's loss (a mean over its samples) and
    `grad_output` is None; on the others `output` is the stage's activation and `grad_output` the
    gradient the next stage sent back. After all micro-batches, the gradients must be the batch's."""
    model, x, y = two_stage_case()
    want = reference_grads(model, x, y)
    m = NUM_MICROBATCHES
    hints = {0: {1 / m: f"is it divided by the micro-batch count on every stage? Only the loss is: the "
                        f"gradient that arrives from the next stage already carries the 1/{m}",
                 float(m): f"the micro-batches' losses are summed: divide each by num_microbatches ({m})"},
             1: {float(m): f"the micro-batches' losses are summed, not averaged: divide each by num_microbatches ({m})",
                 1 / m: "divided twice?"}}
    compare_stage_grads(on_ranks(_gpipe_rank, 2, my_backward), want, hints,
                        "does each stage call backward once per micro-batch, with the gradient it received?")
    return f"both stages' gradients equal one process's on the whole batch ({m} micro-batches of {BATCH // m})"


# ---------------------------------------------------------------------------------------------
# 07: a 1F1B schedule that refuses fewer micro-batches than stages
# ---------------------------------------------------------------------------------------------


@checker("07_few_microbatches")
def check_few_microbatches(my_1f1b_actions) -> str:
    """`my_1f1b_actions(rank, num_ranks, num_microbatches)` -> the rank's list of F and B actions
    in 1F1B order; it must raise ValueError, naming both numbers, when there are fewer
    micro-batches than stages (the pipeline would never fill)."""
    from pipelab.pipeline.actions import ScheduleError, validate
    from pipelab.pipeline.schedules import Schedule

    for p, m in [(2, 4), (4, 4), (4, 8)]:
        actions = [list(call(my_1f1b_actions, r, p, m)) for r in range(p)]
        try:
            validate(Schedule(p, m, actions=actions, name="yours"))
        except ScheduleError as e:
            raise Wrong(f"with {p} ranks and {m} micro-batches your schedule cannot run: {e}") from None
        for r, acts in enumerate(actions):
            live = peak = 0
            for a in acts:
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
            if peak > p - r:
                raise Wrong(f"with {p} ranks and {m} micro-batches, rank {r} holds {peak} micro-batches' activations "
                            f"at once: 1F1B starts a backward as soon as it can and holds at most {p - r} "
                            "(num_ranks - rank)")
    for p, m in [(4, 2), (2, 1)]:
        try:
            my_1f1b_actions(0, p, m)
        except ValueError as e:
            if str(m) not in str(e) or str(p) not in str(e):
                raise Wrong(f"refused {m} micro-batches on {p} ranks, but the message does not name both "
                            f"numbers: {e}") from None
            continue
        except Exception as e:  # noqa: BLE001
            raise Wrong(f"with {m} micro-batches on {p} ranks it raised {type(e).__name__}, not a ValueError: {e}") from None
        raise Wrong(f"accepted {m} micro-batch(es) on {p} ranks: with fewer micro-batches than stages the pipeline never "
                    "fills (torchtitan#775 hung); raise ValueError naming both numbers and the fix")
    return "1F1B order valid with at most num_ranks - rank micro-batches in flight; fewer micro-batches than stages refused"


# ---------------------------------------------------------------------------------------------
# 08: partition by parameters; tied weights
# ---------------------------------------------------------------------------------------------


def best_heaviest(weights: list[int], parts: int) -> int:
    """The smallest possible heaviest stage of a contiguous split (try every bound: small lists)."""
    def stages_needed(cap):
        count, total = 1, 0
        for w in weights:
            if total + w > cap:
                count, total = count + 1, 0
            total += w
        return count
    return min(cap for cap in sorted(set(weights) | {sum(weights[i:j]) for i in range(len(weights))
                                                      for j in range(i + 1, len(weights) + 1)})
               if cap >= max(weights) and stages_needed(cap) <= parts)


PARTITION_CASES = [([80, 10, 10, 80, 10, 10], 2), ([5, 5, 50, 5, 5, 5, 5, 20], 3), ([4, 0, 4, 0, 4, 0, 4, 0], 4)]


@checker("08_partition")
def check_partition(my_partition) -> str:
    """`my_partition(weights, num_stages)` -> stage boundaries [0, ..., len(weights)]: contiguous
    stages whose heaviest holds as few parameters as possible (DeepSpeed's partition_method='parameters')."""
    for weights, parts in PARTITION_CASES:
        bounds = list(call(my_partition, list(weights), parts))
        if len(bounds) != parts + 1 or bounds[0] != 0 or bounds[-1] != len(weights) or bounds != sorted(bounds):
            raise Wrong(f"for {parts} stages of {weights} you returned {bounds}: give {parts + 1} increasing "
                        f"boundaries from 0 to {len(weights)}")
        sums = [sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        best = best_heaviest(weights, parts)
        if max(sums) > best:
            heavy = sums.index(max(sums))
            raise Wrong(f"for {parts} stages of {weights}: your stage {heavy} holds {max(sums)} parameters "
                        f"(stages {sums}), where the best split's heaviest holds {best}: balance parameters, not layers")
    return f"{len(PARTITION_CASES)} layer lists cut with the lightest possible heaviest stage"


VOCAB, DIM = 10, 6


def tied_case():
    """An embedding on stage 0 and an output head on stage 1 sharing one weight, and a batch."""
    torch.manual_seed(8)
    weight = torch.randn(VOCAB, DIM)
    ids, targets = torch.randint(0, VOCAB, (BATCH,)), torch.randint(0, VOCAB, (BATCH,))
    return weight, ids, targets


def _tied_rank(ctx: RankContext, fn) -> torch.Tensor:
    weight, ids, targets = tied_case()
    tied = nn.Parameter(weight.clone())  # each stage holds its own copy of the tied weight
    if ctx.rank == 0:
        h = nn.functional.embedding(ids, tied)
        dist.send(h.detach(), dst=1)
        grad = torch.empty_like(h)
        dist.recv(grad, src=1)
        h.backward(grad)
    else:
        h = torch.empty(BATCH, DIM)
        dist.recv(h, src=0)
        h.requires_grad_()
        nn.functional.cross_entropy(torch.tanh(h) @ tied.T, targets).backward()
        dist.send(h.grad, dst=0)
    fn(tied, None)
    return tied.grad.clone()


@checker("08_tied_weights")
def check_tied_weights(my_tied_grads) -> str:
    """`my_tied_grads(weight, group)`: stage 0's embedding and stage 1's output head share one
    weight, a copy on each rank; after backward each copy holds only its stage's part of the
    gradient. Make both hold the whole gradient (so both copies take the same step)."""
    weight, ids, targets = tied_case()
    tied = nn.Parameter(weight.clone())
    nn.functional.cross_entropy(torch.tanh(nn.functional.embedding(ids, tied)) @ tied.T, targets).backward()
    want = tied.grad
    for rank, got in enumerate(on_ranks(_tied_rank, 2, my_tied_grads)):
        if not same(got, want):
            text = how_far(got, want, {0.5: "an average: the tied weight's gradient is the SUM of the stages' parts"})
            raise Wrong(f"rank {rank}: the tied weight's gradient {text}"
                        + ("" if "SUM" in text else ": does each rank add the other stage's part (all-reduce, sum)?"))
    return "both stages hold the tied weight's whole gradient, the sum of the embedding's and the head's parts"


# ---------------------------------------------------------------------------------------------
# 13: zero bubble's split backward (I, then W later)
# ---------------------------------------------------------------------------------------------


def split_backward_case():
    torch.manual_seed(13)
    stage = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4))
    return stage, torch.randn(5, 6), torch.randn(5, 4)


@checker("13_split_backward")
def check_split_backward(my_split_backward) -> str:
    """`my_split_backward(output, x, weights, grad_output)` -> (the input's gradient, a function W
    that later fills the weights' `.grad`): the I step must not compute the weights' gradients,
    so the previous stage gets its gradient sooner (ZB-H1, ZB-V)."""
    stage, x, grad_out = split_backward_case()
    x.requires_grad_()
    stage(x).backward(grad_out)
    want_x, want = x.grad.clone(), {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    weights = list(stage.parameters())
    answer = call(my_split_backward, stage(x), x, weights, grad_out)
    if not (isinstance(answer, tuple) and len(answer) == 2 and callable(answer[1])):
        raise Wrong(f"my_split_backward returned {type(answer).__name__}; return (input_grad, weight_step)")
    x_grad, weight_step = answer
    early = [n for n, p in stage.named_parameters() if p.grad is not None]
    if early:
        raise Wrong(f"after I, {early[0]} already has its gradient: I computes only the input's "
                    "(torch.autograd.grad(output, [x], grad_output, retain_graph=True)); the weights' wait for W")
    if not isinstance(x_grad, torch.Tensor) or not same(x_grad, want_x):
        got = how_far(x_grad, want_x) if isinstance(x_grad, torch.Tensor) else f"is {x_grad!r}"
        raise Wrong(f"the input's gradient {got}")
    try:
        weight_step()
    except RuntimeError as e:
        raise Wrong(f"W raised RuntimeError ({first_line(e)[:80]}...): keep the graph in I "
                    "(retain_graph=True), W still needs it") from None
    for name, p in stage.named_parameters():
        if p.grad is None or not same(p.grad, want[name]):
            raise Wrong(f"after W, {name}'s gradient " + ("is None" if p.grad is None else how_far(p.grad, want[name])))
    return "I gave the input's gradient alone, W then the weights': both equal one full backward's"

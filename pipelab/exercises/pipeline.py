"""Exercises of the pipeline lessons (06-08), each one a bug the field keeps reporting: gradients
scaled wrong under gradient accumulation (06), a 1F1B that accepts fewer micro-batches than stages
(07), tied weights whose gradients are not summed across the stages holding them (08), and the
partition by parameters (08). The two-stage pipeline here is small and written out: rank 0 holds
stage 0, rank 1 stage 1, activations go right and gradients left."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipelab.exercises.core import Wrong, call, checker, first_line, how_far, on_ranks, same, scale_text, student_call, unchanged
from pipelab.exercises.recorder import COLLECTIVES
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
                scaled = scale_text(g, want[name], hints.get(rank))
                text = scaled or f"{how_far(g, want[name])}; {tip}"
                raise Wrong(f"rank {rank} (stage {rank}), parameter {name}: your gradient {text}")


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
            if inp.grad is None:
                raise Wrong("stage 1: after your backward, its input (the activation stage 0 sent) has no gradient, so "
                            "there is nothing to send back: no gradient at all flowed (use .backward, which fills "
                            ".grad; torch.autograd.grad only returns gradients)")
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
        actions = []
        for r in range(p):
            try:
                actions.append(list(my_1f1b_actions(r, p, m)))
            except ValueError as e:
                raise Wrong(f"rank {r} refused {m} micro-batches on {p} ranks ({first_line(e)}), but that is enough: "
                            "only fewer micro-batches than stages leaves the pipeline unfilled") from None
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001
                raise Wrong(f"with {p} ranks and {m} micro-batches, rank {r}: my_1f1b_actions raised "
                            f"{type(e).__name__}: {first_line(e)}") from None
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
    for p, m in [(4, 2), (2, 1), (4, 3)]:
        for r in range(p):  # every rank must refuse: one that accepts would start and wait forever
            try:
                my_1f1b_actions(r, p, m)
            except ValueError as e:
                if str(m) not in str(e) or str(p) not in str(e):
                    raise Wrong(f"rank {r} refused {m} micro-batches on {p} ranks, but the message does not name both "
                                f"numbers: {e}") from None
                continue
            except Exception as e:  # noqa: BLE001
                raise Wrong(f"with {m} micro-batches on {p} ranks, rank {r} raised {type(e).__name__}, not a "
                            f"ValueError: {e}") from None
            raise Wrong(f"rank {r} accepted {m} micro-batch(es) on {p} ranks: with fewer micro-batches than stages the "
                        "pipeline never fills (torchtitan#775 hung); every rank must raise ValueError naming both numbers")
    return "1F1B order valid with at most num_ranks - rank micro-batches in flight; fewer micro-batches than stages refused on every rank"


# ---------------------------------------------------------------------------------------------
# 08: partition by parameters; tied weights
# ---------------------------------------------------------------------------------------------


def _stage_sums(weights: list[int], bounds: list[int]) -> list[int]:
    return [sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def best_split(weights: list[int], parts: int) -> tuple[int, int]:
    """(the smallest heaviest-minus-lightest, the smallest heaviest) over every split into `parts`
    non-empty contiguous stages (tried one by one: the lists are short)."""
    from itertools import combinations

    sums = [_stage_sums(weights, [0, *cuts, len(weights)]) for cuts in combinations(range(1, len(weights)), parts - 1)]
    return min(max(s) - min(s) for s in sums), min(max(s) for s in sums)


# each needs more than equal layer counts, and more than the smallest heaviest stage alone
PARTITION_CASES = [([80, 10, 10, 80, 10, 10], 2), ([5, 5, 50, 5, 5, 5, 5, 20], 3), ([4, 0, 4, 0, 4, 0, 4, 0], 4),
                   ([1, 2, 3, 4, 5, 6, 7, 8], 3), ([3, 3, 3, 3, 3, 3, 3], 3)]


@checker("08_partition")
def check_partition(my_partition) -> str:
    """`my_partition(weights, num_stages)` -> stage boundaries [0, ..., len(weights)]: contiguous,
    non-empty stages whose heaviest minus lightest parameter count is as small as it can be (the
    rule of the lesson's `partition.partition_balanced`)."""
    for weights, parts in PARTITION_CASES:
        given = list(weights)
        bounds = call(my_partition, given, parts)
        unchanged("weights", list(weights), given)
        try:
            bounds = [int(b) for b in bounds]
        except (TypeError, ValueError):
            raise Wrong(f"for {parts} stages of {weights} you returned {bounds!r}, not a list of boundaries") from None
        if len(bounds) != parts + 1 or bounds[0] != 0 or bounds[-1] != len(weights) or bounds != sorted(bounds):
            raise Wrong(f"for {parts} stages of {weights} you returned {bounds}: give {parts + 1} increasing "
                        f"boundaries from 0 to {len(weights)}")
        empty = [i for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if a == b]
        if empty:
            raise Wrong(f"for {parts} stages of {weights} you returned {bounds}: stage {empty[0]} is empty "
                        "(every stage needs at least one layer)")
        sums = _stage_sums(weights, bounds)
        spread, heaviest = best_split(weights, parts)
        if max(sums) - min(sums) > spread:
            n, k = len(weights), len(weights) // parts
            why = ""
            if bounds in ([i * k for i in range(parts)] + [n], [round(i * n / parts) for i in range(parts + 1)]):
                why = ": the stages hold equal numbers of layers; the rule balances parameters, not layers"
            elif max(sums) == heaviest:
                why = (f": your heaviest stage is as light as it can be ({heaviest}), but the rule is the smallest "
                       "heaviest-minus-lightest, which can need a heavier heaviest stage")
            raise Wrong(f"for {parts} stages of {weights}: your stages hold {sums} parameters, heaviest minus lightest "
                        f"{max(sums) - min(sums)}, where the best split's is {spread}{why}")
    return f"{len(PARTITION_CASES)} layer lists cut into non-empty stages with the smallest heaviest-minus-lightest"


VOCAB, DIM = 10, 6


def tied_case():
    """An embedding on stage 0 and an output head on stage 1 sharing one weight, and a batch."""
    torch.manual_seed(8)
    weight = torch.randn(VOCAB, DIM)
    ids, targets = torch.randint(0, VOCAB, (BATCH,)), torch.randint(0, VOCAB, (BATCH,))
    return weight, ids, targets


TIED_RANKS, TIED_HOLDERS = 3, (0, 2)  # the embedding on the first stage, the head on the last


def _tied_rank(ctx: RankContext, fn) -> dict | None:
    """Three stages: the embedding (rank 0), a tanh (rank 1, no tied weight), the head (rank 2)."""
    weight, ids, targets = tied_case()
    group = dist.new_group(list(TIED_HOLDERS))
    tied = nn.Parameter(weight.clone())  # each holder has its own copy of the tied weight
    if ctx.rank == 0:
        h = nn.functional.embedding(ids, tied)
        dist.send(h.detach(), dst=1)
        grad = torch.empty_like(h)
        dist.recv(grad, src=1)
        h.backward(grad)
    elif ctx.rank == 1:
        h = torch.empty(BATCH, DIM)
        dist.recv(h, src=0)
        h.requires_grad_()
        out = torch.tanh(h)
        dist.send(out.detach(), dst=2)
        grad = torch.empty_like(out)
        dist.recv(grad, src=2)
        out.backward(grad)
        dist.send(h.grad, dst=0)
        return None
    else:
        h = torch.empty(BATCH, DIM)
        dist.recv(h, src=1)
        h.requires_grad_()
        nn.functional.cross_entropy(h @ tied.T, targets).backward()
        dist.send(h.grad, dst=1)
    part = tied.grad
    mine = part.clone()

    def refuse(c):
        if c.op in COLLECTIVES and c.group != TIED_HOLDERS:
            over = "every rank" if c.group is None else f"ranks {list(c.group)}"
            return (f"wrong group: your {c.op} on rank {ctx.rank} runs over {over}, but only ranks {list(TIED_HOLDERS)} "
                    "hold the tied weight (rank 1, the middle stage, never joins): pass group=group")
        return None

    _, rec = student_call(ctx, fn, tied, group, refuse=refuse)
    return {"grad": None if tied.grad is None else tied.grad.clone(), "part": mine, "touched": rec.touched(part),
            "collectives": [c.op for c in rec.collectives()]}


@checker("08_tied_weights")
def check_tied_weights(my_tied_grads) -> str:
    """`my_tied_grads(weight, group)`: the first stage's embedding and the last stage's output head
    share one weight, a copy on each of the two ranks of `group`; after backward each copy holds
    only its stage's part of the gradient. Make both hold the whole gradient (so both take the
    same step). Run on 3 ranks: the middle one holds no copy and does not call it."""
    weight, ids, targets = tied_case()
    tied = nn.Parameter(weight.clone())
    nn.functional.cross_entropy(torch.tanh(nn.functional.embedding(ids, tied)) @ tied.T, targets).backward()
    want = tied.grad
    results = on_ranks(_tied_rank, TIED_RANKS, my_tied_grads)
    parts = {rank: results[rank]["part"] for rank in TIED_HOLDERS}
    for rank in TIED_HOLDERS:
        r, other = results[rank], parts[TIED_HOLDERS[1] if rank == TIED_HOLDERS[0] else TIED_HOLDERS[0]]
        got = r["grad"]
        if got is None:
            raise Wrong(f"rank {rank}: the tied weight's .grad is None after your function: sum into it, do not drop it")
        if same(got, want):
            continue
        if same(got, r["part"]):
            raise Wrong(f"rank {rank}: the tied weight's gradient is still this stage's part only: "
                        + (f"your {r['collectives'][0]} ran on a temporary (a new tensor), so weight.grad never saw "
                           "the result" if r["collectives"] and not r["touched"] else
                           f"nothing summed the other stage's part into it (calls: {r['collectives'] or 'none'})"))
        if same(got, other):
            raise Wrong(f"rank {rank}: the tied weight's gradient is the other stage's part alone: this stage's part "
                        "is missing (copied or broadcast where the two parts are summed)")
        text = how_far(got, want, {0.5: "an average: the tied weight's gradient is the SUM of the stages' parts"})
        raise Wrong(f"rank {rank}: the tied weight's gradient {text}")
    return "both holders of the tied weight hold its whole gradient, the sum of the embedding's and the head's parts"


# ---------------------------------------------------------------------------------------------
# 13: zero bubble's split backward (I, then W later)
# ---------------------------------------------------------------------------------------------


def split_backward_case():
    torch.manual_seed(13)
    stage = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4))
    return stage, torch.randn(5, 6), torch.randn(5, 4)


FROM_GRAD_OUTPUT = "start from grad_output, the gradient the next stage sent back (autograd.grad(output, ..., grad_output))"


def _seeded_by_ones(stage, x) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The input's and weights' gradients of output.sum(): what an answer that drops grad_output gets."""
    x = x.detach().requires_grad_()
    grads = torch.autograd.grad(stage(x).sum(), [x, *stage.parameters()])
    return grads[0], {n: g for (n, _), g in zip(stage.named_parameters(), grads[1:])}


@checker("13_split_backward")
def check_split_backward(my_split_backward) -> str:
    """`my_split_backward(output, x, weights, grad_output)` -> (the input's gradient, a function W
    that later fills the weights' `.grad`): the I step must not compute the weights' gradients,
    so the previous stage gets its gradient sooner (ZB-H1, ZB-V)."""
    stage, x, grad_out = split_backward_case()
    x.requires_grad_()
    stage(x).backward(grad_out)
    want_x, want = x.grad.clone(), {n: p.grad.clone() for n, p in stage.named_parameters()}
    # what earlier micro-batches left in .grad: W adds to it, as backward does
    gen = torch.Generator().manual_seed(31)
    earlier = {n: torch.randn(p.shape, generator=gen) for n, p in stage.named_parameters()}
    for n, p in stage.named_parameters():
        p.grad = earlier[n].clone()
    x = x.detach().requires_grad_()
    ones_x, ones = _seeded_by_ones(stage, x)
    x_kept = x.detach().clone()
    input_grads = []  # every time autograd computes the input's gradient
    x.register_hook(lambda g: input_grads.append(1))
    weights = list(stage.parameters())
    answer = call(my_split_backward, stage(x), x, weights, grad_out)
    if not (isinstance(answer, tuple) and len(answer) == 2 and callable(answer[1])):
        raise Wrong(f"my_split_backward returned {type(answer).__name__}; return (input_grad, weight_step)")
    unchanged("x", x_kept, x.detach())
    x_grad, weight_step = answer
    for n, p in stage.named_parameters():
        if p.grad is None or not torch.equal(p.grad, earlier[n]):
            raise Wrong(f"after I, {n}'s .grad " + ("was set to None" if p.grad is None else "changed")
                        + ": I computes only the input's gradient; the weights' wait for W")
    if not isinstance(x_grad, torch.Tensor) or not same(x_grad, want_x):
        if isinstance(x_grad, torch.Tensor) and same(x_grad, ones_x):
            raise Wrong("the input's gradient is that of output.sum() (a seed of ones): " + FROM_GRAD_OUTPUT)
        got = how_far(x_grad, want_x) if isinstance(x_grad, torch.Tensor) else f"is {x_grad!r}"
        raise Wrong(f"the input's gradient {got}")
    computed, x_grad_kept = len(input_grads), None if x.grad is None else x.grad.clone()
    try:
        weight_step()
    except RuntimeError as e:
        raise Wrong(f"W raised RuntimeError ({first_line(e)[:80]}...): keep the graph in I "
                    "(retain_graph=True), W still needs it") from None
    if len(input_grads) > computed or (x.grad is not None and (x_grad_kept is None or not torch.equal(x.grad, x_grad_kept))):
        raise Wrong("W computed the input's gradient again: that is I's work, already done; W computes the weights' "
                    "gradients only (inputs=weights)")
    for name, p in stage.named_parameters():
        if p.grad is None:
            raise Wrong(f"after W, {name}'s .grad is None: W must add the weights' gradients to .grad")
        if same(p.grad, earlier[name] + want[name]):
            continue
        if same(p.grad, want[name]):
            raise Wrong(f"after W, {name}'s .grad holds this micro-batch's gradient alone: W overwrote what earlier "
                        "micro-batches had accumulated there; add to .grad, as backward does")
        if same(p.grad, earlier[name]):
            raise Wrong(f"after W, {name}'s .grad is unchanged: W computed nothing into .grad (a missing part)")
        if same(p.grad - earlier[name], ones[name]):
            raise Wrong(f"after W, {name}'s .grad gained the gradient of output.sum() (a seed of ones): " + FROM_GRAD_OUTPUT)
        raise Wrong(f"after W, {name}'s .grad less what was there before {how_far(p.grad - earlier[name], want[name])}")
    return "I gave the input's gradient alone, W then added the weights' to .grad: both equal one full backward's"

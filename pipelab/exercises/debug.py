"""Lesson 17's exercise, find the bug: `broken_step` trains data parallel with gradient accumulation
and its loss looks right, but its gradients are not one process's. The student writes `my_step`,
the same step fixed. The checker runs it on two real ranks under NCCL's ordering rule (a collective
that only one rank calls fails within seconds, as it would hang on GPUs), compares every rank's
gradients with one process's, and names what a wrong answer still gets wrong."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipelab.debug.compare import rank_gradients, reference_gradients
from pipelab.debug.consistency import collective_check
from pipelab.exercises.core import Wrong, checker, how_far, on_ranks, same

WORLD_SIZE = 2
NUM_MICROBATCHES = 4


def broken_step(ctx, model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
                num_microbatches: int = NUM_MICROBATCHES) -> float:
    """Data parallel with gradient accumulation: this rank's rows in micro-batches, then the sync.
    Returns this rank's share of the loss. Its loss is right; one line loses gradients."""
    xs, ys = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
    total = 0.0
    for xm, ym in zip(xs.chunk(num_microbatches), ys.chunk(num_microbatches)):
        model.zero_grad()
        loss = loss_fn(model, xm, ym) / num_microbatches
        loss.backward()
        total += loss.item()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= ctx.world_size
    return total


def case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The exercise's model and batch (16 rows: 8 per rank, 2 per micro-batch)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def last_microbatch_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """What `broken_step` computes, in one process: each rank's last micro-batch only, averaged."""
    model = copy.deepcopy(model)  # fresh .grad
    lasts = [(xr.chunk(NUM_MICROBATCHES)[-1], yr.chunk(NUM_MICROBATCHES)[-1])
             for xr, yr in zip(x.chunk(WORLD_SIZE), y.chunk(WORLD_SIZE))]
    loss = sum(mse(model, xm, ym) for xm, ym in lasts) / (NUM_MICROBATCHES * WORLD_SIZE)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


HINTS = {2.0: "the gradients are summed over the 2 ranks, not averaged: divide by world_size after the all-reduce",
         4.0: "each micro-batch's loss must be divided by num_microbatches, so that the accumulated sum is the mean",
         0.5: "divided once too often: by world_size twice, or by num_microbatches and by the rows again",
         0.25: "divided by num_microbatches twice"}


def checked_step(ctx, step, model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor):
    """The student's step on a rank under the lesson's collective check: a collective that only
    some ranks call is named within seconds (gloo alone would fail with a closed connection)."""
    with collective_check(3.0):
        return rank_gradients(ctx, step, model, loss_fn, x, y)


@checker("17_find_the_bug")
def check_find_the_bug(my_step) -> str:
    """Run `my_step` on 2 ranks; its gradients must equal one process's on every rank, its loss too."""
    model, x, y = case()
    try:
        results = on_ranks(checked_step, WORLD_SIZE, my_step, model, mse, x, y)
    except Wrong as e:
        if "has not called collective" in str(e):
            raise Wrong(f"{e}: on GPUs this hangs; every rank must call every collective (here the all-reduce of "
                        "every gradient), in the same order") from None
        raise
    ref_loss, ref = reference_gradients(model, mse, x, y)
    grads = [g for _, g in results]
    missing = [n for n in ref if any(n not in g for g in grads)]
    if missing:
        raise Wrong(f"after my_step, {missing[0]!r} has no gradient on some rank: every rank must run the backward")
    name = next((n for n in ref if not same(grads[0][n], grads[1][n])), None)
    if name is not None:
        raise Wrong(f"rank 0's and rank 1's gradients of {name!r} differ after the step: the ranks never averaged "
                    "them (every rank must all-reduce every gradient, then divide by world_size)")
    lasts = last_microbatch_gradients(model, x, y)
    if all(same(grads[0][n], lasts[n]) for n in ref):
        raise Wrong("your gradients are those of each rank's last micro-batch only: model.zero_grad() inside the "
                    "micro-batch loop discards what the earlier micro-batches accumulated; zero once, before the loop")
    for n in ref:
        if not same(grads[0][n], ref[n]):
            raise Wrong(f"the gradient of {n!r} {how_far(grads[0][n], ref[n], HINTS)} (one process's)")
    losses = [loss for loss, _ in results]
    if any(loss is None for loss in losses) or abs(sum(losses) / len(losses) - ref_loss) > 1e-5:
        raise Wrong(f"the ranks' losses average {sum(l or 0 for l in losses) / len(losses):.5f} where one process's "
                    f"loss is {ref_loss:.5f}: return this rank's share, the mean of its micro-batches' losses")
    return (f"every gradient on both ranks equals one process's ({len(ref)} parameters), "
            f"and so does the loss ({ref_loss:.4f})")

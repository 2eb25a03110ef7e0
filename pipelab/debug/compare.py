"""The course's habit as one call: run a user's distributed step on real ranks and the same step's
math in one process, and say where the ranks' gradients or loss depart from it.

Every rank gets the same starting model and the whole batch; `step(ctx, model, loss_fn, x, y)`
does what the user's training does on that rank (take its share of the batch, its stage of the
model, its micro-batches, its all-reduces) and returns the rank's share of the loss or None (the
mean over the ranks that return one must be the batch's loss: a pipeline's last stage returns it
whole, the others None). The reference is `loss_fn(model, x, y)` and
one backward, in one process. Every gradient a rank holds is compared with the reference's: a
gradient that is a multiple of the reference's is named with its factor (2x: summed twice, or
summed where it should be averaged), any other difference with its size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


def factor(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The number `got` is of `want` when it is one (least squares fit, then checked), else None."""
    got, want = got.double().flatten(), want.double().flatten()
    if float(want @ want) == 0:
        return None
    k = float(got @ want / (want @ want))
    return k if torch.allclose(got, k * want, rtol=1e-4, atol=1e-7) else None


def how_it_differs(got: torch.Tensor, want: torch.Tensor) -> str:
    """'2.00x the one-process gradient' or 'off by up to 0.031'."""
    k = factor(got, want)
    if k is not None:
        return f"{k:.2f}x the one-process gradient"
    return f"off by up to {(got.double() - want.double()).abs().max().item():.3g} from the one-process gradient"


@dataclass(frozen=True)
class Comparison:
    """What the ranks did beside one process: the loss both ways, and per rank the parameters whose
    gradients differ (name -> how)."""

    loss: float | None
    reference_loss: float
    differ: dict[int, dict[str, str]]
    compared: int  # gradients compared, over all ranks

    @property
    def same(self) -> bool:
        loss_ok = self.loss is None or abs(self.loss - self.reference_loss) <= 1e-5 * max(1.0, abs(self.reference_loss))
        return loss_ok and not self.differ

    def __str__(self) -> str:
        lines = []
        if self.loss is not None:
            lines.append(f"loss {self.loss:.6f} on the ranks, {self.reference_loss:.6f} in one process")
        for rank, params in self.differ.items():
            name, how = next(iter(params.items()))
            lines.append(f"rank {rank}: {len(params)} gradient(s) differ, first {name!r}: {how}")
        if not self.differ:
            lines.append(f"all {self.compared} gradients the ranks hold equal one process's")
        return "\n".join(lines)


def reference_gradients(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor):
    """The step's math in one process: the loss and every parameter's gradient."""
    model = copy.deepcopy(model)
    loss = loss_fn(model, x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rank_gradients(ctx, step: Callable, model: nn.Module, loss_fn: Callable, x, y) -> tuple[float | None, dict]:
    """On a rank: run the user's step, return its loss share and the gradients the rank holds."""
    loss = step(ctx, model, loss_fn, x, y)
    return (None if loss is None else float(loss),
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def compare(results: list[tuple[float | None, dict]], reference: tuple[float, dict], rtol: float = 1e-4) -> Comparison:
    """The ranks' (loss, gradients) beside the reference's."""
    ref_loss, ref_grads = reference
    losses = [loss for loss, _ in results if loss is not None]
    differ, compared = {}, 0
    for rank, (_, grads) in enumerate(results):
        bad = {}
        for name, g in grads.items():
            compared += 1
            if not torch.allclose(g, ref_grads[name], rtol=rtol, atol=1e-6):
                bad[name] = how_it_differs(g, ref_grads[name])
        if bad:
            differ[rank] = bad
    loss = sum(losses) / len(losses) if losses else None
    return Comparison(loss, ref_loss, differ, compared)


def compare_with_one_process(step: Callable, model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
                             world_size: int = 2, timeout: float = 60.0, **spawn_kwargs) -> Comparison:
    """Run `step(ctx, model, loss_fn, x, y)` on `world_size` real ranks (each with a copy of
    `model` and the whole batch) and `loss_fn(model, x, y).backward()` in one process; compare."""
    from pipelab.launch import spawn

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module (every rank gets a copy), got {type(model).__name__}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have as many rows, got {x.shape[0]} and {y.shape[0]}")
    results = spawn(rank_gradients, world_size, step, model, loss_fn, x, y, timeout=timeout, **spawn_kwargs)
    return compare(results, reference_gradients(model, loss_fn, x, y))

"""The single-process reference every parallel run is checked against, and the check.

Same model (a deep copy, so the caller's weights stay as they are), same data, same loss, same
SGD steps, in this process: the losses, the gradients of the first step and the weights after the
last. A data-parallel, model-parallel or pipelined run computes the same thing, only elsewhere, so
`assert_same(run, reference)` holds up to float rounding.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from pipelab.build import materialize

Tensors = Mapping[str, "torch.Tensor | None"]


@dataclass
class Reference:
    """What one process computes: a loss per step, the first step's gradients, the final weights."""

    losses: list[float]  # one per step, before its optimizer step
    grads: dict[str, torch.Tensor | None]  # parameter name -> gradient of the first step
    weights: dict[str, torch.Tensor]  # parameter name -> weight after the last step

    @property
    def loss(self) -> float:
        """The first step's loss."""
        return self.losses[0]


@contextmanager
def exact_fp32():
    """Inside: float32 matrix products and convolutions in full float32 on CUDA, TF32 off
    (`torch.backends.cuda.matmul.allow_tf32`, `torch.backends.cudnn.allow_tf32`; cuDNN's is on by
    default, and TF32 keeps 10 bits of mantissa, so a GPU result would miss a float32 reference at
    1e-5). The flags are restored after. Use it (or its decorator form) around what an equality
    check compares; on a CPU the flags change nothing."""
    # Only the two flags: torch 2.13 refuses to read the precision once the flags and
    # set_float32_matmul_precision have both been used in one process.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@exact_fp32()
def reference_run(model: nn.Module, x, y, loss_fn: Callable, steps: int = 1,
                  lr: float | None = 0.1) -> Reference:
    """Train a copy of `model` on the whole batch in this process: `steps` SGD steps with `lr`
    (or, with `lr=None`, one forward and backward and no update). A model built on the meta device
    (`pipelab.build.on_meta`) gets here the weights each rank gives its own stages."""
    model = materialize(copy.deepcopy(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr) if lr is not None else None
    losses, grads = [], None
    for _ in range(steps if optimizer is not None else 1):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if grads is None:
            grads = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                     for n, p in model.named_parameters()}
        if optimizer is not None:
            optimizer.step()
        losses.append(loss.item())
    weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return Reference(losses, grads, weights)


def perturb(module: nn.Module, seed: int) -> None:
    """Give this replica other weights, as if its rank had built the model with its own seed (add
    noise drawn from `seed`): a data-parallel wrapper's broadcast must then make the replicas equal,
    and a run that skipped it fails `assert_same`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device))


def _holders(tensors: Tensors | Sequence[Tensors]) -> list[Tensors]:
    """A run's tensors as a list of holders (a rank or a stage each); one dict is one holder."""
    return [tensors] if isinstance(tensors, Mapping) else list(tensors)


def _compare(what: str, got_all: Tensors | Sequence[Tensors], want: Tensors, label: str,
             atol: float, rtol: float) -> float:
    """Check every tensor every holder has against the reference's; together the holders must
    cover every reference name (a pipeline's stages each hold a part). Return the worst difference."""
    worst, seen = 0.0, set()
    for holder in _holders(got_all):
        for name, got in holder.items():
            if name not in want:
                raise AssertionError(f"{label}{what} of {name!r}: the reference has no such parameter "
                                     f"(it has {sorted(want)[:6]}...)")
            expected = want[name]
            if (got is None) != (expected is None):
                raise AssertionError(f"{label}{what} of {name}: {'None' if got is None else 'a tensor'}, "
                                     f"expected {'None' if expected is None else 'a tensor'}")
            if got is not None:
                torch.testing.assert_close(got.detach().cpu(), expected, atol=atol, rtol=rtol,
                                           msg=lambda m, n=name: f"{label}{what} of {n}: {m}")
                worst = max(worst, (got.detach().cpu() - expected).abs().max().item())
            seen.add(name)
    missing = sorted(set(want) - seen)
    if missing:
        raise AssertionError(f"{label}no part of the run holds the {what} of {missing}")
    return worst


def assert_same(run, ref: Reference, atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """Assert a parallel `run` computed what the single process did; return the largest gradient
    difference.

    `run` has `losses` (one per step it ran, compared with the reference's first ones), `grads`
    (of the first step) and optionally `weights` (after its last step; None to skip) and
    `replica_spread` (how far its data-parallel replicas drifted apart). `grads` and `weights` are
    one dict name -> tensor, or a list of them, one per rank or stage, named as in the reference."""
    label = f"{getattr(run, 'name', '') or ''}: " if getattr(run, "name", None) else ""
    losses = list(run.losses)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref.losses[:len(losses)], dtype=torch.float64), atol=atol, rtol=rtol,
                               msg=lambda m: f"{label}losses: {m}")
    spread = getattr(run, "replica_spread", None)
    if spread is not None and spread > atol:
        raise AssertionError(f"{label}the data-parallel replicas differ by up to {spread:.2e}")
    worst = _compare("gradient", run.grads, ref.grads, label, atol, rtol)
    weights = getattr(run, "weights", None)
    if weights is not None:
        _compare("weight", weights, ref.weights, label, atol, rtol)
    return worst

"""Where the memory goes: the bytes a rank really holds for training, counted from tensor
storages, and the formula of the ZeRO paper beside them.

A tensor is a view of a storage (a block of memory); several tensors may share one (a parameter
that is a view into a flat vector, a DTensor's local shard). So we count each storage once, at its
real size, and a storage freed to size 0 (a ZeRO-3 layer between uses) counts as nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn


@dataclass(frozen=True)
class Held:
    """Bytes one rank holds for training: parameters, gradients, optimizer state (activations and
    communication buffers aside)."""

    parameters: float
    gradients: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (torch's FSDP2 keeps its parameters as DTensors); else `t`."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (each counted once, also across calls that
    share `seen`)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The parameter tensors the modules hold right now: registered parameters, and plain tensors
    put in their place (a ZeRO-3 layer's views into its gathered vector)."""
    found = []
    for m in model.modules():
        found += [p for p in m._parameters.values() if p is not None]
        found += [t for t in vars(m).values() if isinstance(t, torch.Tensor)]
    return found


def held_by(model: nn.Module, optimizer: torch.optim.Optimizer, extra: Iterable[torch.Tensor] = ()) -> Held:
    """What this rank holds: the model's parameter tensors, the optimizer's (and `extra`), their
    gradients, and the optimizer's state (for torch's ZeroRedundancyOptimizer, its local shard's)."""
    inner = getattr(optimizer, "optim", optimizer)
    params = module_tensors(model) + [p for g in optimizer.param_groups for p in g["params"]] + list(extra)
    grads = [p.grad for p in params if p.is_leaf and p.grad is not None]
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    seen: set = set()
    return Held(storage_bytes(params, seen), storage_bytes(grads, seen), storage_bytes(state, seen))


STAGES = ("dp", "zero1", "zero2", "zero3")


def formula(stage: str, psi: float, world_size: int, param_bytes: float = 4, grad_bytes: float = 4,
            state_bytes: float = 8) -> Held:
    """The ZeRO paper's bytes per rank for Ψ parameters on N ranks: each stage divides one more of
    parameters, gradients and optimizer state by N. fp32 with Adam (two moments): 4 + 4 + 8 bytes
    per parameter; the paper's mixed precision: param_bytes=2, grad_bytes=2, state_bytes=12."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    n = world_size
    shard = {"dp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}[stage]
    return Held(param_bytes * psi / shard[0], grad_bytes * psi / shard[1], state_bytes * psi / shard[2])


class PeakMeter:
    """The most bytes `held_by` counts at any layer boundary of a step: sampled before and after
    each layer's forward, and when the gradient of its output arrives in backward (module and
    tensor hooks, so it reads our trainers and torch's the same way). Samples, not every
    allocation: a peak between two samples goes unseen."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Iterable[torch.Tensor] = ()):
        self.model, self.optimizer, self.extra = model, optimizer, list(extra)
        self.peak = 0.0
        self.handles = []
        for m in model.modules():
            if m is model or not list(m.children()):
                self.handles += [m.register_forward_pre_hook(lambda *a: self.sample()),
                                 m.register_forward_hook(self.after_forward, prepend=True)]

    def after_forward(self, module, args, out) -> None:
        self.sample()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self.sample())

    def sample(self) -> None:
        self.peak = max(self.peak, held_by(self.model, self.optimizer, self.extra).total)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

"""16-bit weights for the math, fp32 master weights for the update (Micikevicius et al., 2018).

An update lr * grad is often smaller than half the gap between a bf16 weight and its neighbour
(bf16 keeps 8 significant bits: near 1.0 the gap is 2^-7), so added to a bf16 weight it rounds
away and the weight never moves. The optimizer therefore steps an fp32 copy, the master weights,
and the 16-bit model is refreshed from it after every step. Bytes per parameter, the ZeRO paper's
count: 2 (16-bit weights) + 2 (16-bit gradients) + 4 (fp32 master) + 8 (Adam's two fp32 moments)
= 16, the same as training in fp32. Mixed precision saves time and activations, not weights.
"""

from __future__ import annotations

import torch
from torch import nn

# bytes per parameter: (parameters, gradients, optimizer state) with Adam's two moments
RECIPES: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 8),  # fp32 weights and gradients, Adam's moments
    "bf16 autocast": (4, 4, 8),  # torch.autocast: fp32 weights and gradients, 16-bit math inside
    "bf16 + fp32 master": (2, 2, 12),  # 16-bit weights and gradients; master weights + moments in fp32
}


def bytes_per_parameter(recipe: str) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes per parameter of `recipe` (see RECIPES)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    return RECIPES[recipe]


class MasterWeights:
    """Train `model`, whose parameters are 16-bit, through fp32 copies: backward fills the 16-bit
    gradients, `step` copies them into the masters' fp32 `.grad`, steps the optimizer on the
    masters, and rounds the masters back into the model's weights."""

    def __init__(self, model: nn.Module, make_optimizer, dtype: torch.dtype = torch.bfloat16):
        self.model = model.to(dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = make_optimizer(self.master)

    def step(self) -> None:
        """One optimizer step on the fp32 masters; the 16-bit model gets their rounded values."""
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for m in self.master:
            m.grad = None  # the fp32 gradient lives only during the update
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)  # rounds to the model's 16-bit format
        self.model.zero_grad(set_to_none=False)

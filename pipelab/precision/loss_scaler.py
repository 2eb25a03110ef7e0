"""fp16's dynamic loss scaling, as Micikevicius et al. ("Mixed Precision Training", ICLR 2018) and
torch.amp.GradScaler do it.

fp16 keeps 10 bits of mantissa and 5 of exponent: its smallest positive value is 6e-8, so small
gradients round to zero in backward and the weights they belong to stop learning. Multiplying the
loss by a large `scale` multiplies every gradient by it too (backward is linear), lifting them into
fp16's range; the gradients are divided by `scale` again (in fp32) before the optimizer sees them.
Too large a scale overflows to inf: then the step is skipped and the scale halved. After
`growth_interval` good steps in a row the scale doubles, to find the largest scale that fits.
"""

from __future__ import annotations

from typing import Iterable

import torch


class DynamicLossScaler:
    """Scale the loss, unscale the gradients, skip steps whose gradients are not finite, and adapt
    the scale: halve it on inf/nan, double it after `growth_interval` finite steps in a row."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0  # finite steps since the last overflow or growth
        self.skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale: backward then gives scale times every gradient."""
        return loss * self.scale

    def unscale(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale, in place; True if all of them are finite."""
        finite = True
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / self.scale)  # a power of two: the division is exact
                finite &= bool(torch.isfinite(p.grad).all())
        return finite

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, then step the optimizer unless a gradient overflowed; update the scale.
        Returns whether the step was taken."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        finite = self.unscale(params)
        if finite:
            optimizer.step()
        else:
            self.skipped += 1  # the weights stay as they were: this step's gradients are garbage
        self.update(found_inf=not finite)
        return finite

    def update(self, found_inf: bool) -> None:
        """The update rule: back off on an overflow, grow after a run of good steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

"""FP8 with per-tensor scaling, as NVIDIA's Transformer Engine does it.

e4m3 keeps 3 mantissa bits and reaches only 448, so a tensor is multiplied by a `scale` that
puts its largest magnitude (its amax) near 448 before the cast, and the product is divided by the
scales afterwards. *Current* scaling takes amax from the tensor itself (an extra pass over it
before every cast); *delayed* scaling takes the largest amax of the last few steps (a history),
known before the tensor is computed, at the risk of a tensor that grew since then overflowing.
Where no FP8 matrix unit exists (here, a CPU) the FP8 values are multiplied in a higher precision:
the rounding is FP8's, the arithmetic is not.
"""

from __future__ import annotations

from collections import deque

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def amax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in `x` (a 0-d fp32 tensor)."""
    return x.detach().abs().max().float()


def scale_for(amax_value: torch.Tensor, fp8_max: float = E4M3_MAX, margin: int = 0) -> torch.Tensor:
    """The scale that maps `amax_value` to fp8_max / 2^margin (1 for an all-zero tensor)."""
    a = torch.as_tensor(amax_value, dtype=torch.float32)
    return torch.where(a > 0, fp8_max / (2.0 ** margin) / a, torch.ones_like(a))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """x * scale cast to FP8; values past the format's max saturate to it (e4m3fn has no inf)."""
    fp8_max = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Back from FP8: the stored value divided by its scale, in fp32."""
    return q.float() / scale


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a @ b with both operands cast to e4m3 under their scales, multiplied in fp32 (an FP8 matrix
    unit accumulates in fp32 too), and unscaled by both scales."""
    qa, qb = quantize(a, scale_a), quantize(b, scale_b)
    return (qa.float() @ qb.float() / (scale_a * scale_b)).to(out_dtype)


class DelayedScaling:
    """The scale from the largest amax of the last `history` tensors seen, not the current one's."""

    def __init__(self, history: int = 16, margin: int = 0):
        self.amaxes: deque = deque(maxlen=history)
        self.margin = margin

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """The scale for `x`, from the history before it; then `x`'s amax joins the history."""
        known = max(self.amaxes) if self.amaxes else amax(x)  # the first tensor has no history
        self.amaxes.append(amax(x))
        return scale_for(known, margin=self.margin)

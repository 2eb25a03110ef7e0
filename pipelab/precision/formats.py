"""The number formats of training, read from torch's own `finfo`: how far each reaches (range) and
how finely it cuts (precision), and what rounding into one does to real gradients.

A float is sign, exponent and mantissa. The exponent's bits set the range (fp16's 5 bits stop at
65504 and, below 6e-5, fall into subnormals down to 6e-8); the mantissa's bits set the precision
(the gap between 1 and the next number, `eps`). bf16 keeps fp32's 8 exponent bits and only 7 of
its 23 mantissa bits: fp32's range, coarse steps. tf32 is no storage format: it is fp32 tensors fed
to tensor cores that read 10 mantissa bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    """One number format: its bits, largest value, smallest normal and subnormal, and eps."""

    name: str
    dtype: torch.dtype | None  # None for tf32 (a way of doing fp32 math, not a dtype)
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float


def format_of(name: str, dtype: torch.dtype, exponent_bits: int) -> Format:
    """A format from torch.finfo: its mantissa bits are what eps = 2^-mantissa says."""
    info = torch.finfo(dtype)
    mantissa = round(-torch.log2(torch.tensor(info.eps, dtype=torch.float64)).item())
    return Format(name, dtype, exponent_bits, mantissa, info.max, info.tiny, info.smallest_normal * info.eps, info.eps)


def _tf32() -> Format:
    """tf32: fp32's exponent (8 bits) and range, 10 mantissa bits as fp16 has."""
    fp32 = torch.finfo(torch.float32)
    return Format("tf32", None, 8, 10, fp32.max, fp32.tiny, fp32.tiny * 2.0 ** -10, 2.0 ** -10)


FORMATS: dict[str, Format] = {
    "fp32": format_of("fp32", torch.float32, 8),
    "tf32": _tf32(),
    "bf16": format_of("bf16", torch.bfloat16, 8),
    "fp16": format_of("fp16", torch.float16, 5),
    "fp8 e4m3": format_of("fp8 e4m3", torch.float8_e4m3fn, 4),
    "fp8 e5m2": format_of("fp8 e5m2", torch.float8_e5m2, 5),
}


def rounding_effect(values: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """What storing fp32 `values` in `dtype` does: the share that become zero (underflow), that
    become inf (overflow), that change at all (lost low bits), and the median relative error of
    the ones that stay finite and nonzero."""
    x = values.detach().float().flatten()
    x = x[x != 0]
    if x.numel() == 0:
        raise ValueError("rounding_effect needs at least one nonzero value")
    rounded = x.to(dtype).float()
    zero, inf = rounded == 0, ~torch.isfinite(rounded)
    kept = ~zero & ~inf
    rel = ((rounded[kept] - x[kept]) / x[kept]).abs()
    return {"underflow to zero": zero.float().mean().item(), "overflow to inf": inf.float().mean().item(),
            "changed": (rounded != x).float().mean().item(),
            "median relative error": rel.median().item() if rel.numel() else float("nan")}

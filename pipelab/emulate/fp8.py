"""Modelled time of an FP8 matrix product beside the same product in bf16, and of the extra passes FP8
costs (lesson 16): each by the calibrated roofline of the node's device."""

from __future__ import annotations

from pipelab.emulate.cost import Counts, compute_seconds
from pipelab.emulate.specs import parse_node


def fp8_rates(shape: tuple[int, int, int], node: str = "1xH100-nvlink4") -> dict[str, float]:
    """Modelled times of an m x k by k x n product in bf16 and FP8 on `node`, and of FP8's extra passes:
    amax (read) and cast (read bf16, write fp8) of both operands."""
    m, k, n = shape
    device, flops, operands = parse_node(node).device, 2 * m * k * n, m * k + k * n
    product = {d: compute_seconds(Counts(flops, nbytes * operands + 2 * m * n, 1), device, d)
               for d, nbytes in (("bf16", 2), ("fp8", 1))}
    cast = compute_seconds(Counts(0, 2 * operands + (2 + 1) * operands, 4), device, "bf16")
    return {"bf16 product (us, modelled)": product["bf16"] * 1e6, "fp8 product (us, modelled)": product["fp8"] * 1e6,
            "amax + cast of both operands (us, modelled)": cast * 1e6}

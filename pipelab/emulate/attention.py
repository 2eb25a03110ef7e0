"""Modelled time of attention computed as one fused (flash) kernel, as lesson 14's ring steps are,
and of the K/V passing beside a ring step.

Its FLOPs are the kernel's matrix products: forward Q K^T and P V (4 b h s_q s_k d); backward the
scores again, then dV, dP, dQ and dK (10 b h s_q s_k d) -- what torch's counter counts for the
course's `attend_block` and `block_grads`. The scores stay on chip, so the kernel's memory traffic
is its inputs and outputs only.
"""

from __future__ import annotations

from pipelab.emulate.cost import Counts, compute_seconds
from pipelab.emulate.model import seconds
from pipelab.emulate.specs import parse_node, torch_dtype

PRODUCTS = {"forward": 4, "backward": 10}  # FLOPs per b h s_q s_k d
TENSORS = {"forward": (2, 2), "backward": (4, 4)}  # (q-sized, k-sized) tensors read or written: q, o / k, v


def attention_flops(kind: str, shape: tuple[int, int, int, int, int]) -> float:
    """FLOPs of one fused attention `kind` ("forward" or "backward") of `shape` = (batch, heads,
    q_tokens, k_tokens, head_dim)."""
    if kind not in PRODUCTS:
        raise ValueError(f"kind must be 'forward' or 'backward', got {kind!r}")
    b, h, sq, sk, d = shape
    return float(PRODUCTS[kind] * b * h * sq * sk * d)


def flash_attention_seconds(kind: str, shape: tuple[int, int, int, int, int], node: str,
                            dtype: str = "bfloat16") -> float:
    """Modelled seconds of one fused attention `kind` of `shape` on `node`'s device."""
    b, h, sq, sk, d = shape
    q_sized, k_sized = TENSORS[kind] if kind in TENSORS else (0, 0)
    io = (q_sized * sq + k_sized * sk) * b * h * d * torch_dtype(dtype).itemsize
    return compute_seconds(Counts(attention_flops(kind, shape), io, 1), parse_node(node).device, dtype)


def ring_step_seconds(tokens: int, heads: int, head_dim: int, node: str,
                      dtype: str = "bfloat16") -> tuple[float, float]:
    """Modelled seconds of one causal zig-zag ring step, forward + backward, of a rank holding `tokens`
    tokens (it attends them to half a block of keys), and of the K/V passing beside it (forward K and
    V; backward dK and dV too), one message each way to the next rank of `node`."""
    shape = (1, heads, tokens, tokens // 2, head_dim)
    attention = sum(flash_attention_seconds(kind, shape, node, dtype) for kind in ("forward", "backward"))
    kv = 2 * tokens * heads * head_dim * torch_dtype(dtype).itemsize
    return attention, seconds("send", nbytes=kv, node=node) + seconds("send", nbytes=2 * kv, node=node)

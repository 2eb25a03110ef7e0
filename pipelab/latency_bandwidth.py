"""The latency-bandwidth model of lesson 00, below everything that predicts or models a message.

One message of m bytes takes `latency + m / bandwidth`; a collective is a sequence of such steps.
Lesson 00 fits the two figures and predicts its ring with `ring_all_reduce_time`; the emulator
(`pipelab.emulate.cost`) times collectives on an emulated node with the same formula.
"""

from __future__ import annotations


def ring_all_reduce_time(nbytes: float, world_size: int, bandwidth: float, latency: float) -> float:
    """Predicted seconds of a ring all-reduce of `nbytes` over `world_size` ranks, in the
    latency-bandwidth model, where one message of m bytes takes `latency + m / bandwidth`.

    The ring cuts the tensor into N chunks of nbytes/N. In each of its 2(N-1) steps
    (`ring_schedule`), every rank sends one chunk to its right neighbour while receiving one from
    its left, all ranks at once: a step costs one message, latency + (nbytes/N) / bandwidth. So

        T = 2(N-1) * latency + 2(N-1)/N * nbytes / bandwidth

    The bandwidth term hardly grows with N (2(N-1)/N stays below 2: every rank sends about twice
    its tensor, however many ranks there are), the latency term grows with N: large tensors pay
    bandwidth, small ones pay latency, once per step."""
    if world_size < 1 or bandwidth <= 0 or latency < 0:
        raise ValueError(f"need world_size >= 1, bandwidth > 0 and latency >= 0; got {world_size}, "
                         f"{bandwidth}, {latency}")
    n = world_size
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth

"""A whole training step at the emulated size: each pipeline stage's modelled seconds (forward,
backward, clipping and the SGD step), and one device doing every stage's work alone.

Lesson 10 trains a small model for real and times each rank as if its stage were the tutorial's,
on an H100: the stages are counted on the meta device once (`stages.emulated_stages`), in the
parent, and every rank and the simulator read the same rows.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from pipelab.emulate.cost import Counts, compute_seconds
from pipelab.emulate.specs import torch_dtype
from pipelab.emulate.stages import emulated_stages
from pipelab.emulate.table import stage_table


def itemsize(dtype: str) -> int:
    """Bytes per value of `dtype` ("bfloat16": 2)."""
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


def update_seconds(params: int, device, dtype: str) -> dict[str, float]:
    """Modelled seconds of clipping and the SGD step over `params` parameters on `device`, both
    memory-bound: clipping's norm reads every gradient and its scaling reads and writes it; SGD
    reads each weight and its gradient and writes the weight."""
    nbytes = 3 * params * itemsize(dtype)
    clip, sgd = Counts(flops=3 * params, bytes=nbytes, kernels=2), Counts(flops=2 * params, bytes=nbytes, kernels=1)
    return {"clip": compute_seconds(clip, device, dtype), "optimizer": compute_seconds(sgd, device, dtype)}


def stage_rows(stages: Sequence[nn.Module], example: torch.Tensor, loss_fn: Callable, node, dtype: str) -> list[dict]:
    """Per stage (on meta, fed `example`, the last with `loss_fn`): its parameters, its modelled F,
    I, W and B (`emulated_stages`) on `node`'s device, and its clipping and SGD step."""
    counted = emulated_stages(stages, example, loss_fn, node, dtype, optimizer="sgd")
    rows = []
    for s, stage in enumerate(stages):
        params = sum(p.numel() for p in stage.parameters())
        rows.append({"stage": s, "parameters": params, **counted[s].seconds, **update_seconds(params, node.device, dtype)})
    return rows


def one_device_seconds(model: nn.Module, example: torch.Tensor, loss_fn: Callable, node, dtype: str) -> float:
    """Modelled seconds of one training step of the whole `model` (on meta) on ONE device of `node`:
    its forward and backward with its loss on `example` (the whole step's batch), then clipping and
    the SGD step over all its parameters. No messages: nothing to send."""
    row = stage_rows([model], example, loss_fn, node, dtype)[0]
    return row["F"] + row["B"] + row["clip"] + row["optimizer"]


def time_stage(emulator, row: dict, real_bytes: int, stage: int, dtype: str) -> None:
    """Time a rank's spans by its stage's `row` (`stage_rows`): F, B, I, W, clipping and the SGD
    step; and every message scaled as its gradients are (`row`'s parameters in `dtype` over the real
    stage's `real_bytes`), so its data-parallel all-reduce, the largest message, lasts what it would."""
    emulator.scale_messages(row["parameters"] * itemsize(dtype), real_bytes)
    table = stage_table({stage: {kind: row[kind] for kind in ("F", "B", "I", "W")}})
    table.costs.update({("clip",): row["clip"], ("optimizer",): row["optimizer"]})
    emulator.use(table)


def stage_table_rows(rows: list[dict], real_bytes: list[int], activation_bytes: int, big_activation_bytes: int,
                     dtype: str) -> list[dict]:
    """`stage_rows` as table rows: what each rank's spans last, and how its messages are timed (one
    factor per rank, as `time_stage` sets it): a real activation of `activation_bytes` is timed as
    that factor times it, beside its size at the modelled size (`big_activation_bytes`)."""
    from pipelab.display import human_bytes

    out, size = [], itemsize(dtype)
    for r, nbytes in zip(rows, real_bytes):
        out.append({"stage": r["stage"], "parameters": f"{r['parameters'] / 1e6:,.0f} M",
                    "F (ms per micro-batch)": f"{r['F'] * 1e3:.2f}", "B (ms)": f"{r['B'] * 1e3:.2f}",
                    "clip + SGD (ms per step)": f"{(r['clip'] + r['optimizer']) * 1e3:.2f}",
                    "gradients": human_bytes(r["parameters"] * size),
                    "an activation, timed as": human_bytes(activation_bytes * (r["parameters"] * size / nbytes)),
                    "its size at the modelled size": human_bytes(big_activation_bytes)})
    return out

"""torch's own tensor parallelism of the same `transformer.Block` (lesson 12 runs it beside ours): the
plan `parallelize_module` follows, a counter of the collectives its DTensors issue (in our
`CommMeter`'s ring bytes), and a DTensor gradient turned into this rank's local part.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipelab.tensor_parallel.comm import CommMeter, ring_bytes


def torch_plan(sequence_parallel: bool) -> dict:
    """torch's plan for `transformer.Block`: queries, keys, values and the MLP's first layer
    column-wise, the output projections row-wise; with sequence parallelism the LayerNorms work on
    sequence shards (`SequenceParallel`), each half of the block gathers its input
    (`PrepareModuleInput`: Shard(1) -> Replicate()) and the row-wise layers reduce-scatter their
    output back to sequence shards (`output_layouts=Shard(1)`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    shard_out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(**shard_out), "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(**shard_out)}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather, "mlp": gather})
    return plan


def torch_parallel_block(block, size: int, sequence_parallel: bool):
    """`block` parallelised in place by torch's `parallelize_module` on a 1-D device mesh of `size` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(block, init_device_mesh("cpu", (size,)), torch_plan(sequence_parallel))
    block.attn.n_heads //= size  # each rank now computes its own heads only
    return block


class TorchCollectives(TorchDispatchMode):
    """Counts the collectives torch's DTensor issues (its functional collectives) into a `CommMeter`,
    in the same ring bytes as ours: what each rank's link carries for that collective."""

    KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter"}

    def __init__(self, meter: CommMeter, direction: str, ranks: int):
        super().__init__()
        self.meter, self.direction, self.ranks = meter, direction, ranks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, rest = str(func).partition(".")
        kind = self.KINDS.get(rest.split(".")[0]) if namespace == "_c10d_functional" else None
        if kind is not None:
            t = args[0]
            full = t.numel() * t.element_size() * (self.ranks if kind == "all_gather" else 1)
            self.meter.add(kind, self.direction, ring_bytes(kind, full, self.ranks))
        return func(*args, **(kwargs or {}))


def local_grad(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient. torch leaves the gradient of a replicated parameter that saw
    only a sequence shard as a `Partial` DTensor (each rank holds a summand): redistributing it to
    `Replicate` is the all-reduce our `sync_replicated_grads` does by hand."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            t = t.redistribute(placements=[Replicate()] * len(t.placements))
        t = t.to_local()
    return t.detach().clone()

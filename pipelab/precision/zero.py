"""ZeRO-1, 2 and 3 in mixed precision, the recipe the ZeRO paper counts (Rajbhandari et al., 2020):
bf16 weights and gradients for the math (2 + 2 bytes per parameter), fp32 master weights and Adam's
two moments for the update (12 bytes), each stage sharding one more of the three over N ranks.

Built from lesson 11's flat layer vectors (`pipelab.sharding.FlatLayout`) and counted collectives
(`Collectives`). Rank r keeps fp32 masters only for its shard r of every layer (ZeRO-1 and up), so
it needs only that shard's averaged gradient: a reduce-scatter of the bf16 gradients; after its
step it rounds its masters to bf16 and an all-gather puts the layer back together. ZeRO-2 drops
the whole bf16 gradients once reduce-scattered; ZeRO-3 keeps only a bf16 shard of the weights
between steps and gathers every layer for the step (all at once here: lesson 11 gathers layer by
layer; what is held between steps is the same).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from pipelab.sharding import Collectives, Held, layers_of, storage_bytes
from pipelab.sharding.memory import module_tensors


class MixedZero:
    """Train `model` in bf16 with fp32 master weights, sharded by ZeRO `stage` (0: plain data
    parallelism) over the ranks of `comm`; Adam on the masters."""

    def __init__(self, model: nn.Module, comm: Collectives, stage: int, lr: float = 1e-3):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0 (data parallel), 1, 2 or 3, got {stage!r}")
        self.model, self.comm, self.stage = model.to(torch.bfloat16), comm, stage
        self.rank, self.world_size = dist.get_rank(comm.group), comm.world_size
        self.layers = layers_of(model, self.world_size)
        self.params = []  # per layer: the whole bf16 flat vector, the module's weights are views into it
        for layer in self.layers:
            flat = layer.layout.flatten([getattr(layer.module, n) for n in layer.layout.names])
            for name, view in zip(layer.layout.names, layer.layout.views(flat)):
                getattr(layer.module, name).data = view
            self.params.append(flat)
        whole = stage == 0
        self.master = [(flat if whole else layer.layout.shard(flat, self.rank)).float().clone()
                       for layer, flat in zip(self.layers, self.params)]  # fp32, this rank's part
        self.optimizer = torch.optim.Adam(self.master, lr=lr, foreach=False)
        self.param_shards = [layer.layout.shard(flat, self.rank).clone()  # ZeRO-3: the bf16 shard it keeps
                             for layer, flat in zip(self.layers, self.params)] if stage == 3 else []
        self.grad_shards: list[torch.Tensor] = []
        if stage == 3:
            self.release()

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> float:
        """One step on this rank's slice of the batch; returns this rank's loss (in fp32)."""
        if self.stage == 3:
            self.gather_weights()
        loss = loss_fn(self.model(x).float(), y)
        loss.backward()
        grads = [layer.layout.flatten([getattr(layer.module, n).grad for n in layer.layout.names])
                 for layer in self.layers]
        self.model.zero_grad(set_to_none=True)
        if self.stage == 0:
            for layer, g in zip(self.layers, grads):
                self.comm.all_reduce(g, layer=layer.name)
            self.grad_shards = grads
        else:
            self.grad_shards = []
            for layer, g in zip(self.layers, grads):
                # ZeRO-1 sums into its own piece of the whole gradient; 2 and 3 into a new shard
                shard = layer.layout.shard(g, self.rank) if self.stage == 1 else \
                    torch.empty(layer.layout.shard_numel, dtype=g.dtype)
                self.comm.reduce_scatter(shard, g, layer=layer.name)
                self.grad_shards.append(shard)
            self.whole_grads = grads if self.stage == 1 else []  # ZeRO-1 keeps them; 2 and 3 drop them
        for m, g in zip(self.master, self.grad_shards):
            m.grad = g.float() / self.world_size  # the average, in fp32
        self.optimizer.step()
        for m in self.master:
            m.grad = None  # the fp32 gradient lives only during the update
        self.write_back()
        return loss.item()

    def write_back(self) -> None:
        """Round the fp32 masters into the bf16 weights, and (ZeRO-1, 2) all-gather the layers."""
        if self.stage == 0:
            for flat, m in zip(self.params, self.master):
                flat.copy_(m)
        elif self.stage in (1, 2):
            for layer, flat, m in zip(self.layers, self.params, self.master):
                layer.layout.shard(flat, self.rank).copy_(m)
                self.comm.all_gather(flat, layer.layout.shard(flat, self.rank), layer=layer.name)
        else:
            for shard, m in zip(self.param_shards, self.master):
                shard.copy_(m)
            self.release()

    def gather_weights(self) -> None:
        """ZeRO-3: give each layer's flat vector its memory back and all-gather the bf16 shards into it."""
        for layer, flat, shard in zip(self.layers, self.params, self.param_shards):
            flat.untyped_storage().resize_(layer.layout.padded * flat.element_size())
            self.comm.all_gather(flat, shard, layer=layer.name)

    def release(self) -> None:
        """ZeRO-3: free every layer's whole weights (the storage shrinks to 0 bytes; the views stay)."""
        for flat in self.params:
            flat.untyped_storage().resize_(0)

    def held(self) -> Held:
        """Bytes this rank holds between steps: bf16 weights, bf16 gradients, fp32 masters + Adam."""
        seen: set = set()
        weights = storage_bytes(module_tensors(self.model) + self.params + self.param_shards, seen)
        grads = storage_bytes(self.grad_shards + getattr(self, "whole_grads", []), seen)
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return Held(weights, grads, storage_bytes(self.master + state, seen))

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 master weights as the ranks hold them, gathered (a copy)."""
        out = {}
        for layer, m in zip(self.layers, self.master):
            if self.stage == 0:
                full = m
            else:
                full = torch.empty(layer.layout.padded)
                dist.all_gather_into_tensor(full, m.detach(), group=self.comm.group)
            for name, view in zip(layer.parameter_names(), layer.layout.views(full)):
                out[name] = view.clone()
        return out

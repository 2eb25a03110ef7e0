"""torch's own sharding, behind the same three methods as our trainers (`step`,
`full_parameters`, `held`), so lesson 11 runs it on the same model and data and counts its bytes
the same way: `ZeroRedundancyOptimizer` (ZeRO-1) and FSDP2's `fully_shard` (ZeRO-3)."""

from __future__ import annotations

import torch
from torch import nn

from pipelab.sharding.flat import layers_of
from pipelab.sharding.memory import Held, held_by
from pipelab.sharding.zero import make_optimizer
from pipelab.worker import RankContext


class TorchZero1:
    """torch's ZeRO-1: DDP all-reduces the gradients; `ZeroRedundancyOptimizer` keeps each
    parameter's optimizer state on one rank (whole tensors, not flat pieces) and broadcasts the
    updated parameters."""

    def __init__(self, ctx: RankContext, model: nn.Module, optimizer: str, lr: float):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.model, self.rec = nn.parallel.DistributedDataParallel(model), ctx.rec
        kind = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
        self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kind, lr=lr, foreach=False)

    def step(self, x, y, loss_fn) -> float:
        self.optimizer.zero_grad(set_to_none=False)
        return _black_box_step(self.rec, self.model, self.optimizer, x, y, loss_fn)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.module.named_parameters()}

    def held(self) -> Held:
        return held_by(self.model.module, self.optimizer)


class TorchFSDP:
    """torch's FSDP2: `fully_shard` on every layer and on the whole model, one device mesh."""

    def __init__(self, ctx: RankContext, model: nn.Module, optimizer: str, lr: float, reshard_after_forward: bool):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in layers_of(model, ctx.world_size):
            fully_shard(layer.module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.model, self.rec = model, ctx.rec
        self.optimizer = make_optimizer(optimizer, model.parameters(), lr)

    def step(self, x, y, loss_fn) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        return _black_box_step(self.rec, self.model, self.optimizer, x, y, loss_fn)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}

    def held(self) -> Held:
        return held_by(self.model, self.optimizer)


def _black_box_step(rec, model, optimizer, x, y, loss_fn) -> float:
    """A step of torch's wrappers: their communication is inside, so the spans are F, B, optimizer."""
    with rec.span("F"):
        loss = loss_fn(model(x), y)
    with rec.span("B"):
        loss.backward()
    with rec.span("optimizer"):
        optimizer.step()
    return loss.item()

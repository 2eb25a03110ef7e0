"""ZeRO-3 / FSDP: the parameters themselves are sharded. Between uses, rank r keeps only shard r of
each layer's flat vector (and its gradient and optimizer state): 1/N of everything.

A layer's whole parameters exist only while it computes:

    forward:   all-gather the layer -> compute -> free it
    backward:  all-gather it again -> compute -> reduce-scatter its gradient -> free it

With `prefetch`, the all-gather of the next layer (the layer before, in backward) is issued before
the current layer computes, so it travels while the current layer computes: the wait is hidden,
at the cost of holding two layers' whole parameters instead of one. Per step each rank sends two
all-gathers and one reduce-scatter of every layer: 1.5 times data parallelism's all-reduce.

The trick torch's FSDP uses to free and refill a layer that autograd still refers to: the layer's
gathered vector keeps its tensor, but its *storage* is resized to 0 bytes after use and back to full
size before the next all-gather writes into it. The views autograd saved for backward then see the
refilled values.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelab.sharding.comm import Collectives, Pending
from pipelab.sharding.memory import Held, held_by
from pipelab.sharding.zero import Trainer, make_optimizer
from pipelab.timeline import Recorder


class Zero3(Trainer):
    """ZeRO-3 / FSDP with prefetch, one layer (a module owning parameters) as the unit."""

    def __init__(self, model: nn.Module, comm: Collectives, optimizer: str = "adam", lr: float = 1e-3,
                 prefetch: bool = True):
        super().__init__(model, comm)
        self.prefetch = prefetch
        self.shards, self.full = [], []  # per layer: this rank's shard; the gathered vector (usually empty)
        for i, layer in enumerate(self.layers):
            params = [getattr(layer.module, n) for n in layer.layout.names]
            shard = layer.layout.shard(layer.layout.flatten(params), self.rank).clone()
            shard.grad = torch.zeros_like(shard)
            full = torch.empty(layer.layout.padded, dtype=shard.dtype, device=shard.device, requires_grad=True)
            full.untyped_storage().resize_(0)  # no memory until gathered
            full.register_post_accumulate_grad_hook(lambda full, i=i: self.after_backward(i))
            for name in layer.layout.names:
                delattr(layer.module, name)  # the module's parameters go; views of `full` stand in
            layer.module.register_forward_pre_hook(lambda module, args, i=i: self.before_forward(i))
            layer.module.register_forward_hook(lambda module, args, out, i=i: self.after_forward(i, out))
            self.shards.append(shard)
            self.full.append(full)
        self.optimizer = make_optimizer(optimizer, self.shards, lr)
        self.gathering: dict[int, Pending] = {}  # layer -> its all-gather in flight
        self.started: dict[int, float] = {}  # layer -> when its F or B began
        self.peak_gathered = 0  # most bytes of whole-layer parameters held at once

    # ---- gathering and freeing a layer ---------------------------------------------------
    def gather(self, i: int) -> None:
        """Issue the all-gather of layer `i` into its vector (at once, asynchronously)."""
        if i in self.gathering or not 0 <= i < len(self.layers) or self.gathered(i):
            return
        full = self.full[i]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        # .data: writing through it does not count as changing `full` for autograd's saved views
        self.gathering[i] = self.comm.all_gather(full.data, self.shards[i], layer=self.layers[i].name,
                                                 async_op=True)
        self.peak_gathered = max(self.peak_gathered, self.gathered_bytes())

    def wait_gathered(self, i: int) -> None:
        self.gather(i)
        if i in self.gathering:
            self.gathering.pop(i).wait()

    def free(self, i: int) -> None:
        self.full[i].untyped_storage().resize_(0)

    def gathered(self, i: int) -> bool:
        return self.full[i].untyped_storage().nbytes() > 0

    def gathered_bytes(self) -> int:
        return sum(f.untyped_storage().nbytes() for f in self.full)

    # ---- the hooks: forward -----------------------------------------------------------------
    def before_forward(self, i: int) -> None:
        self.wait_gathered(i)
        if self.prefetch:
            self.gather(i + 1)  # travels while layer i computes
        layer = self.layers[i]
        for name, view in zip(layer.layout.names, layer.layout.views(self.full[i])):
            setattr(layer.module, name, view)
        self.started[i] = self.rec.stamp()  # on a GPU an event on the stream the layer runs on

    def after_forward(self, i: int, out: torch.Tensor) -> torch.Tensor:
        self.rec.ran("F", layer=self.layers[i].name)  # for a clock that keeps modelled time
        self.rec.add_stamped("F", self.started[i], self.rec.stamp(), layer=self.layers[i].name)
        self.free(i)  # autograd keeps the views; their storage is refilled before backward
        if out.requires_grad:
            out.register_hook(lambda grad, i=i: self.before_backward(i))
        return out

    # ---- the hooks: backward ----------------------------------------------------------------
    def before_backward(self, i: int) -> None:
        """The gradient of layer `i`'s output has arrived: its backward is next."""
        self.wait_gathered(i)
        if self.prefetch:
            self.gather(i - 1)
        self.started[i] = self.rec.stamp()

    def after_backward(self, i: int) -> None:
        """Layer `i`'s gradient is complete in its vector: reduce-scatter it, free the layer."""
        full = self.full[i]
        self.rec.ran("B", layer=self.layers[i].name)
        self.rec.add_stamped("B", self.started[i], self.rec.stamp(), layer=self.layers[i].name)
        grad, full.grad = full.grad, None
        pending = self.comm.reduce_scatter(self.shards[i].grad, grad, layer=self.layers[i].name, async_op=True)
        self.in_flight.append((pending, grad))
        self.free(i)

    # ---- the step ---------------------------------------------------------------------------
    def step(self, x, y, loss_fn) -> float:
        loss = loss_fn(self.model(x), y)  # the hooks gather, compute and free layer by layer
        loss.backward()
        self.step_shards(self.shards)  # the parameters stay sharded until the next forward
        return loss.item()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, all-gathered (not counted as the step's messages)."""
        weights = {}
        for layer, shard in zip(self.layers, self.shards):
            full = torch.empty(layer.layout.padded, dtype=shard.dtype, device=shard.device)
            Collectives(Recorder(enabled=False), self.comm.group).all_gather(full, shard)
            weights.update(zip(layer.parameter_names(), (v.clone() for v in layer.layout.views(full))))
        return weights

    def held(self) -> Held:
        return held_by(self.model, self.optimizer, extra=self.full)

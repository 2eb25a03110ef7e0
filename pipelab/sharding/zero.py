"""Plain data parallelism, ZeRO-1 and ZeRO-2: every rank keeps the whole parameters; what is
sharded is the optimizer state (ZeRO-1) and then the gradients too (ZeRO-2).

Each layer's parameters live in one flat vector, split into `world_size` equal shards (`flat`).
Rank r steps the optimizer only on its shard r of every layer, so it needs only its shard's
averaged gradient (a reduce-scatter instead of an all-reduce), and afterwards every rank needs the
whole updated layer back (an all-gather). Reduce-scatter + all-gather are the two halves of the ring
all-reduce (lesson 00): the same bytes as data parallelism, a quarter of the optimizer memory on 4
ranks. ZeRO-3 (`pipelab.sharding.fsdp`) shards the parameters themselves.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from pipelab.sharding.comm import Collectives
from pipelab.sharding.flat import Layer, layers_of
from pipelab.sharding.memory import Held, held_by

OPTIMIZERS = ("adam", "adamw", "sgd")  # each updates every element on its own, so a shard can step alone


def make_optimizer(name: str, params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The optimizer called `name` over `params`, one tensor at a time (foreach=False), so a shard
    gets the very arithmetic the whole tensor gets in one process."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


class Trainer:
    """What the trainers share: the model's layers (the units of sharding), this rank's place, the
    counted collectives, and how to lay parameters and gradients out as flat vectors."""

    optimizer: torch.optim.Optimizer

    def __init__(self, model: nn.Module, comm: Collectives):
        self.model, self.comm, self.rec = model, comm, comm.rec
        self.rank, self.world_size = dist.get_rank(comm.group), comm.world_size
        self.layers = layers_of(model, self.world_size)
        self.in_flight: list = []  # reduce-scatters issued during backward, each with the vector it reads

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> float:
        """One training step on this rank's slice of the batch; returns this rank's loss."""
        raise NotImplementedError

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> float:
        with self.rec.span("F"):
            loss = loss_fn(self.model(x), y)
        with self.rec.span("B"):
            loss.backward()
        return loss.item()

    def step_shards(self, shards: list[torch.Tensor]) -> None:
        """Wait for the gradients' reduce-scatters still in flight, turn each summed gradient
        shard into the average, and step the optimizer on this rank's shards only."""
        for pending, _ in self.in_flight:
            pending.wait()
        self.in_flight.clear()
        for shard in shards:
            shard.grad.div_(self.world_size)
        with self.rec.span("optimizer"):
            self.optimizer.step()

    def flat_parameters(self, layer: Layer) -> torch.Tensor:
        """Move the layer's parameters into one flat vector; they become views into it, so what
        is written into the vector (an all-gather) is the model's new weights."""
        params = [getattr(layer.module, n) for n in layer.layout.names]
        flat = layer.layout.flatten(params)
        for p, view in zip(params, layer.layout.views(flat)):
            p.data = view
        return flat

    def flat_gradients(self, layer: Layer) -> torch.Tensor:
        """One zeroed flat vector for the layer's gradients; each parameter's `.grad` is a view
        into it, and backward adds into an existing `.grad` in place."""
        params = [getattr(layer.module, n) for n in layer.layout.names]
        flat = torch.zeros(layer.layout.padded, dtype=params[0].dtype, device=params[0].device)
        for p, view in zip(params, layer.layout.views(flat)):
            p.grad = view
        return flat

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The whole model's weights as this rank sees them (a copy)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def held(self) -> Held:
        """The bytes this rank holds now for parameters, gradients and optimizer state."""
        return held_by(self.model, self.optimizer)


class DataParallel(Trainer):
    """Plain data parallelism (lesson 01): every rank holds all parameters, all gradients and the
    whole optimizer state. After backward each layer's gradients are all-reduced and averaged,
    and every rank takes the same optimizer step on the whole model."""

    def __init__(self, model: nn.Module, comm: Collectives, optimizer: str = "adam", lr: float = 1e-3):
        super().__init__(model, comm)
        self.grads = [self.flat_gradients(layer) for layer in self.layers]
        self.optimizer = make_optimizer(optimizer, model.parameters(), lr)

    def step(self, x, y, loss_fn) -> float:
        for grad in self.grads:
            grad.zero_()
        loss = self.forward_backward(x, y, loss_fn)
        for layer, grad in zip(self.layers, self.grads):
            self.comm.all_reduce(grad, layer=layer.name)
            grad.div_(self.world_size)
        with self.rec.span("optimizer"):
            self.optimizer.step()
        return loss


class Zero1(Trainer):
    """ZeRO-1: the optimizer state is sharded. Every rank still holds all parameters and all
    gradients, but Adam's two moments only for its shard of each layer, and it updates only that
    shard. The gradients are reduce-scattered (rank r needs only shard r's average) and the updated
    shards all-gathered: the two halves of data parallelism's all-reduce, so the same bytes sent."""

    def __init__(self, model: nn.Module, comm: Collectives, optimizer: str = "adam", lr: float = 1e-3):
        super().__init__(model, comm)
        self.params = [self.flat_parameters(layer) for layer in self.layers]
        self.grads = [self.flat_gradients(layer) for layer in self.layers]
        self.shards = []  # this rank's piece of each layer: views into the flat vectors
        for layer, params, grad in zip(self.layers, self.params, self.grads):
            shard = layer.layout.shard(params, self.rank)
            shard.grad = layer.layout.shard(grad, self.rank)
            self.shards.append(shard)
        self.optimizer = make_optimizer(optimizer, self.shards, lr)  # state for the shards only

    def step(self, x, y, loss_fn) -> float:
        for grad in self.grads:
            grad.zero_()
        loss = self.forward_backward(x, y, loss_fn)
        for layer, grad, shard in zip(self.layers, self.grads, self.shards):
            self.comm.reduce_scatter(shard.grad, grad, layer=layer.name)  # into its own piece of grad
        self.step_shards(self.shards)  # updates this rank's shards, in place in self.params
        for layer, params, shard in zip(self.layers, self.params, self.shards):
            self.comm.all_gather(params, shard, layer=layer.name)  # every rank's updated shard
        return loss


class Zero2(Trainer):
    """ZeRO-2: the gradients are sharded too. The moment backward has finished a layer's
    gradients, they are reduce-scattered (asynchronously, while backward goes on with the layers
    before it) into this rank's gradient shard, and the whole-layer gradients are dropped: no rank
    ever holds all gradients at once. Optimizer step and all-gather as in ZeRO-1."""

    def __init__(self, model: nn.Module, comm: Collectives, optimizer: str = "adam", lr: float = 1e-3):
        super().__init__(model, comm)
        self.params = [self.flat_parameters(layer) for layer in self.layers]
        self.shards = []
        for layer, params in zip(self.layers, self.params):
            shard = layer.layout.shard(params, self.rank)
            shard.grad = torch.zeros_like(shard)  # the only gradients this rank keeps
            self.shards.append(shard)
        self.optimizer = make_optimizer(optimizer, self.shards, lr)
        self.waiting = {}  # layer index -> gradients it still waits for in this backward
        for i, layer in enumerate(self.layers):
            for name in layer.layout.names:
                getattr(layer.module, name).register_post_accumulate_grad_hook(lambda p, i=i: self.grad_ready(i))

    def grad_ready(self, i: int) -> None:
        """A gradient of layer `i` is ready; once all are, send the layer's and drop them."""
        layer = self.layers[i]
        self.waiting[i] = self.waiting.get(i, len(layer.layout.names)) - 1
        if self.waiting[i] == 0:
            params = [getattr(layer.module, n) for n in layer.layout.names]
            flat = layer.layout.flatten([p.grad for p in params])
            for p in params:
                p.grad = None
            pending = self.comm.reduce_scatter(self.shards[i].grad, flat, layer=layer.name, async_op=True)
            self.in_flight.append((pending, flat))

    def step(self, x, y, loss_fn) -> float:
        self.waiting.clear()
        loss = self.forward_backward(x, y, loss_fn)  # the hooks issue the reduce-scatters
        self.step_shards(self.shards)
        for layer, params, shard in zip(self.layers, self.params, self.shards):
            self.comm.all_gather(params, shard, layer=layer.name)
        return loss

"""What `NaiveDDP` and `BucketedDDP` share: equal replicas from the start, a hook per parameter
that fires when its gradient is ready, one callback at the end of each backward, and the timeline.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import nullcontext
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from pipelab.ddp.buckets import parameter_devices
from pipelab.ddp.replicas import broadcast_from_rank0, check_replicas
from pipelab.models import trainable_parameters
from pipelab.streams.base import tensors_in
from pipelab.timeline import Recorder


def _layer_name(param_name: str) -> str:
    """'net.3.weight' -> 'net.3': the module a parameter belongs to."""
    return param_name.rpartition(".")[0] or "(root)"


class DDPBase(nn.Module):
    """What both wrappers share: equal replicas from the start, a hook per parameter that fires
    when its gradient is ready, one callback at the end of each backward, and the timeline.

    Backward time per layer is measured between gradient-ready hooks: a layer's `B` span runs from
    the moment the layer after it had its gradients (or the model's output got its gradient) to the
    moment its own gradients are ready. That is the time backward spent on it, our hooks'
    bookkeeping included. Every span is timed on the rank's one clock (`Recorder.stamp`): on a GPU
    with CUDA events recorded on the stream that runs the work, so a span is when the kernels ran,
    not when Python issued them; on a CPU with the machine's clock. (`rec.ran` says which work
    just ran, for a clock that keeps modelled time.)

    A subclass says what to do with each gradient (`grad_ready`) and at the end of backward
    (`finish_gradients`).

    A module spread over devices (`device_of` names each parameter's device, or the parameters
    sit on several torch devices) puts each layer's `B` span on the lane named after its device,
    and leaves the forward to the devices' own spans: the forward runs on their streams, not here.
    With one thread of backward per GPU, hooks of two devices may run at once: a lock keeps the
    bookkeeping in order."""

    def __init__(self, module: nn.Module, recorder: Recorder | None = None, process_group=None,
                 device_of: Mapping[str, str] | None = None, broadcast_buffers: bool = True):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{type(self).__name__} needs a process group: build it inside a worker "
                               "started by pipelab.launch.spawn (or torchrun)")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.rec = recorder if recorder is not None else Recorder(self.rank, enabled=False)
        check_replicas(module, process_group)
        broadcast_from_rank0(module, process_group)
        self.broadcast_buffers = broadcast_buffers
        self.params = trainable_parameters(module)
        self.device_of = device_of
        devices = parameter_devices(module, device_of)  # None: the module lives on one device
        self.spread = devices is not None
        self._layers = [_layer_name(n) for n, _ in self.params]
        self._params_per_layer = Counter(self._layers)
        self._lane = {layer: "compute" for layer in self._layers} if devices is None else \
            {layer: device for layer, device in zip(self._layers, devices)}  # the layer's B lane
        self._lock = threading.Lock()
        self._handles = [p.register_post_accumulate_grad_hook(self.make_hook(i))
                         for i, (_, p) in enumerate(self.params)]
        self.reset()

    # ---- the step ---------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self.reset()
        if self.broadcast_buffers and torch.is_grad_enabled():
            self.sync_buffers()
        with self.rec.span("F", lane="compute") if not self.spread else nullcontext():
            out = self.module(*inputs, **kwargs)
        for t in tensors_in(out):
            if t.requires_grad:  # its gradient arrives first in backward: the start of our B spans
                t.register_hook(self.on_output_grad)
        return out

    def sync_buffers(self) -> None:
        """Copy rank 0's buffers (BatchNorm's running statistics) to every rank before a forward, as
        torch's DDP does by default (`broadcast_buffers=True`; torch 2.13 calls it
        `forward_sync_buffers`): each rank's forward updates them from its own slice, and without
        this the replicas' buffers drift apart. Only with gradients on, as in torch."""
        buffers = list(self.module.buffers())
        if buffers:
            with self.rec.span("broadcast", lane="comm", what="buffers"), torch.no_grad():
                src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
                for b in buffers:
                    dist.broadcast(b, src=src, group=self.process_group)

    def reset(self) -> None:
        """Forget the state of the last backward (also after one that raised)."""
        self._in_backward = False
        self._mark: float | None = None  # when the last B span ended
        self._layer_left = dict(self._params_per_layer)  # gradients each layer still waits for

    def begin_backward(self) -> None:
        """At the first gradient of a backward pass, queue the end-of-backward callback, as torch's
        DDP does: autograd runs it after the last gradient, before backward() returns."""
        if not self._in_backward:
            self._in_backward = True
            self._mark = self.stamp()
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def on_output_grad(self, grad: torch.Tensor) -> None:
        with self._lock:
            self.begin_backward()

    def make_hook(self, index: int) -> Callable:
        """The hook of parameter `index`: autograd calls it once its `.grad` is written."""
        def hook(param: torch.Tensor) -> None:
            with self._lock:
                self.begin_backward()
                self.record_layer(index)
                self.grad_ready(index, param)

        return hook

    def record_layer(self, index: int) -> None:
        """Once all of a layer's gradients are ready, put its backward on the timeline."""
        layer = self._layers[index]
        self._layer_left[layer] -= 1
        if self._layer_left[layer] == 0:
            self.rec.ran("B", layer=layer)
            t = self.stamp()
            self.rec.add_stamped("B", self._mark, t, lane=self._lane[layer], layer=layer)
            self._mark = t

    def stamp(self):
        """Now, on the rank's clock: a CUDA event on the current stream (the one backward runs on),
        or the recorder's time. A module spread over devices is timed on the host clock: events of
        two devices cannot be compared."""
        return self.rec.now() if self.spread else self.rec.stamp()

    def end_backward(self) -> None:
        try:
            self.finish_gradients()
        finally:
            self.reset()

    # ---- what the two wrappers do differently -------------------------------------------
    def grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Called the moment parameter `index` has its gradient for this backward."""

    def finish_gradients(self) -> None:
        """Called once at the end of backward: leave the averaged gradients in `.grad`."""
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Unhook from the module's parameters (the module then trains as a plain local model)."""
        for h in self._handles:
            h.remove()
        self._handles = []

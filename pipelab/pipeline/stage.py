"""One rank's stages at work: forward, backward, and the stash kept between them.

* `F(s, mb)`: take micro-batch `mb`'s input (the batch slice on stage 0, else the activation
  received from stage s-1), run the stage, send the output on (or, on the last stage, compute the
  loss), and *stash* what the backward will need.
* `B(s, mb)`: take the gradient of the stage's output (from stage s+1, or the loss), backpropagate
  (input and weight gradients), send the input's gradient to stage s-1 and free the stash.
* `I(s, mb)`: the same, but the input gradient only; each layer's output gradient stays in the stash.
* `W(s, mb)`: the weight gradients, from the output gradients `I` kept for each layer; frees the stash.

The kinds are torch.distributed.pipelining's (F, B "full backward", I "backward input", W
"backward weight"). What the stash holds is measured: the bytes of every tensor autograd saves.

With `checkpoint=True` (activation checkpointing, GPipe's "re-materialization") F runs under
`torch.no_grad()` and stashes only the stage's input; the micro-batch's backward first runs the
forward again with autograd recording (`R`, a recompute span on the compute lane), then
backpropagates as usual. Memory for time: one micro-batch's activations at a time, one more forward.

Gradients flow only where they can: a received activation wants its gradient only if it is floating
point (token ids have none), and a stage whose output needs no gradient (a parameter-free first
stage) has no backward to run.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pipelab.models import trainable_parameters
from pipelab.pipeline.p2p import P2P, Message
from pipelab.pipeline.schedules import Action, Schedule
from pipelab.timeline import now

if TYPE_CHECKING:
    from pipelab.worker import RankContext


@dataclass
class LayerIO:
    """A parameterised layer as W sees it: its input, its output (until I has its gradient) and
    the parameters whose gradients W computes."""

    module: nn.Module
    input: torch.Tensor
    output: torch.Tensor | None
    params: list[nn.Parameter]


@dataclass
class Stash:
    """What the backward of one (stage, micro-batch) needs, kept from its F to its B (or W)."""

    inputs: torch.Tensor
    outputs: torch.Tensor | None  # the stage output, or the micro-batch loss on the last stage;
    #                                None while checkpointed (the backward recomputes it)
    layers: list[LayerIO]  # each parameterised layer's input and output, for W
    nbytes: int
    output_grads: list[torch.Tensor] | None = None  # per layer, left by I for W
    rng: tuple | None = None  # a checkpointed forward's random-number state, to recompute it alike


class StashMeter:
    """Counts live stashes and their bytes over the step, so memory is measured, not assumed.
    `clock` stamps the changes (the rank's own, whichever it keeps)."""

    def __init__(self, clock: Callable[[], float] = now):
        self.clock = clock
        self.live = 0
        self.live_bytes = 0
        self.trace: list[tuple[float, int, int]] = [(clock(), 0, 0)]  # (time, stashes, bytes)

    def change(self, count: int, nbytes: int) -> None:
        self.live += count
        self.live_bytes += nbytes
        self.trace.append((self.clock(), self.live, self.live_bytes))

    @property
    def peak(self) -> int:
        return max(n for _, n, _ in self.trace)

    @property
    def peak_bytes(self) -> int:
        return max(b for _, _, b in self.trace)


class SavedBytes:
    """Adds up the bytes a forward keeps for its backward: every tensor autograd saves (seen
    through saved-tensors hooks) and any tensor kept by hand, each storage once, leaving out the
    `exclude` storages (the parameters and the batch, which live anyway)."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.seen, self.total = exclude, set(), 0

    def add(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.exclude and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += t.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.add, lambda t: t)


def rng_state(device: torch.device) -> tuple:
    """The random-number state a forward starts from (the CPU's, and the GPU's when it runs on
    one), so that its recomputation draws the same numbers (e.g. the same dropout masks)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def replayed_rng(state: tuple, device: torch.device):
    """Run the block from random-number state `state`; the caller's state is restored afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def forward_by_layer(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[LayerIO]]:
    """Run `module`, keeping each parameterised layer's input and output: I needs the gradient at
    each output, W each input and that gradient."""
    if not isinstance(module, nn.Sequential):
        out, params = module(x), [p for _, p in trainable_parameters(module)]
        return out, [LayerIO(module, x, out, params)] if params else []
    layers, h = [], x
    for layer in module:
        h_in, h = h, layer(h)
        params = [p for _, p in trainable_parameters(layer)]  # frozen ones get no gradient
        if params:
            layers.append(LayerIO(layer, h_in, h, params))
    return h, layers


def weight_gradients(layer: LayerIO, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
    """The gradients of `layer`'s parameters from its input and its output's gradient alone. A
    linear layer's are two products (dW = g^T x, db = sum of g); another layer runs its own forward
    again from its input: one more forward of that layer."""
    if isinstance(layer.module, nn.Linear):
        g, x = grad_out.reshape(-1, grad_out.shape[-1]), layer.input.reshape(-1, layer.input.shape[-1])
        by_param = {id(layer.module.weight): g.T @ x}
        if layer.module.bias is not None:
            by_param[id(layer.module.bias)] = g.sum(0)
        return [by_param.get(id(p)) for p in layer.params]
    with torch.enable_grad():
        out = layer.module(layer.input.detach())
    return list(torch.autograd.grad(out, layer.params, grad_out, allow_unused=True))


class StageRunner:
    """Runs the F, B, I and W actions of the stages one rank holds (`modules`: stage -> module);
    with `checkpoint`, F keeps only each stage's input and the backward recomputes the rest.
    Each action is one span on the rank's timeline, named by its kind, stage and micro-batch."""

    def __init__(self, ctx: RankContext, schedule: Schedule, modules: dict[int, nn.Module], loss_fn: Callable,
                 p2p: P2P, x_mbs: list[torch.Tensor], y_mbs: list[torch.Tensor], checkpoint: bool = False):
        self.ctx, self.schedule, self.modules, self.loss_fn = ctx, schedule, modules, loss_fn
        self.p2p, self.x_mbs, self.y_mbs, self.checkpoint = p2p, x_mbs, y_mbs, checkpoint
        self.last = schedule.num_stages - 1
        # A (stage, micro-batch) whose backward is split into I and W runs its forward layer by layer.
        self.split = schedule.split_backwards()
        self.stash: dict[tuple[int, int], Stash] = {}
        self.meter = StashMeter(getattr(ctx.rec, "now", now))
        self.losses: list[torch.Tensor] = []
        # Each micro-batch's loss over m, so the m backwards add up to the batch's mean loss's gradient
        # (every Config refuses a loss that sums over its samples: checks.mean_loss).
        self.divisor = schedule.num_microbatches
        # Saved tensors that are not stash: the weights, and the batch itself (it lives anyway).
        self.not_stash = {t.untyped_storage().data_ptr() for t in [*x_mbs, *y_mbs]}
        self.not_stash |= {p.untyped_storage().data_ptr() for m in modules.values() for p in m.parameters()}

    def run(self, action: Action) -> None:
        """Run one action: the method named by its kind."""
        {"F": self.F, "B": self.B, "I": self.I, "W": self.W}[action.kind](action.stage, action.mb)

    def F(self, stage: int, mb: int) -> None:
        """Forward of `stage` on micro-batch `mb`: run it, stash for the backward (everything autograd
        saves, or with `checkpoint` the input alone), send the output on."""
        x = self.x_mbs[mb] if stage == 0 else self.p2p.recv(Message("act", stage - 1, mb))
        if stage > 0 and x.is_floating_point():  # the gradient of what we received goes back
            x.requires_grad_(True)
        saved = SavedBytes(self.not_stash)
        with self.ctx.rec.span("F", mb=mb, stage=stage):
            if self.checkpoint:  # no graph: keep the input and the random state to run it again
                rng = rng_state(self.ctx.device)
                with torch.no_grad():
                    out, _ = self.forward(stage, mb, x)
                saved.add(x)
                stash = Stash(x, None, [], saved.total, rng=rng)
            else:
                with saved.hooks():
                    out, layers = self.forward(stage, mb, x)
                for layer in layers:  # kept for I and W
                    saved.add(layer.output)
                stash = Stash(x, out, layers, saved.total)
        if stage == self.last:
            self.losses.append(out.detach())
        self.stash[stage, mb] = stash
        self.meter.change(+1, stash.nbytes)
        if stage < self.last:
            self.p2p.send(Message("act", stage, mb), out)

    def forward(self, stage: int, mb: int, x: torch.Tensor):
        """The stage's output on `x` (layer by layer where W will need each layer's output), and on
        the last stage the micro-batch's loss, scaled so that the m of them add up to the batch's."""
        if (stage, mb) in self.split:
            out, layers = forward_by_layer(self.modules[stage], x)
        else:
            out, layers = self.modules[stage](x), []
        if stage == self.last:
            out = self.loss_fn(out, self.y_mbs[mb]) / self.divisor
        return out, layers

    def recompute(self, stage: int, mb: int) -> Stash:
        """Re-materialize a checkpointed stash: run the forward again from the kept input, autograd
        recording this time, with the random state of the first run. Its saved bytes join the stash."""
        st = self.stash[stage, mb]
        saved = SavedBytes(self.not_stash | {st.inputs.untyped_storage().data_ptr()})  # counted already
        with (self.ctx.rec.span("R", mb=mb, stage=stage), saved.hooks(),
              replayed_rng(st.rng, self.ctx.device)):
            st.outputs, st.layers = self.forward(stage, mb, st.inputs)
        for layer in st.layers:
            saved.add(layer.output)
        st.nbytes += saved.total
        self.meter.change(0, saved.total)
        return st

    def stashed(self, stage: int, mb: int) -> Stash:
        """The stash of (stage, mb), recomputed first if the forward kept only its input."""
        st = self.stash[stage, mb]
        return self.recompute(stage, mb) if st.outputs is None else st

    def output_grad(self, stage: int, mb: int) -> torch.Tensor | None:
        """The gradient of the stage's output: from the next stage (None on the last: its output is the loss)."""
        return None if stage == self.last else self.p2p.recv(Message("grad", stage + 1, mb))

    def B(self, stage: int, mb: int) -> None:
        """Full backward: input and weight gradients (these add up over micro-batches); send the
        input gradient back and free the stash."""
        grad_out = self.output_grad(stage, mb)
        st = self.stashed(stage, mb)
        with self.ctx.rec.span("B", mb=mb, stage=stage):
            if st.outputs.requires_grad:
                torch.autograd.backward(st.outputs, grad_out)
        self.free(stage, mb)
        self.send_input_grad(stage, mb, st.inputs, st.inputs.grad)

    def I(self, stage: int, mb: int) -> None:  # noqa: E743 - torch's name for "backward input"
        """Input gradient only, sent back at once. The graph goes with it: for W the stash keeps
        only each layer's input and the gradient at its output."""
        grad_out = self.output_grad(stage, mb)
        st = self.stashed(stage, mb)
        takes_grad = st.inputs.requires_grad  # a received floating-point activation
        with self.ctx.rec.span("I", mb=mb, stage=stage):
            wanted = ([st.inputs] if takes_grad else []) + [layer.output for layer in st.layers]
            grads = (list(torch.autograd.grad(st.outputs, wanted, grad_out, allow_unused=True))
                     if wanted and st.outputs.requires_grad else [None] * len(wanted))
        st.output_grads = grads[1:] if takes_grad else grads
        self.keep_for_w(st)
        self.send_input_grad(stage, mb, st.inputs, grads[0] if takes_grad else None)

    def keep_for_w(self, st: Stash) -> None:
        """Drop all but what W needs (each layer's input and output gradient) and count it."""
        st.outputs = None
        for layer in st.layers:
            layer.input, layer.output = layer.input.detach(), None
        kept = SavedBytes(self.not_stash)
        for t in [layer.input for layer in st.layers] + [g for g in st.output_grads if g is not None]:
            kept.add(t)
        self.meter.change(0, kept.total - st.nbytes)
        st.nbytes = kept.total

    def W(self, stage: int, mb: int) -> None:
        """Weight gradients of `stage` on `mb`, from each layer's input and output gradient that I
        kept; free the stash."""
        st = self.stash[stage, mb]
        with self.ctx.rec.span("W", mb=mb, stage=stage):
            for layer, g in zip(st.layers, st.output_grads):
                # Each layer's weight gradient from its own output gradient: no walk back through
                # the earlier layers, which I already did.
                for p, dp in zip(layer.params, weight_gradients(layer, g) if g is not None else []):
                    if dp is not None:
                        p.grad = dp if p.grad is None else p.grad.add_(dp)
        self.free(stage, mb)

    def send_input_grad(self, stage: int, mb: int, inputs: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Send the gradient of the stage's input back to stage-1 (zeros where the output did not
        depend on it; nothing for token ids, which have no gradient)."""
        if stage > 0:
            self.p2p.send(Message("grad", stage, mb), grad if grad is not None else torch.zeros_like(inputs))

    def free(self, stage: int, mb: int) -> None:
        """Drop the stash of (stage, mb): its activations can go."""
        st = self.stash.pop((stage, mb))
        self.meter.change(-1, -st.nbytes)

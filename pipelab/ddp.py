"""Data parallelism built by hand: every rank holds a whole replica of the model, computes the
gradients of its own slice of the batch, and the ranks average their gradients with all-reduce,
so every replica takes the same optimizer step and the replicas stay equal.

* `NaiveDDP` waits until backward is done, then all-reduces the gradients one by one. Simple, but
  the network idles while backward computes, and the processor idles while the gradients travel.
* `BucketedDDP` groups the gradients into buckets of about `bucket_cap_mb` MiB, in the order
  backward produces them (last layer first), and sends each bucket the moment it is complete,
  while backward carries on with the layers before it. That is what
  `torch.nn.parallel.DistributedDataParallel` does.

Both are drop-in like torch's DDP: `out = ddp(x)`, `loss.backward()`, and the gradients are
averaged when `backward()` returns. Both draw what they did on the rank's timeline: the forward
(`F`) and each layer's backward (`B`) on the `compute` lane, each all-reduce on the `comm` lane.

The rest of the module is the lesson around them: the bucket planner, the workers that train a
replica with each variant (and with torch's DDP), the single-process reference they are checked
against, and a bucket-size sweep.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipelab.hardware import synchronize
from pipelab.timeline import Recorder, Timeline, now

MIB = 1024 * 1024  # torch's bucket_cap_mb counts MiB: 25 "MB" are 25 * 2**20 bytes

# ---------------------------------------------------------------------------------------------
# The bucket plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients travel together, flattened into one all-reduce."""

    index: int  # launch order: bucket 0 is sent first
    names: tuple[str, ...]  # in the order backward is expected to produce their gradients
    sizes: tuple[int, ...]  # bytes of each parameter's gradient

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def check_bucket_cap(bucket_cap_mb: float) -> int:
    """The bucket cap in bytes; refuse a cap that is not a positive number of MiB."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be a number of MiB > 0, got {bucket_cap_mb!r}; "
                         "pass e.g. bucket_cap_mb=25 (torch's default), or a tiny value such as "
                         "0.001 for one bucket per parameter")
    return max(1, int(bucket_cap_mb * MIB))


def plan_buckets(params: Sequence[tuple[str, int]], bucket_cap_mb: float) -> list[Bucket]:
    """Group parameters, given as (name, bytes) in registration order, into buckets of about
    `bucket_cap_mb` MiB, walking them in reverse.

    Backward meets the layers last-first, so the first bucket is the first to fill and to be sent.
    A bucket closes as soon as it holds `bucket_cap_mb` or more (torch's rule), so a parameter
    larger than the cap gets a bucket of its own."""
    cap = check_bucket_cap(bucket_cap_mb)
    params = list(params)
    if not params:
        raise ValueError("no parameters to plan buckets for: the module has no parameters that "
                         "require gradients, so there is nothing to average; wrap the model you "
                         "train (e.g. pipelab.models.mlp([8, 16, 4]))")
    names = [name for name, _ in params]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names must be unique, got {twice} more than once")
    for name, nbytes in params:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"parameter {name!r} has size {nbytes!r}; give sizes as whole numbers "
                             "of bytes >= 0, e.g. p.numel() * p.element_size()")
    buckets: list[Bucket] = []
    open_names: list[str] = []
    open_sizes: list[int] = []
    for name, nbytes in reversed(params):
        open_names.append(name)
        open_sizes.append(nbytes)
        if sum(open_sizes) >= cap:
            buckets.append(Bucket(len(buckets), tuple(open_names), tuple(open_sizes)))
            open_names, open_sizes = [], []
    if open_names:  # the first layers' leftovers: the last, smaller bucket
        buckets.append(Bucket(len(buckets), tuple(open_names), tuple(open_sizes)))
    return buckets


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter that gets a gradient, in registration order."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def module_bucket_plan(module: nn.Module, bucket_cap_mb: float = 25.0) -> list[Bucket]:
    """The buckets `BucketedDDP(module, bucket_cap_mb)` will use (no processes needed)."""
    return plan_buckets([(n, p.numel() * p.element_size()) for n, p in trainable_parameters(module)],
                        bucket_cap_mb)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def format_bucket_plan(buckets: Sequence[Bucket]) -> str:
    """A table of the plan: each bucket in launch order, its size, and its parameters in the
    order their gradients are expected."""
    rows = [("bucket", "params", "size", "parameters (gradient order)")]
    for b in buckets:
        rows.append((str(b.index), str(len(b.names)), _human_bytes(b.nbytes), ", ".join(b.names)))
    total = sum(b.nbytes for b in buckets)
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 27)
    lines.append(f"{len(buckets)} bucket(s), {_human_bytes(total)} of gradients per step")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Replicas: the same shapes everywhere, rank 0's values everywhere
# ---------------------------------------------------------------------------------------------


def _shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    params = [(f"parameter {n}", tuple(p.shape), str(p.dtype)) for n, p in trainable_parameters(module)]
    buffers = [(f"buffer {n}", tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return params + buffers


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x[0]} {x[1]} {x[2]} on rank 0 but {y[0]} {y[1]} {y[2]}"
    longer, extra = ("rank 0", a[len(b)]) if len(a) > len(b) else ("it", b[len(a)])
    return f"{longer} has {len(a) if longer == 'rank 0' else len(b)} entries, with {extra[0]}"


def check_replicas(module: nn.Module, group=None) -> None:
    """Raise ValueError on every rank unless all ranks hold a model of the same shape.

    Every rank sends the list of its parameter and buffer shapes to all others, so all ranks
    reach the same verdict and raise together, instead of some hanging in a later collective."""
    mine = _shapes(module)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ValueError(f"rank {rank}'s model differs from rank 0's: {_first_difference(everyone[0], theirs)} "
                             f"on rank {rank}. Every rank must build the same model (same class and "
                             "arguments) before wrapping it; only the weights may differ")
    if not any(kind.startswith("parameter") for kind, _, _ in mine):
        raise ValueError("the module has no parameters that require gradients: there is nothing to "
                         "average. Wrap the model you train (e.g. pipelab.models.mlp([8, 16, 4])), "
                         "or set requires_grad=True on the parameters to train")


def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers into every rank's replica, so all start equal."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=src, group=group)


# ---------------------------------------------------------------------------------------------
# What both wrappers share
# ---------------------------------------------------------------------------------------------


def _layer_name(param_name: str) -> str:
    """'net.3.weight' -> 'net.3': the module a parameter belongs to."""
    return param_name.rpartition(".")[0] or "(root)"


def _output_tensors(out) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _output_tensors(item)]
    return []


class DDPBase(nn.Module):
    """What both wrappers share: equal replicas from the start, a hook per parameter that fires
    when its gradient is ready, one callback at the end of each backward, and the timeline.

    Backward time per layer is measured between gradient-ready hooks: a layer's `B` span runs from
    the moment the layer after it had its gradients (or the model's output got its gradient) to the
    moment its own gradients are ready. That is the time backward spent on it, our hooks'
    bookkeeping included, as seen by the thread that runs backward. (On a GPU these spans, and the
    all-reduce spans too, show when work was *issued*; the kernels may run later.)"""

    def __init__(self, module: nn.Module, recorder: Recorder | None = None, process_group=None):
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
        self.params = trainable_parameters(module)
        self._layers = [_layer_name(n) for n, _ in self.params]
        self._params_per_layer = Counter(self._layers)
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, (_, p) in enumerate(self.params)]
        self._reset()

    # ---- the step ---------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self._reset()
        with self.rec.span("F", lane="compute"):
            out = self.module(*inputs, **kwargs)
        for t in _output_tensors(out):
            if t.requires_grad:  # its gradient arrives first in backward: the start of our B spans
                t.register_hook(self._on_output_grad)
        return out

    def _reset(self) -> None:
        """Forget the state of the last backward (also after one that raised)."""
        self._in_backward = False
        self._mark: float | None = None
        self._layer_left = dict(self._params_per_layer)

    def _begin_backward(self) -> None:
        # The first hook of a backward pass queues the end-of-backward callback, as torch's DDP
        # does: autograd runs it after the last gradient, before backward() returns.
        if not self._in_backward:
            self._in_backward = True
            self._mark = now()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._begin_backward()

    def _make_hook(self, index: int) -> Callable:
        def hook(param: torch.Tensor) -> None:
            self._begin_backward()
            self._record_layer(index)
            self._grad_ready(index, param)

        return hook

    def _record_layer(self, index: int) -> None:
        """Once all of a layer's gradients are ready, put its backward on the timeline."""
        layer = self._layers[index]
        self._layer_left[layer] -= 1
        if self._layer_left[layer] == 0:
            t = now()
            self.rec.add("B", self._mark, t, lane="compute", layer=layer)
            self._mark = t

    def _end_backward(self) -> None:
        try:
            self._finish_gradients()
        finally:
            self._reset()

    # ---- what the two wrappers do differently -------------------------------------------
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Called the moment parameter `index` has its gradient for this backward."""

    def _finish_gradients(self) -> None:
        """Called once at the end of backward: leave the averaged gradients in `.grad`."""
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Unhook from the module's parameters (the module then trains as a plain local model)."""
        for h in self._handles:
            h.remove()
        self._handles = []


# ---------------------------------------------------------------------------------------------
# NaiveDDP
# ---------------------------------------------------------------------------------------------


class NaiveDDP(DDPBase):
    """Data parallelism, the simplest way: after backward, all-reduce every gradient one by one
    and divide by the number of ranks.

    Nothing overlaps: communication starts only when backward has finished, and each parameter
    pays a message's fixed cost. A parameter that got no gradient on this rank takes part with
    zeros (every rank must issue the same all-reduces), and gets the average like the others."""

    def _finish_gradients(self) -> None:
        for name, p in reversed(self.params):  # the order backward produced them
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            start = now()
            dist.all_reduce(p.grad, group=self.process_group)
            self.rec.add("allreduce", start, now(), lane="comm", param=name, bytes=p.grad.nbytes)
            p.grad.div_(self.world_size)


# ---------------------------------------------------------------------------------------------
# BucketedDDP
# ---------------------------------------------------------------------------------------------


class BucketedDDP(DDPBase):
    """Data parallelism that hides communication behind backward, as torch's DDP does.

    Parameters are grouped into buckets of about `bucket_cap_mb` MiB in reverse registration
    order (`plan_buckets`). When a parameter's gradient is ready, a hook copies it, divided by the
    number of ranks, into its slot of the bucket's flat buffer; the moment a bucket is complete,
    the buffer goes out in an asynchronous all-reduce (its sum is the average) while backward goes
    on with the layers before it. At the end of backward we wait for the buckets in order and copy
    each one's averages back into `.grad` as soon as it has arrived.

    Buckets are sent strictly in plan order, even if a later one fills first: collectives must be
    issued in the same order on every rank, or they would pair up the wrong buckets.

    Unused parameters (no gradient in a step) keep their bucket from ever completing. With
    `find_unused_parameters=False` (the default, like torch) that is an error: at the end of
    backward we still send the incomplete buckets, so that no peer hangs waiting for them, and then
    raise a RuntimeError naming the parameters. With `find_unused_parameters=True` they are marked
    ready at the end of backward with zero gradients (so their buckets go out only then), and one
    more small all-reduce per step tells every rank which parameters no rank used: those keep
    `.grad` untouched (None), exactly as in a single process. torch finds them already after forward, by
    walking the autograd graph; marking them at the end is simpler and costs some overlap."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False,
                 recorder: Recorder | None = None, process_group=None):
        check_bucket_cap(bucket_cap_mb)  # before any collective, so a bad value fails fast
        super().__init__(module, recorder, process_group)
        dtypes = {p.dtype for _, p in self.params}
        devices = {p.device for _, p in self.params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"BucketedDDP flattens gradients into one buffer per bucket, so all parameters "
                             f"need one dtype and one device; got dtypes {sorted(map(str, dtypes))} on "
                             f"{sorted(map(str, devices))}: convert the model with module.to(dtype, device)")
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.buckets = module_bucket_plan(module, bucket_cap_mb)
        self._slots, self._flat = self._allocate(*dtypes, *devices)  # one flat gradient buffer per bucket
        self._members = [[i for i, slot in enumerate(self._slots) if slot[0] == b] for b in range(len(self.buckets))]
        self._reset()

    def _allocate(self, dtype: torch.dtype, device: torch.device):
        """Each parameter's (bucket, offset, numel), and one flat gradient buffer per bucket."""
        index_of = {name: i for i, (name, _) in enumerate(self.params)}
        slots: list[tuple[int, int, int]] = [(0, 0, 0)] * len(self.params)
        buffers = []
        for bucket in self.buckets:
            offset = 0
            for name in bucket.names:
                numel = self.params[index_of[name]][1].numel()
                slots[index_of[name]] = (bucket.index, offset, numel)
                offset += numel
            buffers.append(torch.zeros(offset, dtype=dtype, device=device))
        return slots, buffers

    def describe(self) -> str:
        """The bucket plan as a table."""
        return format_bucket_plan(self.buckets)

    def _reset(self) -> None:
        super()._reset()
        if not hasattr(self, "buckets"):
            return  # called by the base class before the plan exists
        self._ready = [False] * len(self.params)
        self._left = [len(b.names) for b in self.buckets]  # gradients each bucket still waits for
        self._next = 0  # the next bucket to send
        self._inflight: list[tuple] = []  # (bucket, launch time, work, arrival time future or None)

    def _slot(self, index: int) -> torch.Tensor:
        bucket, offset, numel = self._slots[index]
        return self._flat[bucket][offset:offset + numel]

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        self._ready[index] = True
        # Divide while copying into the bucket: the all-reduce's sum is then the average, and the
        # division costs no extra pass over the gradients (torch's DDP does the same).
        torch.div(param.grad.reshape(-1), self.world_size, out=self._slot(index))
        self._left[self._slots[index][0]] -= 1
        self._send_complete_buckets()

    def _send_complete_buckets(self) -> None:
        """Send every complete bucket whose predecessors have all been sent."""
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._all_reduce_async(self._next)
            self._next += 1

    def _all_reduce_async(self, bucket: int) -> None:
        start = now()
        work = dist.all_reduce(self._flat[bucket], group=self.process_group, async_op=True)
        arrival = None
        if self.rec.enabled:
            # The callback runs on the communication thread when the all-reduce completes: its
            # clock reading ends the bucket's span on the comm lane. It needs Python's GIL, so it
            # costs a little per bucket and can be late by whatever Python runs at that moment.
            arrival = work.get_future().then(lambda _: now())
        self._inflight.append((bucket, start, work, arrival))

    def _finish_gradients(self) -> None:
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        for i in missing:  # zeros from this rank; their buckets can go out now
            self._slot(i).zero_()
            self._left[self._slots[i][0]] -= 1
        self._send_complete_buckets()
        self._wait_and_write_back()
        if missing and not self.find_unused_parameters:
            names = [self.params[i][0] for i in missing]
            raise RuntimeError(f"parameters {names} got no gradient in this backward on rank {self.rank}, so "
                               "their buckets could only be sent at its end. If the model really "
                               "skips them in some steps, pass find_unused_parameters=True; otherwise "
                               "make the loss depend on them (or set requires_grad=False)")
        if self.find_unused_parameters:  # every rank, every step: the peers can't know we need it
            used = self._used_anywhere(missing)
            for i in missing:
                if used[i]:  # another rank had a gradient for it: take the average too
                    self._write_back(i)

    def _wait_and_write_back(self) -> None:
        """Wait for the buckets in order; copy each one's averages into `.grad` as soon as it is
        back, while the later buckets are still on their way."""
        for bucket, start, work, arrival in self._inflight:
            work.wait()
            if arrival is not None:
                # From launch to arrival: waiting for the peers to launch theirs, queueing behind
                # earlier buckets and moving the bytes. So spans of one rank may overlap.
                self.rec.add("allreduce", start, arrival.wait(), lane="comm", bucket=bucket,
                             bytes=self._flat[bucket].nbytes)
            copy_start = now()
            for i in self._members[bucket]:
                if self._ready[i]:
                    self._write_back(i)
            self.rec.add("copy", copy_start, now(), lane="compute", bucket=bucket)
        self._inflight = []

    def _write_back(self, index: int) -> None:
        p = self.params[index][1]
        average = self._slot(index).view_as(p)
        if p.grad is None:
            p.grad = average.clone()
        else:
            p.grad.copy_(average)

    def _used_anywhere(self, missing: list[int]) -> list[bool]:
        """Which parameters had a gradient on at least one rank (one small all-reduce)."""
        used = torch.ones(len(self.params), device=self._flat[0].device)
        used[missing] = 0
        start = now()
        dist.all_reduce(used, group=self.process_group)
        self.rec.add("allreduce", start, now(), lane="comm", what="used flags", bytes=used.nbytes)
        return (used > 0).tolist()


# ---------------------------------------------------------------------------------------------
# The lesson's workers: each rank trains a replica on its slice of the batch
# ---------------------------------------------------------------------------------------------

VARIANTS = ("naive", "bucketed", "torch")


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal slice of the batch: ranks take consecutive rows."""
    return batch.chunk(world_size)[rank]


def wrap(variant: str, module: nn.Module, bucket_cap_mb: float = 25.0, recorder: Recorder | None = None,
         find_unused_parameters: bool = False, device: torch.device | None = None) -> nn.Module:
    """`module` wrapped by one of the variants: "naive", "bucketed" (ours) or "torch" (torch's DDP)."""
    if variant == "naive":
        return NaiveDDP(module, recorder=recorder)
    if variant == "bucketed":
        return BucketedDDP(module, bucket_cap_mb, find_unused_parameters, recorder=recorder)
    if variant == "torch":
        device_ids = [device.index] if device is not None and device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                                                   find_unused_parameters=find_unused_parameters)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def train_step(ctx, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               loss_fn: Callable) -> tuple[float, float]:
    """One data-parallel training step on this rank's slice; returns (this rank's loss, seconds).

    Our wrappers put their own F and B spans on the timeline; torch's DDP is a black box, so for it
    we time its forward and its whole backward (which includes waiting for its all-reduces)."""
    black_box = isinstance(model, nn.parallel.DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    ctx.barrier()  # every rank starts the step together, so a step time is the step's
    start = now()
    with ctx.rec.span("F", lane="compute") if black_box else nullcontext():
        out = model(x)
    loss = loss_fn(out, y)
    with ctx.rec.span("B", lane="compute") if black_box else nullcontext():
        loss.backward()
    with ctx.rec.span("optimizer", lane="compute"):
        optimizer.step()
    synchronize(ctx.device)
    return loss.item(), now() - start


def _perturb(module: nn.Module, seed: int) -> None:
    """Give this replica different weights, as if its rank had built the model with its own seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device))


def replica_spread(tensors, group=None) -> float:
    """Largest difference of any element of `tensors` (e.g. a replica's parameters) between any
    two ranks: 0.0 means every rank holds the same values."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return (hi - lo).abs().max().item()


def ddp_worker(ctx, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
               variants: Sequence[str] = VARIANTS, bucket_cap_mb: float = 25.0, lr: float = 0.1,
               steps: int = 3, find_unused_parameters: bool = False) -> dict[str, dict]:
    """Worker: train a replica of `model` with each variant on this rank's slice of (x, y).

    Ranks other than 0 start from different weights, as if each had built its model with its own
    seed: the wrapper's broadcast must make them equal. The first step is the one checked against
    the reference (gradients, weights after the SGD step) and warms up; the others are timed."""
    xs = shard(x, ctx.rank, ctx.world_size).to(ctx.device)
    ys = shard(y, ctx.rank, ctx.world_size).to(ctx.device)
    results = {}
    for variant in variants:
        replica = copy.deepcopy(model).to(ctx.device)
        if ctx.rank != 0:
            _perturb(replica, seed=ctx.rank)
        wrapped = wrap(variant, replica, bucket_cap_mb, ctx.rec, find_unused_parameters, ctx.device)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr)
        r: dict = {"losses": [], "step_times": [], "timelines": []}
        for step in range(steps):
            ctx.rec.clear()
            loss, seconds = train_step(ctx, wrapped, optimizer, xs, ys, loss_fn)
            r["losses"].append(loss)
            r["step_times"].append(seconds)
            r["timelines"].append(ctx.timeline())
            if step == 0:
                r["spread"] = replica_spread(replica.parameters())
                if ctx.rank == 0:
                    r["grads"] = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                                  for n, p in replica.named_parameters()}
                    r["weights"] = {n: p.detach().cpu().clone() for n, p in replica.named_parameters()}
        r["buckets"] = wrapped.buckets if isinstance(wrapped, BucketedDDP) else None
        if isinstance(wrapped, DDPBase):
            wrapped.remove_hooks()
        results[variant] = r
    return results


# ---------------------------------------------------------------------------------------------
# The parent side: check, spawn, gather
# ---------------------------------------------------------------------------------------------


@dataclass
class DDPRun:
    """What one variant did on all ranks."""

    variant: str
    loss: float  # of the checked (first) step: the mean of the ranks' losses
    grads: dict[str, torch.Tensor | None]  # rank 0's averaged gradients after the first step
    weights: dict[str, torch.Tensor]  # rank 0's weights after the first SGD step
    replica_spread: float  # largest weight difference between ranks after that step
    step_time: float  # seconds: median over the timed steps of the slowest rank's step
    timeline: Timeline  # a typical timed step, all ranks
    buckets: list[Bucket] | None = None
    step_timelines: list[Timeline] = field(default_factory=list, repr=False)

    @property
    def overlap(self) -> float:
        """Fraction of the all-reduce time hidden behind computation (median over timed steps)."""
        return statistics.median(tl.overlap("compute", "comm") for tl in self.step_timelines)


def check_ddp_inputs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int,
                     bucket_cap_mb: float = 25.0, variants: Sequence[str] = VARIANTS, steps: int = 1) -> None:
    """Refuse what cannot run, before any worker starts."""
    check_bucket_cap(bucket_cap_mb)
    if not trainable_parameters(model):
        raise ValueError("the model has no parameters that require gradients: there is nothing to "
                         "average; pass the model you train (e.g. pipelab.models.mlp([8, 16, 4]))")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants must be some of {VARIANTS}, got {list(variants)!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    batch = x.shape[0]
    if batch % world_size:
        fits = [k for k in range(1, min(batch, 16) + 1) if batch % k == 0]
        raise ValueError(f"a batch of {batch} samples does not split evenly over world_size={world_size} "
                         f"ranks (the averaged gradient would then differ from the full batch's); use "
                         f"world_size in {fits}, or a batch that is a multiple of {world_size}")
    if y.shape[0] != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {y.shape[0]}; pass one target per input")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")


def _typical(timelines: list[Timeline]) -> Timeline:
    """Of several steps, the one with the median makespan: a typical step, not a lucky one."""
    return sorted(timelines, key=lambda tl: tl.makespan)[(len(timelines) - 1) // 2]


def _gather(variant: str, per_rank: list[dict]) -> DDPRun:
    first = per_rank[0]
    timed = slice(1, None) if len(first["step_times"]) > 1 else slice(None)
    slowest = [max(step) for step in zip(*(r["step_times"][timed] for r in per_rank))]
    steps = [Timeline.merge(tls) for tls in zip(*(r["timelines"][timed] for r in per_rank))]
    return DDPRun(variant, statistics.mean(r["losses"][0] for r in per_rank), first["grads"], first["weights"],
                  max(r["spread"] for r in per_rank), statistics.median(slowest), _typical(steps),
                  first["buckets"], steps)


def run_ddp(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None = None,
            world_size: int = 2, variants: Sequence[str] = VARIANTS, bucket_cap_mb: float = 25.0,
            lr: float = 0.1, steps: int = 3, find_unused_parameters: bool = False,
            backend: str = "auto", timeout: float = 120.0) -> dict[str, DDPRun]:
    """Train `model` one SGD step (plus `steps`-1 timed ones) with each variant on `world_size`
    real processes, each on its slice of the batch; return each variant's `DDPRun`."""
    from pipelab.launch import spawn

    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    check_ddp_inputs(model, x, y, world_size, bucket_cap_mb, variants, steps)
    per_rank = spawn(ddp_worker, world_size, model, x, y, loss_fn, list(variants), bucket_cap_mb, lr,
                     steps, find_unused_parameters, backend=backend, timeout=timeout)
    return {v: _gather(v, [r[v] for r in per_rank]) for v in variants}


# ---------------------------------------------------------------------------------------------
# The single-process reference
# ---------------------------------------------------------------------------------------------


@dataclass
class Reference:
    """One process, whole batch: the loss, gradients and weights after one SGD step."""

    loss: float
    grads: dict[str, torch.Tensor | None]
    weights: dict[str, torch.Tensor]


def reference_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None = None,
                   lr: float = 0.1) -> Reference:
    """The step every data-parallel variant must reproduce: the whole batch in one process."""
    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return Reference(loss.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()})


def assert_matches_reference(run: DDPRun, ref: Reference, atol: float = 1e-5, rtol: float = 1e-4) -> float:
    """Assert a data-parallel run's loss, gradients and updated weights equal the single-process
    ones, and that its replicas are equal; return the largest gradient difference."""
    torch.testing.assert_close(torch.tensor(run.loss), torch.tensor(ref.loss), atol=atol, rtol=rtol,
                               msg=lambda m: f"{run.variant}: loss: {m}")
    if run.replica_spread > atol:
        raise AssertionError(f"{run.variant}: the replicas differ by up to {run.replica_spread:.2e} after one step")
    worst = 0.0
    for name, want in ref.grads.items():
        got = run.grads[name]
        if (got is None) != (want is None):
            raise AssertionError(f"{run.variant}: {name}: gradient is {'None' if got is None else 'set'}, "
                                 f"expected {'None' if want is None else 'a tensor'}")
        if want is not None:
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                                       msg=lambda m, name=name: f"{run.variant}: gradient of {name}: {m}")
            worst = max(worst, (got - want).abs().max().item())
        torch.testing.assert_close(run.weights[name], ref.weights[name], atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{run.variant}: updated {name}: {m}")
    return worst


# ---------------------------------------------------------------------------------------------
# Bucket size: one set of processes, every size, ours beside torch's
# ---------------------------------------------------------------------------------------------


@dataclass
class SweepPoint:
    """BucketedDDP (and torch's DDP) at one bucket size."""

    bucket_cap_mb: float
    num_buckets: int
    step_time: float  # seconds, ours: median over timed steps of the slowest rank
    overlap: float  # ours: median fraction of all-reduce time hidden behind compute
    torch_step_time: float | None  # torch's DDP with the same bucket_cap_mb
    timeline: Timeline = field(repr=False)  # ours, a typical step


def bucket_sweep_worker(ctx, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                        caps_mb: Sequence[float], steps: int = 3, rounds: int = 2, with_torch: bool = True,
                        lr: float = 0.01) -> dict:
    """Worker: for each bucket size, our BucketedDDP and torch's DDP on the same replica weights,
    interleaved in `rounds` so that a busy machine slows both alike. Each wrapper's first step
    warms up (torch's DDP also rebuilds its buckets after it) and is not kept."""
    xs = shard(x, ctx.rank, ctx.world_size).to(ctx.device)
    ys = shard(y, ctx.rank, ctx.world_size).to(ctx.device)
    kinds = ["bucketed", "torch"] if with_torch else ["bucketed"]
    wrappers, times, timelines = {}, {}, {}
    for cap in caps_mb:
        for kind in kinds:
            wrapped = wrap(kind, copy.deepcopy(model).to(ctx.device), cap, ctx.rec, device=ctx.device)
            wrappers[cap, kind] = (wrapped, torch.optim.SGD(wrapped.parameters(), lr=lr))
            times[cap, kind], timelines[cap, kind] = [], []
    for round_ in range(rounds):
        for cap in caps_mb:
            for kind in kinds:
                wrapped, optimizer = wrappers[cap, kind]
                for step in range(steps + (1 if round_ == 0 else 0)):
                    ctx.rec.clear()
                    _, seconds = train_step(ctx, wrapped, optimizer, xs, ys, loss_fn)
                    if round_ > 0 or step > 0:
                        times[cap, kind].append(seconds)
                        timelines[cap, kind].append(ctx.timeline())
    buckets = {cap: len(wrappers[cap, "bucketed"][0].buckets) for cap in caps_mb}
    return {"times": times, "timelines": timelines, "buckets": buckets}


def bucket_sweep(model: nn.Module, x: torch.Tensor, y: torch.Tensor, caps_mb: Sequence[float],
                 loss_fn: Callable | None = None, world_size: int = 2, steps: int = 3, rounds: int = 2,
                 with_torch: bool = True, backend: str = "auto", timeout: float = 300.0) -> list[SweepPoint]:
    """Step time and overlap of BucketedDDP at each bucket size (and torch's DDP beside it), all
    measured in one set of `world_size` processes."""
    from pipelab.launch import spawn

    loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
    if not caps_mb or len(set(caps_mb)) != len(caps_mb):
        raise ValueError(f"give one or more different bucket sizes, got caps_mb={caps_mb!r}; "
                         "e.g. caps_mb=[0.25, 1, 4, 25]")
    for cap in caps_mb:
        check_ddp_inputs(model, x, y, world_size, cap, steps=steps)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number >= 1, got {rounds!r}")
    per_rank = spawn(bucket_sweep_worker, world_size, model, x, y, loss_fn, list(caps_mb), steps, rounds,
                     with_torch, backend=backend, timeout=timeout)
    points = []
    for cap in caps_mb:
        steps_tl = [Timeline.merge(tls) for tls in zip(*(r["timelines"][cap, "bucketed"] for r in per_rank))]
        points.append(SweepPoint(
            cap, per_rank[0]["buckets"][cap], _median_slowest(per_rank, (cap, "bucketed")),
            statistics.median(tl.overlap("compute", "comm") for tl in steps_tl),
            _median_slowest(per_rank, (cap, "torch")) if with_torch else None, _typical(steps_tl)))
    return points


def _median_slowest(per_rank: list[dict], key) -> float:
    """Median over steps of the slowest rank's step time: a step ends when its last rank is done."""
    return statistics.median(max(step) for step in zip(*(r["times"][key] for r in per_rank)))


# ---------------------------------------------------------------------------------------------
# Pictures
# ---------------------------------------------------------------------------------------------


def draw_idea(world_size: int = 2, axes=None):
    """The lesson in one picture: replicas that all-reduce their gradients (left), and why
    buckets help (right: naive sends after backward, bucketed sends during it)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    from pipelab.plots import kind_color

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [1, 1.4]})
    left, right = axes
    for r in range(world_size):
        x0 = r * 3.0
        left.add_patch(Rectangle((x0, 1.6), 2.4, 1.0, facecolor="#4C72B0", alpha=0.85))
        left.text(x0 + 1.2, 2.1, f"rank {r}\nreplica of the model", ha="center", va="center", color="white", fontsize=9)
        left.text(x0 + 1.2, 3.0, f"batch slice {r}", ha="center", va="center", fontsize=9)
        left.add_patch(FancyArrowPatch((x0 + 1.2, 2.85), (x0 + 1.2, 2.65), arrowstyle="->", mutation_scale=12))
        left.add_patch(Rectangle((x0 + 0.3, 0.4), 1.8, 0.6, facecolor=kind_color("B")))
        left.text(x0 + 1.2, 0.7, f"gradients g{r}", ha="center", va="center", fontsize=9)
        left.add_patch(FancyArrowPatch((x0 + 1.2, 1.6), (x0 + 1.2, 1.0), arrowstyle="->", mutation_scale=12))
    span = 3.0 * (world_size - 1) + 2.4
    left.add_patch(Rectangle((0, -0.6), span, 0.5, facecolor=kind_color("allreduce")))
    total = " + ".join(f"g{r}" for r in range(world_size)) if world_size <= 3 else f"g0 + ... + g{world_size - 1}"
    left.text(span / 2, -0.35, f"all-reduce: every rank gets ({total}) / {world_size}", ha="center",
              va="center", fontsize=9)
    for r in range(world_size):
        left.add_patch(FancyArrowPatch((r * 3.0 + 1.2, 0.4), (r * 3.0 + 1.2, -0.1), arrowstyle="<->",
                                       mutation_scale=12))
    left.set_xlim(-0.3, span + 0.3)
    left.set_ylim(-0.9, 3.4)
    left.axis("off")
    left.set_title("Data parallelism: same model, different data, averaged gradients")
    _draw_schedule_sketch(right)
    right.legend(handles=[Patch(facecolor=kind_color(k), label=lbl) for k, lbl in
                          [("F", "forward"), ("B", "backward of one layer"), ("allreduce", "all-reduce")]],
                 loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return axes


def _draw_schedule_sketch(ax) -> None:
    """Naive vs bucketed on one rank, with made-up unit costs: 4 layers, 2 buckets."""
    from pipelab.plots import kind_color

    layers, b, comm = 4, 1.0, 1.6
    rows = {"naive · compute": 0, "naive · comm": 1, "bucketed · compute": 2.6, "bucketed · comm": 3.6}
    for who in ("naive", "bucketed"):
        ax.barh(rows[f"{who} · compute"], 2, left=0, color=kind_color("F"), edgecolor="black")
        for i in range(layers):
            ax.barh(rows[f"{who} · compute"], b, left=2 + i * b, color=kind_color("B"), edgecolor="black")
    end = 2 + layers * b
    ax.barh(rows["naive · comm"], 2 * comm, left=end, color=kind_color("allreduce"), edgecolor="black")
    ax.barh(rows["bucketed · comm"], comm, left=2 + 2 * b, color=kind_color("allreduce"), edgecolor="black")
    ax.barh(rows["bucketed · comm"], comm, left=max(end, 2 + 2 * b + comm), color=kind_color("allreduce"),
            edgecolor="black")
    ax.text(end + 2 * comm + 0.1, rows["naive · comm"], "step ends", va="center", fontsize=8)
    ax.text(max(end, 2 + 2 * b + comm) + comm + 0.1, rows["bucketed · comm"], "step ends", va="center", fontsize=8)
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels(list(rows))
    ax.set_ylim(4.2, -0.6)
    ax.set_xlim(0, end + 2 * comm + 1.6)
    ax.set_xlabel("time (arbitrary units)")
    ax.set_title("Why buckets: send the last layers' gradients while backward goes on")
    ax.grid(axis="x", alpha=0.3)


def plot_timelines(runs: dict[str, DDPRun], variants: Sequence[str] = ("naive", "bucketed"), axes=None):
    """Gantt charts of a typical step of each variant, side by side, on one time scale."""
    import matplotlib.pyplot as plt

    from pipelab.plots import gantt

    if axes is None:
        _, axes = plt.subplots(1, len(variants), figsize=(7 * len(variants), 3.2), squeeze=False)
        axes = axes[0]
    longest = max(runs[v].timeline.makespan for v in variants) * 1e3
    for ax, v in zip(axes, variants):
        run = runs[v]
        title = (f"{v}: step {run.step_time * 1e3:.1f} ms, {run.overlap:.0%} of all-reduce time "
                 "hidden behind compute")
        gantt(run.timeline, ax=ax, title=title, legend=ax is axes[-1])
        ax.set_xlim(0, longest * 1.02)
    return axes


def plot_sweep(points: list[SweepPoint], axes=None):
    """Step time (ours and torch's) and overlap against bucket size, the fastest size marked."""
    import matplotlib.pyplot as plt

    from pipelab.plots import sweep

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 3.8))
    caps = [p.bucket_cap_mb for p in points]
    times = {"BucketedDDP (ours)": [p.step_time * 1e3 for p in points]}
    if all(p.torch_step_time is not None for p in points):
        times["torch DistributedDataParallel"] = [p.torch_step_time * 1e3 for p in points]
    sweep(caps, times, "bucket_cap_mb (MiB, log scale)", "step time (ms)", "Step time against bucket size",
          ax=axes[0], logx=True, mark_best="BucketedDDP (ours)")
    sweep(caps, {"BucketedDDP (ours)": [100 * p.overlap for p in points]}, "bucket_cap_mb (MiB, log scale)",
          "all-reduce time hidden behind compute (%)", "Overlap against bucket size", ax=axes[1], logx=True)
    axes[1].set_ylim(0, 100)
    for ax in axes:
        top = ax.secondary_xaxis("top", functions=(lambda v: v, lambda v: v))
        top.set_xticks(caps)
        top.set_xticklabels([str(p.num_buckets) for p in points], fontsize=7)
        top.set_xlabel("number of buckets", fontsize=8)
    return axes

"""How long an operation lasts on an accelerator: count its work, then divide by the device's rates.

- `count(fn, *args)` runs `fn` on META tensors (shapes and dtypes, no data, no memory), so a model
  far larger than this machine can be counted: FLOPs from PyTorch's own counter
  (`torch.utils.flop_counter.FlopCounterMode`, matrix products and convolutions), bytes as what
  every operator reads and writes (the sizes of its input and output tensors; views move nothing).
- `forward_backward_counts(module, x)` counts a forward, and its backward split as zero-bubble
  schedules split it: I, the gradient with respect to the input (what the previous stage waits for),
  and W, the gradients with respect to the weights (which can wait). B = I + W.
- `compute_seconds` is the roofline: an operation takes the longer of its FLOPs over the device's
  FLOP/s and its bytes over the memory bandwidth, at a stated efficiency, plus a launch overhead
  per operator.
- `message_seconds` and `collective_seconds` are the latency-bandwidth model of lesson 00: one
  message of m bytes takes latency + m / bandwidth; a ring collective is a sequence of such steps.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from pipelab.latency_bandwidth import ring_all_reduce_time
from pipelab.emulate.specs import Device, Link, torch_dtype
from pipelab.models import trainable_parameters

# Model FLOPs utilisation of well-tuned large-model training is about half the peak: Megatron-LM
# reports 52% of the A100's peak per GPU (Narayanan et al., "Efficient Large-Scale Language Model
# Training on GPU Clusters Using Megatron-LM", SC 2021, https://arxiv.org/abs/2104.04473) and PaLM
# 46.2% MFU (Chowdhery et al., https://arxiv.org/abs/2204.02311).
EFFICIENCY = 0.5
# Per operator: launching a CUDA kernel from PyTorch's eager mode costs a few microseconds of host
# time, so a stream of tiny operators is bound by launches, not by the GPU. An estimate, not a
# data-sheet figure.
LAUNCH_OVERHEAD_S = 5e-6


@dataclass(frozen=True)
class Counts:
    """Work of an operation: floating-point operations, bytes read and written in device memory,
    and how many operators (kernels) it launches."""
    flops: float
    bytes: float
    kernels: int = 1

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(self.flops + other.flops, self.bytes + other.bytes, self.kernels + other.kernels)

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(max(0.0, self.flops - other.flops), max(0.0, self.bytes - other.bytes),
                      max(0, self.kernels - other.kernels))


ZERO = Counts(0.0, 0.0, 0)

# Operators that move no data: they only describe memory (views) or allocate it.
_NO_TRAFFIC = {"_unsafe_view", "_reshape_alias", "alias", "detach", "lift_fresh", "empty", "empty_like",
               "empty_strided", "new_empty", "new_empty_strided", "sym_size", "sym_stride", "sym_numel",
               "sym_storage_offset", "_local_scalar_dense"}


def _tensor_bytes(tree) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class ByteCounter(TorchDispatchMode):
    """Adds up, for every operator run under it, the bytes of its input and output tensors: what
    the operator reads from memory and writes back. Views (`t()`, `view`, `transpose`...) are free."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_TRAFFIC:
            self.bytes += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
            self.kernels += 1
        return out


def to_meta(tree, dtype=None):
    """`tree` with every tensor replaced by a META tensor of the same shape, dtype (floating ones
    in `dtype` if given) and requires_grad; other values unchanged."""
    def meta(t):
        if not isinstance(t, torch.Tensor):
            return t
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.device.type == "meta" and cast == t.dtype:
            return t
        return torch.empty_like(t, device="meta", dtype=cast).requires_grad_(t.requires_grad)
    return tree_map(meta, tree)


def meta_inputs(example_input, dtype=None) -> tuple:
    """`example_input` (a tensor or a tuple) as a tuple of fresh META leaves; the floating ones
    require grad, as a stage's input does when the previous stage waits for its gradient."""
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    return tuple(to_meta(x, dtype).detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor)
                 else x for x in inputs)


def count(fn, *args, **kwargs) -> Counts:
    """FLOPs, bytes and operators of `fn(*args, **kwargs)`, run on META tensors (the tensors in
    args and kwargs are replaced by meta ones; a module `fn` uses must already be on meta, see
    `meta_module`)."""
    if isinstance(fn, torch.nn.Module):
        fn = meta_module(fn)
    args, kwargs = to_meta((args, kwargs))
    flops, moved = FlopCounterMode(display=False), ByteCounter()
    with flops, moved:
        fn(*args, **kwargs)
    return Counts(float(flops.get_total_flops()), float(moved.bytes), moved.kernels)


def meta_module(module: torch.nn.Module, dtype=None) -> torch.nn.Module:
    """`module` itself if all its parameters and buffers are on meta (in `dtype`, if given), else a
    copy on meta whose floating tensors are in `dtype`. The original keeps its weights, and the
    copy never allocates them: each parameter and buffer is swapped for an empty meta tensor as it
    is copied. Build a large model straight on meta with `with torch.device("meta"): Model(...)`."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.device.type == "meta" and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
           for t in tensors):
        return module
    memo = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(to_meta(p.detach(), dtype), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = to_meta(b, dtype)
    return copy.deepcopy(module, memo)


def _outputs(out) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def forward_backward_counts(module: torch.nn.Module, example_input, dtype=None) -> tuple[Counts, Counts, Counts]:
    """(forward, backward_input, backward_weight) counts of `module` on `example_input` (a tensor
    or a tuple of them), on the meta device: the forward; I, the backward for the input (every
    activation's gradient back to the input); W, the weights' gradients on top of I. B = I + W.
    With `dtype` (e.g. torch.bfloat16) the module and input are counted in that dtype. A stage
    whose input is not differentiable (token ids) has I = 0: nothing waits for its input's
    gradient, so its whole backward is W.

    The backward is counted with a gradient of ones for every output, as a loss's gradient would be.
    W is the whole backward (input and weights) less I, so it holds exactly the weight-gradient
    products (a layer's input gradient is part of I, whether or not the weights need it). Where one
    operator computes both gradients in one call (a convolution's backward), W gets the FLOPs of
    the weight gradient and the bytes it writes, and I the rest."""
    module = meta_module(module, dtype)
    inputs = meta_inputs(example_input, dtype)
    grad_inputs = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    params = [p for _, p in trainable_parameters(module)]
    forward = count(module, *inputs)

    def backward(wrt: list[torch.Tensor]) -> Counts:
        if not wrt:
            return ZERO
        outs = _outputs(module(*inputs))  # a fresh graph, not counted
        if not outs:
            raise ValueError(f"{type(module).__name__}'s output does not require grad: no backward to count")
        grads = [torch.ones_like(o) for o in outs]
        return count(lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True))

    backward_input = backward(grad_inputs)
    backward_weight = backward(grad_inputs + params) - backward_input
    if backward_weight.flops or backward_weight.bytes:  # W runs as its own pass: at least one launch
        backward_weight = Counts(backward_weight.flops, backward_weight.bytes, max(1, backward_weight.kernels))
    return forward, backward_input, backward_weight


def compute_seconds(counts: Counts, device: Device, dtype="float32", efficiency: float = EFFICIENCY,
                    launch_overhead_s: float = LAUNCH_OVERHEAD_S) -> float:
    """Seconds `counts` take on `device` in `dtype`: the roofline, the longer of the FLOPs over the
    device's dense FLOP/s and the bytes over its memory bandwidth, divided by `efficiency` (the
    fraction of the peak real kernels reach), plus `launch_overhead_s` per operator."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is the fraction of the peak a kernel reaches, in (0, 1]; got "
                         f"{efficiency!r}; e.g. 0.5")
    if launch_overhead_s < 0:
        raise ValueError(f"launch_overhead_s must be >= 0 seconds, got {launch_overhead_s!r}; e.g. 5e-6")
    busy = max(counts.flops / device.rate(dtype), counts.bytes / device.memory_bandwidth)
    return busy / efficiency + launch_overhead_s * counts.kernels


def stage_seconds(module: torch.nn.Module, example_input, device: Device, dtype="float32",
                  efficiency: float = EFFICIENCY, launch_overhead_s: float = LAUNCH_OVERHEAD_S) -> dict[str, float]:
    """Modelled seconds of `module`'s forward ("F"), backward ("B") and its two halves ("I", "W")
    on `device` in `dtype`, for one micro-batch like `example_input`: what a pipeline stage's
    spans last on the emulated node (and in the simulator, with the same costs)."""
    forward, grad_input, grad_weight = forward_backward_counts(module, example_input, torch_dtype(dtype))
    seconds = {kind: compute_seconds(counts, device, dtype, efficiency, launch_overhead_s)
               for kind, counts in (("F", forward), ("I", grad_input), ("W", grad_weight))}
    seconds["B"] = compute_seconds(grad_input + grad_weight, device, dtype, efficiency, launch_overhead_s)
    return seconds


def step_flops(module: torch.nn.Module, example_input, dtype=None) -> float:
    """FLOPs of one training step's math for `module` on a batch like `example_input`: its forward
    and both halves of its backward, counted on the meta device (the size costs no memory)."""
    return sum(c.flops for c in forward_backward_counts(module, example_input, dtype))


def budget(flops: float, node: str = "4xH100-nvlink", dtype="float32", efficiency: float = EFFICIENCY) -> str:
    """A GPU profile's time budget from its FLOP count: the seconds `flops` take spread over the
    devices of `node` at `efficiency` of their dense peak in `dtype` (start-up and messages aside)."""
    from pipelab.emulate.specs import parse_node

    n = parse_node(node)
    seconds = flops / (n.count * n.device.rate(dtype) * efficiency)
    return (f"about {seconds:.2g} s of compute on {n.count} x {n.device.name} in "
            f"{dtype} at {efficiency:.0%} of their peak, plus start-up and messages")


def bound(counts: Counts, device: Device, dtype="float32") -> str:
    """"compute" if the FLOPs take longer than the bytes on `device`, else "memory": which side of
    the roofline's ridge the operation sits on."""
    return "compute" if counts.flops / device.rate(dtype) >= counts.bytes / device.memory_bandwidth else "memory"


def arithmetic_intensity(counts: Counts) -> float:
    """FLOPs per byte moved; an operation is compute-bound on a device when this exceeds the
    device's ridge point, FLOP/s over bytes/s."""
    return counts.flops / counts.bytes if counts.bytes else float("inf")


def message_seconds(nbytes: float, link: Link) -> float:
    """Seconds one message of `nbytes` takes over `link`: latency + bytes / bandwidth."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return link.latency_s + nbytes / link.bandwidth_Bps


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")


def collective_seconds(kind: str, nbytes: float, ranks: int, link: Link) -> float:
    """Seconds of a ring collective over `ranks` devices joined by `link`, each step one message
    (latency + bytes / bandwidth) with every rank sending and receiving at once. `nbytes` is the
    whole tensor: the input of all_reduce and reduce_scatter, the output of all_gather.

    - all_reduce: 2(n-1) steps of nbytes/n (lesson 00's `ring_all_reduce_time`);
    - reduce_scatter, all_gather: its two halves, (n-1) steps of nbytes/n each;
    - broadcast: the tensor pipelined down the ring in chunks, (n-1) latencies and nbytes/bandwidth
      once (every link carries the whole tensor, all links at once);
    - barrier: an all_reduce of nothing, 2(n-1) latencies."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; use one of {COLLECTIVES}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {ranks!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    n, latency, bandwidth = ranks, link.latency_s, link.bandwidth_Bps
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return ring_all_reduce_time(nbytes, n, bandwidth, latency)
    if kind == "barrier":
        return ring_all_reduce_time(0, n, bandwidth, latency)
    if kind == "broadcast":
        return (n - 1) * latency + nbytes / bandwidth
    return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth  # reduce_scatter, all_gather

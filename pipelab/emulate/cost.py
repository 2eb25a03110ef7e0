"""How long an operation lasts on an accelerator: count its work, then divide by the device's rates.

- `count(fn, *args)` runs `fn` on META tensors (shapes and dtypes, no data, no memory), so a model
  far larger than this machine can be counted: FLOPs from PyTorch's own counter
  (`torch.utils.flop_counter.FlopCounterMode`, matrix products and convolutions), bytes as what
  every operator reads and writes (the sizes of its input and output tensors; views move nothing).
- `forward_backward_counts(module, x)` counts a forward, and its backward split as zero-bubble
  schedules split it: I, the gradient with respect to the input (what the previous stage waits for),
  and W, the gradients with respect to the weights (which can wait). B = I + W.
- `compute_seconds` is the roofline at measured efficiencies (`calibrated`): each operator lasts
  the longer of the host's cost of launching it and its FLOPs and bytes at the efficiency real
  kernels of that size reach on that device (fitted on published tables). With an explicit
  `efficiency` it is the flat roofline instead: the longer of FLOPs over FLOP/s and bytes over
  bandwidth, divided by `efficiency`, plus `launch_overhead_s` per operator.
- `message_seconds` and `collective_seconds`: over a link with a calibrated model (every link of
  `specs.LINKS`), NCCL's protocols fitted on published nccl-tests tables (`calibrated`); over any
  other link, the latency-bandwidth model of lesson 00: one message of m bytes takes latency +
  m / bandwidth; a ring collective is a sequence of such steps.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from pipelab.latency_bandwidth import ring_all_reduce_time
from pipelab.emulate import calibrated
from pipelab.emulate.specs import Device, Link, dtype_name, torch_dtype
from pipelab.models import trainable_parameters

# The flat model's figures, used where a caller passes an `efficiency` (and by `budget`, a rough
# estimate): model FLOPs utilisation of well-tuned large-model training is about half the peak: Megatron-LM
# reports 52% of the A100's peak per GPU (Narayanan et al., "Efficient Large-Scale Language Model
# Training on GPU Clusters Using Megatron-LM", SC 2021, https://arxiv.org/abs/2104.04473) and PaLM
# 46.2% MFU (Chowdhery et al., https://arxiv.org/abs/2204.02311).
EFFICIENCY = 0.5
# Per operator: launching a CUDA kernel from PyTorch's eager mode costs a few microseconds of host
# time, so a stream of tiny operators is bound by launches, not by the GPU. An estimate, not a
# data-sheet figure.
LAUNCH_OVERHEAD_S = 5e-6
# PIPELAB_EMULATE_MODEL=datasheet (in the environment of every rank) plays the model the emulator
# had before it was calibrated: the flat roofline above for every kernel, and the latency-bandwidth
# formulas below for every link. Only for before/after comparisons
# (`benchmarks/calibration_before_after.py`); the lessons use the calibrated model.
MODEL_ENV = "PIPELAB_EMULATE_MODEL"


def datasheet_model() -> bool:
    """True where the environment asks for the pre-calibration (data-sheet) model."""
    value = os.environ.get(MODEL_ENV, "calibrated")
    if value not in ("calibrated", "datasheet"):
        raise ValueError(f"{MODEL_ENV}={value!r}: use 'calibrated' (the default) or 'datasheet'")
    return value == "datasheet"


@dataclass(frozen=True)
class Counts:
    """Work of an operation: floating-point operations, bytes read and written in device memory,
    how many operators (kernels) it launches and, where counted, how many of them do the FLOPs
    (matrix products, convolutions; `count` counts them; None: the FLOPs taken as one product)."""
    flops: float
    bytes: float
    kernels: int = 1
    flop_kernels: int | None = field(default=None, compare=False)  # a detail: equal work compares equal

    @property
    def compute_kernels(self) -> int:
        """The kernels that do the FLOPs: counted, or one where not counted."""
        if not self.flops:
            return 0
        return min(1, self.kernels) if self.flop_kernels is None else self.flop_kernels

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(self.flops + other.flops, self.bytes + other.bytes, self.kernels + other.kernels,
                      self.compute_kernels + other.compute_kernels)

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(max(0.0, self.flops - other.flops), max(0.0, self.bytes - other.bytes),
                      max(0, self.kernels - other.kernels), max(0, self.compute_kernels - other.compute_kernels))


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
        self.flop_kernels = 0  # operators PyTorch's FLOP counter counts (matrix products, convolutions)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_TRAFFIC:
            self.bytes += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
            self.kernels += 1
            self.flop_kernels += func.overloadpacket in flop_registry
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
    return Counts(float(flops.get_total_flops()), float(moved.bytes), moved.kernels, moved.flop_kernels)


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
        backward_weight = Counts(backward_weight.flops, backward_weight.bytes, max(1, backward_weight.kernels),
                                 max(1, backward_weight.compute_kernels) if backward_weight.flops else 0)
    return forward, backward_input, backward_weight


def device_dtype(device: Device, dtype):
    """`dtype` checked against `device` (a ValueError if the card has no such math)."""
    device.rate(dtype)
    return dtype


def compute_seconds(counts: Counts, device: Device, dtype="float32", efficiency: float | None = None,
                    launch_overhead_s: float | None = None) -> float:
    """Seconds `counts` take on `device` in `dtype`. Calibrated (no `efficiency`): its operators as
    a stream of kernels the host issues while the GPU runs them (`calibrated.stream_seconds`): the
    longer of the kernels' launch floors and the GPU's work -- the FLOPs at the efficiency measured
    for products of their size, or the bytes at the measured bandwidth (`launch_overhead_s` replaces
    the measured floor). With `efficiency`: the flat roofline, the
    longer of FLOPs over dense FLOP/s and bytes over bandwidth, divided by `efficiency`, plus
    `launch_overhead_s` (default 5 us) per operator."""
    if efficiency is None and datasheet_model():
        efficiency = EFFICIENCY
    if efficiency is None:
        if launch_overhead_s is not None and launch_overhead_s < 0:
            raise ValueError(f"launch_overhead_s must be >= 0 seconds, got {launch_overhead_s!r}; e.g. 5e-6")
        return calibrated.stream_seconds(counts.flops, counts.bytes, counts.kernels, counts.compute_kernels,
                                         device, dtype_name(device_dtype(device, dtype)), launch_overhead_s)
    launch = LAUNCH_OVERHEAD_S if launch_overhead_s is None else launch_overhead_s
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is the fraction of the peak a kernel reaches, in (0, 1]; got "
                         f"{efficiency!r}; e.g. 0.5")
    if launch < 0:
        raise ValueError(f"launch_overhead_s must be >= 0 seconds, got {launch!r}; e.g. 5e-6")
    busy = max(counts.flops / device.rate(dtype), counts.bytes / device.memory_bandwidth)
    return busy / efficiency + launch * counts.kernels


def stage_seconds(module: torch.nn.Module, example_input, device: Device, dtype="float32",
                  efficiency: float | None = None, launch_overhead_s: float | None = None) -> dict[str, float]:
    """Modelled seconds of `module`'s forward ("F"), backward ("B") and its two halves ("I", "W")
    on `device` in `dtype`, for one micro-batch like `example_input`: what a pipeline stage's
    spans last on the emulated node (and in the simulator, with the same costs); calibrated unless
    an `efficiency` is given (see `compute_seconds`)."""
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


def message_seconds(nbytes: float, link: Link) -> float:
    """Seconds one message of `nbytes` takes over `link`: NCCL's measured protocols over the link's
    kind (`calibrated.message_seconds`), or latency + bytes / bandwidth for a link without one."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    seconds = None if datasheet_model() else calibrated.message_seconds(nbytes, link)
    return link.latency_s + nbytes / link.bandwidth_Bps if seconds is None else seconds


def ring_figures(link: Link) -> tuple[float, float]:
    """(per-step latency s, bus bandwidth B/s) of the ring the emulator plays over `link` for
    large messages: the calibrated Simple protocol's, or the link's own figures where it has no fit
    (or under the datasheet model), so lesson 00's ring formula predicts what the emulator does."""
    fabric = None if datasheet_model() else calibrated.fabric_of(link)
    return (link.latency_s, link.bandwidth_Bps) if fabric is None else (fabric.simple_step_s, fabric.simple_busbw)


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")


def collective_seconds(kind: str, nbytes: float, ranks: int, link: Link) -> float:
    """Seconds of a collective over `ranks` devices joined by `link`. `nbytes` is the whole tensor:
    the input of all_reduce and reduce_scatter, the output of all_gather. Over a link with a
    calibrated model, NCCL's measured protocols, NVLS and several machines (`calibrated`). Over any
    other link, a ring, each step one message (latency + bytes / bandwidth) with every rank sending
    and receiving at once:

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
    seconds = None if datasheet_model() else calibrated.collective_seconds(kind, nbytes, n, link)
    if seconds is not None:
        return seconds
    if kind == "all_reduce":
        return ring_all_reduce_time(nbytes, n, bandwidth, latency)
    if kind == "barrier":
        return ring_all_reduce_time(0, n, bandwidth, latency)
    if kind == "broadcast":
        return (n - 1) * latency + nbytes / bandwidth
    return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth  # reduce_scatter, all_gather

"""What a rank holds in device memory while it trains, at the emulated size, against the device's
capacity: so a lesson can say "stage 1 would need 93.1 GB of an 80 GB H100" before anything runs.

A rank training its share of a model holds

- its parameters, and their gradients (same size, same dtype);
- the optimizer's state: SGD none, SGD with momentum one copy of the parameters, Adam two (its
  first and second moments);
- with mixed precision (parameters in bf16/fp16), an fp32 master copy of the weights, and the
  optimizer's state in fp32 too: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter with Adam, as the ZeRO
  paper counts it (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", https://arxiv.org/abs/1910.02054, section 3.1);
- the activations its backward needs, stashed per micro-batch, times the micro-batches whose
  backward has not run yet at the peak (GPipe: all m; 1F1B: at most p - stage).

Counts come from the meta device, so a model far larger than this machine can be measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from pipelab.emulate.cost import meta_inputs, meta_module
from pipelab.emulate.specs import GB, Device

# Extra copies of the parameters each optimizer keeps.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}
OPTIMIZER_LABELS = {"sgd": "SGD", "momentum": "momentum", "adam": "Adam"}
FP32_BYTES = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes a rank holds at its peak, part by part, and the device it must fit on."""
    stage: int | str
    device: Device
    parameters: float
    gradients: float
    optimizer_state: float
    master_weights: float
    activations: float
    optimizer: str = "adam"
    notes: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.master_weights + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.device.memory_bytes

    def parts(self) -> dict[str, float]:
        """The non-zero parts, in bytes, under the names the sentence uses."""
        named = {"parameters": self.parameters, "gradients": self.gradients,
                 "fp32 master weights": self.master_weights,
                 OPTIMIZER_LABELS[self.optimizer]: self.optimizer_state, "activations": self.activations}
        return {name: value for name, value in named.items() if value > 0}

    def sentence(self) -> str:
        """E.g. "stage 1 would need 93.1 GB of an 80 GB NVIDIA H100 SXM (parameters 20.1,
        gradients 20.1, Adam 40.2, activations 12.7)"."""
        capacity = self.device.memory_bytes / GB
        unit, scale = ("GB", GB) if self.total >= 0.1 * GB else ("MB", 1e6)  # small stages in MB
        parts = ", ".join(f"{name} {value / scale:.1f}" for name, value in self.parts().items())
        return (f"stage {self.stage} would need {self.total / scale:.1f} {unit} of {_article(capacity)} "
                f"{capacity:g} GB {self.device.name} ({parts})")


def _article(number: float) -> str:
    """"an" before 8, 11, 18, 80, 800...: numbers read with a leading vowel sound."""
    whole = int(number)
    return "an" if str(whole).startswith("8") or whole in (11, 18) else "a"


def _bytes_of(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def rank_memory(parameters: int, device: Device, *, stage: int | str = 0, param_dtype=torch.float32,
                optimizer: str = "adam", activation_bytes: float = 0.0, microbatches_in_flight: int = 1,
                ) -> MemoryBreakdown:
    """The memory of a rank holding `parameters` parameters in `param_dtype`, trained with
    `optimizer` ("sgd", "momentum" or "adam"), stashing `activation_bytes` per micro-batch for
    `microbatches_in_flight` micro-batches at its peak. A half-precision `param_dtype` means mixed
    precision: an fp32 master copy and the optimizer's state in fp32."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATES)}")
    if isinstance(parameters, bool) or not isinstance(parameters, int) or parameters < 0:
        raise ValueError(f"parameters must be a whole number >= 0, got {parameters!r}")
    if isinstance(microbatches_in_flight, bool) or not isinstance(microbatches_in_flight, int) \
            or microbatches_in_flight < 0:
        raise ValueError(f"microbatches_in_flight must be a whole number >= 0, got {microbatches_in_flight!r}")
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes!r}")
    width = _bytes_of(param_dtype)
    mixed = width < FP32_BYTES
    state_width = FP32_BYTES if mixed else width
    return MemoryBreakdown(
        stage=stage, device=device,
        parameters=parameters * width, gradients=parameters * width,
        optimizer_state=OPTIMIZER_STATES[optimizer] * parameters * state_width,
        master_weights=parameters * FP32_BYTES if mixed else 0.0,
        activations=activation_bytes * microbatches_in_flight, optimizer=optimizer,
        notes={"parameters_count": parameters, "microbatches_in_flight": microbatches_in_flight,
               "activation_bytes_per_microbatch": activation_bytes})


def microbatches_in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """How many micro-batches' activations `stage` (0-based) holds at its peak: GPipe runs every
    forward before any backward, so all m; 1F1B starts backwards after p - stage forwards, so at
    most p - stage (the first stage holds the most)."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage!r}")
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages - stage)
    raise ValueError(f"unknown schedule {schedule!r}; use 'gpipe' or '1f1b'")


def stashed_bytes(module: torch.nn.Module, example_input, dtype=None) -> int:
    """Bytes of the tensors autograd saves for `module`'s backward in one forward on
    `example_input` (one micro-batch), counted on the meta device: the activations a stage stashes
    per micro-batch. The parameters it saves (a weight for its input gradient) are not counted:
    they are held anyway. A tensor saved by several operators counts once. With `dtype`, the
    module and input are counted in that dtype."""
    module = meta_module(module, dtype)
    inputs = meta_inputs(example_input, dtype)
    held = {p.untyped_storage()._cdata for p in module.parameters()}
    held |= {b.untyped_storage()._cdata for b in module.buffers()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in held:
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    del out
    return sum(saved.values())


def input_bytes(example_input) -> int:
    """Bytes of a stage's input: all that a checkpointed stage stashes per micro-batch."""
    leaves, _ = tree_flatten(example_input)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def stage_memory(module: torch.nn.Module, example_microbatch, device: Device, *, stage: int | str = 0,
                 optimizer: str = "adam", microbatches_in_flight: int = 1, checkpoint: bool = False,
                 dtype=None) -> MemoryBreakdown:
    """`rank_memory` of a stage `module` (built on meta at the emulated size, or a small real one)
    fed micro-batches like `example_microbatch`, in `dtype` if given (bf16: mixed precision).
    With `checkpoint`, a stage stashes only its input per micro-batch and rebuilds one
    micro-batch's activations at a time in backward."""
    module = meta_module(module, dtype)
    params = list(module.parameters())
    count = sum(p.numel() for p in params)
    param_dtype = params[0].dtype if params else (dtype or torch.float32)
    full = stashed_bytes(module, example_microbatch, dtype)
    if checkpoint:
        kept = input_bytes(meta_inputs(example_microbatch, dtype))
        activations = kept * microbatches_in_flight + full  # plus one micro-batch being recomputed
        per_microbatch, in_flight = activations, 1
    else:
        per_microbatch, in_flight = full, microbatches_in_flight
    breakdown = rank_memory(count, device, stage=stage, param_dtype=param_dtype, optimizer=optimizer,
                            activation_bytes=per_microbatch, microbatches_in_flight=in_flight)
    breakdown.notes.update(microbatches_in_flight=microbatches_in_flight, checkpoint=checkpoint,
                           activation_bytes_per_microbatch=full)
    return breakdown


def check_fits(breakdown: MemoryBreakdown) -> MemoryBreakdown:
    """`breakdown` if it fits its device; else a ValueError with the sentence and what to change."""
    if breakdown.fits:
        return breakdown
    activation_fixes = ["keep fewer micro-batches in flight (1F1B holds at most p - stage, GPipe all m)",
                        "checkpoint activations (recompute the forward during backward)"]
    fixes = ["split the model over more stages (each holds fewer parameters)"]
    if breakdown.optimizer_state > 0:
        fixes += ["shard the optimizer state over data-parallel ranks (ZeRO) or use a lighter optimizer"]
    if not breakdown.master_weights:
        fixes += ["train in mixed precision (bf16 parameters and activations)"]
    if breakdown.activations > 0:  # the largest part's fixes first
        largest = max(breakdown.parts().values())
        fixes = activation_fixes + fixes if breakdown.activations == largest else fixes + activation_fixes
    raise ValueError(f"{breakdown.sentence()}: it does not fit; " + "; or ".join(fixes))


class MemoryMeter:
    """A rank's running memory at the emulated size: fixed parts (parameters, gradients, optimizer
    state) plus activations stashed and released micro-batch by micro-batch; remembers the peak."""

    def __init__(self, device: Device, fixed_bytes: float = 0.0):
        self.device = device
        self.fixed = fixed_bytes
        self.stashed = 0.0
        self.peak = fixed_bytes

    @property
    def current(self) -> float:
        return self.fixed + self.stashed

    def stash(self, nbytes: float) -> None:
        """A micro-batch's activations are kept for its backward."""
        self.stashed += nbytes
        self.peak = max(self.peak, self.current)

    def release(self, nbytes: float) -> None:
        """Its backward ran: they are freed."""
        self.stashed = max(0.0, self.stashed - nbytes)

    @property
    def fits(self) -> bool:
        return self.peak <= self.device.memory_bytes

"""The communication of tensor parallelism: four operators, each the other's mirror in backward.

Megatron-LM (Shoeybi et al., 2019) names two: `f` is the identity forward and an all-reduce in
backward (it stands before a column-parallel layer: every rank reads the whole input, so each
rank's part of the input gradient must be summed); `g` is an all-reduce forward and the identity in
backward (it ends a row-parallel layer: each rank holds a partial sum of the output). Sequence
parallelism (Korthikanti et al., 2022) replaces them by an all-gather along the sequence before the
column-parallel layer (its backward: a reduce-scatter) and a reduce-scatter after the row-parallel
layer (its backward: an all-gather), so that what lies between blocks (LayerNorm, dropout, the
residual) is kept and computed on a slice of the sequence only.

Every operator adds the bytes it sends to the group's `CommMeter`, so a lesson counts real
messages, not a formula.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.autograd.function import FunctionCtx  # autograd's ctx: what forward saves for backward
import torch.distributed as dist


@dataclass
class CommMeter:
    """What a group's collectives sent: per (kind, direction) the number of calls and the bytes
    each rank sent over the ring for them (`ring_bytes`: what a rank's link carries)."""

    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, kind: str, direction: str, nbytes: int) -> None:
        key = (kind, direction)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + nbytes

    def total_bytes(self, direction: str | None = None) -> int:
        return sum(b for (_, d), b in self.bytes.items() if direction in (None, d))

    def clear(self) -> None:
        self.calls.clear()
        self.bytes.clear()


def ring_bytes(kind: str, full_bytes: int, ranks: int) -> int:
    """Bytes each rank sends for one collective on a ring of `ranks` over a tensor of `full_bytes`
    (the whole, unsharded tensor): an all-reduce is a reduce-scatter then an all-gather, each
    (ranks-1) steps of one shard, so it sends twice what either half sends."""
    if ranks == 1:
        return 0
    step = full_bytes / ranks
    return round({"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[kind] * (ranks - 1) * step)


@dataclass
class TensorParallelGroup:
    """The ranks that share one layer's matrices: their process group, this rank's place in it,
    and the meter the operators report to."""

    group: object  # a torch.distributed ProcessGroup (None: the default group)
    rank: int
    size: int
    meter: CommMeter = field(default_factory=CommMeter)
    rec: object = None  # a timeline Recorder: each collective becomes a span on the "tensor" lane

    def _span(self, kind: str):
        return self.rec.span(kind, lane="tensor") if self.rec is not None else nullcontext()

    @classmethod
    def world(cls) -> "TensorParallelGroup":
        """Every rank of the job in one tensor-parallel group."""
        return cls(None, dist.get_rank(), dist.get_world_size())

    def all_reduce(self, t: torch.Tensor, direction: str) -> torch.Tensor:
        t = t.contiguous().clone()
        self.meter.add("all_reduce", direction, ring_bytes("all_reduce", _nbytes(t), self.size))
        with self._span("allreduce"):
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int, direction: str) -> torch.Tensor:
        """The ranks' slices `t`, concatenated along `dim` in rank order."""
        moved = t.movedim(dim, 0).contiguous()
        out = torch.empty((self.size * moved.shape[0], *moved.shape[1:]), dtype=t.dtype, device=t.device)
        self.meter.add("all_gather", direction, ring_bytes("all_gather", _nbytes(out), self.size))
        with self._span("allgather"):
            dist.all_gather_single(out, moved, group=self.group)
        return out.movedim(0, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int, direction: str) -> torch.Tensor:
        """This rank's slice along `dim` of the sum over ranks of `t`."""
        moved = t.movedim(dim, 0).contiguous()
        if moved.shape[0] % self.size:
            raise ValueError(f"a reduce-scatter along dim {dim} of length {moved.shape[0]} needs a length "
                             f"divisible by the tensor-parallel size {self.size}")
        out = torch.empty((moved.shape[0] // self.size, *moved.shape[1:]), dtype=t.dtype, device=t.device)
        self.meter.add("reduce_scatter", direction, ring_bytes("reduce_scatter", _nbytes(moved), self.size))
        with self._span("reducescatter"):
            dist.reduce_scatter_single(out, moved, group=self.group)
        return out.movedim(0, dim)

    def slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of `t` along `dim` (no message: every rank holds all of `t`)."""
        return t.chunk(self.size, dim)[self.rank].contiguous()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: forward the input as it is; backward, sum the ranks' input gradients."""

    @staticmethod
    def forward(ctx: FunctionCtx, x, tp: TensorParallelGroup):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad):
        return ctx.tp.all_reduce(grad, "backward"), None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward, sum the ranks' partial outputs; backward, pass the gradient on."""

    @staticmethod
    def forward(ctx: FunctionCtx, x, tp: TensorParallelGroup):
        return tp.all_reduce(x, "forward")

    @staticmethod
    def backward(ctx: FunctionCtx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence parallel, before a column-parallel layer: forward, all-gather the sequence slices;
    backward, reduce-scatter (each rank's full input gradient is a partial sum, like f's)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x, tp: TensorParallelGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim
        return tp.all_gather(x, dim, "forward")

    @staticmethod
    def backward(ctx: FunctionCtx, grad):
        return ctx.tp.reduce_scatter(grad, ctx.dim, "backward"), None, None


class _ScatterToSequence(torch.autograd.Function):
    """Sequence parallel, after a row-parallel layer: forward, reduce-scatter the partial sums along
    the sequence (g's all-reduce, but each rank keeps its slice); backward, all-gather."""

    @staticmethod
    def forward(ctx: FunctionCtx, x, tp: TensorParallelGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim
        return tp.reduce_scatter(x, dim, "forward")

    @staticmethod
    def backward(ctx: FunctionCtx, grad):
        return ctx.tp.all_gather(grad, ctx.dim, "backward"), None, None


def copy_to_parallel(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return _CopyToParallel.apply(x, tp)


def reduce_from_parallel(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, tp)


def gather_from_sequence(x: torch.Tensor, tp: TensorParallelGroup, dim: int = 1) -> torch.Tensor:
    return _GatherFromSequence.apply(x, tp, dim)


def scatter_to_sequence(x: torch.Tensor, tp: TensorParallelGroup, dim: int = 1) -> torch.Tensor:
    return _ScatterToSequence.apply(x, tp, dim)

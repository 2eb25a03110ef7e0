"""Tensor-parallel layers, each made from the unsplit layer so a run can be compared with it.

A linear layer computes Y = X A + b (in `nn.Linear`, A is `weight.T`). Cut A by columns and every
rank computes its own columns of Y from the whole X: **column parallel**, no message forward. Cut A
by rows and every rank multiplies its slice of X's columns by its rows of A, giving a partial Y
that the ranks sum: **row parallel**. A column-parallel layer followed by a row-parallel one (the
MLP: widen, GELU, narrow; attention: queries/keys/values by heads, then the output) needs one
all-reduce forward (g, after the row layer) and one backward (f, before the column layer): the
GELU and each head's attention run on the rank's own columns, with no message between.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.function import FunctionCtx  # autograd's ctx: what forward saves for backward
from torch import nn
from torch.nn import functional as F

from pipelab.tensor_parallel.comm import (TensorParallelGroup, copy_to_parallel, gather_from_sequence,
                                          reduce_from_parallel, scatter_to_sequence)
from pipelab.transformer import MLP, Attention, Block, attend


def _check_divides(what: str, n: int, tp: TensorParallelGroup) -> None:
    if n % tp.size:
        raise ValueError(f"{what}={n} does not divide by the tensor-parallel size {tp.size}; use a "
                         f"tensor-parallel size that divides {n}, or make {what} a multiple of {tp.size}")


class ColumnParallelLinear(nn.Module):
    """This rank's columns of one or more linear layers that read the same input (attention's
    queries, keys and values are stacked into one, so their input crosses `f` once). The input is
    the whole X: after `f` (tensor parallel) or gathered from the ranks' sequence slices
    (sequence parallel). The output is this rank's columns of Y.

    Under sequence parallelism the weight's gradient needs the whole X. Keeping the gathered X for
    backward needs a full activation per layer on every rank; `regather=True` keeps only this
    rank's slice and gathers X again in backward, as Megatron-LM does: less memory, one more
    all-gather."""

    def __init__(self, linears: nn.Linear | Sequence[nn.Linear], tp: TensorParallelGroup,
                 sequence_parallel: bool = False, regather: bool = False):
        super().__init__()
        linears = [linears] if isinstance(linears, nn.Linear) else list(linears)
        for linear in linears:
            _check_divides("out_features", linear.out_features, tp)
        self.tp, self.sequence_parallel, self.regather = tp, sequence_parallel, regather
        self.weight = nn.Parameter(torch.cat([tp.slice(l.weight.detach(), 0) for l in linears]))
        self.bias = nn.Parameter(torch.cat([tp.slice(l.bias.detach(), 0) for l in linears]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.regather:
            return _GatherThenLinear.apply(x, self.weight, self.bias, self.tp)
        x = gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_parallel(x, self.tp)
        return F.linear(x, self.weight, self.bias)


class _GatherThenLinear(torch.autograd.Function):
    """All-gather the sequence slices, then the linear layer; for backward keep only the slice
    and gather it again (Korthikanti et al., 2022, section 4.2.2)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x_slice, weight, bias, tp: TensorParallelGroup):
        ctx.save_for_backward(x_slice, weight)
        ctx.tp = tp
        return F.linear(tp.all_gather(x_slice, 1, "forward"), weight, bias)

    @staticmethod
    def backward(ctx: FunctionCtx, grad):
        x_slice, weight = ctx.saved_tensors
        x = ctx.tp.all_gather(x_slice, 1, "backward")  # the whole X again, for the weight's gradient
        grad_x = ctx.tp.reduce_scatter(grad @ weight, 1, "backward")
        grad_weight = grad.flatten(0, -2).T @ x.flatten(0, -2)
        return grad_x, grad_weight, grad.flatten(0, -2).sum(0), None


class RowParallelLinear(nn.Module):
    """This rank's rows of A (its slice of `weight`'s columns): it reads its own columns of X (a
    column-parallel layer's output) and adds a partial Y. The partial Ys are summed by `g`
    (tensor parallel) or reduce-scattered so each rank keeps its slice of the sequence (sequence
    parallel). The bias is added once, after the sum, so every rank holds all of it."""

    def __init__(self, linear: nn.Linear, tp: TensorParallelGroup, sequence_parallel: bool = False):
        super().__init__()
        _check_divides("in_features", linear.in_features, tp)
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = nn.Parameter(tp.slice(linear.weight.detach(), 1))
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        y = scatter_to_sequence(partial, self.tp) if self.sequence_parallel else reduce_from_parallel(partial, self.tp)
        return y + self.bias


class ParallelMLP(nn.Module):
    """The MLP cut across ranks: widen (column parallel), GELU on the rank's own columns, narrow
    (row parallel). One all-reduce forward, one backward."""

    def __init__(self, mlp: MLP, tp: TensorParallelGroup, sequence_parallel: bool = False,
                 regather: bool = False):
        super().__init__()
        self.fc1 = ColumnParallelLinear(mlp.fc1, tp, sequence_parallel, regather)
        self.fc2 = RowParallelLinear(mlp.fc2, tp, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelAttention(nn.Module):
    """Attention with its heads cut across ranks: each rank computes n_heads / size heads from
    its columns of the queries, keys and values (one stacked column-parallel layer), and the
    output projection is row parallel. One all-reduce forward, one backward."""

    def __init__(self, attn: Attention, tp: TensorParallelGroup, sequence_parallel: bool = False,
                 regather: bool = False):
        super().__init__()
        _check_divides("n_heads", attn.n_heads, tp)
        self.local_heads = attn.n_heads // tp.size
        self.qkv = ColumnParallelLinear([attn.q, attn.k, attn.v], tp, sequence_parallel, regather)
        self.out = RowParallelLinear(attn.out, tp, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(attend(q, k, v, self.local_heads))


class ParallelBlock(nn.Module):
    """A GPT block over a tensor-parallel group. Its LayerNorms are whole on every rank. With
    `sequence_parallel`, the block takes and returns this rank's slice of the sequence, and its
    LayerNorms, dropout and residual work on that slice only; their parameters then see only the
    slice, so their gradients are summed over the group after backward (`sync_replicated_grads`).
    `regather`: see `ColumnParallelLinear`."""

    def __init__(self, block: Block, tp: TensorParallelGroup, sequence_parallel: bool = False,
                 regather: bool = False):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.ln1 = _copy_layer_norm(block.ln1)
        self.attn = ParallelAttention(block.attn, tp, sequence_parallel, regather)
        self.ln2 = _copy_layer_norm(block.ln2)
        self.mlp = ParallelMLP(block.mlp, tp, sequence_parallel, regather)
        self.dropout = nn.Dropout(block.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every rank holds whole: the LayerNorms and the row layers' biases."""
        return [*self.ln1.parameters(), *self.ln2.parameters(), self.attn.out.bias, self.mlp.fc2.bias]

    def sync_replicated_grads(self) -> None:
        """Sequence parallel only: each rank's gradient of a replicated parameter covers its slice of
        the sequence; the sum over the group is the whole sequence's gradient."""
        if not self.sequence_parallel:
            return
        for p in self.replicated_parameters():
            if p.grad is not None:
                p.grad.copy_(self.tp.all_reduce(p.grad, "parameters"))


def _copy_layer_norm(norm: nn.LayerNorm) -> nn.LayerNorm:
    copy = nn.LayerNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine)
    copy.load_state_dict(norm.state_dict())
    return copy

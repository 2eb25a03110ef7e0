"""Lesson 16's other runs: the formats and what rounding does to gradients, recomputation's activation
bytes and modelled step time, FP8's scaling, and the bf16 all-reduce on real ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelab.checks import divides, whole_number
from pipelab.emulate.cost import compute_seconds, count, forward_backward_counts, meta_module
from pipelab.emulate.fp8 import fp8_rates  # noqa: F401 - the lesson's modelled FP8 product
from pipelab.emulate.specs import parse_node
from pipelab.experiments.expert_parallel import one_thread
from pipelab.experiments.precision import Config
from pipelab.experiments.tensor_parallel import parameter_storages, saved_activation_bytes
from pipelab.precision import (FORMATS, DelayedScaling, MODES, RecomputedBlock, amax, attention_core, dequantize,
                               fp8_matmul, quantize, rounding_effect, scale_for)
from pipelab.sharding import Collectives
from pipelab.transformer import Block
from pipelab.worker import RankContext

def format_rows() -> list[dict]:
    """Each format's bits, range and precision, from torch.finfo."""
    return [{"format": f.name, "bits (sign/exp/mantissa)": f"1/{f.exponent_bits}/{f.mantissa_bits}",
             "largest": f"{f.max:.3g}", "smallest normal": f"{f.smallest_normal:.2g}",
             "smallest subnormal": f"{f.smallest_subnormal:.2g}", "eps (1 to next)": f"{f.eps:.2g}"}
            for f in FORMATS.values()]


def rounding_rows(named: dict[str, torch.Tensor]) -> list[dict]:
    """Per set of gradients and 16/8-bit format: what rounding into it did."""
    def shown(k: str, v: float) -> str:
        return f"{v:.2%}" if k != "median relative error" else f"{v:.1e}" if v == v else "none left"
    return [{"gradients": what, "format": fmt,
             **{k: shown(k, v) for k, v in rounding_effect(g, FORMATS[fmt].dtype).items()}}
            for what, g in named.items() for fmt in ("bf16", "fp16", "fp8 e4m3")]


@dataclass(frozen=True)
class BlockSize:
    """A Transformer block's size: sequence s, batch b, width h, heads a."""

    seq_len: int = 128
    batch: int = 2
    dim: int = 64
    n_heads: int = 4

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch", "dim", "n_heads"):
            whole_number(name, getattr(self, name))
        divides("dim", self.dim, "n_heads", self.n_heads)

    @property
    def sbh(self) -> int:
        return self.seq_len * self.batch * self.dim


def korthikanti_per_mode(size: BlockSize, mode: str, dropout: bool) -> float:
    """Activation bytes of one 16-bit block by Korthikanti et al. (2022): sbh(34 + 5as/h) kept whole,
    34 sbh with selective recomputation, 2 sbh with full; without dropout's masks sbh(32 + 2as/h), 32 sbh."""
    base, scores = (34, 5) if dropout else (32, 2)
    kept = {"none": base + scores * size.n_heads * size.seq_len / size.dim, "selective": base, "full": 2}[mode]
    return kept * size.sbh


@one_thread()
def recompute_rows(size: BlockSize) -> tuple[list[dict], bool]:
    """Per mode, the bytes autograd keeps for backward on the bf16 block beside the formula; and
    whether every mode gave the same gradients bit for bit."""
    torch.manual_seed(0)
    block = Block(size.dim, size.n_heads).to(torch.bfloat16)
    x = torch.randn(size.batch, size.seq_len, size.dim, dtype=torch.bfloat16)
    rows, grads = [], []
    for mode in MODES:
        x_in = x.clone().requires_grad_()
        y, kept = saved_activation_bytes(lambda: RecomputedBlock(block, mode)(x_in), parameter_storages(block))
        y.float().square().mean().backward()
        grads.append([x_in.grad] + [p.grad.clone() for p in block.parameters()])
        block.zero_grad(set_to_none=True)
        rows.append({"recomputation": mode, "counted (bytes/sbh)": round(kept / size.sbh, 3),
                     "Korthikanti, no dropout (bytes/sbh)": korthikanti_per_mode(size, mode, False) / size.sbh,
                     "Korthikanti, with dropout (bytes/sbh)": korthikanti_per_mode(size, mode, True) / size.sbh})
    return rows, all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))


@one_thread()
def recompute_times(size: BlockSize, node: str = "1xH100-nvlink4") -> list[dict]:
    """Per mode, the modelled step time of one bf16 block at `size` on `node`: forward + backward,
    plus the forward again (full) or the attention core again (selective)."""
    block = RecomputedBlock(meta_module(Block(size.dim, size.n_heads), torch.bfloat16))
    x = torch.empty(size.batch, size.seq_len, size.dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    forward, grad_in, grad_w = forward_backward_counts(block, x, torch.bfloat16)
    q = torch.empty(size.batch, size.seq_len, size.dim, dtype=torch.bfloat16, device="meta")
    core = count(attention_core, q, q, q, size.n_heads)
    base = forward + grad_in + grad_w
    work = {"none": base, "full": base + forward, "selective": base + core}
    ms = {mode: compute_seconds(w, parse_node(node).device, "bf16") * 1e3 for mode, w in work.items()}
    return [{"recomputation": m, "FLOPs": f"{work[m].flops:.3g}", "modelled step (ms)": float(f"{ms[m]:.3g}"),
             "FLOPs vs none": round(work[m].flops / base.flops - 1, 4),
             "overhead vs none": round(ms[m] / ms["none"] - 1, 4)}
            for m in MODES]


def recompute_verdict(rows: list[dict], times: list[dict]) -> tuple:
    kept = {r["recomputation"]: r["counted (bytes/sbh)"] for r in rows}
    cost = {r["recomputation"]: r["overhead vs none"] for r in times}
    text = (f"Selective recomputation kept {kept['selective'] / kept['none']:.0%} of the activations for "
            f"{cost['selective']:.1%} more modelled time; full recomputation keeps less and costs more (table above).")
    return "16.recompute", "selective cheaper" if cost["selective"] < cost["full"] else "selective not cheaper", \
        text, dict(selective_overhead=cost["selective"], full_overhead=cost["full"])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius)."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@one_thread()
def fp8_errors(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """The relative error of a @ b in bf16 and in FP8 e4m3 (per-tensor scales; no scale), against fp32."""
    want, one = a.float() @ b.float(), torch.tensor(1.0)
    return {"bf16": relative_error(a.bfloat16() @ b.bfloat16(), want),
            "fp8 e4m3, per-tensor scale": relative_error(fp8_matmul(a, b, scale_for(amax(a)), scale_for(amax(b))),
                                                         want),
            "fp8 e4m3, no scale": relative_error(fp8_matmul(a, b, one, one), want)}


@one_thread()
def fp8_rows(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[dict]:
    """Per named product, its operands' amax and the errors of `fp8_errors`."""
    return [{"product": name, "amax of the operands": f"{amax(a).item():.2g}, {amax(b).item():.2g}",
             **{k: f"{v:.1e}" for k, v in fp8_errors(a, b).items()}} for name, (a, b) in pairs.items()]


def lesson_matrices(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, tuple]:
    """The MLP's second layer's products on the batch: forward (input @ weight^T) and backward (the
    far smaller output gradient @ weight)."""
    hidden = torch.tanh(model[0](x)).detach()
    out = model[2](hidden)
    grad_out, = torch.autograd.grad(torch.nn.functional.mse_loss(model[4](torch.tanh(out)), y), out)
    w = model[2].weight.detach()
    return {"forward: input @ weight^T": (hidden, w.T), "backward: output gradient @ weight": (grad_out, w)}


@one_thread()
def scaling_over_steps(tensors: list[torch.Tensor], history: int = 4) -> list[dict]:
    """Per tensor of a sequence (a layer's activations step by step): its e4m3 round trip's error with
    current and with delayed scaling, and the share that saturated."""
    delayed, rows = DelayedScaling(history), []
    for step, t in enumerate(tensors):
        row = {"step": step, "amax": amax(t).item()}
        for name, scale in (("current", scale_for(amax(t))), ("delayed", delayed.scale(t))):
            back = dequantize(quantize(t, scale), scale)
            row[f"{name} error"] = relative_error(back, t)
            past = (t.float() * scale).abs() > FORMATS["fp8 e4m3"].max * (1 + 2 ** -10)  # the amax itself lands on 448
            row[f"{name} saturated"] = past.float().mean().item()
        rows.append(row)
    return rows


@dataclass
class AllReduced:
    """One rank's gradient all-reduced in fp32 and in bf16, and the bytes each call sent."""

    fp32: torch.Tensor
    bf16: torch.Tensor
    bytes_fp32: float
    bytes_bf16: float


def gradient_of_rank(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s gradient: the same on every call, different across ranks."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)) * 1e-3


def allreduce_worker(ctx: RankContext, cfg: Config) -> AllReduced:
    """All-reduce (sum) this rank's gradient in fp32 and again cast to bf16, each call's bytes counted by
    lesson 11's `Collectives`."""
    g = gradient_of_rank(ctx.rank, cfg.numel)
    full, half = g.clone(), g.bfloat16()
    sent = []
    for tensor in (full, half):
        comm = Collectives(ctx.rec)
        comm.all_reduce(tensor)
        sent.append(comm.bytes_sent())
    return AllReduced(full, half.float(), *sent)


def allreduce_verdict(results: list[AllReduced], cfg: Config) -> tuple:
    """bf16's bytes beside fp32's, and the error bf16 added to one process's exact sum."""
    r0, exact = results[0], sum(gradient_of_rank(r, cfg.numel).double() for r in range(cfg.world_size))
    ratio, err16 = r0.bytes_bf16 / r0.bytes_fp32, relative_error(r0.bf16, exact)
    text = f"The bf16 all-reduce sent {ratio:.2f}x fp32's bytes and added a relative error of {err16:.1e} to the sum."
    verdict = "half the bytes" if ratio == 0.5 else f"{ratio:.2f} of the bytes"
    return "16.bf16_allreduce", verdict, text, dict(ratio=ratio, error_bf16=err16,
                                                    error_fp32=relative_error(r0.fp32, exact))

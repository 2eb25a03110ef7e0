"""Lesson 12, parts 1-3: one GPT block cut across a tensor-parallel group, ours and torch's.

Each rank runs every variant (tensor parallel, sequence parallel with and without re-gathering, and
torch's `parallelize_module` with and without `SequenceParallel`) on the same weights and data, and
returns its outputs, gradients, the bytes its collectives sent and the bytes its forward kept for
backward; `gather` checks every variant against `reference(cfg)`, the unsplit block in this process.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from pipelab import experiments
from pipelab.checks import divides, divisors, whole_number
from pipelab.measure import Measured, time_steps
from pipelab.tensor_parallel import ParallelBlock, TensorParallelGroup
from pipelab.tensor_parallel.torch_plan import TorchCollectives, local_grad, torch_parallel_block
from pipelab.transformer import Block
from pipelab.worker import RankContext

OURS = ("tp", "tp+sp", "tp+sp regather")
TORCH = ("torch tp", "torch tp+sp")
VARIANTS = OURS + TORCH


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """One block of width `dim` with `n_heads` heads, on a batch of `batch` sequences of `seq_len`
    tokens, cut over `world_size` ranks; `steps` forward+backward passes timed per variant."""

    dim: int = 64
    n_heads: int = 4
    batch: int = 2
    seq_len: int = 64
    seed: int = 0
    steps: int = 5
    variants: tuple[str, ...] = VARIANTS

    def check(self) -> None:
        super().check()
        for name in ("dim", "n_heads", "batch", "seq_len", "steps"):
            whole_number(name, getattr(self, name))
        divides("dim", self.dim, "n_heads", self.n_heads)
        if self.n_heads % self.world_size:
            raise ValueError(f"n_heads={self.n_heads} does not divide by the tensor-parallel size "
                             f"world_size={self.world_size}: each rank computes whole heads; use world_size in "
                             f"{divisors(self.n_heads)}")
        divides("seq_len", self.seq_len, "world_size", self.world_size)  # sequence parallelism's shards
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ValueError(f"variants must be some of {VARIANTS}, got {list(self.variants)!r}")

    def block(self) -> Block:
        torch.manual_seed(self.seed)
        return Block(self.dim, self.n_heads)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's input and the gradient its output receives (the loss is sum(output * g))."""
        g = torch.Generator().manual_seed(self.seed + 1)
        shape = (self.batch, self.seq_len, self.dim)
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def saved_activation_bytes(fn, exclude: set[int]):
    """Run `fn()` and count the bytes autograd keeps for backward (each storage once), leaving out
    the storages in `exclude` (the parameters, which are kept anyway)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _storage(t: torch.Tensor):
    """The memory behind `t`; for torch's DTensor, behind this rank's local shard."""
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def parameter_storages(module: nn.Module) -> set[int]:
    return {_storage(p).data_ptr() for p in module.parameters()}


# --- on each rank ------------------------------------------------------------------------------


@dataclass
class VariantResult:
    """What one rank's run of one variant gave."""

    output: torch.Tensor  # this rank's output (its slice of the sequence under sequence parallelism)
    input_grad: torch.Tensor
    grads: dict[str, torch.Tensor]  # named as in `ParallelBlock` (torch's q, k, v stacked like ours)
    sent: dict[tuple[str, str], int]  # (collective, direction) -> bytes this rank sent
    calls: dict[tuple[str, str], int]
    activation_bytes: int  # kept by the forward for backward
    seconds: list[float]  # timed forward+backward passes


@dataclass
class Result:
    rank: int
    variants: dict[str, VariantResult]


def sequence_parallel(variant: str) -> bool:
    return "sp" in variant


def worker(ctx: RankContext, cfg: Config) -> Result:
    """Run each variant of the block on this rank: check pass, then `cfg.steps` timed passes."""
    tp = TensorParallelGroup.world()
    x, g = cfg.data()
    results = {}
    for variant in cfg.variants:
        tp.meter.clear()
        block = _build(variant, cfg, tp)
        x_in, g_in = (tp.slice(x, 1), tp.slice(g, 1)) if sequence_parallel(variant) else (x, g)
        x_in = x_in.clone().requires_grad_()
        with _counted(variant, tp, "forward"):
            y, kept = saved_activation_bytes(lambda: block(x_in), parameter_storages(block))
        with _counted(variant, tp, "backward"):
            (y * g_in).sum().backward()
        with _counted(variant, tp, "parameters"):
            _sync(block)
            grads = _grads_as_ours(variant, block)
        sent, calls = dict(tp.meter.bytes), dict(tp.meter.calls)
        steps = time_steps(ctx, lambda i: _pass(block, x_in, g_in), cfg.steps,
                           prepare=lambda i: block.zero_grad(set_to_none=True))
        results[variant] = VariantResult(y.detach(), x_in.grad, grads, sent, calls, kept, steps.seconds)
    return Result(ctx.rank, results)


def _counted(variant: str, tp: TensorParallelGroup, direction: str):
    """Our operators count their own bytes; torch's collectives are counted as they dispatch."""
    return nullcontext() if variant in OURS else TorchCollectives(tp.meter, direction, tp.size)


def _pass(block: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
    with torch.no_grad():
        x.grad = None
    (block(x) * g).sum().backward()
    _sync(block)


def _sync(block: nn.Module) -> None:
    if isinstance(block, ParallelBlock):
        block.sync_replicated_grads()


def _build(variant: str, cfg: Config, tp: TensorParallelGroup) -> nn.Module:
    if variant in OURS:
        return ParallelBlock(cfg.block(), tp, sequence_parallel(variant), regather="regather" in variant)
    return torch_parallel_block(cfg.block(), cfg.world_size, sequence_parallel(variant))


def _grads_as_ours(variant: str, block: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients named as `ParallelBlock` names them: torch's q, k and v shards are
    stacked into `attn.qkv`, and its DTensor gradients become this rank's local shards."""
    grads = {n: local_grad(p.grad) for n, p in block.named_parameters()}
    if variant in OURS:
        return grads
    for kind in ("weight", "bias"):
        grads[f"attn.qkv.{kind}"] = torch.cat([grads.pop(f"attn.{m}.{kind}") for m in "qkv"])
    return grads


# --- the parent side ---------------------------------------------------------------------------


@dataclass
class VariantRun:
    """One variant on all ranks, checked against the unsplit block."""

    name: str
    difference: float  # largest difference from one process: outputs, input and weight gradients
    sent: dict[str, int]  # bytes rank 0 sent per step: "forward", "backward", "parameters"
    calls: dict[tuple[str, str], int]
    activation_bytes: int  # rank 0's
    step_time: Measured  # seconds per forward+backward, slowest rank


@dataclass
class TensorParallelRun:
    cfg: Config
    variants: dict[str, VariantRun]
    one_process_activation_bytes: int  # the unsplit block's, in this process

    def __getitem__(self, name: str) -> VariantRun:
        return self.variants[name]


def run(cfg: Config) -> TensorParallelRun:
    return experiments.run(worker, cfg, gather)


def gather(cfg: Config, results: list[Result]) -> TensorParallelRun:
    y_ref, dx_ref, ref_block, ref_bytes = reference(cfg)
    grads_block = copy.deepcopy(ref_block)
    with torch.no_grad():
        for p, r in zip(grads_block.parameters(), ref_block.parameters()):
            p.copy_(r.grad)
    variants = {}
    for name in cfg.variants:
        per_rank = [r.variants[name] for r in results]
        diff = max(_difference(name, cfg, rank, got, y_ref, dx_ref, grads_block) for rank, got in enumerate(per_rank))
        sent = {d: sum(b for (_, dd), b in per_rank[0].sent.items() if dd == d)
                for d in ("forward", "backward", "parameters")}
        seconds = [max(step) for step in zip(*(r.seconds for r in per_rank))]
        variants[name] = VariantRun(name, diff, sent, per_rank[0].calls, per_rank[0].activation_bytes,
                                    Measured.of(seconds))
    return TensorParallelRun(cfg, variants, ref_bytes)


def reference(cfg: Config):
    """The unsplit block in this process: output, input gradient, the block with its gradients,
    and the bytes its forward kept for backward."""
    block = cfg.block()
    x, g = cfg.data()
    x = x.clone().requires_grad_()
    y, kept = saved_activation_bytes(lambda: block(x), parameter_storages(block))
    (y * g).sum().backward()
    return y.detach(), x.grad, block, kept


def _difference(name, cfg, rank, got: VariantResult, y_ref, dx_ref, grads_block) -> float:
    tp = TensorParallelGroup(None, rank, cfg.world_size)
    want_y, want_dx = (tp.slice(y_ref, 1), tp.slice(dx_ref, 1)) if sequence_parallel(name) else (y_ref, dx_ref)
    expected = {n: p.detach() for n, p in ParallelBlock(grads_block, tp).named_parameters()}
    diffs = [(got.output - want_y).abs().max(), (got.input_grad - want_dx).abs().max()]
    diffs += [(got.grads[n] - expected[n]).abs().max() for n in expected]
    return float(max(diffs))


# --- activation memory: Korthikanti et al. (2022) beside what the ranks kept -------------------


def korthikanti_bytes(cfg: Config, sequence_parallel: bool, tensor_parallel: int | None = None) -> float:
    """Activation bytes per layer by Korthikanti et al., "Reducing Activation Recomputation in
    Large Transformer Models" (2022), eqs. 1-4: 2-byte activations and 1-byte dropout masks.
    One process: sbh(34 + 5as/h); tensor parallel over t: sbh(10 + 24/t + 5as/(ht)); with sequence
    parallelism: sbh/t (34 + 5as/h)."""
    s, b, h, a = cfg.seq_len, cfg.batch, cfg.dim, cfg.n_heads
    t = tensor_parallel or cfg.world_size
    scores = 5 * a * s / h
    if t == 1:
        return s * b * h * (34 + scores)
    if sequence_parallel:
        return s * b * h / t * (34 + scores)
    return s * b * h * (10 + 24 / t + scores / t)


def predicted_bytes(run: TensorParallelRun, sequence_parallel: bool | None) -> float:
    """Activation bytes per rank from our block's two parts as Korthikanti splits them: R, kept whole
    under tensor parallelism (the LayerNorms'), and S, divided by t (between f and g), solved from
    one process = R + S and tensor parallel = R + S/t. None: one process; else R + S/t or (R + S)/t."""
    t, whole = run.cfg.world_size, run.one_process_activation_bytes
    split = (whole - run["tp"].activation_bytes) * t / (t - 1)
    return whole if sequence_parallel is None else whole / t if sequence_parallel else whole - split + split / t


def memory_table(run: TensorParallelRun) -> list[dict]:
    """Per variant: activation bytes kept per rank, measured, beside ours predicted from R and S and
    beside Korthikanti's formula (in its own 2-byte units), per sbh."""
    sbh = run.cfg.seq_len * run.cfg.batch * run.cfg.dim
    rows = [("one process", run.one_process_activation_bytes, None)]
    rows += [(name, v.activation_bytes, sequence_parallel(name)) for name, v in run.variants.items()]
    return [{"variant": name, "measured (bytes/sbh)": round(kept / sbh, 2),
             "predicted (bytes/sbh)": round(predicted_bytes(run, sp) / sbh, 2),
             "Korthikanti, 16-bit (bytes/sbh)": round(korthikanti_bytes(run.cfg, bool(sp), 1 if sp is None else None) / sbh, 2)}
            for name, kept, sp in rows]


# --- verdicts ----------------------------------------------------------------------------------

TOLERANCE = 1e-4  # float32 sums in another order: far above rounding, far below a wrong shard


def same_as_one_process(run: TensorParallelRun) -> tuple[str, str, str, dict]:
    """Whether every variant gave the unsplit block's outputs and gradients."""
    worst = max(v.difference for v in run.variants.values())
    verdict = "same" if worst <= TOLERANCE else "different"
    text = (f"all {len(run.variants)} variants gave the unsplit block's outputs and gradients on {run.cfg.world_size} "
            f"ranks (largest difference {worst:.1e})" if verdict == "same" else
            f"a variant differs from one process by {worst:.1e}, above the tolerance")
    return "12.same_as_one_process", verdict, text, {"largest_difference": worst, "tolerance": TOLERANCE}


def bytes_verdict(run: TensorParallelRun) -> tuple[str, str, str, dict]:
    """Whether sequence parallelism sent what tensor parallelism sent, counted from the messages."""
    moved = {name: v.sent["forward"] + v.sent["backward"] for name, v in run.variants.items() if name in OURS}
    verdict = "same bytes" if moved["tp"] == moved["tp+sp"] else "different bytes"
    text = (f"per block and pass rank 0 sent {moved['tp']:,} bytes with tensor parallelism and {moved['tp+sp']:,} "
            "with sequence parallelism: a ring all-reduce is a reduce-scatter plus an all-gather")
    return "12.bytes", verdict, text, {**moved, "tp+sp parameters": run["tp+sp"].sent["parameters"]}


def memory_verdict(run: TensorParallelRun) -> tuple[str, str, str, dict]:
    """Whether the measured activation bytes follow the formula's shape: R + S/t under tensor
    parallelism, (R + S)/t under sequence parallelism with re-gathering."""
    measured = run["tp+sp regather"].activation_bytes
    predicted = predicted_bytes(run, True)
    verdict = "as the formula divides" if abs(measured - predicted) <= 0.01 * predicted else "differs"
    text = (f"sequence parallelism with re-gathering kept {measured:,} activation bytes per rank against the "
            f"formula's (R + S)/t = {predicted:,.0f}" + (", as it divides" if verdict == "as the formula divides" else ""))
    return "12.activation_memory", verdict, text, {"measured": measured, "predicted": predicted}


def all_reduce_count_verdict(run: TensorParallelRun) -> tuple[str, str, str, dict]:
    """How many all-reduces one block needed forward and backward, ours against torch's plan."""
    def count(name: str, direction: str) -> int:
        return sum(c for (kind, d), c in run[name].calls.items() if kind == "all_reduce" and d == direction)

    ours = (count("tp", "forward"), count("tp", "backward"))
    theirs = (count("torch tp", "forward"), count("torch tp", "backward")) if "torch tp" in run.variants else None
    text = f"our block all-reduced {ours[0]} times forward and {ours[1]} backward"
    if theirs is not None:
        text += (f", torch's plan {theirs[0]} and {theirs[1]}: its separate query, key and value layers each sum "
                 "their own input gradient")
    return ("12.all_reduces_per_block", f"{ours[0]} forward, {ours[1]} backward", text,
            {"ours": list(ours), "torch": list(theirs or ())})


def node_verdict(run: TensorParallelRun) -> tuple[str, str, str, dict]:
    """Why tensor parallelism stays inside a node: what one block sends per pass against what a
    pipeline boundary sends (one activation forward, its gradient backward), from this run's bytes."""
    cfg = run.cfg
    tp_bytes = run["tp"].sent["forward"] + run["tp"].sent["backward"]
    boundary = 2 * cfg.batch * cfg.seq_len * cfg.dim * 4  # fp32 activation forward + gradient back
    ratio = tp_bytes / boundary
    text = (f"one block sent {ratio:.1f}x what a pipeline stage boundary sends for the same batch, again in every "
            "layer and on the critical path: traffic for NVLink, not for crossing nodes")
    return "12.inside_a_node", f"{ratio:.1f}x a boundary", text, {"tp_bytes": tp_bytes, "boundary_bytes": boundary}


# --- what a DTensor is: one tensor, its placements, each rank's local part ---------------------


def dtensor_worker(ctx: RankContext, cfg: Config) -> list[tuple[str, tuple[int, ...], list]]:
    """A 4 x 6 tensor of 0..23 distributed three ways over a 1-D mesh of every rank: per placement,
    what this rank keeps (its placements, local shape and values)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, full = init_device_mesh("cpu", (cfg.world_size,)), torch.arange(24.0).reshape(4, 6)
    placed = [distribute_tensor(full, mesh, [placement]) for placement in (Shard(0), Shard(1), Replicate())]
    return [(str(d.placements), tuple(d.to_local().shape), d.to_local().int().tolist()) for d in placed]


def dtensor_table(cfg: Config) -> list[dict]:
    """Per placement and rank: the local shape and values a DTensor keeps there."""
    per_rank = experiments.run(dtensor_worker, cfg)
    return [{"placements": placements, "rank": rank, "local shape": shape, "local values": values}
            for i in range(len(per_rank[0])) for rank, ranks in enumerate(per_rank) for placements, shape, values in [ranks[i]]]


def run_flops(params: dict) -> float:
    """FLOPs of lesson 12 at the notebook parameters `params` (missing names take the defaults),
    counted on the meta device: `steps` forward+backward passes of the block per variant and the
    reference's pass (the 3-D grid's small model is negligible beside the block)."""
    from pipelab.emulate.cost import step_flops

    p = {"dim": 64, "n_heads": 4, "batch": 2, "seq_len": 64, "steps": 5, **params}
    block = Block(p["dim"], p["n_heads"]).to("meta")
    step = step_flops(block, torch.empty(p["batch"], p["seq_len"], p["dim"], device="meta"))
    return step * (p["steps"] * len(VARIANTS) + 1)

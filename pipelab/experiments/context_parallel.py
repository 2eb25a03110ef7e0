"""Lesson 14 from a notebook: one attention layer's sequence split over ranks, ring and all-to-all,
every variant checked against one process's attention; the 128K-token figures are modelled."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pipelab import experiments
from pipelab.checks import divides, whole_number
from pipelab.context_parallel import Layout, Ring, ring_attention, ulysses_attention
from pipelab.emulate.attention import attention_flops, ring_step_seconds
from pipelab.experiments.tensor_parallel import saved_activation_bytes
from pipelab.measure import Measured, RankSteps, compare, gather_steps, time_steps
from pipelab.tensor_parallel.comm import CommMeter
from pipelab.timeline import Timeline
from pipelab.worker import RankContext

# name -> (method, layout, causal)
VARIANTS = {"ring": ("ring", "contiguous", False), "ring causal": ("ring", "contiguous", True),
            "ring zigzag": ("ring", "zigzag", False), "ring zigzag causal": ("ring", "zigzag", True),
            "ulysses": ("ulysses", "contiguous", False), "ulysses causal": ("ulysses", "contiguous", True),
            "torch": ("torch", "zigzag", False)}  # torch's default "head-tail" load balancer is zig-zag
LAYOUTS = ("contiguous", "zigzag")  # of the timed causal passes


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """Attention with `heads` heads of `head_dim` over `batch` sequences of `seq_len` tokens, split
    over `world_size` ranks; `steps` causal passes timed per layout at `timed_seq_len` tokens."""

    batch: int = 1
    heads: int = 4
    head_dim: int = 16
    seq_len: int = 64
    timed_seq_len: int = 1024
    steps: int = 3
    seed: int = 0
    variants: tuple[str, ...] = tuple(VARIANTS)

    def check(self) -> None:
        super().check()
        for name in ("batch", "heads", "head_dim", "seq_len", "timed_seq_len", "steps"):
            whole_number(name, getattr(self, name))
        divides("heads", self.heads, "world_size", self.world_size)  # all-to-all: heads / world_size each
        for name, n in (("seq_len", self.seq_len), ("timed_seq_len", self.timed_seq_len)):
            if n % (2 * self.world_size):  # zig-zag: 2n chunks, rank r holds r and 2n-1-r
                raise ValueError(f"{name}={n} does not split into 2 x world_size = {2 * self.world_size} zig-zag "
                                 f"chunks; use a multiple of {2 * self.world_size}")
        if not self.variants or any(v not in VARIANTS for v in self.variants):
            raise ValueError(f"variants must be some of {list(VARIANTS)}, got {list(self.variants)!r}")

    def data(self, seq_len: int | None = None) -> list[torch.Tensor]:
        """Queries, keys, values and the gradient the output receives: (batch, heads, tokens, head_dim)."""
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.heads, seq_len or self.seq_len, self.head_dim)
        return [torch.randn(shape, generator=g) for _ in range(4)]


def torch_context_parallel(ctx: RankContext, cfg) -> tuple[torch.Tensor, dict[str, str]]:
    """torch's `context_parallel` (it shards q, k, v in place, head-tail: our zig-zag) non-causal with the
    math backend, as runs on CPU: this rank's output, and per backend what causal attention answered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))

    def attend(causal: bool, kernel) -> torch.Tensor:
        q, k, v = (t.to(ctx.device) for t in cfg.data()[:3])
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]), kernel:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out = attend(False, sdpa_kernel(SDPBackend.MATH)).detach().cpu()
    answers = {}
    for backend in ("math", "default"):
        try:
            attend(True, sdpa_kernel(SDPBackend.MATH) if backend == "math" else nullcontext())
            answers[f"causal, {backend} backend"] = "ran"
        except Exception as e:  # noqa: BLE001 - what torch raised is the lesson's figure
            answers[f"causal, {backend} backend"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    return out, answers


@dataclass
class VariantResult:
    output: torch.Tensor  # this rank's shard
    grads: tuple[torch.Tensor, ...]  # dQ, dK, dV of this rank's shard (empty for torch's)
    sent: dict[tuple[str, str], int]  # (kind, direction) -> bytes this rank sent
    activation_bytes: int  # what the forward kept for backward on this rank


@dataclass
class Result:
    variants: dict[str, VariantResult]
    steps: dict[str, RankSteps]  # layout -> the timed causal ring passes
    torch_refusals: dict[str, str]


def worker(ctx: RankContext, cfg: Config) -> Result:
    """Every variant once (checked, counted), then `cfg.steps` timed causal passes per layout."""
    variants, refusals = {}, {}
    for variant in cfg.variants:
        if variant == "torch":
            out, refusals = torch_context_parallel(ctx, cfg)
            variants[variant] = VariantResult(out, (), {}, 0)
            continue
        method, name, causal = VARIANTS[variant]
        ring, layout = Ring.world(meter=CommMeter()), Layout(name, ctx.world_size)
        q, k, v, g = (layout.shard(t, ctx.rank).to(ctx.device) for t in cfg.data())
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out, kept = saved_activation_bytes(lambda: ring_attention(q, k, v, ring, layout, causal) if method == "ring"
                                           else ulysses_attention(q, k, v, ring, causal), set())
        (out * g).sum().backward()
        variants[variant] = VariantResult(out.detach().cpu(), tuple(t.grad.cpu() for t in (q, k, v)),
                                          dict(ring.meter.bytes), kept)
    steps = {}
    for name in LAYOUTS:
        ring, layout = Ring.world(rec=ctx.rec), Layout(name, ctx.world_size)
        q, k, v, g = (layout.shard(t, ctx.rank).to(ctx.device) for t in cfg.data(cfg.timed_seq_len))
        q.requires_grad_()
        steps[name] = time_steps(ctx, lambda i: (ring_attention(q, k, v, ring, layout, True) * g).sum().backward(),
                                 cfg.steps)
    return Result(variants, steps, refusals)


@dataclass
class VariantRun:
    name: str
    differences: dict[str, float]  # per tensor, largest difference from one process: output, dQ, dK, dV
    sent: dict[str, int]  # bytes rank 0 sent: "forward", "backward"
    activation_bytes: int  # rank 0's

    @property
    def difference(self) -> float:
        return max(self.differences.values())


@dataclass
class ContextParallelRun:
    cfg: Config
    variants: dict[str, VariantRun]
    one_process_activation_bytes: int  # the same ring code on one rank: Q, K, V, O and the log-sum-exp
    scores_activation_bytes: int  # torch's math attention in one process, which keeps the s x s scores
    step_time: dict[str, Measured]  # layout -> causal forward+backward, slowest rank (measured)
    timelines: dict[str, Timeline] = field(repr=False, default_factory=dict)
    torch_refusals: dict[str, str] = field(default_factory=dict)


def run(cfg: Config) -> ContextParallelRun:
    return experiments.run(worker, cfg, gather)


def reference(cfg: Config) -> dict[bool, list[torch.Tensor]]:
    """Attention over the whole sequence in this process, not causal and causal: output, dQ, dK, dV."""
    def once(causal: bool) -> list[torch.Tensor]:
        q, k, v, g = cfg.data()
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        (out * g).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]
    return {causal: once(causal) for causal in (False, True)}


def gather(cfg: Config, results: list[Result]) -> ContextParallelRun:
    n, want, variants = cfg.world_size, reference(cfg), {}
    for name in cfg.variants:
        per_rank = [r.variants[name] for r in results]
        layout = Layout(VARIANTS[name][1], n)
        got = [layout.unshard([r.output for r in per_rank])]
        got += [layout.unshard([r.grads[i] for r in per_rank]) for i in range(len(per_rank[0].grads))]
        diff = {t: float((a - b).abs().max())  # torch's: the output only
                for t, a, b in zip(("output", "dQ", "dK", "dV"), got, want[VARIANTS[name][2]])}
        sent = {d: sum(b for (_, dd), b in per_rank[0].sent.items() if dd == d) for d in ("forward", "backward")}
        variants[name] = VariantRun(name, diff, sent, per_rank[0].activation_bytes)
    steps = {name: gather_steps([r.steps[name] for r in results]) for name in LAYOUTS}
    return ContextParallelRun(cfg, variants, *one_process_memory(cfg), {n: s.step_time for n, s in steps.items()},
                              {n: s.timelines[-1] for n, s in steps.items()}, results[0].torch_refusals)


def one_process_memory(cfg: Config) -> tuple[int, int]:
    """Bytes kept for backward in one process: by the ring code on a ring of one, and by torch's math
    attention, which keeps the s x s probabilities."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, _ = (t.requires_grad_() for t in cfg.data())
    _, ring_bytes = saved_activation_bytes(
        lambda: ring_attention(q, k, v, Ring(0, 1), Layout("contiguous", 1), False), set())
    with sdpa_kernel(SDPBackend.MATH):
        _, math_bytes = saved_activation_bytes(lambda: F.scaled_dot_product_attention(q, k, v), set())
    return ring_bytes, math_bytes


def formula(method: str, cfg: Config) -> dict[str, int]:
    """Bytes a rank sends, with B one rank's shard of K (batch x heads x s/n x head_dim floats).
    Ring: forward K and V on n-1 times (2B each); backward K, V, dK, dV on n-1 times and dK, dV home
    once more. All-to-all: Q, K, V and O back re-sharded, (n-1)/n of each sent; backward the same."""
    n = cfg.world_size
    b = cfg.batch * cfg.heads * cfg.seq_len // n * cfg.head_dim * 4
    if method == "ring":
        return {"forward": (n - 1) * 2 * b, "backward": (n - 1) * 4 * b + 2 * b}
    return {"forward": 4 * b * (n - 1) // n, "backward": 4 * b * (n - 1) // n}


def bytes_table(run: ContextParallelRun) -> list[dict]:
    """Per variant: bytes rank 0 sent forward and backward, counted from its messages, beside the formula."""
    rows = []
    for name, v in run.variants.items():
        if (method := VARIANTS[name][0]) != "torch":
            want = formula(method, run.cfg)
            rows.append({"variant": name, "sent forward": v.sent["forward"], "formula forward": want["forward"],
                         "sent backward": v.sent["backward"], "formula backward": want["backward"]})
    return rows


def blocks_per_rank(layout: str, ranks: int, causal: bool = True) -> dict[int, float]:
    """Per rank: its ring attention's work in one forward in blocks of (s/n)^2 token pairs, counted from the
    algorithm's own pairing of chunks (a zig-zag pair is a quarter block; a masked diagonal pair counts whole)."""
    from pipelab.context_parallel.ring import _pairs

    lay = Layout(layout, ranks)
    size = 1 / len(lay.chunks(0)) ** 2
    return {r: size * sum(1 for k in range(ranks) for _ in _pairs(lay, r, k, 1, causal)) for r in range(ranks)}


def ring_overlap(tokens: int = 128 * 1024, ranks: tuple[int, ...] = (2, 4, 8, 16, 32, 64),
                 per_node: int = 8) -> list[dict]:
    """Per ring size n: a modelled causal zig-zag ring step of Llama 2 7B's attention (32 heads of 128) on s/n
    tokens per rank, its K/V passing, and the share hidden; beyond `per_node` ranks over InfiniBand NDR."""
    rows = []
    for n in ranks:
        nvlink = n <= per_node
        attention, kv = ring_step_seconds(tokens // n, 32, 128, f"{n}xH100-{'nvlink' if nvlink else 'ib'}")
        rows.append({"ranks": n, "tokens per rank": tokens // n, "link": "NVLink 4" if nvlink else "InfiniBand NDR",
                     "attention fwd+bwd (ms)": round(attention * 1e3, 3),
                     "K/V passing fwd+bwd (ms)": round(kv * 1e3, 3),
                     "hidden": f"{min(1.0, attention / kv):.0%}"})
    return rows


# NeMo's published context-parallel results: Llama 2 7B, FP8, DGX-H100, TFLOP/s per GPU.
NEMO_SOURCE = ("NVIDIA NeMo Framework user guide, Performance: Context Parallelism, "
               "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/performance-summary.html")
# The whole model's throughput is not modelled here (part 5 models one attention layer's ring step on
# the same H100s), so the table names the published hardware and gives no emulated column.
NEMO_HARDWARE = "published on DGX-H100 (H100 SXM, NVLink 4), FP8; not emulated"
NEMO_CP = [{"sequence": "128K", "without CP (TFLOP/s per GPU)": 424, "with CP": 555, "hardware": NEMO_HARDWARE},
           {"sequence": "512K", "without CP (TFLOP/s per GPU)": 104, "with CP": 549, "hardware": NEMO_HARDWARE},
           {"sequence": "1M", "without CP (TFLOP/s per GPU)": 26.5, "with CP": 536, "hardware": NEMO_HARDWARE}]


TOLERANCE = 1e-4  # float32 sums in another order: far above rounding, far below a wrong block


def same_as_one_process(run: ContextParallelRun) -> tuple[str, str, str, dict]:
    worst = max(v.difference for v in run.variants.values())
    verdict = "same" if worst <= TOLERANCE else "different"
    text = (f"all {len(run.variants)} variants give one process's output (and dQ, dK, dV) on "
            f"{run.cfg.world_size} ranks: largest difference {worst:.1e}" if verdict == "same" else
            f"a variant differs from one process by {worst:.1e} (above {TOLERANCE:g})")
    return "14.same_as_one_process", verdict, text, {"largest_difference": worst}


def balance_verdict(run: ContextParallelRun) -> tuple[str, str, str, dict]:
    contiguous, zigzag = run.step_time["contiguous"], run.step_time["zigzag"]
    verdict = compare(zigzag, contiguous)
    text = (f"measured, a causal pass took {zigzag.median * 1e3:.0f} ms with zig-zag shards, which even out the "
            f"ranks' work, against {contiguous.median * 1e3:.0f} ms contiguous ({verdict})")
    return "14.causal_balance", verdict, text, {"zigzag_s": zigzag.median, "contiguous_s": contiguous.median}


def bytes_verdict(run: ContextParallelRun) -> tuple[str, str, str, dict]:
    exact = all(r["sent forward"] == r["formula forward"] and r["sent backward"] == r["formula backward"]
                for r in bytes_table(run))
    ratio = sum(formula("ring", run.cfg).values()) / sum(formula("ulysses", run.cfg).values())
    verdict = "as the formulas count" if exact else "differs from the formulas"
    text = (f"counted from the messages, {verdict}: per layer the ring sends (6n-4)B per rank, "
            f"all-to-all 8(n-1)B/n, {ratio:.1f}x less at n={run.cfg.world_size}")
    return "14.bytes", verdict, text, {"ring_over_all_to_all": ratio}


def memory_verdict(run: ContextParallelRun) -> tuple[str, str, str, dict]:
    n, whole = run.cfg.world_size, run.one_process_activation_bytes
    per_rank = max(v.activation_bytes for name, v in run.variants.items() if VARIANTS[name][0] == "ring")
    verdict = "1/n of one process" if per_rank * n == whole else "not 1/n"
    text = (f"a ring rank kept {per_rank:,} bytes for backward, {verdict}; torch's math attention in one "
            f"process keeps {run.scores_activation_bytes:,}, the s x s probabilities")
    return "14.activation_memory", verdict, text, {"per_rank": per_rank, "one_process": whole}


def overlap_verdict(rows: list[dict]) -> tuple[str, str, str, dict]:
    at8 = next(r for r in rows if r["ranks"] == 8)
    exposed = next((r for r in rows if r["hidden"] != "100%"), None)
    where = f"n={exposed['ranks']} ({exposed['link']})" if exposed else f"none up to n={rows[-1]['ranks']}"
    text = (f"modelled at 128K tokens, the K/V passing hides behind the attention on 8 H100s "
            f"({at8['hidden']}); it first shows at {where}")
    return "14.ring_overlap", f"exposed from {where}", text, {"exposed_from": exposed["ranks"] if exposed else None}


def torch_verdict(run: ContextParallelRun) -> tuple[str, str, str, dict]:
    diff = run.variants["torch"].difference
    verdict = "same" if diff <= TOLERANCE else "different"
    refused = sum(a != "ran" for a in run.torch_refusals.values())
    text = (f"torch's context_parallel (non-causal, math backend) gives one process's output ({verdict}, "
            f"largest difference {diff:.1e}); on CPU it refused {refused} of {len(run.torch_refusals)} causal tries")
    return "14.torch_context_parallel", verdict, text, {"difference": diff}


def nemo_verdict(rows: list[dict]) -> tuple[str, str, str, dict]:
    at8 = next(r for r in rows if r["ranks"] == 8)
    verdict = "consistent" if at8["hidden"] == "100%" else "K/V passing exposed"
    text = (f"NeMo keeps {min(r['with CP'] for r in NEMO_CP):g}+ TFLOP/s per GPU with CP up to 1M tokens; the model hides K/V passing at "
            f"8 ranks ({verdict}) but cannot explain throughput without CP")
    return "14.nemo", verdict, text, {"hidden_at_8": at8["hidden"]}


def run_flops(params: dict) -> float:
    """FLOPs of one run of lesson 14 at the notebook parameters `params` (missing names: the defaults):
    a forward and backward of the whole sequence per variant, `steps` causal passes (half that) per layout."""
    cfg = Config(**{k: v for k, v in params.items() if k in Config.__dataclass_fields__})

    def pass_flops(s: int) -> float:  # as torch's counter counts attend_block and block_grads
        return sum(attention_flops(kind, (cfg.batch, cfg.heads, s, s, cfg.head_dim)) for kind in ("forward", "backward"))

    return pass_flops(cfg.seq_len) * (len(VARIANTS) + 2) + pass_flops(cfg.timed_seq_len) / 2 * 2 * cfg.steps

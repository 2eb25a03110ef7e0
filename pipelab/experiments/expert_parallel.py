"""Lesson 15 from a notebook: a Mixture-of-Experts layer with its experts spread over ranks, checked
against the one-process layer on every rank's tokens (one group per rank, capacity per group, as
GShard does); the load and its modelled time are in `experiments.expert_load`."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pipelab import experiments
from pipelab.checks import divides, positive_number, whole_number
from pipelab.emulate.cost import step_flops
from pipelab.expert_parallel import ExpertParallelGroups, ExpertParallelMoE, MoELayer, reduce_gradients
from pipelab.measure import Measured, time_steps
from pipelab.worker import RankContext

@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """A layer of `experts` expert MLPs (width `dim`, hidden `hidden`), each token to its `top_k`,
    each expert taking capacity_factor x its fair share; `tokens` tokens per rank; experts split
    over groups of `ep` ranks (default: all of them), world_size / ep copies of each expert."""

    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    dim: int = 16
    hidden: int = 32
    tokens: int = 64
    ep: int | None = None
    aux_weight: float = 0.01  # the balancing loss's weight (Switch Transformer used 0.01)
    skew: float = 1.0  # how far every token leans one way, so the router loads some experts more
    seed: int = 0
    steps: int = 3  # timed forward+backward passes
    syncs: tuple[str, ...] = ("reduce_gradients",)  # the first is checked whole; each one's expert gradients too

    @property
    def ep_size(self) -> int:
        return self.world_size if self.ep is None else self.ep

    def check(self) -> None:
        super().check()
        for name in ("experts", "top_k", "dim", "hidden", "tokens", "steps"):
            whole_number(name, getattr(self, name))
        positive_number("capacity_factor", self.capacity_factor, example="capacity_factor=1.25")
        ep = whole_number("ep", self.ep_size, example=f"ep={self.world_size}")
        divides("world_size", self.world_size, "ep", ep)  # world_size / ep expert-parallel groups
        if self.experts % ep:  # each rank holds experts / ep of them
            raise ValueError(f"experts={self.experts} do not divide over ep={ep} ranks; use experts="
                             f"{ep * max(1, round(self.experts / ep))} or an ep that divides {self.experts}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} is more than the experts={self.experts} a token can go to; "
                             f"use top_k <= {self.experts} (Switch Transformer 1, Mixtral 2)")
        if not self.syncs or any(s not in SYNC for s in self.syncs):
            raise ValueError(f"syncs must be some of {tuple(SYNC)}, got {self.syncs!r}")

    def layer(self) -> MoELayer:
        torch.manual_seed(self.seed)
        return MoELayer(self.dim, self.hidden, self.experts, self.top_k, self.capacity_factor)

    def data(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s tokens (every one leaning the same way by `skew`) and targets."""
        lean = torch.randn(self.dim, generator=torch.Generator().manual_seed(self.seed + 1))
        g = torch.Generator().manual_seed(self.seed + 2 + rank)
        x = torch.randn(self.tokens, self.dim, generator=g) + self.skew * lean
        return x, torch.randn(self.tokens, self.dim, generator=g)


@contextmanager
def one_thread():
    """One intra-op thread, as each rank runs (a block or a decorator): on a busy 2-core machine two
    threads spinning for each other slow small tensors tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def loss_of(cfg: Config, out, target: torch.Tensor) -> torch.Tensor:
    """One group's loss: mean squared error plus the weighted balancing loss."""
    return ((out.y - target) ** 2).mean() + cfg.aux_weight * out.aux_loss


def reduce_as_plain_data_parallel(moe: ExpertParallelMoE) -> None:
    """What data parallelism alone does: average each gradient over the ranks holding a copy of it.
    Right for the router; for an expert, whose gradient already sums its whole group's tokens, it
    leaves the gradient ep_size times too large (pytorch#160285)."""
    for p in moe.router.parameters():
        dist.all_reduce(p.grad)
        p.grad /= moe.groups.world_size
    for p in moe.experts.parameters():
        if moe.groups.copies_size > 1:
            dist.all_reduce(p.grad, group=moe.groups.copies)
        p.grad /= moe.groups.copies_size


SYNC = {"reduce_gradients": reduce_gradients, "as_plain_data_parallel": reduce_as_plain_data_parallel}


@dataclass
class Result:
    y: torch.Tensor
    keep: torch.Tensor  # (tokens, k) the assignments within capacity
    loss: float
    input_grad: torch.Tensor
    grads: dict[str, dict[str, torch.Tensor]]  # per sync: router.weight, experts.w_in / w_out (this rank's experts)
    first_expert: int
    sent: torch.Tensor  # (E,) assignments this rank sent to each expert
    seconds: list[float]  # timed forward+backward passes


def worker(ctx: RankContext, cfg: Config) -> Result:
    """A checked pass per gradient sync in `cfg.syncs`, then `cfg.steps` timed passes of the first."""
    groups = ExpertParallelGroups.build(ctx.rank, ctx.world_size, cfg.ep_size)
    moe = ExpertParallelMoE(cfg.layer(), groups).to(ctx.device)
    x, target = (t.to(ctx.device) for t in cfg.data(ctx.rank))
    x = x.requires_grad_()

    def step(sync) -> tuple:
        out = moe(x)
        (loss := loss_of(cfg, out, target)).backward()
        sync(moe)
        return out, loss

    def prepare(i: int = 0) -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None

    grads = {}
    for name in cfg.syncs:
        prepare()
        out, loss = step(SYNC[name])
        grads[name] = {n: p.grad.detach().cpu().clone() for n, p in moe.named_parameters()}
    seconds = time_steps(ctx, lambda i: step(SYNC[cfg.syncs[0]]), cfg.steps, prepare=prepare).seconds
    return Result(out.y.detach().cpu(), out.routing.keep.cpu(), float(loss.detach()), x.grad.detach().cpu(),
                  grads, moe.first, out.tokens_per_expert.cpu(), seconds)


@dataclass
class ExpertParallelRun:
    cfg: Config
    difference: dict[str, float]  # largest difference from one process: "outputs", "loss", "input", "router", "experts"
    experts: dict[str, tuple[float, float]]  # per sync: the experts' largest difference, their factor of one process's
    same_dropped: bool  # every rank dropped exactly the assignments one process drops
    dropped: int  # assignments dropped, all ranks
    counts: torch.Tensor = field(repr=False)  # (ranks, E) assignments each rank sent to each expert
    step_time: Measured = None  # seconds per forward+backward, slowest rank (measured)


def run(cfg: Config) -> ExpertParallelRun:
    return experiments.run(worker, cfg, gather)


def reference(cfg: Config):
    """The whole layer in this process on every rank's tokens, one group per rank, the loss the mean
    of the groups': the layer with its gradients, and per group the output, input and loss."""
    layer = cfg.layer()
    outs, xs, losses = [], [], []
    with one_thread():
        for rank in range(cfg.world_size):
            x, target = cfg.data(rank)
            xs.append(x.requires_grad_())
            outs.append(layer(x))
            losses.append(loss_of(cfg, outs[-1], target))
        torch.stack(losses).mean().backward()
    return layer, outs, xs, losses


def gather(cfg: Config, results: list[Result]) -> ExpertParallelRun:
    layer, outs, xs, losses = reference(cfg)
    w, main = cfg.world_size, cfg.syncs[0]
    diff = {"outputs": 0.0, "loss": 0.0, "input": 0.0, "router": 0.0}
    for r, out, x, loss in zip(results, outs, xs, losses):
        diff["outputs"] = max(diff["outputs"], float((r.y - out.y.detach()).abs().max()))
        diff["loss"] = max(diff["loss"], abs(r.loss - float(loss.detach())))
        # a rank's input gradient is of its own loss; one process's of the mean over w groups
        diff["input"] = max(diff["input"], float((r.input_grad - w * x.grad).abs().max()))
        router = r.grads[main]["router.weight"] - layer.router.weight.grad
        diff["router"] = max(diff["router"], float(router.abs().max()))
    experts = {sync: _expert_check(layer, results, sync) for sync in cfg.syncs}
    diff["experts"] = experts[main][0]
    same_dropped = all(torch.equal(r.keep, out.routing.keep) for r, out in zip(results, outs))
    seconds = [max(s) for s in zip(*(r.seconds for r in results))]
    return ExpertParallelRun(cfg, diff, experts, same_dropped, int(sum(int((~r.keep).sum()) for r in results)),
                             torch.stack([r.sent for r in results]), Measured.of(seconds))


def _expert_check(layer: MoELayer, results: list[Result], sync: str) -> tuple[float, float]:
    """Every rank's expert gradients against one process's: the largest difference, and the factor
    they are of one process's (least squares)."""
    got, want = [], []
    for r in results:
        n = r.grads[sync]["experts.w_in"].shape[0]
        for name in ("w_in", "w_out"):
            got.append(r.grads[sync][f"experts.{name}"].flatten())
            want.append(getattr(layer.experts, name).grad[r.first_expert:r.first_expert + n].flatten())
    got, want = torch.cat(got), torch.cat(want)
    return float((got - want).abs().max()), float(got @ want / (want @ want))


def per_expert_table(run: ExpertParallelRun) -> list[dict]:
    """Per rank: the assignments it sent to each expert, and the expert ranks that hold them."""
    local = run.cfg.experts // run.cfg.ep_size
    return [{"rank": r, **{f"to expert {e} (rank {r // run.cfg.ep_size * run.cfg.ep_size + e // local})": int(c)
                           for e, c in enumerate(row)}} for r, row in enumerate(run.counts)]


TOLERANCE = 1e-4  # float32 sums in another order: far above rounding, far below a wrong gradient


def same_as_one_process(run: ExpertParallelRun) -> tuple[str, str, str, dict]:
    worst = max(run.difference.values())
    ok = worst <= TOLERANCE and run.same_dropped
    text = (f"on {run.cfg.world_size} ranks (ep={run.cfg.ep_size}), outputs, loss and every gradient match one process "
            f"(largest difference {worst:.1e}), with the same {run.dropped} assignments dropped" if ok else
            f"{max(run.difference, key=run.difference.get)} differ from one process by {worst:.1e}"
            + ("" if run.same_dropped else ", and the dropped assignments differ"))
    return "15.same_as_one_process", "same" if ok else "different", text, {
        "largest_difference": worst, "dropped": run.dropped}


def doubled_gradient(run: ExpertParallelRun, sync: str = "as_plain_data_parallel") -> tuple[str, str, str, dict]:
    """The factor the experts' gradients under `sync` are of one process's."""
    worst, ratio = run.experts[sync]
    right = worst <= TOLERANCE
    verdict = "right" if right else f"{ratio:.2f}x"
    text = (f"with {sync}, the experts' gradients match one process (largest difference {worst:.1e})" if right else
            f"with {sync}, the experts' gradients are {ratio:.2f}x one process's: each already sums its group's "
            f"{run.cfg.ep_size} ranks' tokens, so divide by the world size, {run.cfg.world_size}")
    return "15.expert_gradients", verdict, text, {"ratio": ratio, "largest_difference": worst}


def run_flops(params: dict) -> float:
    """FLOPs of one run of lesson 15 at the notebook parameters `params` (missing names: the defaults),
    counted on the meta device: per rank and pass the router and each token's k experts (none dropped);
    2 + `steps` passes on `world_size` ranks, 1 + `steps` on `grid_world_size`."""
    p = {"world_size": 2, "grid_world_size": 4, **params}
    cfg = Config(**{k: v for k, v in p.items() if k in ("experts", "top_k", "dim", "hidden", "tokens", "steps")})
    with torch.device("meta"):
        router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        expert = nn.Sequential(nn.Linear(cfg.dim, cfg.hidden, bias=False), nn.GELU(),
                               nn.Linear(cfg.hidden, cfg.dim, bias=False))
    per_pass = (step_flops(router, torch.empty(cfg.tokens, cfg.dim, device="meta"))
                + step_flops(expert, torch.empty(cfg.tokens * cfg.top_k, cfg.dim, device="meta")))
    return per_pass * (p["world_size"] * (2 + cfg.steps) + p["grid_world_size"] * (1 + cfg.steps))

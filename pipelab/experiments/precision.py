"""Lesson 16's training curves (fp32, bf16, fp16 with our loss scaler and GradScaler step for step, a
small-gradient model) and memory per parameter, one process and ZeRO in mixed precision on real ranks;
`precision_parts` holds the formats, recomputation, FP8 and the bf16 all-reduce."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from pipelab import experiments
from pipelab.checks import positive_number, whole_number
from pipelab.experiments.expert_parallel import one_thread
from pipelab.precision import DynamicLossScaler, MasterWeights, MixedZero, bytes_per_parameter
from pipelab.sharding import Collectives, formula, held_by
from pipelab.worker import RankContext

CURVES = ("fp32", "bf16 autocast", "bf16 + fp32 master", "fp16 + our scaler", "fp16 + GradScaler")


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    width: int = 64  # the MLP: width -> width -> width -> 1
    batch: int = 64  # rows per step, split over the ranks in the multi-rank runs
    steps: int = 30  # optimizer steps per training curve
    lr: float = 1e-3  # Adam's learning rate
    init_scale: float = 2.0 ** 24  # the loss scale fp16 starts at (too large on purpose: it must back off)
    growth_interval: int = 5  # good steps before the scale doubles (torch's default is 2000)
    loss_weight: float = 1e-6  # the small-gradient run's loss is multiplied by this (a mean over ~1e6 values)
    loss_rtol: float = 0.05  # how far a 16-bit curve may stray from fp32's, relative
    zero_world_sizes: tuple = (2, 4)  # ranks of the ZeRO runs in mixed precision
    numel: int = 4096  # the gradient of the bf16 all-reduce on world_size ranks
    seed: int = 0

    def check(self) -> None:
        super().check()
        for name in ("width", "batch", "steps", "growth_interval", "numel"):
            whole_number(name, getattr(self, name), example=f"{name}={getattr(Config, name)}")
        for name in ("lr", "init_scale", "loss_weight", "loss_rtol"):
            positive_number(name, getattr(self, name), example=f"{name}={getattr(Config, name)}")
        if not self.zero_world_sizes or any(max(self.zero_world_sizes) % n for n in self.zero_world_sizes):
            raise ValueError(f"zero_world_sizes={self.zero_world_sizes!r}: give sizes that all divide the largest "
                             "(its ranks are cut into groups of each size), e.g. (2, 4)")
        for n in (self.world_size, *self.zero_world_sizes):
            if self.batch % n:
                raise ValueError(f"batch={self.batch} does not split over {n} ranks; use a multiple of "
                                 f"{n}, e.g. batch={n * max(1, self.batch // n)}")

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs, and a teacher's outputs as targets."""
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.batch, self.width, generator=g)
        return x, torch.tanh(x @ torch.randn(self.width, 1, generator=g) / self.width ** 0.5)

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Linear(self.width, self.width), nn.Tanh(), nn.Linear(self.width, self.width),
                             nn.Tanh(), nn.Linear(self.width, 1))

    def loss(self, out: torch.Tensor, y: torch.Tensor, small: bool = False) -> torch.Tensor:
        """Mean squared error in fp32; `small`: times `loss_weight`, and every gradient as small."""
        loss = nn.functional.mse_loss(out.float(), y)
        return loss * self.loss_weight if small else loss


def adam(cfg: Config):
    return lambda params: torch.optim.Adam(params, lr=cfg.lr, foreach=False)


@dataclass
class Curve:
    """One recipe's losses by step, and (fp16) the loss scale and skipped steps."""

    recipe: str
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # steps whose update was skipped (inf/nan)
    weights: list[dict] = field(default_factory=list)  # after every step (fp16: step-for-step equality)


@one_thread()
def train(cfg: Config, recipe: str, small: bool = False, scaling: bool = True) -> Curve:
    """`cfg.steps` Adam steps of the MLP in `recipe` (one of CURVES) on the whole batch; `small`:
    the loss times `cfg.loss_weight` (the curve records it unweighted)."""
    x, y = cfg.data()
    model, curve = cfg.model(), Curve(recipe)
    fp16 = recipe.startswith("fp16")
    if recipe == "bf16 + fp32 master":
        trainer = MasterWeights(model, adam(cfg))
        optimizer, x = None, x.bfloat16()
    else:
        optimizer = adam(cfg)(model.parameters())
    scaler = (torch.amp.GradScaler("cpu", init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
              if recipe == "fp16 + GradScaler" else
              DynamicLossScaler(cfg.init_scale, growth_interval=cfg.growth_interval) if fp16 and scaling else None)
    dtype = {"bf16 autocast": torch.bfloat16}.get(recipe, torch.float16 if fp16 else None)
    for step in range(cfg.steps):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = cfg.loss(model(x), y, small)
        curve.losses.append(loss.item() / (cfg.loss_weight if small else 1))
        if scaler is None:
            loss.backward()
            trainer.step() if optimizer is None else optimizer.step()
        elif isinstance(scaler, DynamicLossScaler):
            curve.scales.append(scaler.scale)
            scaler.scale_loss(loss).backward()
            if not scaler.step(optimizer):
                curve.skipped.append(step)
        else:  # torch's recipe, step then update: the step was skipped if the scale backed off
            curve.scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < curve.scales[-1]:
                curve.skipped.append(step)
        if fp16:
            curve.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        (optimizer or trainer.optimizer).zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return curve


def curves(cfg: Config) -> dict[str, Curve]:
    """Every recipe of CURVES trained from the same weights on the same batch."""
    return {r: train(cfg, r) for r in CURVES}


def taken(curve: Curve) -> list[float]:
    """The losses after 0, 1, 2, ... updates taken (a skipped step took none: the last loss counts)."""
    by_updates: dict[int, float] = {}
    for step, loss in enumerate(curve.losses):
        by_updates[step - sum(s < step for s in curve.skipped)] = loss
    return list(by_updates.values())


def agreement(runs: dict[str, Curve]) -> dict[str, float]:
    """Per 16-bit recipe, the largest relative gap of its loss from fp32's after as many updates."""
    ref = runs["fp32"].losses
    return {r: max(abs(a - b) / abs(b) for a, b in zip(taken(c), ref)) for r, c in runs.items() if r != "fp32"}


def bitwise_equal_steps(runs: dict[str, Curve]) -> dict[str, int]:
    """Per recipe, on how many steps its loss equals fp32's bit for bit."""
    ref = runs["fp32"].losses
    return {r: sum(a == b for a, b in zip(c.losses, ref)) for r, c in runs.items() if r != "fp32"}


def curves_verdict(runs: dict[str, Curve], rtol: float) -> tuple:
    gaps, equal = agreement(runs), bitwise_equal_steps(runs)
    worst = max(gaps, key=gaps.get)
    within = gaps[worst] <= rtol
    text = (f"Every half-precision curve stays within {gaps[worst]:.1%} of fp32's loss after as many updates ({worst} "
            f"the farthest), {'inside' if within else 'outside'} the {rtol:.0%} tolerance.")
    return "16.curves", "within tolerance" if within else "outside tolerance", text, \
        dict(worst_gap=gaps[worst], rtol=rtol, bit_equal_steps=max(equal.values()))


def scalers_verdict(runs: dict[str, Curve]) -> tuple:
    ours, torchs = runs["fp16 + our scaler"], runs["fp16 + GradScaler"]
    same = ours.scales == torchs.scales and ours.skipped == torchs.skipped and all(
        torch.equal(a[n], b[n]) for a, b in zip(ours.weights, torchs.weights) for n in a)
    text = (f"Over {len(ours.scales)} steps, {len(ours.skipped)} of them skipped, ours and torch.amp.GradScaler took "
            + ("the same scales, skips and weights, bit for bit." if same else "different scales, skips or weights."))
    return "16.scalers", "equal" if same else "different", text, \
        dict(skipped=len(ours.skipped), lowest=min(ours.scales))


def small_gradients(cfg: Config) -> dict[str, Curve]:
    """The small-gradient model in fp32, fp16 without loss scaling, and fp16 with our scaler."""
    return {"fp32": train(cfg, "fp32", small=True), "fp16, no scaling": train(cfg, "fp16 + our scaler", True, False),
            "fp16 + our scaler": train(cfg, "fp16 + our scaler", small=True)}


@one_thread()
def zero_gradient_share(cfg: Config, scale: float = 1.0) -> float:
    """The share of the small-gradient run's first-layer weight gradients exactly 0 in fp16 autocast,
    the loss times `scale`."""
    model, (x, y) = cfg.model(), cfg.data()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = cfg.loss(model(x), y, small=True)
    (loss * scale).backward()
    return (model[0].weight.grad == 0).float().mean().item()


def small_gradients_verdict(runs: dict[str, Curve]) -> tuple:
    def drop(c: Curve) -> float:
        return 1 - c.losses[-1] / c.losses[0]
    base = drop(runs["fp32"])
    kept = {r: drop(c) / base for r, c in runs.items() if r != "fp32"}
    stops = kept["fp16, no scaling"] < 0.5 <= kept["fp16 + our scaler"]
    text = (f"fp16 without scaling kept {kept['fp16, no scaling']:.0%} of fp32's loss drop, with our loss scaler "
            f"{kept['fp16 + our scaler']:.0%}.")
    return "16.small_gradients", "scaling needed" if stops else "no difference", text, kept


@one_thread()
def held_per_parameter(cfg: Config, recipe: str) -> tuple[float, float, float]:
    """Bytes per parameter one process holds after a step of `recipe`, counted from tensor storages."""
    model, (x, y) = cfg.model(), cfg.data()
    psi = sum(p.numel() for p in model.parameters())
    if recipe == "bf16 + fp32 master":
        trainer = MasterWeights(model, adam(cfg))
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]  # the 16-bit gradients, before the step frees them
        trainer.step()
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        held = held_by(model, trainer.optimizer)
        held_master = held.optimizer_state + 4 * psi  # the masters are the optimizer's parameters
        return held.parameters / psi - 4, held.gradients / psi, held_master / psi
    optimizer = adam(cfg)(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "bf16 autocast"):
        loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    optimizer.step()
    held = held_by(model, optimizer)
    return held.parameters / psi, held.gradients / psi, held.optimizer_state / psi


def memory_rows(cfg: Config) -> list[dict]:
    """Per recipe, bytes per parameter counted from tensor storages (one process) beside the formula."""
    rows = []
    for recipe in ("fp32", "bf16 autocast", "bf16 + fp32 master"):
        got, want = held_per_parameter(cfg, recipe), bytes_per_parameter(recipe)
        rows.append({"recipe": recipe, "counted (params, grads, state)": ", ".join(f"{v:.2f}" for v in got),
                     "formula": ", ".join(str(v) for v in want), "counted total": round(sum(got), 3),
                     "formula total": sum(want)})
    return rows


@dataclass
class ZeroResult:
    """One rank's ZeRO runs, per stage."""

    losses: dict[int, list[float]]
    held: dict[int, tuple[float, float, float]]
    masters: dict[int, dict[str, torch.Tensor]]
    sent: dict[int, float]


def zero_worker(ctx: RankContext, cfg: Config) -> dict[int, ZeroResult]:
    """Per size n of cfg.zero_world_sizes, ZeRO stages 0-3 in mixed precision from the same weights on
    this rank's group of n ranks."""
    torch.set_num_threads(1)
    groups = {n: [dist.new_group(list(range(i, i + n))) for i in range(0, ctx.world_size, n)]
              for n in cfg.zero_world_sizes}  # every rank creates every group, in the same order
    out = {}
    for n, mine in groups.items():
        group, rank = mine[ctx.rank // n], ctx.rank % n
        x, y = (t.chunk(n)[rank] for t in cfg.data())
        out[n] = result = ZeroResult({}, {}, {}, {})
        for stage in (0, 1, 2, 3):
            comm = Collectives(ctx.rec, group)
            trainer = MixedZero(cfg.model(), comm, stage, cfg.lr)
            result.losses[stage] = [trainer.step(x.bfloat16(), y, nn.functional.mse_loss) for _ in range(3)]
            result.held[stage] = astuple(trainer.held())
            result.sent[stage] = comm.bytes_sent() / 3
            result.masters[stage] = trainer.full_parameters()
    return out


@one_thread()
def reference(cfg: Config) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, bf16 weights and fp32 masters: the losses and masters ZeRO must reach."""
    model, (x, y) = cfg.model(), cfg.data()
    trainer = MasterWeights(model, adam(cfg))
    losses = []
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        losses.append(loss.item())
        loss.backward()
        trainer.step()
    return losses, {n: m.detach().clone() for (n, _), m in zip(model.named_parameters(), trainer.master)}


def zero_runs(cfg: Config) -> dict[int, list[ZeroResult]]:
    """ZeRO 0-3 in mixed precision on groups of each of cfg.zero_world_sizes ranks, all in one start of
    max(zero_world_sizes) ranks; per size, the first group's results."""
    world = max(cfg.zero_world_sizes)
    per_rank = experiments.run(zero_worker, replace(cfg, world_size=world))
    return {n: [per_rank[r][n] for r in range(n)] for n in cfg.zero_world_sizes}


def zero_rows(cfg: Config, runs: dict[int, list[ZeroResult]]) -> list[dict]:
    """Per ranks and stage: the fullest rank's bytes per parameter counted beside the formula (2 + 2 + 12),
    and how far its losses and masters are from one process."""
    psi = sum(p.numel() for p in cfg.model().parameters())
    ref_losses, ref_masters = reference(cfg)
    rows = []
    for n, ranks in runs.items():
        for stage in (0, 1, 2, 3):
            held = max((r.held[stage] for r in ranks), key=sum)
            want = formula(("dp", "zero1", "zero2", "zero3")[stage], psi, n, 2, 2, 12)
            loss_gap = max(abs(sum(r.losses[stage][i] for r in ranks) / n - ref_losses[i]) / ref_losses[i]
                           for i in range(len(ref_losses)))
            weight_gap = max((ranks[0].masters[stage][k] - v).abs().max().item() for k, v in ref_masters.items())
            rows.append({"ranks": n, "stage": f"ZeRO-{stage}" if stage else "DP",
                         "counted B/param": round(sum(held) / psi, 3), "formula B/param": want.total / psi,
                         "loss vs one process": float(f"{loss_gap:.2g}"), "largest master difference":
                         float(f"{weight_gap:.2g}"), "sent per step (B)": ranks[0].sent[stage]})
    return rows

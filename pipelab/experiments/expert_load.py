"""Lesson 15's load: where the router sends tokens, and what an uneven load costs in modelled time.

Tokens per expert before and after the balancing loss trains (one process: lesson 15 shows the
layer over ranks equals it); one step of the layer in modelled time (`pipelab.emulate.moe` times
each part) from where the tokens really went, so the busiest expert's rank sets the pace; a
capacity-factor sweep; the scaling book's condition for the all-to-alls to hide, beside the step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pipelab.emulate.moe import all_to_all_seconds, expert_seconds, hiding_condition
from pipelab.experiments.expert_parallel import Config, one_thread
from pipelab.timeline import Span, Timeline


# ---- Load: tokens per expert before and after the balancing loss trains -----------------------------


def load_after_training(cfg: Config, steps: int, aux_weight: float, lr: float = 0.1) -> list[torch.Tensor]:
    """Tokens per expert (all ranks' tokens, before capacity: where the router sends them) before
    and after each of `steps` SGD steps of the one-process layer with the balancing loss at `aux_weight`."""
    layer = cfg.layer()
    data = [cfg.data(rank) for rank in range(cfg.world_size)]
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    loads = []
    with one_thread():
        for step in range(steps + 1):
            outs = [layer(x) for x, _ in data]
            loads.append(sum(torch.bincount(o.routing.experts.reshape(-1), minlength=cfg.experts) for o in outs))
            if step == steps:
                return loads
            loss = torch.stack([((o.y - t) ** 2).mean() + aux_weight * o.aux_loss for o, (_, t) in zip(outs, data)])
            opt.zero_grad()
            loss.mean().backward()
            opt.step()
    return loads


def imbalance(load: torch.Tensor) -> float:
    """The busiest expert's load over the mean load: 1 is even; the step waits on the busiest."""
    return float(load.max() / load.float().mean())


# ---- A step in modelled time ------------------------------------------------------------------------


@dataclass
class ModelledStep:
    """One step of the layer in modelled time, from where the tokens really went."""

    timeline: Timeline
    node: str
    all_to_all: float  # seconds of one all-to-all (the busiest rank's share sets it)
    experts: list[float]  # per rank: its experts' forward + backward seconds
    assignments: list[int]  # per rank: the assignments its experts computed, at the modelled size

    @property
    def step(self) -> float:
        return self.timeline.makespan

    @property
    def communication(self) -> float:
        return 4 * self.all_to_all  # dispatch and combine, forward and backward


def modelled_step(cfg: Config, counts: torch.Tensor, link: str | None = None) -> ModelledStep:
    """The first expert-parallel group's step, counts (ranks, E) scaled to the modelled size: dispatch,
    the experts' forward, combine; in backward the combine's and dispatch's all-to-alls the other
    way around the experts' backward. An all-to-all ends for all when the last rank reaches it."""
    n, local = cfg.ep_size, cfg.experts // cfg.ep_size
    node = f"{n}x{link or cfg.link}"
    c = counts[:n].double() * (cfg.modelled_tokens / cfg.tokens)
    between = c.view(n, n, local).sum(2) * (1 - torch.eye(n, dtype=torch.double))  # [source, destination], off-rank
    row = cfg.modelled_dim * getattr(torch, cfg.dtype).itemsize
    a2a = all_to_all_seconds(float(torch.maximum(between.sum(1), between.sum(0)).max()) * row, node)
    arrived = c.sum(0).view(n, local).round().long()  # per rank, per local expert

    def experts(kind: str, rank: int) -> float:
        return sum(expert_seconds(kind, int(t), cfg.modelled_dim, cfg.modelled_hidden, node, cfg.dtype)
                   for t in arrived[rank])

    fwd, bwd = [experts("forward", r) for r in range(n)], [experts("backward", r) for r in range(n)]
    spans, t = [], 0.0
    for phase in ("dispatch", "F", "combine", "combine backward", "B", "dispatch backward"):
        lengths = {"F": fwd, "B": bwd}.get(phase, [a2a] * n)
        lane = "compute" if phase in ("F", "B") else "comm"
        spans += [Span(r, lane, phase, t, t + lengths[r]) for r in range(n) if lengths[r] > 0]
        t += max(lengths)
    return ModelledStep(Timeline(spans), node, a2a, [f + b for f, b in zip(fwd, bwd)],
                        [int(a) for a in arrived.sum(1)])


def evenly(counts: torch.Tensor) -> torch.Tensor:
    """The same assignments per rank, spread evenly over the experts: the load a perfect router gives."""
    return counts.sum(1, keepdim=True).double().expand_as(counts) / counts.shape[1]


def routed_counts(cfg: Config) -> tuple[torch.Tensor, int]:
    """Per rank and expert, the assignments kept (routed in one process, as each rank routes its
    own tokens), and the assignments dropped."""
    layer = cfg.layer()
    with torch.no_grad(), one_thread():
        outs = [layer(cfg.data(rank)[0]) for rank in range(cfg.world_size)]
    return torch.stack([o.tokens_per_expert for o in outs]), sum(int(o.routing.dropped.sum()) for o in outs)


def capacity_sweep(cfg: Config, factors: tuple[float, ...]) -> list[dict]:
    """Per capacity factor: the assignments dropped and the modelled step."""
    rows = []
    for f in factors:
        c = replace(cfg, capacity_factor=f)
        counts, dropped = routed_counts(c)
        step = modelled_step(c, counts)
        assignments = cfg.world_size * cfg.tokens * cfg.top_k
        rows.append({"capacity factor": f, "dropped (%)": round(100 * dropped / assignments, 1),
                     "modelled step (ms)": round(step.step * 1e3, 3)})
    return rows


# ---- Verdicts ---------------------------------------------------------------------------------------


def balancing_verdict(loads: list[torch.Tensor], plain: list[torch.Tensor]) -> tuple[str, str, str, dict]:
    """Whether the balancing loss evened the load (busiest over mean) more than training without it."""
    before, after, without = imbalance(loads[0]), imbalance(loads[-1]), imbalance(plain[-1])
    verdict = "evened" if after < before and after < without else "not evened"
    text = (f"with the balancing loss the busiest expert's load fell to {after:.2f}x the mean, against "
            f"{without:.2f}x without it")
    return "15.balancing_loss", verdict, text, {"before": before, "after": after, "without": without}


def pace_verdict(step: ModelledStep, even: ModelledStep) -> tuple[str, str, str, dict]:
    """Whether the busiest rank's experts set the modelled step, against the same load spread evenly."""
    busiest = max(range(len(step.experts)), key=step.experts.__getitem__)
    longer = step.step / even.step - 1
    verdict = "busiest sets the pace" if longer > 0 else "even"
    text = (f"rank {busiest}'s experts computed the most assignments ({step.assignments[busiest]:,}); every "
            f"rank waits for it, so the modelled step is {100 * longer:.0f}% longer than with an even load")
    return "15.busiest_sets_the_pace", verdict, text, {"modelled_step_s": step.step, "even_step_s": even.step}


def capacity_verdict(rows: list[dict]) -> tuple[str, str, str, dict]:
    """What raising the capacity factor trades: dropped assignments against the modelled step."""
    lo, hi = rows[0], rows[-1]
    verdict = ("fewer drops, longer step" if hi["dropped (%)"] < lo["dropped (%)"]
               and hi["modelled step (ms)"] > lo["modelled step (ms)"] else "no trade")
    text = (f"raising the capacity factor cut the dropped assignments from {lo['dropped (%)']}% to "
            f"{hi['dropped (%)']}% and lengthened the modelled step (table above)")
    return "15.capacity", verdict, text, {"rows": rows}


def hiding_verdict(rows: list[dict]) -> tuple[str, str, str, dict]:
    """Whether the scaling book's condition says what the modelled step shows, on every link."""
    agree = all((r["formula: compute / all-to-all"] > 1) == (r["modelled: compute / all-to-all"] > 1) for r in rows)
    hidden = [r["link"] for r in rows if r["modelled: compute / all-to-all"] > 1]
    text = (f"the condition {'agrees' if agree else 'disagrees'} with the modelled step on all {len(rows)} links: "
            f"the experts' compute outlasts the all-to-alls over {', '.join(hidden) or 'none of them'}")
    return "15.all_to_all_hides", "agrees" if agree else "disagrees", text, {"rows": rows}


def hiding_table(cfg: Config, counts: torch.Tensor, links: tuple[str, ...]) -> list[dict]:
    """Per link: the condition's threshold and ratio, beside the modelled step's (busiest rank's experts
    over the four all-to-alls)."""
    rows = []
    for link in links:
        row = hiding_condition(f"{cfg.ep_size}x{link}", cfg.modelled_tokens, cfg.top_k, cfg.experts, cfg.modelled_dim,
                               cfg.modelled_hidden, cfg.dtype)
        step = modelled_step(cfg, counts, link)
        row["modelled: compute / all-to-all"] = max(step.experts) / step.communication
        rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    return rows

"""Lesson 15's load: tokens per expert before and after the balancing loss trains (in one process,
which lesson 15 shows the layer over ranks equals), and what an uneven load costs in modelled time.

The modelled part is taken on an emulated node of the run's expert-parallel ranks over a link, at
a size of its own (`at`: e.g. `Emulated("H100-nvlink", tokens=512)`; `SIZE` its names and defaults).
The ranks themselves run on this machine."""

from __future__ import annotations

from dataclasses import replace

import torch

from pipelab.checks import whole_number
from pipelab.emulate import Emulated, node_name, node_of, size_of
from pipelab.emulate.moe import ModelledStep, hiding_condition, moe_step
from pipelab.experiments.expert_parallel import Config, one_thread


def load_after_training(cfg: Config, steps: int, aux_weight: float, lr: float = 0.1) -> list[torch.Tensor]:
    """Tokens per expert (all ranks', before capacity) before and after each of `steps` SGD steps of
    the one-process layer with the balancing loss at `aux_weight`."""
    layer = cfg.layer()
    data = [cfg.data(rank) for rank in range(cfg.world_size)]
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    loads = []
    with one_thread():
        for step in range(steps + 1):
            outs = [layer(x) for x, _ in data]
            loads.append(sum(torch.bincount(o.routing.experts.reshape(-1), minlength=cfg.experts) for o in outs))
            if step < steps:
                opt.zero_grad()
                torch.stack([((o.y - t) ** 2).mean() + aux_weight * o.aux_loss for o, (_, t) in zip(outs, data)]
                            ).mean().backward()
                opt.step()
    return loads


def imbalance(load: torch.Tensor) -> float:
    """The busiest expert's load over the mean (1: even); the step waits on the busiest."""
    return float(load.max() / load.float().mean())


# Modelled time's size: Mixtral-8x7B's expert (width 4096, hidden 14336) in bfloat16, `tokens` per rank.
SIZE = {"tokens": 8192, "dim": 4096, "hidden": 14336, "dtype": "bfloat16"}
NVLINK = Emulated("H100-nvlink")


def modelled_node(cfg: Config, at: Emulated | str = NVLINK):
    """The node name of `cfg`'s expert-parallel ranks over `at`'s link ("2xH100-nvlink") and the
    modelled size; a bad link name or size is refused here (call it before the run)."""
    name, size = f"{cfg.ep_size}x{node_name(at)}", size_of(SIZE, at)
    node_of(name)  # a bad name lists the known devices and links
    for key in ("tokens", "dim", "hidden"):
        whole_number(key, getattr(size, key))
    return name, size


def modelled_step(cfg: Config, counts: torch.Tensor, at: Emulated | str = NVLINK) -> ModelledStep:
    """The first expert-parallel group's step on an emulated node, the run's counts (ranks, E)
    scaled from its tokens per rank to the modelled size."""
    node, size = modelled_node(cfg, at)
    scaled = counts[:cfg.ep_size].double() * (size.tokens / cfg.tokens)
    return moe_step(scaled, node, size.dim, size.hidden, size.dtype)


def evenly(counts: torch.Tensor) -> torch.Tensor:
    """The same assignments per rank, spread evenly over the experts: the load a perfect router gives."""
    return counts.sum(1, keepdim=True).double().expand_as(counts) / counts.shape[1]


def routed_counts(cfg: Config) -> tuple[torch.Tensor, int]:
    """Per rank and expert the assignments kept, routed in one process as each rank routes its own
    tokens, and the assignments dropped."""
    layer = cfg.layer()
    with torch.no_grad(), one_thread():
        outs = [layer(cfg.data(rank)[0]) for rank in range(cfg.world_size)]
    return torch.stack([o.tokens_per_expert for o in outs]), sum(int(o.routing.dropped.sum()) for o in outs)


def capacity_sweep(cfg: Config, factors: tuple[float, ...], at: Emulated | str = NVLINK) -> list[dict]:
    """Per capacity factor: the assignments dropped and the modelled step."""
    rows, assignments = [], cfg.world_size * cfg.tokens * cfg.top_k
    for f in factors:
        counts, dropped = routed_counts(c := replace(cfg, capacity_factor=f))
        rows.append({"capacity factor": f, "dropped (%)": round(100 * dropped / assignments, 1),
                     "modelled step (ms)": round(modelled_step(c, counts, at).step * 1e3, 3)})
    return rows


def balancing_verdict(loads: list[torch.Tensor], plain: list[torch.Tensor]) -> tuple[str, str, str, dict]:
    before, after, without = imbalance(loads[0]), imbalance(loads[-1]), imbalance(plain[-1])
    verdict = "evened" if after < before and after < without else "not evened"
    text = (f"with the balancing loss the busiest expert's load fell to {after:.2f}x the mean, against "
            f"{without:.2f}x without it")
    return "15.balancing_loss", verdict, text, {"before": before, "after": after, "without": without}


def pace_verdict(step: ModelledStep, even: ModelledStep) -> tuple[str, str, str, dict]:
    busiest = max(range(len(step.experts)), key=step.experts.__getitem__)
    longer = step.step / even.step - 1
    verdict = "busiest sets the pace" if longer > 0 else "even"
    text = (f"rank {busiest}'s experts computed the most assignments ({step.assignments[busiest]:,}); every "
            f"rank waits for it, so the modelled step is {100 * longer:.0f}% longer than with an even load")
    return "15.busiest_sets_the_pace", verdict, text, {"modelled_step_s": step.step, "even_step_s": even.step}


def capacity_verdict(rows: list[dict]) -> tuple[str, str, str, dict]:
    lo, hi = rows[0], rows[-1]
    verdict = ("fewer drops, longer step" if hi["dropped (%)"] < lo["dropped (%)"]
               and hi["modelled step (ms)"] > lo["modelled step (ms)"] else "no trade")
    text = (f"raising the capacity factor cut the dropped assignments from {lo['dropped (%)']}% to "
            f"{hi['dropped (%)']}% and lengthened the modelled step (table above)")
    return "15.capacity", verdict, text, {"rows": rows}


def hiding_verdict(rows: list[dict]) -> tuple[str, str, str, dict]:
    agree = all((r["formula: compute / all-to-all"] > 1) == (r["modelled: compute / all-to-all"] > 1) for r in rows)
    hidden = [r["link"] for r in rows if r["modelled: compute / all-to-all"] > 1]
    text = (f"the condition {'agrees' if agree else 'disagrees'} with the modelled step on all {len(rows)} links: "
            f"the experts' compute outlasts the all-to-alls over {', '.join(hidden) or 'none of them'}")
    return "15.all_to_all_hides", "agrees" if agree else "disagrees", text, {"rows": rows}


def hiding_table(cfg: Config, counts: torch.Tensor, links: tuple[str, ...], at: Emulated | str = NVLINK) -> list[dict]:
    """Per link: the scaling book's threshold and ratio beside the modelled step's (the busiest rank's
    experts over the four all-to-alls), at `at`'s size."""
    rows = []
    for link in links:
        over = Emulated(link, **(at.size if isinstance(at, Emulated) else {}))
        node, size = modelled_node(cfg, over)
        row = hiding_condition(node, size.tokens, cfg.top_k, cfg.experts, size.dim, size.hidden, size.dtype)
        step = modelled_step(cfg, counts, over)
        row["modelled: compute / all-to-all"] = max(step.experts) / step.communication
        rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    return rows

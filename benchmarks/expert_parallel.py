"""The expert-parallel layer's step at n ranks against the same layer in one process, measured in
one run; and the bytes its all-to-alls carried against the formula.

Each round, all ranks run `steps` forward+backward passes of the expert-parallel layer (each on its
own tokens), then rank 0 alone runs the one-process layer on every rank's tokens (the others wait):
the ratio is the slowest rank's median pass over the one process's, round by round (below 1: the
ranks together are faster than one process doing all the work). Bytes: what each rank's dispatch
sent to other ranks, counted from its split sizes, against T k D b (n-1)/n for T tokens per rank,
k experts each, width D, b bytes per value (an even load with nothing dropped).

    python benchmarks/expert_parallel.py
    python benchmarks/expert_parallel.py --world-size 4 --experts 8 --dim 256 --hidden 1024 --tokens 1024

Last line: one JSON object of the figures (a measured figure X comes with X_min and X_max).
"""

import argparse
import json
import statistics
import time

import torch

from pipelab import hardware
from pipelab.experiments import expert_parallel as epx
from pipelab.expert_parallel import ExpertParallelGroups, ExpertParallelMoE
from pipelab.launch import spawn
from pipelab.measure import Measured, ratios, time_steps


def _figure(name: str, m: Measured, digits: int = 3) -> dict:
    return {name: round(m.median, digits), f"{name}_min": round(m.low, digits), f"{name}_max": round(m.high, digits)}


def rounds_worker(ctx, cfg: epx.Config, rounds: int) -> dict:
    """Per round: this rank's median expert-parallel pass; on rank 0 also the one process's median pass."""
    moe = ExpertParallelMoE(cfg.layer(), ExpertParallelGroups.build(ctx.rank, ctx.world_size, cfg.ep_size))
    x, target = cfg.data(ctx.rank)
    whole, data = cfg.layer(), [cfg.data(r) for r in range(cfg.world_size)]

    def ep_pass(i: int):
        out = moe(x)
        epx.loss_of(cfg, out, target).backward()
        epx.reduce_gradients(moe)
        return out.tokens_per_expert

    def one_process_pass() -> float:
        start = time.perf_counter()
        torch.stack([epx.loss_of(cfg, whole(xr), tr) for xr, tr in data]).mean().backward()
        return time.perf_counter() - start

    ep, one, sent = [], [], None
    for _ in range(rounds):
        steps = time_steps(ctx, ep_pass, cfg.steps, prepare=lambda i: moe.zero_grad(set_to_none=True))
        ep.append(statistics.median(steps.seconds))
        sent = steps.results[-1]
        if ctx.rank == 0:
            times = []
            for _ in range(cfg.steps):
                whole.zero_grad(set_to_none=True)
                times.append(one_process_pass())
            one.append(statistics.median(times[1:] or times))
        ctx.barrier()
    return {"ep": ep, "one": one, "sent": sent}


def main(world_size: int = 2, experts: int = 4, dim: int = 128, hidden: int = 512, tokens: int = 512,
         steps: int = 5, rounds: int = 5) -> dict:
    cfg = epx.Config(world_size=world_size, experts=experts, dim=dim, hidden=hidden, tokens=tokens, steps=steps,
                     capacity_factor=float(experts), skew=0.0)  # capacity for every token: nothing dropped
    per_rank = spawn(rounds_worker, world_size, cfg, rounds, timeout=600)
    ep = [max(r) for r in zip(*(p["ep"] for p in per_rank))]
    one = per_rank[0]["one"]
    ratio = ratios(ep, one)
    n, local, row = world_size, experts // world_size, dim * 4
    sent = [sum(int(c) for e, c in enumerate(p["sent"]) if e // local != rank) * row for rank, p in enumerate(per_rank)]
    formula = tokens * cfg.top_k * dim * 4 * (n - 1) / n
    print(hardware.describe(world_size))
    print(f"MoE layer: {experts} experts (width {dim}, hidden {hidden}), top-{cfg.top_k}, {tokens} tokens per rank "
          f"over {world_size} ranks; median (min-max) of {rounds} rounds, each the median of {steps} passes")
    print(f"expert parallel {format(Measured.of(ep).scaled(1e3), '.2f')} ms per pass, one process (all ranks' tokens) "
          f"{format(Measured.of(one).scaled(1e3), '.2f')} ms; ratio {ratio:.2f}")
    print(f"dispatch bytes to other ranks per rank: {sent} counted, {formula:,.0f} by T k D b (n-1)/n; "
          "the combine sends the same back")
    return {"world_size": world_size, "experts": experts, "dim": dim, "hidden": hidden, "tokens": tokens,
            "rounds": rounds, **_figure("ep_over_one_process", ratio),
            **_figure("ep_ms", Measured.of(ep).scaled(1e3), 2),
            **_figure("one_process_ms", Measured.of(one).scaled(1e3), 2),
            "dispatch_bytes_counted": sent, "dispatch_bytes_formula": formula,
            "counted_over_formula": round(sum(sent) / len(sent) / formula, 3)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    print(json.dumps(main(a.world_size, a.experts, a.dim, a.hidden, a.tokens, a.steps, a.rounds)))

"""An emulated node against the simulator: the same schedules, the same costs, real ranks.

    python benchmarks/emulation.py [--node 4xH100-nvlink] [--num-microbatches 8] [--width 4096]
                                   [--layers 8] [--rows 64] [--steps 2]

For GPipe, 1F1B, interleaved and ZB-H1 at p = 2 and 4: each stage's F, I and W are counted on the
meta device at the emulated size (an MLP of `layers` Linear layers of `width`, `rows` rows per
micro-batch) and timed on the node's device (`emulate.cost.stage_seconds`; a full backward B lasts
I + W, as in the simulator). The ranks then run the schedule for real on `spawn(..., emulate=node)`:
a small MLP of the same depth (width 16), real autograd, real gloo messages under NCCL's ordering
rule, every gradient checked against one process -- while each span lasts its modelled cost on the
rank's logical clock and each message the link time of its emulated size (`rows` x `width` float32).
The simulator (`pipeline.simulate`) plays the same schedule with the same costs, a transfer taking
one such message's link time.

Prints a table and, as its last line, one JSON object: per schedule and p, the emulated step time
over the simulated makespan (`_ratio`: what the runtime adds -- messages waiting in NCCL's order,
link time), the emulated and simulated bubbles, and the worst ratio and bubble gap over all.
Logical time does not depend on the machine's load: a loaded run prints the same figures.
"""

from __future__ import annotations

import argparse
import json

import torch

from pipelab import measure, models
from pipelab.display import format_table
from pipelab.emulate.cost import message_seconds, stage_seconds
from pipelab.emulate.specs import parse_node
from pipelab.emulate.table import stage_table
from pipelab.launch import spawn
from pipelab.pipeline.p2p import P2P, message_specs
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, simulate
from pipelab.pipeline.stage import StageRunner
from pipelab.reference import reference_run
from pipelab.timeline import Timeline
from pipelab.worker import RankContext

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]
SMALL = 16  # the width the ranks really compute at


def stage_costs(node, num_stages: int, width: int, layers: int, rows: int) -> dict[int, dict[str, float]]:
    """Each stage's modelled seconds {"F", "I", "W", "B" = I + W} at the emulated size, counted on meta."""
    with torch.device("meta"):
        big = models.mlp([width] * (layers + 1))
    costs = {}
    for s, stage in enumerate(split_model(big, num_stages)):
        t = stage_seconds(stage, torch.empty(rows, width, device="meta"), node.device)
        costs[s] = {"F": t["F"], "I": t["I"], "W": t["W"], "B": t["I"] + t["W"]}
    return costs


def pipeline_steps(ctx: RankContext, runs: list[tuple], model, x, y, m: int, steps: int, message_bytes: int):
    """For each (schedule name, stage costs): `steps` timed steps on this rank's clock, and the
    last step's gradients of this rank's stages. Messages last `message_bytes` on the link."""
    ctx.emulator.scale_messages(message_bytes, x.chunk(m)[0].nbytes)
    out = {}
    for name, costs in runs:
        schedule = make_schedule(name, ctx.world_size, m)
        stages = split_model(model, schedule.num_stages)
        modules = {s: stages[s] for s in range(schedule.num_stages) if schedule.rank_of(s) == ctx.rank}
        specs = message_specs(stages, x, m)

        ctx.emulator.use(stage_table(costs))  # each stage's spans last its modelled seconds

        def step(i):
            p2p = P2P(ctx, schedule, specs)
            runner = StageRunner(ctx, schedule, modules, torch.nn.MSELoss(), p2p, list(x.chunk(m)),
                                 list(y.chunk(m)))
            for action in schedule.actions[ctx.rank]:
                runner.run(action)
            p2p.finish()

        def zero_grads(i):
            for module in modules.values():
                module.zero_grad(set_to_none=True)

        timed = measure.time_steps(ctx, step, steps, prepare=zero_grads)
        grads = {s: [p.grad for p in mod.parameters()] for s, mod in modules.items()}
        out[name] = (timed.seconds, timed.timelines, grads)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", default="4xH100-nvlink")
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch at the emulated size")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    node, m = parse_node(args.node), args.num_microbatches

    torch.manual_seed(0)
    model = models.mlp([SMALL] * (args.layers + 1))
    x, y = torch.randn(4 * m, SMALL), torch.randn(4 * m, SMALL)
    want = list(reference_run(model, x, y, torch.nn.MSELoss(), lr=None).grads.values())
    message_bytes = args.rows * args.width * 4  # one activation (or gradient) at the emulated size
    transfer = message_seconds(message_bytes, node.link)

    rows, figures = [], {}
    for p in (2, 4):
        costs = {name: stage_costs(node, make_schedule(name, p, m).num_stages, args.width, args.layers, args.rows)
                 for name in SCHEDULES}
        results = spawn(pipeline_steps, p, list(costs.items()), model, x, y, m, args.steps, message_bytes,
                        emulate=node)
        for name in SCHEDULES:
            schedule = make_schedule(name, p, m)
            by_stage = {s: g for rank in results for s, g in rank[name][2].items()}
            for got, w in zip([g for s in sorted(by_stage) for g in by_stage[s]], want, strict=True):
                torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)  # the same math as one process
            step = max(rank[name][0][-1] for rank in results)  # the slowest rank's last step
            timeline = Timeline.merge(rank[name][1][-1] for rank in results).filter(lane="compute")
            per_stage = {s: (1e3 * c["F"], 1e3 * c["I"], 1e3 * c["W"]) for s, c in costs[name].items()}
            sim = simulate(schedule, Costs(transfer=1e3 * transfer, per_stage=per_stage))
            ratio, bubble = step * 1e3 / sim.makespan_ms, timeline.bubble_fraction()
            key = f"{name.replace('-', '')}_p{p}"
            figures[f"{key}_ratio"] = round(ratio, 4)
            figures[f"{key}_bubble"] = round(bubble, 4)
            figures[f"{key}_simulated_bubble"] = round(sim.bubble_fraction, 4)
            rows.append({"schedule": name, "p": p, "emulated ms": f"{step * 1e3:.3f}",
                         "simulated ms": f"{sim.makespan_ms:.3f}", "ratio": f"{ratio:.3f}",
                         "bubble": f"{bubble:.3f}", "simulated bubble": f"{sim.bubble_fraction:.3f}",
                         "gap": f"{bubble - sim.bubble_fraction:+.3f}"})
    figures["max_ratio"] = max(v for k, v in figures.items() if k.endswith("_ratio"))
    figures["max_bubble_gap"] = round(max(abs(figures[k] - figures[k.replace("_bubble", "_simulated_bubble")])
                                          for k in figures if k.endswith("_bubble") and "simulated" not in k), 4)
    print(f"{node}: MLP {args.layers} x {args.width}, {args.rows} rows per micro-batch, m={m}; "
          f"messages of {message_bytes / 1e6:g} MB, {transfer * 1e6:.2f} us each; emulated step (logical "
          "clock) over the simulated makespan")
    print(format_table(rows))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

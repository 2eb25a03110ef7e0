"""Our GPipe and 1F1B against torch.distributed.pipelining's, same model, data and ranks.

    python benchmarks/pipeline.py [--ranks 2] [--microbatches 8] [--width 1024] [--layers 8]
                                  [--batch 256] [--steps 5] [--rounds 3]

Both run in this one invocation, alternating rounds so that a busy machine slows both alike.
Prints a table, then, as its last line, one JSON object with: step time ratio ours / torch per
schedule (below 1.0: ours is faster), and our measured bubble against (p-1)/(m+p-1) (torch's
bubble, measured from its F/B calls, and the simulated bubble with our measured per-stage costs
beside it).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from pipelab import hardware, models
from pipelab.display import format_table
from pipelab.experiments.pipeline import run_pipelines, run_torch_pipelines
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, gpipe_bubble, simulate
from pipelab.reference import assert_same, reference_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="steps per round; the first warms up")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of ours and torch's")
    args = parser.parse_args()
    print(hardware.describe())

    torch.manual_seed(0)
    model = models.mlp([args.width] * (args.layers + 1))
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    loss_fn = torch.nn.MSELoss()
    stages = split_model(model, args.ranks)
    p, m = args.ranks, args.microbatches
    schedules = [make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)]
    reference = reference_run(torch.nn.Sequential(*stages), x, y, loss_fn, lr=None)

    times: dict[tuple[str, str], list[float]] = {}
    bubbles: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        ours = run_pipelines(stages, schedules, x, y, loss_fn, steps=args.steps)
        theirs = run_torch_pipelines(stages, schedules, x, y, loss_fn, steps=args.steps)
        for a, b in zip(ours, theirs):
            assert_same(a, reference, atol=1e-4, rtol=1e-4)
            assert abs(a.loss - b.loss) <= 1e-5 * max(1.0, abs(b.loss))
            times.setdefault((a.schedule.name, "ours"), []).append(a.step_time)
            times.setdefault((a.schedule.name, "torch"), []).append(b.step_time)
            bubbles.setdefault((a.schedule.name, "ours"), []).append(a.bubble_fraction)
            bubbles.setdefault((a.schedule.name, "torch"), []).append(b.bubble_fraction)
            # The ideal bubble of this schedule with each stage's measured costs: unequal stages included.
            fitted = simulate(a.schedule, Costs.from_timeline(a.timeline, per_stage=True))
            bubbles.setdefault((a.schedule.name, "simulated"), []).append(fitted.bubble_fraction)

    formula = gpipe_bubble(p, m)
    rows, figures = [], {"p": p, "m": m, "bubble_formula": round(formula, 4)}
    for s in schedules:
        ours_ms = 1e3 * statistics.median(times[s.name, "ours"])
        torch_ms = 1e3 * statistics.median(times[s.name, "torch"])
        bubble = statistics.median(bubbles[s.name, "ours"])
        torch_bubble = statistics.median(bubbles[s.name, "torch"])
        simulated = statistics.median(bubbles[s.name, "simulated"])
        rows.append({"schedule": s.name, "ours_ms": round(ours_ms, 2), "torch_ms": round(torch_ms, 2),
                     "ratio": round(ours_ms / torch_ms, 3), "bubble": round(bubble, 3),
                     "torch bubble": round(torch_bubble, 3), "simulated": round(simulated, 3),
                     "formula": round(formula, 3),
                     "bubble-formula": round(bubble - formula, 3)})
        key = s.name.lower()
        figures[f"{key}_ratio"] = round(ours_ms / torch_ms, 3)
        figures[f"{key}_ours_ms"] = round(ours_ms, 2)
        figures[f"{key}_torch_ms"] = round(torch_ms, 2)
        figures[f"{key}_bubble"] = round(bubble, 4)
        figures[f"{key}_torch_bubble"] = round(torch_bubble, 4)
        figures[f"{key}_simulated_bubble"] = round(simulated, 4)
        figures[f"{key}_bubble_minus_formula"] = round(bubble - formula, 4)
    print(f"p={p} ranks, m={m} micro-batches, MLP {args.layers} x {args.width}, batch {args.batch}; "
          f"median of {args.rounds} rounds x {args.steps - 1} measured steps")
    print(format_table(rows))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

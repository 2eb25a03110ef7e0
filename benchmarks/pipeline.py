"""Our GPipe and 1F1B against torch.distributed.pipelining's, same model, data and ranks.

    python benchmarks/pipeline.py [--ranks 2] [--num-microbatches 8] [--width 1024] [--layers 8]
                                  [--batch 256] [--steps 5] [--rounds 5]

Ours and torch's run in alternation, round by round (ours, torch, ours, torch, ...:
`measure.alternate`), so a load that comes and goes on the machine slows both alike; the ratio
ours / torch is taken round by round (`measure.ratios`) and reported as its median with the min and
max over the rounds. Prints a table, then, as its last line, one JSON object with, per schedule:
the step time ratio ours / torch (below 1.0: ours is faster) and its `_low`/`_high`, both step
times, and our measured bubble against (p-1)/(m+p-1), torch's bubble (measured from its F/B calls)
and the bubble simulated with our measured per-stage costs, each with its `_low`/`_high`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from pipelab import hardware, measure, models
from pipelab.display import format_table
from pipelab.experiments import pipeline
from pipelab.measure import Measured
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import gpipe_bubble
from pipelab.reference import assert_same


def pooled(measurements) -> Measured:
    """All repeats of several rounds as one measurement."""
    return Measured.of(v for m in measurements for v in m.values)


def spread(figures: dict, name: str, value: Measured, digits: int) -> None:
    """Record a figure as its median under `name`, and its min and max as `name_low`, `name_high`."""
    figures[name] = round(value.median, digits)
    figures[f"{name}_low"], figures[f"{name}_high"] = round(value.low, digits), round(value.high, digits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="steps per round; the first warms up")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of ours and torch's")
    args = parser.parse_args()
    print(hardware.describe())

    torch.manual_seed(0)
    model = models.mlp([args.width] * (args.layers + 1))
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    loss_fn = torch.nn.MSELoss()
    stages = split_model(model, args.ranks)
    p, m = args.ranks, args.num_microbatches
    schedules = [make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)]
    ours_cfg = pipeline.Config(world_size=p, stages=stages, schedules=schedules, x=x, y=y, loss_fn=loss_fn,
                               steps=args.steps)
    configs = {"ours": ours_cfg, "torch": dataclasses.replace(ours_cfg, engine="torch")}
    reference = pipeline.reference(ours_cfg)[0]  # one process; both schedules run the same batch

    runs: dict[str, list] = {"ours": [], "torch": []}  # per side, per round: one run per schedule

    def side(name: str):
        def one_round() -> float:
            result = pipeline.run(configs[name])
            runs[name].append(result)
            return sum(r.step_time.median for r in result)
        return one_round

    measure.alternate({name: side(name) for name in configs},
                      args.rounds, warmup=0)  # every round starts fresh processes and drops its first step
    for ours, theirs in zip(runs["ours"], runs["torch"]):
        for a, b in zip(ours, theirs):
            assert_same(a, reference, atol=1e-4, rtol=1e-4)
            assert abs(a.loss - b.loss) <= 1e-5 * max(1.0, abs(b.loss))
            torch.testing.assert_close(a.mb_losses, b.mb_losses)  # micro-batch by micro-batch

    formula = gpipe_bubble(p, m)
    rows, figures = [], {"p": p, "m": m, "rounds": args.rounds, "bubble_formula": round(formula, 4)}
    for i, s in enumerate(schedules):
        ours = [r[i] for r in runs["ours"]]
        theirs = [r[i] for r in runs["torch"]]
        ratio = measure.ratios([r.step_time.median for r in ours], [r.step_time.median for r in theirs])
        ours_ms = Measured.of(r.step_time.median for r in ours).scaled(1e3)
        torch_ms = Measured.of(r.step_time.median for r in theirs).scaled(1e3)
        bubble, torch_bubble = pipeline.pooled_bubble(ours), pipeline.pooled_bubble(theirs)
        simulated = pooled(r.simulated_bubble for r in ours)
        rows.append({"schedule": s.name, "ours_ms": f"{ours_ms:.1f}", "torch_ms": f"{torch_ms:.1f}",
                     "ratio": f"{ratio:.3f}", "bubble": f"{bubble:.3f}", "torch bubble": f"{torch_bubble:.3f}",
                     "simulated": f"{simulated:.3f}", "formula": round(formula, 3),
                     "bubble-formula": round(bubble.median - formula, 3)})
        key = s.name.lower()
        spread(figures, f"{key}_ratio", ratio, 3)
        spread(figures, f"{key}_ours_ms", ours_ms, 2)
        spread(figures, f"{key}_torch_ms", torch_ms, 2)
        spread(figures, f"{key}_bubble", bubble, 4)
        spread(figures, f"{key}_torch_bubble", torch_bubble, 4)
        spread(figures, f"{key}_simulated_bubble", simulated, 4)
        figures[f"{key}_bubble_minus_formula"] = round(bubble.median - formula, 4)
    print(f"p={p} ranks, m={m} micro-batches, MLP {args.layers} x {args.width}, batch {args.batch}; "
          f"{args.rounds} alternating rounds x {args.steps - 1} measured steps; median (min-max): "
          "step times and ratios over the rounds, bubbles over every measured step")
    print(format_table(rows))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

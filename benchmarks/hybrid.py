"""The pipe x data grid against one pipeline and against pure data parallelism, same processes.

    python benchmarks/hybrid.py [--pipe 2] [--data 2] [--num-microbatches 4] [--schedule 1f1b]
                                [--width 1024] [--layers 8] [--batch 256] [--steps 5] [--rounds 3]
                                [--emulate auto|NODE] [--emulated-scale 64]

An MLP of `layers` Linear layers of `width` on `pipe x data` processes, laid out three ways in one
set of processes: one pipeline of `pipe x data` stages on the whole batch, the grid (`data`
pipelines of `pipe` stages, each stage's gradients all-reduced over its copies from the moment its
last backward is done), and pure data parallelism (every process the whole model). The layouts
alternate round by round (`measure.alternate`: A B C A B C ...) so that a load that comes and goes
slows them all alike; a step time is the slowest process's, a round's figure the median of its
timed steps. Every layout is first checked against one process (losses, gradients, weights after
the SGD steps).

Prints a table, then, as its last line, one JSON object: the grid's step time against one pipeline
and against pure data parallelism (below 1.0: the grid is faster) as the median of the round-by-
round ratios with their min and max (`measure.ratios`), and the share of the grid's data-parallel
all-reduce time (from the last copy's launch to arrival) during which some process still computed,
i.e. hidden behind pipeline compute (median of the timed steps, with the lowest and highest), beside
the share the schedule would hide on one device per process, simulated with the measured costs.

With `--emulate auto` (pipe x data H100s where this machine lacks them) or a node name such as
`4xH100-pcie4`, the same processes run on an emulated node: every F, B, message and all-reduce
lasts what the device and link models give at `--emulated-scale` times the width and the batch
(the logical clock: every round alike, whatever the load).
"""

from __future__ import annotations

import argparse
import json

import torch

from pipelab import experiments, hardware, models
from pipelab.display import format_table
from pipelab.emulate import Emulated
from pipelab.experiments import grid as experiment
from pipelab.measure import ratios
from pipelab.reference import assert_same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipe", type=int, default=2)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the layouts alternating")
    parser.add_argument("--emulate", default=None, help="'auto' or a node such as 4xH100-nvlink (default: this machine)")
    parser.add_argument("--emulated-scale", type=int, default=64, help="emulated width and batch / real ones")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = models.mlp([args.width] * (args.layers + 1))
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    node = hardware.lesson_node(args.pipe * args.data, args.emulate) if args.emulate else None
    cfg = experiment.Config(model=model, x=x, y=y, layouts=experiment.layouts_of(args.pipe, args.data, args.num_microbatches),
                            schedule=args.schedule, steps=args.steps, rounds=args.rounds, timeout=900,
                            emulate=Emulated(node, scale=args.emulated_scale) if node else None)
    world = cfg.world_size
    print(hardware.describe(world, node, size=cfg.widened.describe(model, args.batch) if node else None))
    runs = experiments.run(experiment.worker, cfg, experiment.gather)
    worst = 0.0
    for run in runs:
        worst = max(worst, assert_same(run, experiment.reference(cfg), atol=1e-5, rtol=1e-4))
    prediction = experiment.predict(cfg)
    device, devices = prediction.device, prediction.here

    one_pipe, grid, dp = runs
    print(f"{world} processes, MLP {args.layers} x {args.width}, batch {args.batch}, {args.schedule}, "
          f"m={args.num_microbatches}; {args.rounds} alternating rounds x {args.steps} timed steps; every layout matches "
          f"one process (largest gradient difference {worst:.1e}); one {device} forward+backward of the whole "
          f"batch: {prediction.one_device * 1e3:.1f} ms")
    print(format_table([{"layout": r.name, "step_ms": round(r.step_time.median * 1e3, 1),
                         "fastest_ms": round(r.step_time.low * 1e3, 1), "slowest_ms": round(r.step_time.high * 1e3, 1),
                         "grid_vs_this": f"{ratios(grid.round_times, r.round_times):.3f}",
                         f"predicted_ms_{devices}_{device}": round(prediction.seconds(r.layout) * 1e3, 1),
                         f"predicted_ms_{world}_gpus": round(prediction.seconds(r.layout, world) * 1e3, 1),
                         "hidden_allreduce": round(r.overlap.median, 3)} for r in runs]))
    hidden = grid.overlap
    vs_pipe, vs_dp = ratios(grid.round_times, one_pipe.round_times), ratios(grid.round_times, dp.round_times)
    figures = {
        "world_size": world, "pipe": args.pipe, "data": args.data, "num_microbatches": args.num_microbatches,
        "schedule": args.schedule, "emulate": cfg.node_name, "grid_ms": round(grid.step_time.median * 1e3, 2),
        "one_pipeline_ms": round(one_pipe.step_time.median * 1e3, 2), "data_parallel_ms": round(dp.step_time.median * 1e3, 2),
        "rounds": args.rounds,
        "grid_vs_one_pipeline": round(vs_pipe.median, 3), "grid_vs_one_pipeline_min": round(vs_pipe.low, 3),
        "grid_vs_one_pipeline_max": round(vs_pipe.high, 3),
        "grid_vs_data_parallel": round(vs_dp.median, 3), "grid_vs_data_parallel_min": round(vs_dp.low, 3),
        "grid_vs_data_parallel_max": round(vs_dp.high, 3),
        "allreduce_hidden": round(hidden.median, 3), "allreduce_hidden_min": round(hidden.low, 3),
        "allreduce_hidden_max": round(hidden.high, 3),
        "allreduce_hidden_simulated": round(grid.simulated_overlap(), 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

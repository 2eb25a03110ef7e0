"""Our BucketedDDP against torch's DistributedDataParallel: same model, data, ranks and bucket size.

    python benchmarks/ddp.py [--ranks 2] [--width 1024] [--layers 10] [--batch 128]
                             [--bucket-cap-mb 8 25] [--steps 3] [--rounds 5]

An MLP of about 10M parameters (10 Linear layers of 1024 x 1024, 40 MiB of gradients). Our
gradients are first checked against one process. Then both wrappers train in one set of
processes, in turn (ours, torch's, ours, torch's, ... `measure.alternate`), `--steps` timed steps
each per round, so that a load that comes and goes hits both alike. A step time is the slowest
rank's; a round's figure is its median step. Each round gives one ratio ours / torch, and we
report the median of those ratios with their min and max.

Prints a table, then, as its last line, one JSON object: the ratio ours / torch (below 1.0: ours
is faster; median over rounds, with `ratio_vs_torch_low` and `_high` its min and max) and the
fraction of our all-reduce time hidden behind compute (median over timed steps), at the first bucket size given (8 MiB:
5 buckets), and the same figures at the others (torch's default of
25 MiB makes only 2 buckets of this model, and the last, 40% of the bytes, can only leave after
backward, which caps the overlap near one half).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from pipelab import experiments, hardware, models
from pipelab.experiments import bucket_sweep, ddp
from pipelab.reference import assert_same, reference_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128, help="the whole batch, split over the ranks")
    parser.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[8.0, 25.0],
                        help="bucket sizes in MiB; the first one gives the headline figures")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per wrapper and round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of ours and torch's")
    args = parser.parse_args()
    print(hardware.describe(args.ranks))

    torch.manual_seed(0)
    model = models.mlp([args.width] * (args.layers + 1))
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    params = sum(p.numel() for p in model.parameters())

    check = ddp.Config(model=model, x=x, y=y, world_size=args.ranks, variants=["bucketed"],
                       bucket_cap_mb=args.bucket_cap_mb[0], steps=1, timeout=300)
    sweep = bucket_sweep.Config(model=model, x=x, y=y, world_size=args.ranks, caps_mb=args.bucket_cap_mb,
                                steps=args.steps, rounds=args.rounds, timeout=600)  # both checked before any rank starts
    reference = reference_run(model, x, y, nn.MSELoss(), steps=1, lr=0.1)
    worst = assert_same(experiments.run(ddp.worker, check, ddp.gather)["bucketed"], reference, atol=1e-5, rtol=1e-4)

    points = experiments.run(bucket_sweep.worker, sweep, bucket_sweep.gather)
    print(f"{args.ranks} ranks, MLP {args.layers} x {args.width} ({params / 1e6:.1f}M parameters, "
          f"{params * 4 / 2**20:.0f} MiB of gradients), batch {args.batch}; {args.rounds} rounds x "
          f"{args.steps} timed steps, ours and torch's in turn; gradients match one process (largest "
          f"difference {worst:.1e})")
    print("step times: median (min-max) over every timed step; ratio: median (min-max) over rounds")
    print(f"{'bucket_cap_mb':>13} {'buckets':>7} {'ours (ms)':>20} {'torch (ms)':>20} {'ours / torch':>20} "
          f"{'overlap':>7}")
    for p in points:
        print(f"{p.bucket_cap_mb:>13g} {p.num_buckets:>7} {format(p.step_time.scaled(1e3), '.1f'):>20} "
              f"{format(p.torch_step_time.scaled(1e3), '.1f'):>20} {format(p.ratio, '.3f'):>20} "
              f"{p.overlap.median:>7.2f}")
    main_point = points[0]
    figures = {
        "world_size": args.ranks, "params_M": round(params / 1e6, 2), "bucket_cap_mb": main_point.bucket_cap_mb,
        "buckets": main_point.num_buckets, "ours_ms": round(main_point.step_time.median * 1e3, 2),
        "torch_ms": round(main_point.torch_step_time.median * 1e3, 2),
        "ratio_vs_torch": round(main_point.ratio.median, 3),
        "ratio_vs_torch_low": round(main_point.ratio.low, 3), "ratio_vs_torch_high": round(main_point.ratio.high, 3),
        "rounds": args.rounds, "overlap": round(main_point.overlap.median, 3),
    }
    for p in points[1:]:
        at = f"at_{p.bucket_cap_mb:g}mb"
        figures[f"ratio_vs_torch_{at}"] = round(p.ratio.median, 3)
        figures[f"ratio_vs_torch_low_{at}"] = round(p.ratio.low, 3)
        figures[f"ratio_vs_torch_high_{at}"] = round(p.ratio.high, 3)
        figures[f"overlap_{at}"] = round(p.overlap.median, 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

"""Our ZeRO-3 against torch's FSDP2 `fully_shard`: same model, data, ranks and optimizer.

    python benchmarks/sharding.py [--ranks 2] [--width 512] [--layers 8] [--batch 64]
                                  [--steps 3] [--rounds 5] [--ours zero3] [--theirs fully_shard]

An MLP of `--layers` Linear layers of width x width, trained with Adam; every Linear is one unit
of sharding on both sides (ours: `pipelab.sharding.Zero3` with prefetch; theirs: `fully_shard` on
every Linear and on the model, reshard_after_forward=True). Both are first checked against one
process (losses and weights after 2 Adam steps). Then both train in one set of processes, in turn
(ours, theirs, ours, ... `measure.alternate`), `--steps` timed steps each per round, so a load
that comes and goes hits both alike. A step time is the slowest rank's; a round's figure is its
median step; each round gives one ratio ours / theirs, reported as the median with min and max.

Peak bytes per rank: the most parameters, gradients and optimizer state a rank held at any
layer boundary (`sharding.memory.PeakMeter`, the same sampling for both; activations and
communication buffers are not counted).

Prints a table, then, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from pipelab import experiments, hardware, models
from pipelab.display import human_bytes
from pipelab.experiments import sharding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="the whole batch, split over the ranks")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of ours and theirs")
    parser.add_argument("--ours", default="zero3", choices=sharding.OURS)
    parser.add_argument("--theirs", default="fully_shard", choices=sharding.TORCH)
    args = parser.parse_args()
    print(hardware.describe(args.ranks))

    torch.manual_seed(0)
    model = models.mlp([args.width] * (args.layers + 1))
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    check = sharding.Config(model=model, x=x, y=y, world_size=args.ranks, variants=(args.ours, args.theirs),
                            steps=2, timeout=600)
    worst = sharding.assert_same(experiments.run(sharding.worker, check, sharding.gather), sharding.reference(check))

    cfg = sharding.RaceConfig(model=model, x=x, y=y, world_size=args.ranks, variants=(args.ours, args.theirs),
                              steps=args.steps, rounds=args.rounds, timeout=600)
    race = experiments.run(sharding.race_worker, cfg, sharding.race_gather)
    psi = cfg.psi
    print(f"{args.ranks} ranks, MLP {args.layers} x {args.width} ({psi / 1e6:.2f}M parameters), batch {args.batch}, "
          f"Adam; {args.rounds} rounds x {args.steps} timed steps, in turn; both equal one process (largest "
          f"weight difference {max(worst.values()):.1e})")
    print("step: median (min-max) over every timed step; ratio: median (min-max) over rounds; "
          f"formula: ZeRO-3's 16Ψ/N = {human_bytes(16 * psi / args.ranks)}")
    print(f"{'variant':>48} {'step (ms)':>22} {'peak bytes per rank':>20}")
    for v in cfg.variants:
        print(f"{sharding.LABEL[v]:>48} {format(race.step_time[v].scaled(1e3), '.1f'):>22} "
              f"{human_bytes(race.peak[v]):>20}")
    print(f"{'ours / theirs, round by round':>48} {format(race.ratio, '.3f'):>22} "
          f"{race.peak[args.ours] / race.peak[args.theirs]:>20.3f}")
    print(json.dumps({
        "world_size": args.ranks, "params_M": round(psi / 1e6, 3), "ours": args.ours, "theirs": args.theirs,
        "ours_ms": round(race.step_time[args.ours].median * 1e3, 2),
        "theirs_ms": round(race.step_time[args.theirs].median * 1e3, 2),
        "ratio": round(race.ratio.median, 3), "ratio_low": round(race.ratio.low, 3),
        "ratio_high": round(race.ratio.high, 3), "rounds": args.rounds,
        "peak_bytes_ours": int(race.peak[args.ours]), "peak_bytes_theirs": int(race.peak[args.theirs]),
        "peak_ratio": round(race.peak[args.ours] / race.peak[args.theirs], 3),
        "formula_bytes": int(16 * psi / args.ranks), "max_weight_difference": max(worst.values()),
    }))


if __name__ == "__main__":
    main()

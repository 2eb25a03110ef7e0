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
import statistics
from functools import partial

import torch

from pipelab import experiments, hardware, models
from pipelab.display import human_bytes
from pipelab.experiments import sharding
from pipelab.measure import Measured, alternate, ratios, time_steps
from pipelab.sharding.memory import PeakMeter


def race_worker(ctx, cfg: sharding.Config, rounds: int) -> tuple[dict, dict, dict]:
    """Both variants built side by side, a warm-up round, then `rounds` rounds of `cfg.steps` timed
    steps of each in turn (`measure.alternate`); a `PeakMeter` samples each one's bytes at every
    layer boundary. Returns each variant's median step per round, its timed steps, its peak bytes."""
    x = cfg.x.chunk(ctx.world_size)[ctx.rank].to(ctx.device)
    y = cfg.y.chunk(ctx.world_size)[ctx.rank].to(ctx.device)
    trainers = {v: sharding.trainer(ctx, cfg, v, cfg.build().to(ctx.device)) for v in cfg.variants}
    meters = {v: PeakMeter(t.model, t.optimizer, getattr(t, "full", ())) for v, t in trainers.items()}
    seconds: dict[str, list[float]] = {v: [] for v in cfg.variants}

    def one_round(v: str) -> float:
        def step(i: int) -> float:
            loss = trainers[v].step(x, y, cfg.loss_fn)
            meters[v].sample()  # after the step too: gradients and optimizer state all there
            return loss
        got = time_steps(ctx, step, cfg.steps, warmup=0)
        seconds[v] += got.seconds
        return statistics.median(got.seconds)

    per_round = alternate({v: partial(one_round, v) for v in cfg.variants}, rounds, warmup=1)
    return per_round, {v: s[-rounds * cfg.steps:] for v, s in seconds.items()}, {v: m.peak for v, m in meters.items()}


def race(cfg: sharding.Config, rounds: int) -> tuple[dict, Measured, dict]:
    """Each variant's step times (the slowest rank's), the per-round ratio first / second (each
    round's median steps, slowest rank), and each one's peak bytes (the fullest rank)."""
    results = experiments.run(partial(race_worker, rounds=rounds), cfg)
    a, b = cfg.variants
    slowest = {v: [max(r) for r in zip(*(res[0][v] for res in results))] for v in cfg.variants}
    steps = {v: Measured.of(max(s) for s in zip(*(res[1][v] for res in results))) for v in cfg.variants}
    return steps, ratios(slowest[a], slowest[b]), {v: max(res[2][v] for res in results) for v in cfg.variants}


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

    cfg = sharding.Config(model=model, x=x, y=y, world_size=args.ranks, variants=(args.ours, args.theirs),
                          steps=args.steps, timeout=600)
    step_time, ratio, peak = race(cfg, args.rounds)
    psi = cfg.psi
    print(f"{args.ranks} ranks, MLP {args.layers} x {args.width} ({psi / 1e6:.2f}M parameters), batch {args.batch}, "
          f"Adam; {args.rounds} rounds x {args.steps} timed steps, in turn; both equal one process (largest "
          f"weight difference {max(worst.values()):.1e})")
    print("step: median (min-max) over every timed step; ratio: median (min-max) over rounds; "
          f"formula: ZeRO-3's 16Ψ/N = {human_bytes(16 * psi / args.ranks)}")
    print(f"{'variant':>48} {'step (ms)':>22} {'peak bytes per rank':>20}")
    for v in cfg.variants:
        print(f"{sharding.LABEL[v]:>48} {format(step_time[v].scaled(1e3), '.1f'):>22} "
              f"{human_bytes(peak[v]):>20}")
    print(f"{'ours / theirs, round by round':>48} {format(ratio, '.3f'):>22} "
          f"{peak[args.ours] / peak[args.theirs]:>20.3f}")
    print(json.dumps({
        "world_size": args.ranks, "params_M": round(psi / 1e6, 3), "ours": args.ours, "theirs": args.theirs,
        "ours_ms": round(step_time[args.ours].median * 1e3, 2),
        "theirs_ms": round(step_time[args.theirs].median * 1e3, 2),
        "ratio": round(ratio.median, 3), "ratio_low": round(ratio.low, 3),
        "ratio_high": round(ratio.high, 3), "rounds": args.rounds,
        "peak_bytes_ours": int(peak[args.ours]), "peak_bytes_theirs": int(peak[args.theirs]),
        "peak_ratio": round(peak[args.ours] / peak[args.theirs], 3),
        "formula_bytes": int(16 * psi / args.ranks), "max_weight_difference": max(worst.values()),
    }))


if __name__ == "__main__":
    main()

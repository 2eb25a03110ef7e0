"""Lesson 10's Transformer LM: tokens/s of the pipe x data grid against one process, same machine.

    python benchmarks/lm.py [--pipe 2] [--data 2] [--num-microbatches 2] [--schedule 1f1b]
                            [--emsize 64] [--nhid 128] [--nlayers 4] [--batches 100] [--repeats 3]
                            [--emulate 4xH100-nvlink]

Each round trains `batches` windows of the built-in corpus (Python's documentation) on the grid
(its tokens/s: the median over its log intervals, the first dropped) and then the same number of
steps of the whole model in this process on one thread (as a worker runs); rounds alternate the
two (A B A B ...), so a load that comes and goes hits both alike. The grid's first losses are
checked against one process's. Prints a table, then, as its last line, one JSON object: the
median tokens/s of both and the median round-by-round ratio with its min-max (above 1.0: the
grid is faster).

With `--emulate NODE` the grid runs once on that emulated node (its clocks modelled at the lesson's
emulated size, `capstone.Config.SIZE`) and the baseline is one emulated device's modelled
step: both deterministic, so there is one round and no spread.
"""

from __future__ import annotations

import argparse
import json

import torch

from pipelab import hardware
from pipelab.data import load_corpus
from pipelab.display import format_table
from pipelab.experiments.capstone import Config, emulated_size, train
from pipelab.experiments.capstone_verdicts import LOSS_TOLERANCE, baseline_tokens_per_second, one_process_rates
from pipelab.lm_training import single_process_losses
from pipelab.measure import Measured, alternate, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipe", type=int, default=2)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--emsize", type=int, default=64)
    parser.add_argument("--nhid", type=int, default=128)
    parser.add_argument("--nlayers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=100, help="training windows timed on each side, per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of grid then one process")
    parser.add_argument("--emulate", default=None, help="an emulated node, e.g. 4xH100-nvlink (modelled time)")
    args = parser.parse_args()
    cfg = Config(emsize=args.emsize, nhid=args.nhid, nlayers=args.nlayers, pipe=args.pipe, data=args.data,
                 num_microbatches=args.num_microbatches, schedule=args.schedule, max_batches=args.batches,
                 log_interval=max(1, args.batches // 5), timeout=900, emulate=args.emulate)
    print(hardware.describe(cfg.world_size, args.emulate, size=emulated_size(cfg) if args.emulate else None))
    corpus = load_corpus()
    if args.emulate:
        emulated(cfg, corpus)
        return
    first_losses = []

    def grid() -> float:
        run = train(cfg, corpus, progress=False)
        first_losses.append(run.losses[:3])
        return run.tokens_per_second.median

    figures = alternate({"grid": grid, "one": lambda: one_process_rates(corpus, cfg, args.batches, 1)[0]},
                        repeats=args.repeats, warmup=0)
    want = single_process_losses(corpus, cfg, 3)
    for losses in first_losses:
        torch.testing.assert_close(losses, want, atol=LOSS_TOLERANCE, rtol=1e-5)
    grid_rate, one_rate = Measured.of(figures["grid"]), Measured.of(figures["one"])
    speedup = ratios(figures["grid"], figures["one"])
    rows = [{"run": f"grid {args.pipe} x {args.data}, {args.schedule}", "tokens/s (median, min-max)": f"{grid_rate:,.0f}"},
            {"run": "one process, one thread", "tokens/s (median, min-max)": f"{one_rate:,.0f}"},
            {"run": "grid / one process, per round", "tokens/s (median, min-max)": f"{speedup:.3f}"}]
    print(format_table(rows))
    print(json.dumps({"grid_tokens_per_s": round(grid_rate.median, 1), "one_process_tokens_per_s": round(one_rate.median, 1),
                      "speedup": round(speedup.median, 3), "speedup_min": round(speedup.low, 3),
                      "speedup_max": round(speedup.high, 3), "repeats": args.repeats, "pipe": args.pipe,
                      "data": args.data, "schedule": args.schedule}))


def emulated(cfg: Config, corpus) -> None:
    """One grid run on the emulated node against one emulated device: modelled, so one round."""
    run = train(cfg, corpus, progress=False)
    torch.testing.assert_close(run.losses[:3], single_process_losses(corpus, cfg, 3), atol=LOSS_TOLERANCE, rtol=1e-5)
    grid, one = run.tokens_per_second.median, baseline_tokens_per_second(corpus, cfg).median
    print(format_table([{"run": f"grid {cfg.pipe} x {cfg.data}, {cfg.schedule} ({cfg.emulate})", "tokens/s": f"{grid:,.0f}"},
                        {"run": "one emulated device", "tokens/s": f"{one:,.0f}"}]))
    print(json.dumps({"grid_tokens_per_s": round(grid, 1), "one_device_tokens_per_s": round(one, 1),
                      "speedup": round(grid / one, 3), "emulate": cfg.emulate, "pipe": cfg.pipe, "data": cfg.data,
                      "schedule": cfg.schedule}))


if __name__ == "__main__":
    main()

"""Lesson 10's Transformer LM: tokens/s of the pipe x data grid against one process, same machine.

    python benchmarks/lm.py [--pipe 2] [--data 2] [--microbatches 2] [--schedule 1f1b]
                            [--emsize 64] [--nhid 128] [--nlayers 4] [--batches 100]

Trains `batches` windows of the built-in corpus (Python's documentation) on the grid, checks that
its first losses equal one process's, then times the same number of steps of the whole model in
this process on one thread (as a worker runs). Prints a table, then, as its last line, one JSON
object: tokens/s of both and their ratio (above 1.0: the grid is faster).
"""

from __future__ import annotations

import argparse
import json

import torch

from pipelab import hardware
from pipelab.data import load_corpus
from pipelab.display import format_table
from pipelab.experiments.capstone import LMConfig, single_process_losses, train_lm, train_one_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipe", type=int, default=2)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--emsize", type=int, default=64)
    parser.add_argument("--nhid", type=int, default=128)
    parser.add_argument("--nlayers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=100, help="training windows timed on each side")
    args = parser.parse_args()
    print(hardware.describe(args.pipe * args.data))

    corpus = load_corpus()
    cfg = LMConfig(emsize=args.emsize, nhid=args.nhid, nlayers=args.nlayers, pipe=args.pipe, data=args.data,
                   microbatches=args.microbatches, schedule=args.schedule, max_batches=args.batches,
                   log_interval=args.batches)
    run = train_lm(corpus, cfg, timeout=900)
    torch.testing.assert_close(run.losses[:3], single_process_losses(corpus, cfg, 3), atol=1e-4, rtol=1e-5)
    one = train_one_process(corpus, cfg, len(run.losses))
    rows = [{"run": f"grid {args.pipe} x {args.data}, {args.schedule}", "tokens/s": round(run.tokens_per_second)},
            {"run": "one process, one thread", "tokens/s": round(one)}]
    print(format_table(rows))
    print(json.dumps({"grid_tokens_per_s": round(run.tokens_per_second, 1), "one_process_tokens_per_s": round(one, 1),
                      "speedup": round(run.tokens_per_second / one, 3), "pipe": args.pipe, "data": args.data,
                      "schedule": args.schedule}))


if __name__ == "__main__":
    main()

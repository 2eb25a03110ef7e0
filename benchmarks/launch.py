"""How long does `spawn` take to start workers, join the process group and return?

    python benchmarks/launch.py [--world-size 2] [--repeats 5]

Times an empty worker end to end (process start, imports, process-group rendezvous, result back),
the price every multi-process lesson pays per call, both ways a rank can start: forked from
pipelab's worker server (torch imported once; the default on Linux without CUDA GPUs) and as a
fresh Python process (PIPELAB_FRESH_WORKERS=1). The first forked call, which starts the server, is
left out. The last line is a JSON object with the ratio, measured in this run.
"""

import argparse
import json
import os
import time

from pipelab.launch import spawn
from pipelab.measure import median_spread
from pipelab.worker import RankContext


def empty_worker(ctx: RankContext) -> int:
    return ctx.rank


def time_calls(world_size: int, repeats: int, fresh: bool) -> list[float]:
    os.environ["PIPELAB_FRESH_WORKERS"] = "1" if fresh else "0"
    spawn(empty_worker, world_size)  # warm-up: starts the server when ranks are forked
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert spawn(empty_worker, world_size) == list(range(world_size))
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    result = {"world_size": ns.world_size}
    for name, fresh in (("forked", False), ("fresh", True)):
        times = time_calls(ns.world_size, ns.repeats, fresh)
        print(f"spawn({ns.world_size} ranks) {name}, {ns.repeats} calls: " + ", ".join(f"{t:.2f}s" for t in times))
        result[f"{name}_median_s"] = round(median_spread(times)[0], 3)
    result["fresh_over_forked"] = round(result["fresh_median_s"] / result["forked_median_s"], 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

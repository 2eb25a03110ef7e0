"""How long does `spawn` take to start workers, join the process group and return?

    python benchmarks/launch.py [--world-size 2] [--repeats 5]

Times an empty worker end to end (process start, `import torch`, process-group rendezvous, result
back), the price every multi-process lesson pays per call. The last line is a JSON object.
"""

import argparse
import json
import time

from pipelab.launch import spawn
from pipelab.measure import median_spread
from pipelab.worker import RankContext


def empty_worker(ctx: RankContext) -> int:
    return ctx.rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    times = []
    for _ in range(ns.repeats):
        t0 = time.perf_counter()
        assert spawn(empty_worker, ns.world_size) == list(range(ns.world_size))
        times.append(time.perf_counter() - t0)
    print(f"spawn({ns.world_size} ranks), {ns.repeats} calls: " + ", ".join(f"{t:.2f}s" for t in times))
    median, fastest, _ = median_spread(times)
    print(json.dumps({"world_size": ns.world_size, "startup_median_s": round(median, 3),
                      "startup_min_s": round(fastest, 3)}))


if __name__ == "__main__":
    main()

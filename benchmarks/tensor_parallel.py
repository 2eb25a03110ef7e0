"""Our tensor-parallel GPT block against torch's `parallelize_module`, measured in one run.

Every rank runs ours and torch's (tensor parallel, and with sequence parallelism), their forward
and backward passes in alternating rounds (`measure.alternate`: A B C D A B C D ...), so a load that
comes and goes slows them alike. Each figure is the median of the round-by-round ratios of the
slowest rank's median pass, ours over torch's (below 1: ours is faster), with its min and max.

    python benchmarks/tensor_parallel.py
    python benchmarks/tensor_parallel.py --world-size 4 --dim 512 --heads 8 --seq-len 256

Last line: one JSON object of the figures (a measured figure X comes with X_min and X_max).
"""

import argparse
import json

from pipelab import hardware
from pipelab.experiments.tensor_parallel import Config, alternated
from pipelab.measure import Measured, ratios


def _figure(name: str, m: Measured, digits: int = 3) -> dict:
    return {name: round(m.median, digits), f"{name}_min": round(m.low, digits), f"{name}_max": round(m.high, digits)}


def main(world_size: int = 2, dim: int = 256, heads: int = 8, batch: int = 4, seq_len: int = 128,
         steps: int = 5, rounds: int = 5) -> dict:
    cfg = Config(world_size=world_size, dim=dim, n_heads=heads, batch=batch, seq_len=seq_len, steps=steps,
                 variants=("tp", "torch tp", "tp+sp", "torch tp+sp"))
    per_round = alternated(cfg, rounds)
    print(hardware.describe(world_size))
    print(f"GPT block dim={dim}, heads={heads}, batch={batch}, seq_len={seq_len} over {world_size} ranks; "
          f"median (min-max) of {rounds} alternating rounds, each the median of {steps} passes")
    for name, seconds in per_round.items():
        print(f"{name:<14}{format(Measured.of(seconds).scaled(1e3), '.2f'):>28} ms per forward+backward")
    tp = ratios(per_round["tp"], per_round["torch tp"])
    sp = ratios(per_round["tp+sp"], per_round["torch tp+sp"])
    print(f"ours / torch's: tensor parallel {tp:.2f}, with sequence parallelism {sp:.2f}")
    return {"world_size": world_size, "dim": dim, "heads": heads, "seq_len": seq_len, "rounds": rounds,
            **_figure("tp_ours_over_torch", tp), **_figure("sp_ours_over_torch", sp),
            **_figure("tp_ms", Measured.of(per_round["tp"]).scaled(1e3), 2),
            **_figure("torch_tp_ms", Measured.of(per_round["torch tp"]).scaled(1e3), 2)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    print(json.dumps(main(a.world_size, a.dim, a.heads, a.batch, a.seq_len, a.steps, a.rounds)))

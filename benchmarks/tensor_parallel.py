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
import statistics

from pipelab import experiments, hardware
from pipelab.experiments.tensor_parallel import Config, _build, _pass, sequence_parallel
from pipelab.measure import Measured, alternate, ratios, time_steps
from pipelab.tensor_parallel import TensorParallelGroup
from pipelab.worker import RankContext


def alternated_worker(ctx: RankContext, cfg: Config, rounds: int) -> dict[str, list[float]]:
    """Each round, every variant's median of `cfg.steps` forward+backward passes, the variants in
    turn (`measure.alternate`), so a load that comes and goes slows them alike."""
    tp = TensorParallelGroup.world()
    x, g = cfg.data()
    runs = {}
    for variant in cfg.variants:
        block = _build(variant, cfg, tp)
        x_in, g_in = (tp.slice(x, 1), tp.slice(g, 1)) if sequence_parallel(variant) else (x, g)
        x_in = x_in.clone().requires_grad_()

        def one_round(block=block, x_in=x_in, g_in=g_in) -> float:
            steps = time_steps(ctx, lambda i: _pass(block, x_in, g_in), cfg.steps,
                               prepare=lambda i: block.zero_grad(set_to_none=True))
            return statistics.median(steps.seconds)

        runs[variant] = one_round
    return alternate(runs, rounds)


def alternated(cfg: Config, rounds: int) -> dict[str, list[float]]:
    """Per variant, the slowest rank's median pass of each round (seconds)."""
    per_rank = experiments.run(lambda ctx, c: alternated_worker(ctx, c, rounds), cfg)
    return {v: [max(r) for r in zip(*(ranks[v] for ranks in per_rank))] for v in cfg.variants}


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

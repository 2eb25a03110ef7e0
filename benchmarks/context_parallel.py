"""Our ring attention against torch's `context_parallel`, measured in one run.

Both run non-causal attention (what torch's runs on CPU, with the math backend) on the same zig-zag
shards (torch's default head-tail load balancer), forward only, in alternating rounds
(`measure.alternate`: A B A B ...), so a load that comes and goes slows them alike. The figure is
the median of the round-by-round ratios of the slowest rank's median forward, ours over torch's
(below 1: ours is faster), with its min and max.

    python benchmarks/context_parallel.py
    python benchmarks/context_parallel.py --world-size 4 --seq-len 2048

Last line: one JSON object of the figures (a measured figure X comes with X_min and X_max).
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from pipelab import hardware
from pipelab.context_parallel import Layout, Ring, ring_attention
from pipelab.experiments import context_parallel as cpx
from pipelab.launch import spawn
from pipelab.measure import Measured, alternate, ratios, time_steps


def worker(ctx, cfg: cpx.Config, rounds: int) -> dict[str, list[float]]:
    """Each round, ours then torch's: the median of `cfg.steps` forwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh, ring, layout = init_device_mesh("cpu", (ctx.world_size,)), Ring.world(), Layout("zigzag", ctx.world_size)
    q, k, v, _ = cfg.data()
    shards = [layout.shard(t, ctx.rank) for t in (q, k, v)]

    def ours() -> float:
        with torch.no_grad():
            return statistics.median(time_steps(ctx, lambda i: ring_attention(*shards, ring, layout), cfg.steps).seconds)

    def theirs() -> float:
        buffers = [t.clone() for t in (q, k, v)]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]), sdpa_kernel(SDPBackend.MATH):
            with torch.no_grad():
                return statistics.median(time_steps(ctx, lambda i: F.scaled_dot_product_attention(*buffers),
                                                    cfg.steps).seconds)

    return alternate({"ours": ours, "torch": theirs}, rounds)


def main(world_size: int = 2, heads: int = 8, head_dim: int = 64, seq_len: int = 1024, steps: int = 5,
         rounds: int = 5) -> dict:
    cfg = cpx.Config(world_size=world_size, heads=heads, head_dim=head_dim, seq_len=seq_len, steps=steps,
                     timed_seq_len=seq_len)
    per_rank = spawn(worker, world_size, cfg, rounds, timeout=600)
    per_round = {name: [max(r) for r in zip(*(ranks[name] for ranks in per_rank))] for name in ("ours", "torch")}
    print(hardware.describe(world_size))
    print(f"attention heads={heads}, head_dim={head_dim}, seq_len={seq_len}, non-causal, forward, over {world_size} "
          f"ranks; median (min-max) of {rounds} alternating rounds, each the median of {steps} forwards")
    for name, seconds in per_round.items():
        print(f"{name:<8}{format(Measured.of(seconds).scaled(1e3), '.2f'):>28} ms per forward")
    ratio = ratios(per_round["ours"], per_round["torch"])
    print(f"ours / torch's: {ratio:.2f}")
    ms = {name: Measured.of(s).scaled(1e3) for name, s in per_round.items()}
    return {"world_size": world_size, "heads": heads, "head_dim": head_dim, "seq_len": seq_len, "rounds": rounds,
            "ours_over_torch": round(ratio.median, 3), "ours_over_torch_min": round(ratio.low, 3),
            "ours_over_torch_max": round(ratio.high, 3), "ours_ms": round(ms["ours"].median, 2),
            "torch_ms": round(ms["torch"].median, 2)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    print(json.dumps(main(a.world_size, a.heads, a.head_dim, a.seq_len, a.steps, a.rounds)))

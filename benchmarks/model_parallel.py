"""One device vs naive model parallel vs best split vs dual streams, measured in one run.

Times one forward of the SplitResNet (best of a few repeats) on two devices: CUDA GPUs when the
machine has two, otherwise two virtual CPU devices. The pipelined and dual-stream sweeps run in
interleaved rounds, so a drifting machine load hits both alike. Also reports how much of device
1's compute stream the copies take when they sit in it (pipelined) and how much of the copy time
runs under compute when they have their own stream (dual stream).

    python benchmarks/model_parallel.py                      # lessons 02-03's model
    python benchmarks/model_parallel.py --channels 16 --blocks 1 2 --expansion 8 --batch 32 --size 32
                                                             # lesson 04's wide cut

Last line: one JSON object of the figures.
"""

import argparse
import json

import torch

from pipelab import hardware
from pipelab import model_parallel as mp
from pipelab.experiments.model_parallel import split_sweeps, time_forward
from pipelab.models import SplitResNet
from pipelab.streams import devices


def main(channels: int = 64, blocks: tuple[int, int] = (2, 2), batch: int = 64, size: int = 16,
         repeats: int = 5, expansion: int = 1) -> dict:
    devs = devices(2)
    torch.manual_seed(0)
    model = mp.place(SplitResNet(channels, tuple(blocks), expansion=expansion), devs)
    x = torch.randn(batch, 3, size, size)
    sizes = [s for s in (2, 4, 8, 16, 32, 64, 128, 256) if s <= batch]
    sweeps = split_sweeps(model, x, devs, sizes, ("pipelined", "dual_stream"), repeats)
    piped, dual = sweeps["pipelined"], sweeps["dual_stream"]
    base = piped["one_device_s"]
    best, best_dual = piped["best_split"], dual["best_split"]
    naive, _ = time_forward(model, x, devs, "naive", repeats=repeats)
    _, tl_piped = time_forward(model, x, devs, "pipelined", best, repeats)
    _, tl_dual = time_forward(model, x, devs, "dual_stream", best_dual, repeats)
    d1 = devs[1].label
    copy_share = tl_piped.filter(kind="copy").busy_time(d1, "compute") / tl_piped.busy_time(d1, "compute")
    overlap = tl_dual.overlap("compute", "copy", rank=d1)

    print(hardware.describe())
    print(f"SplitResNet(channels={channels}, blocks={tuple(blocks)}, expansion={expansion}), "
          f"batch {batch}, {size}x{size} images")
    print(f"{'variant':<26}{'forward ms':>12}{'speedup':>10}")
    print(f"{'one device':<26}{base * 1e3:>12.1f}{1.0:>10.2f}")
    print(f"{'naive (2 devices)':<26}{naive * 1e3:>12.1f}{base / naive:>10.2f}")
    for s in sizes:
        print(f"{f'pipelined split={s}':<26}{piped['seconds'][s] * 1e3:>12.1f}{piped['speedup'][s]:>10.2f}")
    for s in sizes:
        print(f"{f'dual stream split={s}':<26}{dual['seconds'][s] * 1e3:>12.1f}{dual['speedup'][s]:>10.2f}")
    print(f"copies take {copy_share:.0%} of device 1's compute stream when pipelined (split {best}); "
          f"with a copy stream {overlap:.0%} of the copy time overlaps compute (split {best_dual})")
    return {"device": devs[0].name.split(":")[0], "one_device_ms": round(base * 1e3, 2),
            "naive_speedup": round(base / naive, 3), "best_split": best,
            "best_split_speedup": round(piped["speedup"][best], 3),
            "dual_stream_split": best_dual, "dual_stream_speedup": round(dual["speedup"][best_dual], 3),
            "dual_stream_over_best_split": round(piped["seconds"][best] / dual["seconds"][best_dual], 3),
            "pipelined_copy_share": round(copy_share, 3), "dual_stream_overlap": round(overlap, 3)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--blocks", type=int, nargs=2, default=(2, 2), metavar=("SEQ1", "SEQ2"))
    parser.add_argument("--expansion", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(main(args.channels, tuple(args.blocks), args.batch, args.size, args.repeats, args.expansion)))

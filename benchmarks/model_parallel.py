"""One device vs naive model parallel vs best split vs dual streams, measured in one run.

Times one forward of the SplitResNet on two devices: CUDA GPUs when the machine has two,
otherwise two virtual CPU devices. The one-device forward and every pipelined and dual-stream
split run in alternating rounds (`measure.alternate`: A B C ... A B C ...), so a load that comes
and goes hits all alike; each speedup is the median of the round-by-round ratios, with its min
and max. Also reports, from the median runs, how much of device 1's compute stream the copies
take when they sit in it (pipelined) and how much of the copy time runs under compute when they
have their own stream (dual stream).

    python benchmarks/model_parallel.py                      # lessons 02-03's model
    python benchmarks/model_parallel.py --channels 16 --blocks 1 2 --expansion 8 --batch 32 --size 32
                                                             # lesson 04's wide cut

Last line: one JSON object of the figures (a measured figure X comes with X_min and X_max).
"""

import argparse
import json

import torch

from pipelab import hardware
from pipelab import model_parallel as mp
from pipelab.experiments.model_parallel import time_forwards
from pipelab.measure import Measured, ratios
from pipelab.models import SplitResNet
from pipelab.streams import devices


def _figure(name: str, m: Measured, digits: int = 3) -> dict:
    """A measured figure as JSON keys: the median under `name`, its min and max beside it."""
    return {name: round(m.median, digits), f"{name}_min": round(m.low, digits), f"{name}_max": round(m.high, digits)}


def main(channels: int = 64, blocks: tuple[int, int] = (2, 2), batch: int = 64, size: int = 16,
         repeats: int = 5, expansion: int = 1) -> dict:
    devs = devices(2)
    torch.manual_seed(0)
    model = mp.place(SplitResNet(channels, tuple(blocks), expansion=expansion), devs)
    x = torch.randn(batch, 3, size, size)
    sizes = [s for s in (2, 4, 8, 16, 32, 64, 128, 256) if s <= batch]
    cases = {"one_device": ("one_device", None), "naive": ("naive", None)}
    cases.update({(v, s): (v, s) for v in ("pipelined", "dual_stream") for s in sizes})
    runs = time_forwards(model, x, devs, cases, repeats)  # all of them in alternating rounds
    base = runs["one_device"]
    speedup = {key: ratios(base.seconds, r.seconds) for key, r in runs.items()}  # round by round
    best = max(sizes, key=lambda s: speedup[("pipelined", s)].median)
    best_dual = max(sizes, key=lambda s: speedup[("dual_stream", s)].median)
    naive_speedup = speedup["naive"]
    dual_over_best = ratios(runs[("pipelined", best)].seconds, runs[("dual_stream", best_dual)].seconds)
    tl_piped, tl_dual = runs[("pipelined", best)].typical, runs[("dual_stream", best_dual)].typical  # median runs
    d1 = devs[1].label
    copy_share = tl_piped.filter(kind="copy").busy_time(d1, "compute") / tl_piped.busy_time(d1, "compute")
    overlap = tl_dual.overlap("compute", "copy", rank=d1)

    print(hardware.describe_devices(2))
    print(f"SplitResNet(channels={channels}, blocks={tuple(blocks)}, expansion={expansion}), "
          f"batch {batch}, {size}x{size} images; median (min-max) of {repeats} alternating rounds")
    print(f"{'variant':<26}{'forward ms':>24}{'speedup':>22}")
    for name, key in [("one device", "one_device"), ("naive (2 devices)", "naive"),
                      *((f"{v} split={s}", (v, s)) for v in ("pipelined", "dual_stream") for s in sizes)]:
        ms = format(runs[key].measured.scaled(1e3), ".1f")
        print(f"{name:<26}{ms:>24}{format(speedup[key], '.2f'):>22}")
    print(f"copy stream's best (split {best_dual}) over pipelined's best (split {best}): {dual_over_best:.2f}x")
    print(f"copies take {copy_share:.0%} of device 1's compute stream when pipelined (split {best}); "
          f"with a copy stream {overlap:.0%} of the copy time overlaps compute (split {best_dual}); median runs")
    return {"device": devs[0].name.split(":")[0], "repeats": repeats,
            **_figure("one_device_ms", base.measured.scaled(1e3), 2),
            **_figure("naive_speedup", naive_speedup), "best_split": best,
            **_figure("best_split_speedup", speedup[("pipelined", best)]),
            "dual_stream_split": best_dual, **_figure("dual_stream_speedup", speedup[("dual_stream", best_dual)]),
            **_figure("dual_stream_over_best_split", dual_over_best),
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

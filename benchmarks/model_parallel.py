"""One device vs naive model parallel vs best split vs dual streams, measured in one run.

Times one forward of the SplitResNet on two devices: CUDA GPUs when the machine has two,
otherwise two virtual CPU devices. The one-device forward and every pipelined and dual-stream
split run in alternating rounds (`measure.alternate`: A B C ... A B C ...), so a load that comes
and goes hits all alike; each speedup is the median of the round-by-round ratios, with its min
and max. Also reports, per round, how much of device 1's compute stream the copies take when they
sit in it (pipelined) and how much of the copy time runs under compute when they have their own
stream (dual stream).

    python benchmarks/model_parallel.py                      # lessons 02-03's model
    python benchmarks/model_parallel.py --channels 16 --blocks 1 2 --expansion 8 --batch 32 --size 32
                                                             # lesson 04's wide cut
    python benchmarks/model_parallel.py --emulate 2xH100-nvlink --channels 8 --batch 120 --size 8
                                                             # paced as 2 emulated H100s running the
                                                             # tutorial's ResNet-50 (its split sizes),
                                                             # the tutorial's published figures beside

Last line: one JSON object of the figures (a measured figure X comes with X_min and X_max).
"""

import argparse
import json

from pipelab import hardware
from pipelab.emulate import Emulated, anchors
from pipelab.experiments.model_parallel import TUTORIAL_SPLITS, Config, Forward, ResNet50Pace, speedup, time_forwards
from pipelab.measure import Measured
from pipelab.streams import devices


def _figure(name: str, m: Measured, digits: int = 3) -> dict:
    """A measured figure as JSON keys: the median under `name`, its min and max beside it."""
    return {name: round(m.median, digits), f"{name}_min": round(m.low, digits), f"{name}_max": round(m.high, digits)}


def main(channels: int = 64, blocks: tuple[int, int] = (2, 2), batch: int = 64, size: int = 16,
         repeats: int = 5, expansion: int = 1, emulate: str | None = None, cut: str = "layer2") -> dict:
    pace = ResNet50Pace.on(Emulated(emulate, cut=cut) if emulate else None, batch)  # None: real time here
    devs = devices(2, pace=pace)
    cfg = Config.resnet(devs, channels=channels, blocks=tuple(blocks), batch=batch, size=size, expansion=expansion,
                        repeats=repeats)
    choices = TUTORIAL_SPLITS if pace is not None else (2, 4, 8, 16, 32, 64, 128, 256)
    sizes = [s for s in choices if s <= batch]
    forwards = {"one_device": Forward("one_device"), "naive": Forward("naive")}
    forwards.update({(v, s): Forward(v, s) for v in ("pipelined", "dual_stream") for s in sizes})
    runs = time_forwards(cfg, forwards)  # all of them in alternating rounds
    base = runs["one_device"]
    gain = {key: speedup(base, r) for key, r in runs.items()}  # round by round
    best = max(sizes, key=lambda s: gain[("pipelined", s)].median)
    best_dual = max(sizes, key=lambda s: gain[("dual_stream", s)].median)
    dual_over_best = speedup(runs[("pipelined", best)], runs[("dual_stream", best_dual)])
    copy_share = runs[("pipelined", best)].copy_share  # per round
    overlap = runs[("dual_stream", best_dual)].overlap  # per round

    print(hardware.describe_devices(2, emulate, size=pace and pace.size))
    print(f"SplitResNet(channels={channels}, blocks={tuple(blocks)}, expansion={expansion}), "
          f"batch {batch}, {size}x{size} images; median (min-max) of {repeats} alternating rounds")
    print(f"{'variant':<26}{'forward ms':>24}{'speedup':>22}")
    for name, key in [("one device", "one_device"), ("naive (2 devices)", "naive"),
                      *((f"{v} split={s}", (v, s)) for v in ("pipelined", "dual_stream") for s in sizes)]:
        ms = format(runs[key].step_time.scaled(1e3), ".1f")
        print(f"{name:<26}{ms:>24}{format(gain[key], '.2f'):>22}")
    print(f"copy stream's best (split {best_dual}) over pipelined's best (split {best}): {dual_over_best:.2f}x")
    print(f"copies take {copy_share.scaled(100):.0f} % of device 1's compute stream when pipelined (split {best}); "
          f"with a copy stream {overlap.scaled(100):.0f} % of the copy time overlaps compute (split {best_dual})")
    published = {}
    if pace is not None:  # the tutorial's figures beside the emulated ones, where it ran the same split
        published = {"published_naive_speedup": round(1 / anchors.anchor("tutorial_naive_mp_slowdown").value, 3),
                     "published_split20_speedup": round(anchors.anchor("tutorial_pipeline_split20_speedup").value, 3),
                     "published_split12_speedup": round(anchors.anchor("tutorial_pipeline_split12_speedup").value, 3),
                     **{f"split{s}_speedup": round(gain[("pipelined", s)].median, 3) for s in (12, 20) if s in sizes}}
        print(f"published (the tutorial, training steps on its GPUs): naive {published['published_naive_speedup']}x, "
              f"split 20 {published['published_split20_speedup']}x, split 12 {published['published_split12_speedup']}x")
    return {"device": f"emulated {pace.node}" if pace is not None else devs[0].name.split(":")[0], "repeats": repeats,
            **published,
            **_figure("one_device_ms", base.step_time.scaled(1e3), 2),
            **_figure("naive_speedup", gain["naive"]), "best_split": best,
            **_figure("best_split_speedup", gain[("pipelined", best)]),
            "dual_stream_split": best_dual, **_figure("dual_stream_speedup", gain[("dual_stream", best_dual)]),
            **_figure("dual_stream_over_best_split", dual_over_best),
            **_figure("pipelined_copy_share", copy_share), **_figure("dual_stream_overlap", overlap)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--blocks", type=int, nargs=2, default=(2, 2), metavar=("SEQ1", "SEQ2"))
    parser.add_argument("--expansion", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--emulate", default=None, help="an emulated node, e.g. 2xH100-nvlink (default: none)")
    parser.add_argument("--cut", default="layer2", help="where the emulated ResNet-50 is cut (layer1-layer3)")
    args = parser.parse_args()
    print(json.dumps(main(args.channels, tuple(args.blocks), args.batch, args.size, args.repeats, args.expansion,
                          args.emulate, args.cut)))

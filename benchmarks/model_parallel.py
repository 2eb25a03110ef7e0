"""One device vs naive model parallel vs best split vs dual streams, measured in one run.

Times one forward of the SplitResNet (best of a few repeats) on two devices: CUDA GPUs when the
machine has two, otherwise two virtual CPU devices. Last line: one JSON object of the figures.
"""

import json

import torch

from pipelab import hardware
from pipelab import model_parallel as mp
from pipelab.streams import devices


def main(channels: int = 64, blocks: int = 2, batch: int = 64, size: int = 16, repeats: int = 3) -> dict:
    devs = devices(2)
    torch.manual_seed(0)
    model = mp.place(mp.SplitResNet(channels, blocks), devs)
    x = torch.randn(batch, 3, size, size)
    sweep = mp.split_sweep(model, x, devs, [2, 4, 8, 16, 32, 64], repeats)
    base = sweep["one_device_s"]
    best = sweep["best_split"]
    naive, _ = mp.time_forward(model, x, devs, "naive", repeats=repeats)
    dual, _ = mp.time_forward(model, x, devs, "dual_stream", best, repeats)
    print(hardware.describe())
    print(f"{'variant':<22}{'forward ms':>12}{'speedup':>10}")
    print(f"{'one device':<22}{base * 1e3:>12.1f}{1.0:>10.2f}")
    print(f"{'naive (2 devices)':<22}{naive * 1e3:>12.1f}{base / naive:>10.2f}")
    for s, sp in sweep["speedup"].items():
        print(f"{f'pipelined split={s}':<22}{base / sp * 1e3:>12.1f}{sp:>10.2f}")
    print(f"{f'dual stream split={best}':<22}{dual * 1e3:>12.1f}{base / dual:>10.2f}")
    return {"device": devs[0].name.split(":")[0], "one_device_ms": round(base * 1e3, 2),
            "naive_speedup": round(base / naive, 3), "best_split": best,
            "best_split_speedup": round(sweep["speedup"][best], 3),
            "dual_stream_speedup": round(base / dual, 3)}


if __name__ == "__main__":
    print(json.dumps(main()))

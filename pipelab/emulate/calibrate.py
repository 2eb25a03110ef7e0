"""Calibrate an emulated device on a real GPU: measure it, fit the model's figures, write them as JSON.

`pipelab calibrate` runs `calibrate()` on this machine's first GPU: matrix products over sizes and
dtypes, a large copy (achieved memory bandwidth), a tiny kernel (launch cost) and, with two GPUs or
more, a copy between two and NCCL's collectives over message sizes (`calibrate_links`). Each
figure is timed with CUDA events after a warm-up, as the median of repeats. `fit()` turns the
measurements into the model's figures:

- every timing is fitted as `t = overhead + work / rate` (work: FLOPs, bytes), minimising the
  *relative* error, so small and large sizes count alike; the matrix product's efficiency at FLOPs
  F is then `F / (overhead + F / rate)` over the peak, the efficiency-versus-size curve;
- a link's latency and bandwidth come from send/receive the same way, a collective's bus bandwidth
  from its bytes times NCCL's bus factor (nccl-tests' PERFORMANCE.md convention).

The JSON file holds the GPU's name, driver, CUDA and torch versions, the date, the raw measurements
and the fit. `load_node(path, count)` reads it back as a `specs.Node` of `count` such GPUs, which
is what `emulate="8x:calibration.json"` means: one GPU calibrates an emulated node of eight. With
one GPU nothing measures a link, so the node's link is the data sheet's for that card (said so).
"""

from __future__ import annotations

import json
import os
import statistics
import re
from typing import Callable

FORMAT = "pipelab-calibration/1"
# Where `pipelab calibrate` writes and `pipelab run --profile gpu` / `doctor` look, unless told.
ENV_PATH = "PIPELAB_CALIBRATION"
DEFAULT_PATH = os.path.join("~", ".cache", "pipelab", "calibration.json")

MATMUL_SIZES = (256, 512, 1024, 2048, 4096, 8192)
COPY_BYTES = tuple(2**k for k in range(20, 31, 2))  # 1 MiB .. 1 GiB
# A product lasting under this many launches is launch-bound: the fit of its rate leaves it out.
LAUNCH_BOUND = 3
# Bytes each rank sends per byte of message, NCCL's "bus bandwidth" factor for n ranks.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}


HELP = """\
Measure this machine's GPU and write what the emulator needs as JSON:

  - matrix products n x n x n, n = 256 .. 8192, in float32, tf32, bfloat16 and float16 (those the GPU
    has), fitted as time = overhead + FLOPs / rate: the sustained rate and the efficiency-versus-size curve;
  - a large copy in device memory (1 MiB .. 1 GiB): the achieved memory bandwidth;
  - a one-element kernel launched back to back: the launch cost;
  - with two GPUs or more: the copy between two and NCCL's all-reduce, all-gather, reduce-scatter and
    send/receive over message sizes (1 KiB .. 256 MiB): the link's latency and bandwidth. One GPU
    cannot measure a link: the file's node then uses the card's data-sheet link.

Timing: CUDA events, a warm-up, the median of repeats; about a minute in all. The file holds the
GPU's name, driver, CUDA and torch versions, the date, the raw measurements and the fit. Use it as
an emulated node: emulate="8x:calibration.json" (eight of this GPU; "@pcie5" after the file names
the link), or `pipelab run --profile gpu` on a one-GPU machine finds it at the default path.
`pipelab doctor` says which spec is in use.

Exit code: 0 when written, 3 when this machine has no CUDA GPU (nothing is measured), 1 when the
measurements cannot be fitted (they are written, unfitted, to the file).
"""


def default_path() -> str:
    """The calibration file's default place: $PIPELAB_CALIBRATION, else ~/.cache/pipelab/calibration.json."""
    return os.path.abspath(os.path.expanduser(os.environ.get(ENV_PATH) or DEFAULT_PATH))


# ---------------------------------------------------------------------------------------------
# Fitting (plain Python: runs and is tested without a GPU)
# ---------------------------------------------------------------------------------------------


def fit_line(work: list[float], seconds: list[float]) -> tuple[float, float]:
    """(overhead_s, rate) of `seconds = overhead + work / rate`, least squares on the relative error.

    A negative overhead (noise at small sizes) is clamped to 0 and the rate refitted alone."""
    if len(work) != len(seconds) or len(work) < 2:
        raise ValueError(f"a fit needs at least two (work, seconds) pairs, got {len(work)} and {len(seconds)}")
    if min(seconds) <= 0 or min(work) <= 0:
        raise ValueError(f"work and seconds must all be > 0, got work {work} and seconds {seconds}")
    # Each row divided by its time: [1/t, w/t] . [a, b] = 1, with b = 1/rate.
    rows = [(1 / t, w / t) for w, t in zip(work, seconds)]
    s11 = sum(r[0] * r[0] for r in rows)
    s12 = sum(r[0] * r[1] for r in rows)
    s22 = sum(r[1] * r[1] for r in rows)
    y1, y2 = sum(r[0] for r in rows), sum(r[1] for r in rows)
    det = s11 * s22 - s12 * s12
    a, b = ((s22 * y1 - s12 * y2) / det, (s11 * y2 - s12 * y1) / det) if det > 0 else (-1.0, 0.0)
    if a < 0:
        a, b = 0.0, y2 / s22
    if b <= 0:
        raise ValueError(f"the times do not grow with the work (work {work}, seconds {seconds}): nothing to fit")
    return a, 1 / b


def efficiency_curve(overhead_s: float, rate: float, peak: float, flops: list[float]) -> list[float]:
    """The fitted matrix product's fraction of `peak` at each FLOP count: F / (overhead + F/rate) / peak."""
    return [f / (overhead_s + f / rate) / peak for f in flops]


def matmul_flops(n: int) -> float:
    """FLOPs of an n x n by n x n matrix product (a multiply and an add per term)."""
    return 2.0 * n**3


def fit(measured: dict, sheet: dict | None = None) -> dict:
    """The model's figures from `measured` (what `measure_device`/`calibrate_links` return):
    per dtype the matrix product's overhead, sustained rate and efficiency curve (over the data
    sheet's dense peak when `sheet` {dtype: FLOP/s} knows it, else over the sustained rate), the
    memory bandwidth, the launch cost, and with link measurements the link and collectives."""
    out: dict = {"matmul": {}}
    by_dtype: dict[str, list] = {}
    for row in measured["matmul"]:
        by_dtype.setdefault(row["dtype"], []).append(row)
    launch = statistics.median(measured["launch_s"])
    for dtype, rows in by_dtype.items():
        rows = sorted(rows, key=lambda r: r["n"])
        flops = [matmul_flops(r["n"]) for r in rows]
        # The model's launch floor explains the products that last a few launches; the line is
        # fitted on the rest, where the work shows (all rows if fewer than two are left).
        working = [(f, r["seconds"]) for f, r in zip(flops, rows) if r["seconds"] > LAUNCH_BOUND * launch]
        working = working if len(working) >= 2 else list(zip(flops, [r["seconds"] for r in rows]))
        try:
            overhead, rate = fit_line([f for f, _ in working], [s for _, s in working])
        except ValueError as e:  # one dtype's noisy times leave the others' fits standing
            out["matmul"][dtype] = {"error": str(e)}
            continue
        peak = (sheet or {}).get(dtype)
        out["matmul"][dtype] = {
            "overhead_s": overhead, "flops_per_s": rate, "sheet_flops_per_s": peak,
            "efficiency_of": "data sheet's dense peak" if peak else "the fitted sustained rate",
            "curve": [{"n": r["n"], "measured": f / r["seconds"] / (peak or rate), "fitted": e}
                      for r, f, e in zip(rows, flops, efficiency_curve(overhead, rate, peak or rate, flops))]}
    copies = measured["copy"]
    overhead, bandwidth = fit_line([r["bytes"] for r in copies], [r["seconds"] for r in copies])
    out["memory"] = {"overhead_s": overhead, "bytes_per_s": bandwidth}
    out["launch_s"] = launch
    links = measured.get("links")
    if links:
        out["link"] = _fit_link(links)
    return out


def _fit_link(links: dict) -> dict:
    """Latency and bandwidth of the link (send/receive), each collective's bus bandwidth, the copy."""
    n = links["ranks"]
    result: dict = {"ranks": n, "collectives": {}}
    for name, rows in links["collectives"].items():
        factor = BUS_FACTOR[name](n)
        latency, busbw = fit_line([r["bytes"] * factor for r in rows], [r["seconds"] for r in rows])
        result["collectives"][name] = {"latency_s": latency, "bus_bytes_per_s": busbw}
    p2p = result["collectives"].get("send_recv")
    if p2p:
        result["latency_s"], result["bytes_per_s"] = p2p["latency_s"], p2p["bus_bytes_per_s"]
    if links.get("copy"):
        lat, bw = fit_line([r["bytes"] for r in links["copy"]], [r["seconds"] for r in links["copy"]])
        result["copy"] = {"latency_s": lat, "bytes_per_s": bw}
    return result


# ---------------------------------------------------------------------------------------------
# The JSON file and the emulated node it makes
# ---------------------------------------------------------------------------------------------


def known_device(gpu_name: str) -> tuple[str, object] | None:
    """(key, Device) of the data sheet's card this GPU's name names ("NVIDIA H100 80GB HBM3" -> h100)."""
    from pipelab.emulate import specs

    name = gpu_name.lower().replace("-", " ")
    for key in sorted(specs.DEVICES, key=len, reverse=True):
        if key in name.split() or f" {key} " in f" {name} ":
            return key, specs.DEVICES[key]
    return None


def spec(info: dict, measured: dict) -> dict:
    """The whole calibration record: where it ran (`info`), the raw measurements and the fit."""
    sheet = known_device(info["gpu"])
    return {"format": FORMAT, **info, "data_sheet": sheet[0] if sheet else None,
            "measured": measured, "fit": fit(measured, dict(sheet[1].flops) if sheet else None)}


def write(record: dict, path: str) -> str:
    """Write the record as JSON at `path` (folders made); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, allow_nan=False)
    return path


def load(path: str) -> dict:
    """A calibration record written by `pipelab calibrate`; a ValueError naming the file otherwise."""
    try:
        with open(os.path.expanduser(path)) as f:
            record = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read calibration file {path!r} ({e.strerror}); write one with "
                         f"`pipelab calibrate --out {path}` on a machine with a GPU") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration file {path!r} is not JSON ({e}); rewrite it with `pipelab calibrate`") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a calibration file of format {FORMAT!r}; rewrite it with "
                         "`pipelab calibrate`")
    return record


def parse_node(text: str):
    """"8x:calibration.json" (or "8x:calibration.json@pcie5", naming the link) -> `load_node`."""
    match = re.fullmatch(r"\s*(\d+)\s*[x*]\s*:(.+?)(?:@([a-z0-9_.-]+))?\s*", text, flags=re.IGNORECASE)
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"cannot read calibrated node {text!r}: write COUNTx:FILE (e.g. '8x:calibration.json', "
                         "a file `pipelab calibrate` wrote), optionally @LINK (e.g. '8x:calibration.json@pcie5')")
    return load_node(match.group(2).strip(), int(match.group(1)), match.group(3))


def describe(record: dict) -> str:
    """One line: which GPU, when, with what."""
    return (f"{record['gpu']} calibrated {record['date']} (driver {record.get('driver') or '-'}, "
            f"CUDA {record.get('cuda') or '-'}, torch {record.get('torch')})")


def efficiency_spec(fit_: dict, sheet) -> tuple[dict, dict, float]:
    """(peak FLOP/s per dtype, `calibrated.Efficiency` fields, memory bandwidth) from a fit.

    A measured time `overhead + F / rate` is the model's `(F + half) / (peak * e_max)` with
    e_max = rate / peak and half = overhead * rate: the data sheet's peak stays the limit (e_max
    <= 1) where the card is known, else the fitted rate is the peak (e_max = 1)."""
    peaks, matmul = {}, {}
    for dtype, m in fit_["matmul"].items():
        if "error" in m:
            continue
        peak = max(m["sheet_flops_per_s"] or m["flops_per_s"], m["flops_per_s"])
        peaks[dtype] = peak
        matmul[dtype] = [m["flops_per_s"] / peak, m["overhead_s"] * m["flops_per_s"]]
    bandwidth = max(sheet.memory_bandwidth if sheet else 0.0, fit_["memory"]["bytes_per_s"])
    efficiency = {"launch_s": fit_["launch_s"], "matmul": matmul,
                  "memory_fraction": fit_["memory"]["bytes_per_s"] / bandwidth}
    return peaks, efficiency, bandwidth


def _device(record: dict, sheet, source: str):
    """The calibrated GPU as a `specs.Device` the hardware model (`calibrated`) times with its own
    measured efficiency: matrix products by size, streaming bandwidth, launch floor."""
    from pipelab.emulate import specs

    peaks, efficiency, bandwidth = efficiency_spec(record["fit"], sheet)
    efficiency["source"] = source
    return specs.device_from_spec({
        "name": f"{record['gpu']} (calibrated)", "flops": peaks, "memory_bandwidth": bandwidth,
        "memory_bytes": float(record["memory_bytes"]), "source": source, "efficiency": efficiency,
        "nvlink": sheet.nvlink if sheet else None, "pcie": sheet.pcie if sheet else "pcie4",
        "notes": (f"matrix products and copies as measured (the data sheet's peak the limit); launch "
                  f"{record['fit']['launch_s'] * 1e6:.1f} us measured")})


def load_node(path: str, count: int, link: str | None = None):
    """`count` calibrated GPUs as a `specs.Node`: rates, memory bandwidth and size as measured on
    the GPU; the link measured when the file has one, else `link` (a key of specs.LINKS) or the
    data sheet's link of that card (NVLink when it has one), else PCIe 4."""
    from pipelab.emulate import specs

    record = load(path)
    f = record["fit"]
    source = f"measured by pipelab calibrate: {describe(record)}, file {os.path.basename(path)}"
    sheet = specs.DEVICES.get(record.get("data_sheet") or "")
    device = _device(record, sheet, source)
    if link is None and f.get("link"):
        measured = f["link"]
        node_link = specs.Link(f"{record['gpu']} link (calibrated)", measured["latency_s"],
                               measured["bytes_per_s"], source, source)
    else:
        key = (link or (sheet.nvlink or sheet.pcie if sheet else "pcie4")).lower()
        key = specs.LINK_ALIASES.get(key, key)
        if key in ("nvlink", "pcie"):
            key = (sheet.nvlink if key == "nvlink" else sheet.pcie) if sheet else ("pcie4" if key == "pcie" else None)
        if key not in specs.LINKS:
            raise ValueError(f"link {link!r} for calibrated node {path!r}: use one of {sorted(specs.LINKS)}")
        node_link = specs.LINKS[key]
    return specs.Node(count, device, node_link)


# ---------------------------------------------------------------------------------------------
# Measuring (needs a GPU)
# ---------------------------------------------------------------------------------------------


class NoGPU(RuntimeError):
    """This machine has no CUDA GPU that torch can use: nothing to calibrate."""


def gpu_problem() -> str | None:
    """Why this machine cannot calibrate (None when it can)."""
    import torch

    if not torch.cuda.is_available():
        built = f"torch {torch.__version__} built with CUDA {torch.version.cuda}" if torch.version.cuda \
            else f"torch {torch.__version__} built without CUDA"
        return (f"no CUDA GPU visible ({built}); run `pipelab calibrate` on a machine with an NVIDIA GPU, "
                "then pass its JSON file to emulate= (e.g. emulate=\"8x:calibration.json\")")
    return None


def calibrate(path: str, log: Callable[[str], None] = print, sizes=MATMUL_SIZES) -> dict:
    """Measure this machine's first GPU (and its links, with two or more), fit, write the JSON at
    `path`; returns the record. Raises NoGPU without a GPU."""
    problem = gpu_problem()
    if problem:
        raise NoGPU(problem)
    from pipelab.emulate import gpu_timing as g

    info = g.machine_info()
    log(f"calibrating {info['gpu']} (driver {info['driver']}, CUDA {info['cuda']}, torch {info['torch']})")
    measured = {"matmul": g.measure_matmul(sizes, g.dtypes_supported(), log),
                "copy": g.measure_copy(COPY_BYTES, log), "launch_s": g.measure_launch()}
    log(f"  launch {statistics.median(measured['launch_s']) * 1e6:.2f} us per tiny kernel")
    if info["gpu_count"] >= 2:
        measured["links"] = g.measure_links(log)
    else:
        log("links: one GPU, so no copy between GPUs and no NCCL collectives (they need two GPUs); "
            "a node emulated from this file uses the card's data-sheet link")
    try:
        record = spec(info, measured)
    except ValueError as e:  # keep what was measured: a fit that fails must not lose the run
        write({"format": FORMAT + "-unfitted", **info, "measured": measured, "fit_error": str(e)}, path)
        raise ValueError(f"the measurements could not be fitted ({e}); they are in {path}") from None
    write(record, path)
    return record


def summary(record: dict) -> str:
    """What the fit found, a few lines for the terminal."""
    f = record["fit"]
    lines = [describe(record)]
    for dtype, m in f["matmul"].items():
        if "error" in m:
            lines.append(f"  {dtype:>8}: not fitted ({m['error']})")
            continue
        big = m["curve"][-1]
        peak = f", {big['fitted']:.0%} of the data sheet's at n={big['n']}" if m["sheet_flops_per_s"] else ""
        lines.append(f"  {dtype:>8}: sustained {m['flops_per_s'] / 1e12:.1f} TFLOP/s, "
                     f"overhead {m['overhead_s'] * 1e6:.1f} us{peak}")
    lines.append(f"  memory: {f['memory']['bytes_per_s'] / 1e9:.0f} GB/s (read + write); "
                 f"launch {f['launch_s'] * 1e6:.2f} us")
    if f.get("link"):
        lines.append(f"  link: {f['link']['bytes_per_s'] / 1e9:.1f} GB/s, latency {f['link']['latency_s'] * 1e6:.1f} us")
    return "\n".join(lines)


def in_use(path: str | None = None) -> str:
    """Which spec the emulated nodes of `pipelab run --profile gpu` on one GPU use: the calibration
    file at `path` (default: default_path()), or the data sheets when there is none."""
    path = path or default_path()
    if not os.path.exists(path):
        return f"data sheets (pipelab/emulate/datasheets.py); no calibration file at {path} (`pipelab calibrate` writes one)"
    try:
        return f"calibration file {path}: {describe(load(path))}"
    except (ValueError, KeyError) as e:
        return f"data sheets (pipelab/emulate/datasheets.py); the calibration file at {path} is unusable: {e}"


def _read_name(text: str):
    """`specs.parse_node`'s reader of "8x:calibration.json" names (None for any other name)."""
    return parse_node(text) if ":" in text else None


def _register() -> None:
    from pipelab.emulate import specs

    if _read_name not in specs.NODE_READERS:
        specs.NODE_READERS.append(_read_name)


_register()

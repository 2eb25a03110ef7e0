"""The measurements `pipelab calibrate` makes on real GPUs (fitted in `calibrate.py`).

Kernels are timed with CUDA events on the GPU's own stream: a warm-up, then a batch of calls long
enough (about a millisecond) that the events' resolution does not matter, repeated, the median
batch divided by its calls. Only a copy between two GPUs uses the host clock (two devices, two
streams: no single stream sees the whole copy) after synchronising both. NCCL's collectives run in
one process per GPU, timed on each rank's stream as nccl-tests does, over message sizes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

BATCH_S = 1e-3  # one timed batch lasts at least this long
REPEATS = 7
LONGEST_CALL_S = 0.25  # a size whose single call takes longer is not repeated (keeps the run short)
# Lesson 06's stage timed on a lent H100 with CUDA events: its rows, each a stage and its F and F+B.
MEASURED_STAGES = Path(__file__).parent / "calibrations" / "h100-sxm-2026-11-27-measured.json"


def measured_stages(path: Path = MEASURED_STAGES) -> dict:
    """The measured run of lesson 06's stage: the GPU, versions, date and its `rows`."""
    return json.loads(Path(path).read_text())


def measured_stage(row: dict) -> tuple[nn.Sequential, torch.Tensor]:
    """The stage a measured row timed, rebuilt on the meta device with its input, so the cost model
    can time the same module: `layers` Linear(`width`) with a ReLU after each (none after the last
    where the row says so), on `rows` rows."""
    with torch.device("meta"):
        layers: list[nn.Module] = []
        for i in range(row["layers"]):
            layers.append(nn.Linear(row["width"], row["width"]))
            if not (row["last_stage_relu_dropped"] and i == row["layers"] - 1):
                layers.append(nn.ReLU())
        return nn.Sequential(*layers), torch.empty(row["rows"], row["width"])


def time_kernel(fn: Callable[[], object], repeats: int = REPEATS, warmup: int = 2) -> float:
    """Median seconds of one `fn()` on the current CUDA stream (CUDA events, batches >= BATCH_S)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) / 1e3
    if one > LONGEST_CALL_S:
        repeats = 1
    calls = max(1, min(1000, math.ceil(BATCH_S / max(one, 1e-7))))
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def dtypes_supported() -> list[str]:
    """The matrix-product dtypes this GPU runs: float32 and float16 always, tf32 and bfloat16 from Ampere (8.0) on."""
    major, _ = torch.cuda.get_device_capability()
    found = ["float32", "float16"]
    if major >= 8:
        found[1:1] = ["tf32"]
    if torch.cuda.is_bf16_supported() and major >= 8:
        found.append("bfloat16")
    return found


def measure_matmul(sizes, dtypes, log=print) -> list[dict]:
    """Seconds of an n x n by n x n product per size and dtype (tf32: float32 tensors, TF32 math)."""
    storage = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}
    saved = torch.backends.cuda.matmul.allow_tf32
    rows = []
    try:
        for dtype in dtypes:
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            for n in sizes:
                a = torch.randn(n, n, device="cuda", dtype=storage[dtype])
                b = torch.randn(n, n, device="cuda", dtype=storage[dtype])
                out = torch.empty(n, n, device="cuda", dtype=storage[dtype])
                seconds = time_kernel(lambda: torch.mm(a, b, out=out))
                rows.append({"dtype": dtype, "n": n, "seconds": seconds})
                log(f"  matmul {dtype:>8} n={n:<5} {seconds * 1e3:8.3f} ms  {2 * n**3 / seconds / 1e12:7.1f} TFLOP/s")
                del a, b, out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    torch.cuda.empty_cache()
    return rows


def measure_copy(sizes, log=print) -> list[dict]:
    """Seconds of copying `nbytes` within device memory; `bytes` counts the read and the write."""
    free, _ = torch.cuda.mem_get_info()
    rows = []
    for nbytes in sizes:
        if 2 * nbytes > free // 2:
            log(f"  copy {nbytes / 2**20:.0f} MiB skipped: {free / 2**30:.1f} GiB free")
            continue
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
        dst = torch.empty_like(src)
        seconds = time_kernel(lambda: dst.copy_(src))
        rows.append({"bytes": 2 * nbytes, "seconds": seconds})
        log(f"  copy {nbytes / 2**20:6.0f} MiB {seconds * 1e6:9.1f} us  {2 * nbytes / seconds / 1e9:7.0f} GB/s")
        del src, dst
    torch.cuda.empty_cache()
    return rows


def measure_launch(repeats: int = REPEATS) -> list[float]:
    """Seconds per launch of a one-element kernel, back to back (what each tiny operator costs)."""
    x = torch.zeros(1, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(100):
        x.add_(1)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        for _ in range(1000):
            x.add_(1)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 1000)
    return times


def driver_version() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi (None when it cannot be asked)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def machine_info() -> dict:
    """GPU name, memory, compute capability, count, driver, CUDA, torch, Python, date (UTC)."""
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "memory_bytes": props.total_memory,
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "gpu_count": torch.cuda.device_count(), "driver": driver_version(),
            "cuda": torch.version.cuda, "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


# ---------------------------------------------------------------------------------------------
# Several GPUs: a copy between two, and NCCL's collectives
# ---------------------------------------------------------------------------------------------


def measure_peer_copy(sizes, log=print) -> list[dict]:
    """Seconds of copying `bytes` from GPU 0 to GPU 1 (host clock around synchronised batches)."""
    rows = []
    for nbytes in sizes:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        dst.copy_(src)
        times = []
        for _ in range(REPEATS):
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
            t = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
            times.append(time.perf_counter() - t)
        rows.append({"bytes": nbytes, "seconds": statistics.median(times)})
        log(f"  GPU0->GPU1 copy {nbytes / 2**20:8.3f} MiB {rows[-1]['seconds'] * 1e6:9.1f} us")
        del src, dst
    return rows


def _collective(name: str, x, out, rank: int, world: int):
    import torch.distributed as dist

    if name == "all_reduce":
        return lambda: dist.all_reduce(x)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, x)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out, x)
    # send/receive: every rank sends to the next and receives from the previous, as nccl-tests' sendrecv.
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, out, (rank - 1) % world)]
    return lambda: [w.wait() for w in dist.batch_isend_irecv(ops)]


def _nccl_worker(rank: int, world: int, port: int, sizes, path: str) -> None:
    """One rank of the collectives' measurement; rank 0 writes the medians (the slowest rank's) to `path`."""
    import json

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    results: dict[str, list] = {}
    for name in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        for nbytes in sizes:
            count = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by the ranks
            x = torch.ones(count, device="cuda")
            out = torch.empty(count * world if name == "all_gather" else
                              count // world if name == "reduce_scatter" else count, device="cuda")
            fn = _collective(name, x, out, rank, world)
            dist.barrier()
            seconds = torch.tensor([time_kernel(fn, repeats=5, warmup=3)], device="cuda")
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            results.setdefault(name, []).append({"bytes": count * 4, "seconds": seconds.item()})
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(world: int, sizes, log=print) -> dict[str, list]:
    """NCCL's all-reduce, all-gather, reduce-scatter and send/receive over `world` GPUs, one process each."""
    import json

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "collectives.json")
        mp.spawn(_nccl_worker, args=(world, port, list(sizes), path), nprocs=world, join=True)
        with open(path) as f:
            results = json.load(f)
    for name, rows in results.items():
        big = rows[-1]
        log(f"  {name:<14} {world} GPUs, {big['bytes'] / 2**20:.0f} MiB: {big['seconds'] * 1e3:.3f} ms")
    return results


MESSAGE_BYTES = tuple(2**k for k in range(10, 29, 3))  # 1 KiB .. 256 MiB


def measure_links(log=print, sizes=None) -> dict:
    """With two GPUs or more: the copy between two and the collectives over all (up to 8)."""
    world = min(torch.cuda.device_count(), 8)
    sizes = tuple(sizes or MESSAGE_BYTES)
    log(f"links: {world} GPUs")
    return {"ranks": world, "copy": measure_peer_copy(sizes, log),
            "collectives": measure_collectives(world, sizes, log)}


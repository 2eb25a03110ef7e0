"""What this machine has, and which path a lesson takes on it.

Every notebook prints `describe()` first (`describe_devices()` in the one-process lessons 02-04),
so a reader of an executed notebook knows whether the timelines came from GPUs with NCCL, from CPU
processes with gloo, or from one process driving devices through streams.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    cpu_cores: int
    gpus: tuple[str, ...]  # names of the visible CUDA devices
    torch_version: str
    cuda_version: str | None

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset / container limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory this process can still take: the kernel's MemAvailable (Linux), or free
    pages from sysconf; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def detect() -> Hardware:
    """Look at the machine: CPU cores, CUDA devices and their names, torch version."""
    import torch

    gpus: tuple[str, ...] = ()
    if torch.cuda.is_available():
        gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return Hardware(cpu_cores(), gpus, torch.__version__, torch.version.cuda)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def synchronize(device) -> None:
    """Wait for the GPU work queued on `device` (a no-op on CPU).

    GPU work is asynchronous: without this, a clock read after a kernel launch measures only the
    launch, not the work."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def choose_backend(world_size: int, backend: str = "auto") -> str:
    """The process-group backend for `world_size` ranks on this machine.

    NCCL needs one GPU per rank; with fewer GPUs than ranks the ranks run on CPU with gloo.
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    gpus = gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine has "
            f"{gpus} GPU(s); use backend='gloo' (CPU) or a smaller world_size"
        )
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    return backend


def _machine(hw: Hardware) -> str:
    """The machine in a few words: its GPUs, or its CPU cores."""
    if hw.gpus:
        names = ", ".join(sorted(set(hw.gpus)))
        return f"{hw.gpu_count} GPU(s) ({names}), {hw.cpu_cores} CPU cores, CUDA {hw.cuda_version}"
    return f"no GPU, {hw.cpu_cores} CPU cores ({platform.processor() or platform.machine()})"


def describe(world_size: int = 2) -> str:
    """One line: the machine, and the path `world_size` ranks (one process each) take on it."""
    hw = detect()
    backend = choose_backend(world_size)
    if backend == "nccl":
        path = f"GPU path: {world_size} ranks on cuda:0..{world_size - 1} with NCCL"
    else:
        path = f"CPU path: {world_size} ranks on CPU with gloo, one thread each"
    return f"{path} | {_machine(hw)} | torch {hw.torch_version}"


def describe_devices(n: int = 2) -> str:
    """One line: the machine, and the path of a one-process lesson that drives `n` devices
    through streams (lessons 02-04): n GPUs when it has them, else n virtual CPU devices
    (the choice `streams.devices(n)` makes). No ranks, no process group: one Python process."""
    hw = detect()
    if hw.gpu_count >= n:
        path = f"GPU path: one process drives {n} GPUs (cuda:0..{n - 1}), a CUDA stream per stream"
    else:
        path = (f"CPU path: one process drives {n} virtual CPU devices, "
                f"a worker thread per stream, one intra-op thread each")
    return f"{path} | {_machine(hw)} | torch {hw.torch_version}"

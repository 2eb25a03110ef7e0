"""What this machine has, and which path a lesson takes on it.

Every notebook prints `describe()` first (`describe_devices()` in the one-process lessons 02-04),
so a reader of an executed notebook knows whether the timelines came from GPUs with NCCL, from CPU
processes with gloo, or from one process driving devices through streams.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import subprocess
import sys
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


CGROUP_ROOT = "/sys/fs/cgroup"  # where cgroup v2 is mounted (containers, JupyterHub, Slurm jobs)


def _cgroup_value(name: str) -> str | None:
    """This process's cgroup v2 file `name` (e.g. "cpu.max"), read from its own cgroup's folder
    (as /proc/self/cgroup names it) or the mount's root, as a container sees it; None without one."""
    folders = [CGROUP_ROOT]
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):  # the cgroup v2 line: "0::/path"
                    folders.insert(0, CGROUP_ROOT + line[3:].strip().rstrip("/"))
    except OSError:
        pass
    for folder in folders:
        try:
            with open(os.path.join(folder, name)) as f:
                return f.read().strip()
        except OSError:
            continue
    return None


def cgroup_cpu_limit() -> float | None:
    """CPUs the cgroup's quota allows (`cpu.max` "200000 100000" is 2.0), or None for no quota.
    A container limited with `docker run --cpus 2` sees every host core but gets two cores' time."""
    text = _cgroup_value("cpu.max")
    if not text or text.split()[0] == "max":
        return None
    quota, period = text.split()[:2]
    return int(quota) / int(period)


def cgroup_memory_available() -> int | None:
    """Bytes the cgroup still allows (`memory.max` minus `memory.current`), or None for no limit.
    The host's free memory says nothing about a container's limit: its OOM killer strikes first."""
    limit = _cgroup_value("memory.max")
    if not limit or limit == "max":
        return None
    used = _cgroup_value("memory.current")
    return max(0, int(limit) - int(used or 0))


def cpu_cores() -> int:
    """Cores this process may use: its CPU affinity (taskset, cpusets), further limited by a cgroup
    CPU quota (containers, JupyterHub), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return cores


def available_memory() -> int | None:
    """Bytes of memory this process can still take: the kernel's MemAvailable on Linux (the smaller
    of it and the cgroup's allowance in a container), the machine's memory on macOS (`sysctl
    hw.memsize`; macOS does not say how much is free), free pages elsewhere; None where none is known."""
    known = [m for m in (_meminfo_available(), cgroup_memory_available()) if m is not None]
    if known:
        return min(known)
    if sys.platform == "darwin":
        return _macos_memsize()
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES; Windows no sysconf
        return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _macos_memsize() -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def platform_problem() -> str | None:
    """Why this platform cannot run the course's workers, or None. Workers are POSIX processes:
    each rank leads its own process group so that spawn can end it and whatever it started."""
    if sys.platform == "win32" or not hasattr(os, "killpg"):
        return ("pipelab's workers need Linux or macOS (each rank runs in its own POSIX process group, "
                "which Windows lacks); on Windows, run the course in WSL2 "
                "(https://learn.microsoft.com/windows/wsl/install) or a Linux container")
    return None


def loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), for the process
    groups of one machine: gloo otherwise binds to the address of the host name, which a laptop on
    a `.local` name may not resolve."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


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


DEFAULT_NODE = "H100-nvlink"  # what a timing lesson emulates where the machine lacks the GPUs


def lesson_node(world_size: int, emulate: str | None = "auto", kind: str = DEFAULT_NODE,
                device: str = "auto") -> str | None:
    """The emulated node a timing lesson runs its `world_size` ranks on: none where this machine
    has a GPU per rank (nothing is emulated there), where `emulate` is None, or where "auto" meets
    `device="cuda"` (lessons 02-04: the devices are this machine's GPU, measured); with "auto",
    `world_size` x `kind` (e.g. "2xH100-nvlink"); any other name as given."""
    if emulate is None or (emulate == "auto" and (gpu_count() >= world_size or device == "cuda")):
        return None
    return f"{world_size}x{kind}" if emulate == "auto" else emulate


def describe(world_size: int = 2, emulate: str | None = None, size: str | None = None) -> str:
    """One line: the machine, and the path `world_size` ranks (one process each) take on it; with
    `emulate` (a node name), that the ranks run on that emulated node, what is modelled and, with
    `size` (e.g. "16 layers of width 8192, micro-batches of 4096 rows in bfloat16"), at which size."""
    hw = detect()
    if emulate is not None:
        return _emulated(f"{world_size} ranks as", "real processes, real math and real gloo messages", emulate, size, hw)
    backend = choose_backend(world_size)
    if backend == "nccl":
        path = f"GPU path: {world_size} ranks on cuda:0..{world_size - 1} with NCCL"
    else:
        path = f"CPU path: {world_size} ranks on CPU with gloo, one thread each"
    return f"{path} | {_machine(hw)} | torch {hw.torch_version}"


def _emulated(who: str, real: str, emulate, size: str | None, hw) -> str:
    """The line of an emulated node: who runs as which node (its name, e.g. "2xH100-nvlink"), what
    stays real, what is modelled (the model's figures: `pipelab.emulate.model_table`)."""
    at = f" at the emulated size: {size}" if size else ""
    calibrated = ":" in str(emulate)  # "8x:calibration.json": a GPU `pipelab calibrate` measured
    basis = "from the GPU as `pipelab calibrate` measured it" if calibrated else "on the emulated node"
    return (f"Emulated node: {who} {emulate} ({real} on this machine's CPU; each operation's time modelled "
            f"{basis}, not measured{at}) | {_machine(hw)} | torch {hw.torch_version}")


def describe_devices(n: int = 2, emulate: str | None = None, size: str | None = None, device: str = "auto") -> str:
    """One line: the machine, and the path of a one-process lesson that drives `n` devices
    through streams (lessons 02-04): the choice `streams.devices(n, device=device)` makes, n GPUs
    when it has them, n sets of streams of one GPU with `device="cuda"` on a smaller machine, else
    n virtual CPU devices. No ranks, no process group: one Python process.
    With `emulate` (a node name), the virtual devices are paced as that node's devices."""
    hw = detect()
    if emulate is not None:
        return _emulated(f"one process drives {n} virtual devices paced as", "real math", emulate, size, hw)
    if device == "cuda" and 1 <= hw.gpu_count < n:
        path = (f"one-GPU path: one process drives {n} devices as sets of CUDA streams of cuda:0 (measured; they share "
                f"its SMs, so overlap is concurrency on one GPU, not {n} GPUs)")
    elif hw.gpu_count >= n and device != "cpu":
        path = f"GPU path: one process drives {n} GPUs (cuda:0..{n - 1}), a CUDA stream per stream"
    else:
        path = (f"CPU path: one process drives {n} virtual CPU devices, "
                f"a worker thread per stream, one intra-op thread each")
    return f"{path} | {_machine(hw)} | torch {hw.torch_version}"

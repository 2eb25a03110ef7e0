"""The emulator's hardware model, calibrated on published measurements of real GPUs and links.

The data sheet gives each device's peak (`specs`); what real kernels and NCCL reach is measured,
and differs with the size of the work. Every constant here was fitted (`fitting`) on the rows
marked `calibrate` in `measured` (`published/*.csv`, each table with its source); the rows marked
`check` were held out, and the tests hold the model to them.

- **A kernel** lasts the longer of the host's cost of issuing it (`launch_s`, a floor) and its work
  at the measured efficiency: a matrix product of F FLOPs at a saturating fraction of the peak,
  e(F) = e_max F / (F + half) -- small products cannot fill the GPU -- and a memory-bound kernel at
  the measured fraction of the sheet's bandwidth. The peak stays the limit (e <= e_max <= 1).
- **A collective** on one machine is NCCL's ring: 2(n-1) steps for all-reduce, n-1 for all-gather,
  reduce-scatter and broadcast, each protocol (LL: low latency, low bandwidth; Simple: the
  reverse) a per-step latency plus the bus factor x bytes / its bus bandwidth, NCCL taking the
  faster for each size. On NVSwitch nodes (NVLink 4) an all-reduce of 5 or more GPUs may go
  through the switch instead (NVLS, NVLink SHARP): a latency plus bytes / its algorithm bandwidth.
- **Several machines** (g GPUs to a machine, one network card each): NCCL's ring runs through every
  GPU, pipelined, so its bytes go at the slower of the machine's link and its g cards together, and
  each of its steps takes the network's measured step; an all-reduce goes up and down NCCL's tree
  instead, 2 (g - 1 + log2 machines) steps (the chain inside each machine, the tree across them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipelab.emulate.measured import bus_factor

# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Efficiency:
    """What one device's kernels reach: the per-kernel floor (seconds), the matrix products'
    (e_max, half_flops) per dtype, and the fraction of the sheet's memory bandwidth a streaming
    kernel reaches; `source` names the measured tables (or says the figures are borrowed)."""
    launch_s: float
    matmul: dict[str, tuple[float, float]]
    memory_fraction: float
    source: str


MEMORY_TABLE = "a800_pcie_memory_mli"
# fitting.fit_memory on that table's calibrate rows: the A800 (an A100 80GB PCIe) streams at 0.8928
# of its 1,935 GB/s, and a tiny kernel lasts 7.28 us there. The fraction is applied to every device:
# it is the only measured memory table the repository holds.
MEMORY_FRACTION = 0.8928
MEMORY_LAUNCH_S = 7.279e-6

# fitting.fit_device on each device's matrix-product table, rows n = 1024, 4096, 10240 (a fitted
# half of ~0 means the launch floor alone explains the small products). dtype -> (e_max, half_flops).
H100 = Efficiency(1.144e-5, {"float32": (0.7593, 7.73e8), "tf32": (0.8011, 4.95e9), "float16": (0.7203, 0.0),
                             "bfloat16": (0.7614, 0.0)}, MEMORY_FRACTION, "h100_matmul_zzc0721")
A100_PCIE = Efficiency(6.79e-6, {"float32": (0.8307, 1.72e9), "tf32": (0.6777, 1.57e9), "float16": (0.7229, 3.62e9),
                                 "bfloat16": (0.7209, 2.93e9)}, MEMORY_FRACTION, "a100_pcie_matmul_zzc0721")
L4 = Efficiency(1.18e-5, {"float32": (0.4008, 0.0), "tf32": (0.4206, 1.67e9), "float16": (0.4415, 0.0),
                          "bfloat16": (0.4621, 5.96e7)}, MEMORY_FRACTION, "l4_matmul_zzc0721")
# One row each (mamf_stas00): the H100's fp8 at its measured best, 1402.6 TFLOP/s (fill as its bf16);
# the A100 SXM's bf16 and fp16 at the measured best 271.2 TFLOP/s (fill as the A100 PCIe's), the
# rest as the A100 PCIe's.
H100_FP8 = (0.7088, 0.0)
A100_SXM_HALF_PRECISION = {"bfloat16": (0.8930, 2.93e9), "float16": (0.8985, 3.62e9)}

EFFICIENCIES: dict[str, Efficiency] = {
    "h100": Efficiency(H100.launch_s, {**H100.matmul, "float8": H100_FP8}, MEMORY_FRACTION,
                       "h100_matmul_zzc0721; fp8: mamf_stas00"),
    "a100-pcie": A100_PCIE,
    "a100": Efficiency(A100_PCIE.launch_s, {**A100_PCIE.matmul, **A100_SXM_HALF_PRECISION}, MEMORY_FRACTION, "mamf_stas00 (bf16 peak fraction); the rest a100_pcie_matmul_zzc0721"),
    "l4": L4,
}


def efficiency_of(device) -> Efficiency:
    """The calibrated efficiency of `device` (a `specs.Device`): its own (a calibration spec), the
    fit for its key, or the borrowed one `specs` names for devices without measured tables."""
    from pipelab.emulate import specs

    if getattr(device, "efficiency", None):
        e = device.efficiency
        return Efficiency(e["launch_s"], {k: tuple(v) for k, v in e["matmul"].items()},
                          e["memory_fraction"], e.get("source", device.source))
    key = specs.key_of(device)
    return EFFICIENCIES.get(key) or EFFICIENCIES[specs.EFFICIENCY_FROM.get(key, "h100")]


def _matmul_fit(eff: Efficiency, device, dtype: str) -> tuple[float, float]:
    if dtype in eff.matmul:
        return eff.matmul[dtype]
    # A dtype the tables lack: the device's best measured fraction, the fill time of its bf16/fp16.
    e_max = max(e for e, _ in eff.matmul.values())
    ref = next((d for d in ("bfloat16", "float16", "float32") if d in eff.matmul), next(iter(eff.matmul)))
    fill_s = eff.matmul[ref][1] / (device.rate(ref) * eff.matmul[ref][0])
    return e_max, fill_s * device.rate(dtype) * e_max


def kernel_seconds(flops: float, nbytes: float, device, dtype: str, launch_s: float | None = None) -> float:
    """Seconds of one kernel of `flops` and `nbytes` on `device` in `dtype` (a dtype name of
    `specs.DTYPE_NAMES`): the launch floor, the FLOPs at the measured efficiency for that much work,
    or the bytes at the measured bandwidth -- the longest."""
    eff = efficiency_of(device)
    floor = eff.launch_s if launch_s is None else launch_s
    compute = 0.0
    if flops > 0:
        e_max, half = _matmul_fit(eff, device, dtype)
        compute = (flops + half) / (device.rate(dtype) * e_max)
    memory = nbytes / (eff.memory_fraction * device.memory_bandwidth)
    return max(floor, compute, memory)


def stream_seconds(flops: float, nbytes: float, kernels: int, compute_kernels: int, device, dtype: str,
                   launch_s: float | None = None) -> float:
    """Seconds of `kernels` kernels issued one after another (eager PyTorch: the host issues while
    the GPU runs): the longer of the host's issue time (the launch floor each) and the GPU's, whose
    `compute_kernels` products do `flops` at the efficiency measured for products of their size
    and whose kernels move `nbytes` at the measured bandwidth (a roofline over the whole stream)."""
    eff = efficiency_of(device)
    floor = eff.launch_s if launch_s is None else launch_s
    compute = 0.0
    if flops > 0:
        e_max, half = _matmul_fit(eff, device, dtype)
        compute = (flops + max(1, compute_kernels) * half) / (device.rate(dtype) * e_max)
    memory = nbytes / (eff.memory_fraction * device.memory_bandwidth)
    return max(kernels * floor, compute, memory)


def matmul_seconds(m: int, n: int, k: int, device, dtype: str, itemsize: int = 2) -> float:
    """Seconds of one (m x k) @ (k x n) product: 2mnk FLOPs, reading both and writing the result."""
    return kernel_seconds(2.0 * m * n * k, float(itemsize * (m * k + k * n + m * n)), device, dtype)


# ---------------------------------------------------------------------------------------------
# Links and collectives
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fabric:
    """What NCCL reaches over one kind of link: the LL and Simple protocols (per-step latency in
    seconds, bus bandwidth in bytes/s) and, on NVSwitch nodes, NVLS all-reduce (latency, algorithm
    bandwidth; 0 where there is none); `source` names the measured tables or the assumption."""
    ll_step_s: float
    ll_busbw: float
    simple_step_s: float
    simple_busbw: float
    nvls_s: float = 0.0
    nvls_algbw: float = 0.0
    source: str = ""


NVLS_MIN_RANKS = 5  # h200_nvls_sweep: NCCL picks NVLS from 5 GPUs of an 8 x H200 node, Ring at 4
# fitting.fit_fabric on the calibrate rows of a100_allreduce_nccl_tests.
NVLINK3 = Fabric(2.970e-6, 23.50e9, 5.894e-6, 216.0e9, source="a100_allreduce_nccl_tests")
# ... and of h200_allreduce_bench and h200_collectives_16g (the Simple step latency is NVLink 3's:
# those tables never time the ring at a size where its latency shows).
NVLINK4 = Fabric(3.792e-6, 46.73e9, NVLINK3.simple_step_s, 367.6e9, 42.11e-6, 247.2e9,
                 source="h200_allreduce_bench, h200_collectives_16g")
# fitting.fit_fabric on the calibrate rows of b200_allreduce_1node (NCCL's choice on 8 x B200, NVLS
# not told apart from the ring there: the NVLS pair is what fits the table, not a measured NVLS rate).
NVLINK5 = Fabric(4.933e-6, 99.83e9, 7.645e-6, 780.3e9, 45.63e-6, 125.7e9, source="b200_allreduce_1node")
# No measured table: NCCL's cost model puts PCIe's per-step latency at 5.7 us against NVLink's 3.4
# (src/graph/tuning.cc, hwLat), so the NVLink 3 steps scaled by 5.7/3.4; the bandwidth is the data
# sheet's at the efficiency NCCL's ring reaches on NVLink 4 (367.6 of 450 GB/s).
PCIE_LATENCY = 5.7 / 3.4
RING_EFFICIENCY = NVLINK4.simple_busbw / 450e9
LL_SHARE = NVLINK3.ll_busbw / NVLINK3.simple_busbw


def _pcie(sheet_Bps: float) -> Fabric:
    bw = sheet_Bps * RING_EFFICIENCY
    return Fabric(NVLINK3.ll_step_s * PCIE_LATENCY, bw * LL_SHARE, NVLINK3.simple_step_s * PCIE_LATENCY, bw,
                  source="assumed: the data sheet at NVLink 4's measured ring efficiency; NCCL's PCIe latency")


# fitting.fit_fabric on the calibrate rows of h100_4node_ib_allreduce and h100_4node_ib_allgather
# (4 x 8 H100, one 400 Gb/s NDR card a GPU), with NVLink 4 inside the machines (hierarchical_seconds):
# per card, the LL and Simple step and bus bandwidth. NCCL_DEBUG was off there, so which algorithm
# ran at each size is not known: the tree and the ring are what fits. The step is the mean hop of
# 32-GPU rings and trees, most of whose hops stay inside a machine; a node of one GPU a machine
# ("2xH100-ib-ndr") crosses the network at every step, which it likely makes too short.
IB_NDR = Fabric(2.365e-6, 3.779e9, 7.614e-6, 40.34e9, source="h100_4node_ib_allreduce, h100_4node_ib_allgather")
# No measured table: InfiniBand NDR's fit with the bandwidth at 100 of its 400 Gb/s line rate.
ETHERNET_100G = Fabric(IB_NDR.ll_step_s, IB_NDR.ll_busbw / 4, IB_NDR.simple_step_s, IB_NDR.simple_busbw / 4,
                       source="assumed: InfiniBand NDR's fit (h100_4node_ib_*) at a quarter of its bandwidth")
# fitting.fit_fabric on the calibrate rows of b200_allreduce_4node_efa, with NVLink 5 inside the
# machines: one protocol, a per-step cost (network and NCCL's proxy) and the bandwidth per card.
EFA = Fabric(24.47e-6, 45.96e9, 24.47e-6, 45.96e9, source="b200_allreduce_4node_efa")

FABRICS: dict[str, Fabric] = {
    "nvlink5": NVLINK5, "nvlink4": NVLINK4, "nvlink3": NVLINK3, "efa": EFA,
    "pcie3": _pcie(16e9), "pcie4": _pcie(32e9), "pcie5": _pcie(64e9),
    "ib-ndr": IB_NDR, "100gbe": ETHERNET_100G,
}


def fabric_of(link) -> Fabric | None:
    """The calibrated model of `link` (a `specs.Link`): its own (a calibration spec's `fabric`), the
    fit for its kind, or None for a link without one (the plain latency-bandwidth formula applies)."""
    if getattr(link, "fabric", None):
        return Fabric(**link.fabric)
    return FABRICS.get(getattr(link, "kind", ""))


STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1,
         "broadcast": lambda n: n - 1, "send": lambda n: 1}


def ring_seconds(kind: str, nbytes: float, ranks: int, fabric: Fabric, algo: str = "auto") -> float:
    """Seconds of collective `kind` of `nbytes` (the whole tensor) over `ranks` GPUs joined by
    `fabric`: the faster protocol of NCCL's ring, or NVLS for an all-reduce where the node has it
    (`algo="ring"` forces the ring, as NCCL_NVLS_ENABLE=0 does)."""
    if ranks <= 1 and kind != "send":
        return 0.0
    steps, factor = STEPS[kind](ranks), bus_factor(kind, ranks)
    seconds = min(steps * fabric.ll_step_s + factor * nbytes / fabric.ll_busbw,
                  steps * fabric.simple_step_s + factor * nbytes / fabric.simple_busbw)
    if kind == "all_reduce" and algo == "auto" and fabric.nvls_algbw and ranks >= NVLS_MIN_RANKS:
        seconds = min(seconds, fabric.nvls_s + nbytes / fabric.nvls_algbw)
    return seconds


def hierarchical_seconds(kind: str, nbytes: float, ranks: int, per_node: int, inner: Fabric, net: Fabric) -> float:
    """A collective over `ranks` GPUs, `per_node` to a machine, each with its own network card:
    NCCL's ring through every GPU, pipelined (its bytes at the slower of the machine's link and the
    machine's cards together, each step at the network's step), or for an all-reduce NCCL's tree
    (the chain inside each machine, a binary tree across them, up and down); the faster protocol."""
    machines = max(1, ranks // per_node)
    if machines == 1:
        return ring_seconds(kind, nbytes, ranks, inner)
    if kind == "send":  # one message between machines: one card
        return ring_seconds("send", nbytes, 2, net)
    factor = bus_factor(kind, ranks)
    ll_bw = min(inner.ll_busbw, per_node * net.ll_busbw)
    simple_bw = min(inner.simple_busbw, per_node * net.simple_busbw)
    steps = STEPS[kind](ranks)
    if kind == "all_reduce":
        steps = 2 * (per_node - 1 + math.ceil(math.log2(machines)))
    return min(steps * net.ll_step_s + factor * nbytes / ll_bw, steps * net.simple_step_s + factor * nbytes / simple_bw)


def collective_seconds(kind: str, nbytes: float, ranks: int, link) -> float | None:
    """Seconds of collective `kind` ("all_reduce", "reduce_scatter", "all_gather", "broadcast",
    "barrier") of `nbytes` over `ranks` devices of a node joined by `link`, or None where the link
    has no calibrated model. A barrier is an all-reduce of nothing."""
    fabric = fabric_of(link)
    if fabric is None:
        return None
    if kind == "barrier":
        kind, nbytes = "all_reduce", 0.0
    if getattr(link, "per_node", 0):
        return hierarchical_seconds(kind, nbytes, ranks, link.per_node, fabric_of_key(link.inner), fabric)
    return ring_seconds(kind, nbytes, ranks, fabric)


def message_seconds(nbytes: float, link) -> float | None:
    """Seconds of one message of `nbytes` over `link` (between machines, on a node of several), or
    None where the link has no calibrated model: the faster protocol's one step."""
    fabric = fabric_of(link)
    return None if fabric is None else ring_seconds("send", nbytes, 2, fabric)


def fabric_of_key(key: str) -> Fabric:
    """The calibrated model of the link known as `key` (a key of `specs.LINKS`)."""
    return FABRICS[key]

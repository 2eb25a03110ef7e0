"""The accelerators and links the course knows, each figure with its public source beside it:
the vendor's data sheet for what a data sheet states, and, where no data sheet states a figure (a
link's latency), where the estimate comes from. Two conventions, the vendors' own:

- FLOP/s are *dense*: NVIDIA's data sheets print tensor-core rates "with sparsity" (2:4 structured
  sparsity doubles them), so the dense rate is half the printed one; training uses dense math.
- A link's bandwidth here is *one direction*: data sheets print NVLink and PCIe as the sum of both
  directions ("900 GB/s" for NVLink 4 is 450 GB/s each way), network ports per direction.

GB is 10^9 bytes, as on the data sheets. `specs` reads node names against these tables and lets a
user add their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as _with

import torch

GB = 1e9
TERA = 1e12

# The dtype names a device's `flops` table uses, and the spellings accepted for each.
DTYPE_NAMES = {
    "float32": ("float32", "fp32", "float", "torch.float32"),
    "tf32": ("tf32", "tensorfloat32"),
    "bfloat16": ("bfloat16", "bf16", "torch.bfloat16"),
    "float16": ("float16", "fp16", "half", "torch.float16"),
    "float8": ("float8", "fp8", "float8_e4m3fn", "float8_e5m2", "torch.float8_e4m3fn", "torch.float8_e5m2"),
}


def dtype_name(dtype) -> str:
    """The table's name for `dtype` (a torch.dtype or a string such as "bf16"): one of DTYPE_NAMES."""
    text = str(dtype).lower()
    for name, spellings in DTYPE_NAMES.items():
        if text in spellings:
            return name
    raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)} (or a torch dtype, "
                     "e.g. torch.bfloat16)")


def torch_dtype(dtype) -> torch.dtype:
    """The dtype tensors are stored in for math in `dtype`: tf32 is float32 storage with
    tensor-core math; fp8 training keeps its tensors in bf16 around fp8 matrix products."""
    return {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16, "float8": torch.bfloat16}[dtype_name(dtype)]


@dataclass(frozen=True)
class Device:
    """One accelerator: dense FLOP/s per dtype name, memory bandwidth (bytes/s), memory (bytes).
    `source` names the data sheet every figure comes from; `nvlink` and `pcie` name the links
    (keys of LINKS) the card itself has, so "4xH100-nvlink" can mean the H100's own NVLink."""
    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: float
    source: str
    nvlink: str | None = None
    pcie: str = "pcie4"
    notes: str = ""
    # Measured efficiency (`calibrated.Efficiency` fields) where it comes with the device, e.g. from
    # a calibration spec (`device_from_spec`); None: the fit `calibrated` holds for this device.
    efficiency: dict | None = None

    def rate(self, dtype="float32") -> float:
        """Dense FLOP/s in `dtype`; a ValueError if the card has no such math (a T4 has no bf16)."""
        name = dtype_name(dtype)
        if name not in self.flops:
            raise ValueError(f"{self.name} has no {name} math in its data sheet; use one of "
                             f"{sorted(self.flops)}")
        return self.flops[name]


@dataclass(frozen=True)
class Link:
    """What joins two devices: one message of m bytes takes `latency_s + m / bandwidth_Bps`.
    `bandwidth_Bps` is bytes/s in one direction. `source` is the bandwidth's data sheet,
    `latency_source` where the latency comes from (an estimate: data sheets do not state it)."""
    name: str
    latency_s: float
    bandwidth_Bps: float
    source: str
    latency_source: str = ""
    # Which measured link model applies: a key of LINKS (`calibrated.FABRICS`), or "" for the plain
    # latency-bandwidth formula above. `fabric` carries a calibration spec's own fit instead.
    kind: str = ""
    # Several machines: `per_node` devices to a machine joined by the link `inner` (a key of
    # LINKS); this link (`kind`) joins the machines, one network card per device. 0: one machine.
    per_node: int = 0
    inner: str = ""
    fabric: dict | None = None


# ---------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------

# Per-step latency of NCCL's own cost model for a ring (Simple protocol), in microseconds: the
# closest thing to a published per-message latency of a GPU link. NVLink 3.4, PCIe 5.7, network 14.
NCCL_TUNING = ("NCCL's cost model, src/graph/tuning.cc, table hwLat (Ring, Simple protocol), "
               "https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc")

H100_SHEET = ("NVIDIA H100 Tensor Core GPU data sheet (H100 SXM column), "
              "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
A100_SHEET = ("NVIDIA A100 Tensor Core GPU data sheet (A100 80GB SXM column), "
              "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
              "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
L4_SHEET = ("NVIDIA L4 Tensor Core GPU data sheet, "
            "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet")
T4_SHEET = ("NVIDIA T4 Tensor Core GPU data sheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
            "Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf")
NDR_SHEET = ("NVIDIA ConnectX-7 adapter data sheet (InfiniBand NDR, 400 Gb/s per port), "
             "https://www.nvidia.com/content/dam/en-zz/Solutions/networking/ethernet-adapters/"
             "connectx-7-datasheet-Final.pdf")
H200_SHEET = ("NVIDIA H200 Tensor Core GPU data sheet (H200 SXM column), "
              "https://www.nvidia.com/en-us/data-center/h200/")
P40_SHEET = ("NVIDIA Tesla P40 data sheet, https://images.nvidia.com/content/pdf/tesla/"
             "184427-Tesla-P40-Datasheet-NV-Final-Letter-Web.pdf")
L40S_SHEET = "NVIDIA L40S GPU data sheet, https://www.nvidia.com/en-us/data-center/l40s/"
B200_SHEET = ("NVIDIA DGX B200 data sheet (8 x B200: FP8 72 PFLOPS, FP16/BF16 36 PFLOPS, TF32 18 PFLOPS "
              "'with sparsity', FP32 600 TFLOPS; 1,440 GB HBM3e at 64 TB/s; NVLink 5 14.4 TB/s in all), "
              "https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet")
ADA_WHITEPAPER = ("NVIDIA Ada GPU Architecture whitepaper, appendix table of the GeForce RTX 4090, "
                  "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
EFA_DOC = ("AWS EC2 P6-B200 instances: 8 x 400 Gb/s EFA v4 network interfaces, one per GPU, "
           "https://aws.amazon.com/ec2/instance-types/p6/")
ETHERNET_STD = "IEEE 802.3ba/802.3bj 100 Gb/s Ethernet (100 Gb/s per direction), https://standards.ieee.org/ieee/802.3/"

LINKS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4", 3.4e-6, 900 * GB / 2,
                    H100_SHEET + ": NVLink 900 GB/s (both directions, so 450 GB/s each way)",
                    "estimate, " + NCCL_TUNING + ": NVLink 3.4 us"),
    "nvlink3": Link("NVLink 3", 3.4e-6, 600 * GB / 2,
                    A100_SHEET + ": NVLink 600 GB/s (both directions, so 300 GB/s each way)",
                    "estimate, " + NCCL_TUNING + ": NVLink 3.4 us"),
    "nvlink5": Link("NVLink 5", 3.4e-6, 1800 * GB / 2,
                    B200_SHEET + ": NVLink 1.8 TB/s per GPU (both directions, so 900 GB/s each way)",
                    "estimate, " + NCCL_TUNING + ": NVLink 3.4 us"),
    "pcie3": Link("PCIe 3 x16", 5.7e-6, 32 * GB / 2,
                  T4_SHEET + ": x16 PCIe Gen3, 32 GB/s (both directions, so 16 GB/s each way)",
                  "estimate, " + NCCL_TUNING + ": PCI 5.7 us"),
    "pcie4": Link("PCIe 4 x16", 5.7e-6, 64 * GB / 2,
                  A100_SHEET + ": PCIe Gen4 64 GB/s (both directions, so 32 GB/s each way)",
                  "estimate, " + NCCL_TUNING + ": PCI 5.7 us"),
    "pcie5": Link("PCIe 5 x16", 5.7e-6, 128 * GB / 2,
                  H100_SHEET + ": PCIe Gen5 128 GB/s (both directions, so 64 GB/s each way)",
                  "estimate, " + NCCL_TUNING + ": PCI 5.7 us"),
    "ib-ndr": Link("InfiniBand NDR 400G", 14e-6, 400e9 / 8, NDR_SHEET + ": 400 Gb/s = 50 GB/s each way",
                   "estimate, " + NCCL_TUNING + ": network 14 us"),
    "efa": Link("AWS EFA v4 400G", 14e-6, 400e9 / 8, EFA_DOC + ": 400 Gb/s = 50 GB/s each way",
                "estimate, " + NCCL_TUNING + ": network 14 us"),
    "100gbe": Link("100 GbE", 14e-6, 100e9 / 8, ETHERNET_STD + ": 100 Gb/s = 12.5 GB/s each way",
                   "estimate, " + NCCL_TUNING + ": network 14 us, which assumes RDMA (RoCE); over "
                   "plain TCP sockets a message takes longer"),
}

# Each link knows its own key, so the calibrated model (`calibrated.FABRICS`) finds its fit.
LINKS = {key: _with(link, kind=key) for key, link in LINKS.items()}

# Short names a node string may use for a link; "nvlink" and "pcie" mean the device's own.
LINK_ALIASES = {"ib": "ib-ndr", "ndr": "ib-ndr", "infiniband": "ib-ndr", "ethernet": "100gbe", "eth": "100gbe"}

# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------

DEVICES: dict[str, Device] = {
    "h100": Device(
        "NVIDIA H100 SXM",
        # Data sheet: FP32 67 TFLOPS; TF32 989, BF16 1,979, FP16 1,979, FP8 3,958 TFLOPS "with sparsity".
        {"float32": 67 * TERA, "tf32": 989 / 2 * TERA, "bfloat16": 1979 / 2 * TERA,
         "float16": 1979 / 2 * TERA, "float8": 3958 / 2 * TERA},
        memory_bandwidth=3.35e12, memory_bytes=80 * GB,  # 3.35 TB/s, 80 GB HBM3
        source=H100_SHEET, nvlink="nvlink4", pcie="pcie5",
        notes="tensor-core rates are half the data sheet's 'with sparsity' figures"),
    "a100": Device(
        "NVIDIA A100 80GB SXM",
        # Data sheet: FP32 19.5 TFLOPS; TF32 156, BF16 312, FP16 312 TFLOPS dense (312/624/624 sparse).
        {"float32": 19.5 * TERA, "tf32": 156 * TERA, "bfloat16": 312 * TERA, "float16": 312 * TERA},
        memory_bandwidth=2039 * GB, memory_bytes=80 * GB,  # 2,039 GB/s, 80 GB HBM2e
        source=A100_SHEET, nvlink="nvlink3", pcie="pcie4",
        notes="no FP8 math on A100"),
    "l4": Device(
        "NVIDIA L4",
        # Data sheet: FP32 30.3 TFLOPS; TF32 120, BF16 242, FP16 242, FP8 485 TFLOPS "with sparsity".
        {"float32": 30.3 * TERA, "tf32": 120 / 2 * TERA, "bfloat16": 242 / 2 * TERA,
         "float16": 242 / 2 * TERA, "float8": 485 / 2 * TERA},
        memory_bandwidth=300 * GB, memory_bytes=24 * GB,  # 300 GB/s, 24 GB GDDR6
        source=L4_SHEET, nvlink=None, pcie="pcie4",
        notes="tensor-core rates are half the data sheet's 'with sparsity' figures; no NVLink"),
    "t4": Device(
        "NVIDIA T4",
        # Data sheet: single precision 8.1 TFLOPS, mixed precision (FP16/FP32) 65 TFLOPS.
        {"float32": 8.1 * TERA, "float16": 65 * TERA},
        memory_bandwidth=300 * GB, memory_bytes=16 * GB,  # 300 GB/s, 16 GB GDDR6
        source=T4_SHEET, nvlink=None, pcie="pcie3",
        notes="Turing: no TF32, BF16 or FP8 math; no NVLink. Memory bandwidth as the data sheet prints it "
              "(256-bit GDDR6 at 10 Gb/s would give 320 GB/s)"),
    "h200": Device(
        "NVIDIA H200 SXM",
        # Data sheet: the H100's rates (FP32 67; TF32 989, BF16/FP16 1,979, FP8 3,958 "with sparsity").
        {"float32": 67 * TERA, "tf32": 989 / 2 * TERA, "bfloat16": 1979 / 2 * TERA,
         "float16": 1979 / 2 * TERA, "float8": 3958 / 2 * TERA},
        memory_bandwidth=4.8e12, memory_bytes=141 * GB,  # 4.8 TB/s, 141 GB HBM3e
        source=H200_SHEET, nvlink="nvlink4", pcie="pcie5",
        notes="the H100's compute with more and faster memory"),
    "a100-40gb": Device(
        "NVIDIA A100 40GB SXM",
        {"float32": 19.5 * TERA, "tf32": 156 * TERA, "bfloat16": 312 * TERA, "float16": 312 * TERA},
        memory_bandwidth=1555 * GB, memory_bytes=40 * GB,  # 1,555 GB/s, 40 GB HBM2
        source=A100_SHEET.replace("A100 80GB SXM column", "A100 40GB SXM column"), nvlink="nvlink3", pcie="pcie4",
        notes="no FP8 math on A100"),
    "a100-pcie": Device(
        "NVIDIA A100 80GB PCIe",
        {"float32": 19.5 * TERA, "tf32": 156 * TERA, "bfloat16": 312 * TERA, "float16": 312 * TERA},
        memory_bandwidth=1935 * GB, memory_bytes=80 * GB,  # 1,935 GB/s, 80 GB HBM2e
        source=A100_SHEET.replace("A100 80GB SXM column", "A100 80GB PCIe column"), nvlink=None, pcie="pcie4",
        notes="a PCIe card: its GPUs talk over PCIe (an NVLink bridge joins pairs only)"),
    "l40s": Device(
        "NVIDIA L40S",
        # Data sheet: FP32 91.6; TF32 366, BF16/FP16 733, FP8 1,466 TFLOPS "with sparsity".
        {"float32": 91.6 * TERA, "tf32": 366 / 2 * TERA, "bfloat16": 733 / 2 * TERA,
         "float16": 733 / 2 * TERA, "float8": 1466 / 2 * TERA},
        memory_bandwidth=864 * GB, memory_bytes=48 * GB,  # 864 GB/s, 48 GB GDDR6
        source=L40S_SHEET, nvlink=None, pcie="pcie4",
        notes="a PCIe card without NVLink; tensor-core rates are half the 'with sparsity' figures"),
    "b200": Device(
        "NVIDIA B200",
        # Data sheet (DGX B200, 8 GPUs): the per-GPU eighth, tensor-core rates half the 'with sparsity' ones.
        {"float32": 600 / 8 * TERA, "tf32": 18000 / 16 * TERA, "bfloat16": 36000 / 16 * TERA,
         "float16": 36000 / 16 * TERA, "float8": 72000 / 16 * TERA},
        memory_bandwidth=8e12, memory_bytes=180 * GB,  # 64 TB/s and 1,440 GB over 8 GPUs
        source=B200_SHEET, nvlink="nvlink5", pcie="pcie5",
        notes="rates are the DGX B200's over its 8 GPUs; no matrix-product table measured: the H100's fit"),
    "rtx4090": Device(
        "NVIDIA GeForce RTX 4090",
        # Whitepaper: FP32 82.6 TFLOPS; tensor TF32 82.6, FP16/BF16 165.2 and FP8 330.3 TFLOPS dense
        # with FP32 accumulate (the GeForce rate; twice that 'with sparsity').
        {"float32": 82.6 * TERA, "tf32": 82.6 * TERA, "bfloat16": 165.2 * TERA, "float16": 165.2 * TERA,
         "float8": 330.3 * TERA},
        memory_bandwidth=1008 * GB, memory_bytes=24 * GB,  # 1,008 GB/s, 24 GB GDDR6X
        source=ADA_WHITEPAPER, nvlink=None, pcie="pcie4",
        notes="a PCIe 4 card without NVLink; no matrix-product table measured: the L4's fit"),
    "p40": Device(
        "NVIDIA Tesla P40",
        # Data sheet: single precision 12 TFLOPS ("up to", boost clock); Pascal: no tensor cores.
        {"float32": 12 * TERA},
        memory_bandwidth=346 * GB, memory_bytes=24 * GB,  # 346 GB/s, 24 GB GDDR5
        source=P40_SHEET, nvlink=None, pcie="pcie3",
        notes="torchgpipe's benchmarks ran on it; Pascal: no tensor cores, fp32 only here"),
}

DEVICE_ALIASES = {"h100-sxm": "h100", "a100-80gb": "a100", "a100-sxm": "a100", "h200-sxm": "h200",
                  "a100-40gb-sxm": "a100-40gb", "l40": "l40s",
                  "4090": "rtx4090"}

# Devices without a measured table of their own borrow the fit of a device that has one:
# the H200 is the H100's compute (stas00's MAMF table: "H200 is the same"); the other A100s are
# the A100; the L40S, T4 and P40, PCIe cards, borrow the L4's, the one PCIe card measured.
EFFICIENCY_FROM = {"h200": "h100", "b200": "h100", "rtx4090": "l4", "a100-40gb": "a100", "l40s": "l4", "t4": "l4", "p40": "l4"}

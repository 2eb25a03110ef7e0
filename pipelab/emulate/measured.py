"""Published measurements of real GPUs and links, as the repository holds them (`published/*.csv`).

Each CSV file is one published table: its header lines (`# source:`, `# hardware:`, `# measured:`,
`# use:`) say where it was published, on which hardware and how it was measured. Every row says
whether it `calibrate`s the emulator's hardware model (the fits in `pipelab.emulate.calibrated`
come from these rows only) or only `check`s it (held out: the tests and
`benchmarks/emulator_vs_published.py` hold the model to them).

Two kinds of row:

- a collective (`Collective`): NCCL's bus bandwidth for `nbytes` over `ranks` GPUs of a node, as
  nccl-tests prints it (`busbw`); `algo` is `auto` (what NCCL picked) or `ring` (Ring forced);
- a kernel (`Kernel`): a matrix product m x n x k in TFLOP/s, or a memory-bound kernel moving
  `nbytes` in GB/s, on one device in one dtype.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).with_name("published")
USES = ("calibrate", "check")


@dataclass(frozen=True)
class Table:
    """One published table: its name, where it was published, the hardware and how it was measured."""
    name: str
    source: str
    hardware: str
    measured: str
    use: str


@dataclass(frozen=True)
class Collective:
    """NCCL's measured bus bandwidth of one collective (bytes/s), and the table it comes from."""
    table: str
    kind: str
    node: str
    ranks: int
    nbytes: float
    busbw_Bps: float
    algo: str
    use: str

    def seconds(self) -> float:
        """The measured time: nccl-tests' busbw is the payload over the time, times the collective's
        bus factor (2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 otherwise)."""
        return self.nbytes * bus_factor(self.kind, self.ranks) / self.busbw_Bps


@dataclass(frozen=True)
class Kernel:
    """One measured kernel: a matrix product (`shape` m, n, k; rate in FLOP/s) or a memory-bound
    kernel (`nbytes` moved; rate in bytes/s)."""
    table: str
    kind: str
    device: str
    dtype: str
    shape: tuple[int, int, int] | None
    nbytes: float
    rate: float
    use: str

    @property
    def flops(self) -> float:
        return 2.0 * self.shape[0] * self.shape[1] * self.shape[2] if self.shape else 0.0

    def seconds(self) -> float:
        """The measured time of one call: its FLOPs (or bytes) over the measured rate."""
        return (self.flops if self.kind == "matmul" else self.nbytes) / self.rate


def bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x this (doc/PERFORMANCE.md in nccl-tests)."""
    n = ranks
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def _read(path: Path) -> tuple[Table, list[dict]]:
    header, lines = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            header[key.strip()] = value.strip()
        elif line.strip():
            lines.append(line)
    table = Table(header["table"], header["source"], header["hardware"], header["measured"], header["use"])
    rows = list(csv.DictReader(lines))
    for row in rows:
        if row["use"] not in USES:
            raise ValueError(f"{path.name}: use must be one of {USES}, got {row['use']!r}")
    return table, rows


@lru_cache(maxsize=None)
def tables() -> dict[str, Table]:
    """Every published table the repository holds, by name."""
    return {t.name: t for t, _ in (_read(p) for p in sorted(HERE.glob("*.csv")))}


@lru_cache(maxsize=None)
def collectives() -> tuple[Collective, ...]:
    """Every measured collective row."""
    out = []
    for path in sorted(HERE.glob("*.csv")):
        table, rows = _read(path)
        out += [Collective(table.name, r["kind"], r["node"], int(r["ranks"]), float(r["nbytes"]),
                           float(r["busbw_GBps"]) * 1e9, r["algo"], r["use"]) for r in rows if "busbw_GBps" in r]
    return tuple(out)


@lru_cache(maxsize=None)
def kernels() -> tuple[Kernel, ...]:
    """Every measured kernel row (matrix products and memory-bound kernels)."""
    out = []
    for path in sorted(HERE.glob("*.csv")):
        table, rows = _read(path)
        for r in rows:
            if "measured" not in r:
                continue
            shape = (int(r["m"]), int(r["n"]), int(r["k"])) if r["m"] else None
            scale = 1e12 if r["unit"] == "TFLOP/s" else 1e9
            out.append(Kernel(table.name, r["kind"], r["device"], r["dtype"], shape,
                              float(r["nbytes"] or 0.0), float(r["measured"]) * scale, r["use"]))
    return tuple(out)

"""The emulator held against published measurements: every row of `measured` beside what the
emulator gives for the same operation on the same hardware.

`compare()` uses the calibrated model (what the lessons use); `compare(model="sheet")` the model
the emulator had before it was calibrated -- the data sheet at a flat 50 % of the peak plus 5 us a
kernel, messages at latency + bytes / the sheet's bandwidth, collectives as ring formulas over it
-- so the two can be set side by side on the same rows. `summary` gives the fraction within 25 %
and the median error, over all rows and over the held-out (`check`) rows alone.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import replace

from pipelab.emulate import calibrated, cost, measured
from pipelab.emulate.cost import Counts
from pipelab.emulate.model import seconds
from pipelab.emulate.specs import DEVICES, key_of, parse_node

MODELS = ("calibrated", "sheet")


def _collective(row: measured.Collective, model: str) -> float:
    node = parse_node(row.node)
    if model == "sheet":
        return cost.collective_seconds(row.kind, row.nbytes, row.ranks, replace(node.link, kind=""))
    if row.algo == "ring":  # NCCL_NVLS_ENABLE=0: the ring alone
        return calibrated.ring_seconds(row.kind, row.nbytes, row.ranks, calibrated.fabric_of(node.link), "ring")
    return seconds(row.kind, nbytes=row.nbytes, node=node, ranks=row.ranks)


def _kernel(row: measured.Kernel, model: str) -> float:
    device = DEVICES[row.device]
    node = f"1x{row.device}"
    if model == "sheet":
        work = Counts(row.flops, row.nbytes if row.kind == "memory" else 0.0, 1)
        return cost.compute_seconds(work, device, row.dtype, efficiency=0.5)
    if row.kind == "matmul":
        return seconds("matmul", shape=row.shape, node=node, dtype=row.dtype)
    return seconds("memory", nbytes=row.nbytes, node=node, dtype=row.dtype)


def compare(model: str = "calibrated") -> list[dict]:
    """One dict per measured row: the table, what was measured, the measured and emulated seconds,
    their error (emulated / measured - 1) and whether the row calibrated the model or only checks it."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    out = []
    for row in measured.collectives():
        what = f"{row.kind} {row.nbytes:.3g} B, {row.ranks} ranks{', ring forced' if row.algo == 'ring' else ''}"
        out.append({"table": row.table, "hardware": row.node, "what": what, "use": row.use,
                    "measured_s": row.seconds(), "emulated_s": _collective(row, model)})
    for row in measured.kernels():
        what = (f"matmul {'x'.join(map(str, row.shape))} {row.dtype}" if row.kind == "matmul"
                else f"memory-bound {row.nbytes:.3g} B")
        out.append({"table": row.table, "hardware": row.device, "what": what, "use": row.use,
                    "measured_s": row.seconds(), "emulated_s": _kernel(row, model)})
    for item in out:
        item["error"] = item["emulated_s"] / item["measured_s"] - 1
    return out


def summary(rows: list[dict]) -> dict:
    """The fraction of rows within 25 % of the measurement and the median absolute error, over
    all rows and over the held-out (`check`) rows; with the count of tables and hardware kinds."""
    def stats(selected):
        errors = [abs(r["error"]) for r in selected]
        return {"rows": len(errors), "within_25pct": sum(e <= 0.25 for e in errors) / len(errors),
                "median_error": statistics.median(errors)}
    return {"all": stats(rows), "check": stats([r for r in rows if r["use"] == "check"]),
            "calibrate": stats([r for r in rows if r["use"] == "calibrate"]),
            "tables": len({r["table"] for r in rows}),
            "hardware": sorted({_device(r["hardware"]) for r in rows})}


def _device(hardware: str) -> str:
    """The device a row ran on: "4x8xB200-efa" -> "b200"; a kernel row's device key as it is."""
    if re.match(r"^(\d+x)+", hardware):  # a node, its link's name perhaps holding '-' ("ib-ndr")
        return key_of(parse_node(hardware).device)
    return hardware.lower()

"""The model an emulated lesson runs on, as one table: every figure of it with its source.

Each emulated lesson shows this table once, in its first section, so a student sees what its
modelled times come from: the device's peak (the limit), what its kernels reach (fitted on
published measurements: the matrix products' efficiency curve, the memory bandwidth, the cost of
one kernel), what NCCL reaches over the link (each protocol's per-step latency and bus bandwidth),
and the size the lesson's work is modelled at. With `PIPELAB_EMULATE_MODEL=datasheet` (the model
before calibration, for comparisons) it shows that model's constants instead.
"""

from __future__ import annotations

EFFICIENCY_SOURCE = ("model FLOPs utilisation of tuned large-model training: Megatron-LM 52 % of the A100's peak "
                     "(https://arxiv.org/abs/2104.04473), PaLM 46.2 % (https://arxiv.org/abs/2204.02311)")
LAUNCH_SOURCE = "an estimate of launching one kernel from PyTorch's eager mode (a few µs of host time), not a data-sheet figure"
LESSON = "this lesson's parameters"


def model_table(node, size: str | None = None, dtype: str = "float32") -> list[dict]:
    """Rows (figure, value, source) of the emulated `node` (a name such as "2xH100-nvlink", or a
    `specs.Node`) as a lesson's modelled times use it: device, `dtype` and its peak, what its
    kernels reach, device memory, what NCCL reaches over its link, and the emulated `size`."""
    from pipelab.emulate import cost
    from pipelab.emulate.specs import parse_node

    node = parse_node(node)
    device = node.device
    rows = [("emulated node", str(node), LESSON),
            ("device", device.name, device.source),
            ("dtype", dtype, LESSON),
            (f"peak dense {dtype} math (the limit)", f"{device.rate(dtype) / 1e12:g} TFLOP/s", device.source),
            *(_datasheet_kernels(device) if cost.datasheet_model() else _calibrated_kernels(device, dtype)),
            ("device memory", f"{device.memory_bytes / 1e9:g} GB", device.source),
            *_link_rows(node.link, cost.datasheet_model())]
    if size:
        rows.append(("emulated size", size, LESSON))
    return [{"figure": f, "value": v, "source": s} for f, v, s in rows]


def _cited(names: str) -> str:
    """Published tables named in `names` ("a; b: c"), each as its file and its source."""
    from pipelab.emulate.measured import tables

    known = tables()
    found = [n for n in known if n in names]
    cited = "; ".join(f"pipelab/emulate/published/{n}.csv ({known[n].source})" for n in found)
    return f"fitted on {cited}" if cited else names


def _calibrated_kernels(device, dtype: str) -> list[tuple[str, str, str]]:
    from pipelab.emulate.calibrated import MEMORY_TABLE, _matmul_fit, efficiency_of

    from pipelab.emulate import specs
    from pipelab.emulate.calibrated import EFFICIENCIES

    eff = efficiency_of(device)
    e_max, half = _matmul_fit(eff, device, dtype)
    key = specs.key_of(device)
    fit = _cited(eff.source)
    if not getattr(device, "efficiency", None) and key not in EFFICIENCIES:  # no measured table of its own
        fit = f"no measured table for this device: the {specs.EFFICIENCY_FROM.get(key, 'h100')}'s fit, {fit}"
    curve = (f"{e_max:.0%} of the peak for large products, half of that at {half / 1e9:.3g} GFLOP per product"
             if half > 0 else f"{e_max:.0%} of the peak at every size (a small product lasts the shortest kernel)")
    return [(f"matrix products in {dtype}: fraction of the peak reached, e(F) = e_max F / (F + half)", curve,
             fit),
            ("memory bandwidth reached (memory-bound kernels)",
             f"{eff.memory_fraction * device.memory_bandwidth / 1e12:.3g} TB/s ({eff.memory_fraction:.0%} of the "
             f"sheet's {device.memory_bandwidth / 1e12:g})", _cited(MEMORY_TABLE)),
            ("shortest kernel (the host's cost of issuing one)", f"{eff.launch_s * 1e6:.3g} µs", fit)]


def _datasheet_kernels(device) -> list[tuple[str, str, str]]:
    from pipelab.emulate import cost

    return [("efficiency (fraction of the peak reached)", f"{cost.EFFICIENCY:.0%}", EFFICIENCY_SOURCE),
            ("memory bandwidth", f"{device.memory_bandwidth / 1e12:g} TB/s", device.source),
            ("launch cost per operator", f"{cost.LAUNCH_OVERHEAD_S * 1e6:g} µs", LAUNCH_SOURCE)]


def _link_rows(link, datasheet: bool) -> list[tuple[str, str, str]]:
    from pipelab.emulate.calibrated import fabric_of

    fabric = None if datasheet else fabric_of(link)
    if fabric is None:
        return [(f"link {link.name}: latency per message", f"{link.latency_s * 1e6:g} µs",
                 link.latency_source or link.source),
                (f"link {link.name}: bandwidth each way", f"{link.bandwidth_Bps / 1e9:g} GB/s", link.source)]
    source = _cited(fabric.source)
    rows = [(f"link {link.name}: NCCL's LL protocol, per ring step and bus bandwidth",
             f"{fabric.ll_step_s * 1e6:.3g} µs, {fabric.ll_busbw / 1e9:.3g} GB/s", source),
            (f"link {link.name}: NCCL's Simple protocol, per ring step and bus bandwidth",
             f"{fabric.simple_step_s * 1e6:.3g} µs, {fabric.simple_busbw / 1e9:.3g} GB/s "
             f"(the sheet's line rate: {link.bandwidth_Bps / 1e9:g} GB/s)", source)]
    if getattr(link, "inner", None):  # a node of several machines: each reduces inside first
        rows += _link_rows(specs_link(link.inner), datasheet)
    if fabric.nvls_algbw:
        rows.append((f"link {link.name}: NVLS all-reduce (5 or more GPUs), latency and algorithm bandwidth",
                     f"{fabric.nvls_s * 1e6:.3g} µs, {fabric.nvls_algbw / 1e9:.3g} GB/s", source))
    return rows


def specs_link(key: str):
    """The link known as `key` (a key of `specs.LINKS`): inside each machine of a several-machine node."""
    from pipelab.emulate.specs import LINKS

    return LINKS[key]

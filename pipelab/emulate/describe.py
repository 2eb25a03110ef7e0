"""The model an emulated lesson runs on, as one table: every figure of it with its source.

Each emulated lesson shows this table once, in its first section, so a student sees what its
modelled times come from: the device and its math, the efficiency and launch cost the model
assumes, each link's latency and bandwidth, and the size the lesson's work is modelled at.
"""

from __future__ import annotations

EFFICIENCY_SOURCE = ("model FLOPs utilisation of tuned large-model training: Megatron-LM 52 % of the A100's peak "
                     "(https://arxiv.org/abs/2104.04473), PaLM 46.2 % (https://arxiv.org/abs/2204.02311)")
LAUNCH_SOURCE = "an estimate of launching one kernel from PyTorch's eager mode (a few µs of host time), not a data-sheet figure"
LESSON = "this lesson's parameters"


def model_table(node, size: str | None = None, dtype: str = "float32") -> list[dict]:
    """Rows (figure, value, source) of the emulated `node` (a name such as "2xH100-nvlink", or a
    `specs.Node`) as a lesson's modelled times use it: device, `dtype` and its FLOP/s, efficiency,
    memory bandwidth, launch cost, the link's latency and bandwidth, and the emulated `size`."""
    from pipelab.emulate import cost
    from pipelab.emulate.specs import parse_node

    node = parse_node(node)
    device, link = node.device, node.link
    efficiency = getattr(cost, "EFFICIENCY", None)
    launch = getattr(cost, "LAUNCH_OVERHEAD_S", None)
    rows = [("emulated node", str(node), LESSON),
            ("device", device.name, device.source),
            ("dtype", dtype, LESSON),
            (f"peak dense {dtype} math", f"{device.rate(dtype) / 1e12:g} TFLOP/s", device.source),
            ("efficiency (fraction of the peak reached)", f"{efficiency:.0%}" if efficiency is not None else "-",
             EFFICIENCY_SOURCE),
            ("memory bandwidth", f"{device.memory_bandwidth / 1e12:g} TB/s", device.source),
            ("device memory", f"{device.memory_bytes / 1e9:g} GB", device.source),
            ("launch cost per operator", f"{launch * 1e6:g} µs" if launch is not None else "-", LAUNCH_SOURCE),
            (f"link {link.name}: latency per message", f"{link.latency_s * 1e6:g} µs", link.latency_source or link.source),
            (f"link {link.name}: bandwidth each way", f"{link.bandwidth_Bps / 1e9:g} GB/s", link.source)]
    if size:
        rows.append(("emulated size", size, LESSON))
    return [{"figure": f, "value": v, "source": s} for f, v, s in rows]

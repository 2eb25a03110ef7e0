"""One question, one call: how long does this take on that node? `seconds` answers it for a matrix
product, a memory-bound kernel, a message or a collective, with the calibrated hardware model
(`pipelab.emulate.calibrated`, fitted on published measurements) -- the same functions the
emulated lessons' clocks use.

    >>> seconds("all_reduce", nbytes=58e6, node="8xH100-nvlink")        # doctest: +SKIP
    >>> seconds("matmul", shape=(4096, 4096, 4096), node="1xH100", dtype="bf16")  # doctest: +SKIP
    >>> seconds("send", nbytes=64e6, node="2xH100-nvlink")              # doctest: +SKIP
"""

from __future__ import annotations

from pipelab.emulate import calibrated
from pipelab.emulate.specs import Node, dtype_name, parse_node, torch_dtype

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")
KINDS = ("matmul", "memory", "send") + COLLECTIVE_KINDS


def _bytes(kind: str, nbytes) -> float:
    if nbytes is None:
        raise ValueError(f"seconds({kind!r}) needs nbytes=, the bytes it moves, e.g. nbytes=58e6")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes < 0:
        raise ValueError(f"nbytes must be a number of bytes >= 0, got {nbytes!r}")
    return float(nbytes)


def seconds(kind: str, *, nbytes: float | None = None, node: "str | Node" = "1xH100",
            shape: tuple[int, int, int] | None = None, dtype="bfloat16", ranks: int | None = None) -> float:
    """Modelled seconds of one operation on `node` (a name such as "8xH100-nvlink" or a Node):

    - "matmul": an (m x k) @ (k x n) product, `shape=(m, n, k)`, in `dtype`, on one device;
    - "memory": a memory-bound kernel reading and writing `nbytes` in all, on one device;
    - "send": one message of `nbytes` between two devices (between machines on a node of several);
    - "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier": a collective of
      `nbytes` (the whole tensor) over `ranks` devices (default: all the node's).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of {KINDS}")
    node = parse_node(node)
    if kind == "matmul":
        if shape is None or len(shape) != 3 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise ValueError(f"seconds('matmul') needs shape=(m, n, k), three whole numbers >= 1, got {shape!r}")
        name = dtype_name(dtype)
        node.device.rate(name)  # a ValueError if the card lacks that math
        itemsize = torch_dtype(name).itemsize
        return calibrated.matmul_seconds(*shape, node.device, name, itemsize)
    if kind == "memory":
        return calibrated.kernel_seconds(0.0, _bytes(kind, nbytes), node.device, dtype_name(dtype))
    from pipelab.emulate.cost import collective_seconds, message_seconds

    if kind == "send":
        return message_seconds(_bytes(kind, nbytes), node.link)
    ranks = node.count if ranks is None else ranks
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= node.count:
        raise ValueError(f"ranks must be a whole number from 1 to the node's {node.count} devices, got {ranks!r}")
    return collective_seconds(kind, 0.0 if kind == "barrier" else _bytes(kind, nbytes), ranks, node.link)

"""Emulated accelerator nodes: real processes and real math, modelled time. The only owner of it.

`specs` holds the devices and links (every figure with its public source), `cost` counts an
operation's FLOPs and bytes on the meta device and turns them into seconds, `memory` adds up what a
rank would hold on the device, `stages` counts a pipeline's stages at the emulated size. `table` is
a rank's cost table: what each span lasts, by its kind, stage, layer or bytes, built once from the
model at the emulated size and installed on the rank's logical clock (`clock`) with
`Emulator.use`; the algorithms record their spans as on hardware and never see it. `comm` is the
rank's communication under NCCL's ordering rule (and, on an emulated node, timed by the link
model). `model_table` is the table of the model a lesson runs on, each figure with its source.

A rank gets them from `spawn`: `spawn(fn, n, emulate="4xH100-nvlink")` runs the ranks on an
emulated node (modelled time, NCCL's rule); `spawn(fn, n, nccl_rule=True)` only puts the ranks'
communication under NCCL's rule, on the machine's own clock. The parent passes either by an
environment variable (`PIPELAB_EMULATE`: the node as JSON; `PIPELAB_NCCL_RULE`); `pipelab.launch`
hands `install_from_environment` to the worker's start hooks (`worker.ON_START`), which run once
the process group has formed. A caller started with `PIPELAB_NCCL_RULE=1` puts every spawn under
the rule (e.g. a whole test run).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipelab.emulate import calibrate, comm  # noqa: F401 - calibrate reads "8x:FILE" node names
from pipelab.emulate.clock import LogicalClock, RealClock
from pipelab.emulate.model import seconds
from pipelab.emulate.describe import model_table  # noqa: F401 - what every emulated lesson shows first
from pipelab.emulate.emulated import Emulated, node_name, size_of  # noqa: F401 - what `emulate=` can say

if TYPE_CHECKING:
    from pipelab.worker import RankContext

ENV_NODE = "PIPELAB_EMULATE"
ENV_RULE = "PIPELAB_NCCL_RULE"


@dataclass
class Emulator:
    """What a rank on an emulated node has: the `node` (a `specs.Node`), its logical `clock`, its
    communication `rule` and a `memory` meter at the emulated size. `dtype` and `efficiency` are
    what a compute cost given as `cost.Counts` is turned into seconds with."""

    node: Any
    clock: LogicalClock
    rule: comm.Rule
    memory: Any
    dtype: str = "float32"
    efficiency: float | None = field(default=None)  # None: the calibrated model

    def scale_messages(self, emulated_bytes: float, real_bytes: float) -> None:
        """Time every message and collective as if its tensor were `emulated_bytes / real_bytes`
        times larger: the rank computes at a small size, the link carries the emulated one."""
        if emulated_bytes < 0 or real_bytes <= 0:
            raise ValueError(f"need emulated_bytes >= 0 and real_bytes > 0, got {emulated_bytes!r}, {real_bytes!r}")
        self.rule.bytes_scale = emulated_bytes / real_bytes

    def use(self, table=None, memory=None) -> None:
        """Time this rank's work by `table` (an `emulate.table.CostTable`, built once from the model
        at the emulated size; None: an empty one, nothing modelled): the clock looks every span up
        there. With `memory` (a `memory.MemoryMeter`), what the table stashes and frees goes on it."""
        from pipelab.emulate.table import CostTable

        if memory is not None:
            self.memory = memory
        self.clock.table, self.clock.memory = table if table is not None else CostTable(), self.memory

    def seconds(self, cost) -> float:
        """Modelled seconds of a compute cost: seconds as they are, or `cost.Counts` on the device."""
        if isinstance(cost, (int, float)):
            return float(cost)
        from pipelab.emulate.cost import compute_seconds

        return compute_seconds(cost, self.node.device, self.dtype, self.efficiency)


def node_of(emulate, world_size: int | None = None) -> Any:
    """The `specs.Node` an `emulate=` argument names ("4xH100-nvlink", a Node or an `Emulated`; None
    for None), a name parsed once: a ValueError listing the known devices and links for a bad name,
    or naming a node that fits when it has fewer devices than `world_size` ranks."""
    emulate = node_name(emulate)
    if emulate is None:
        return None
    node = _named(emulate) if isinstance(emulate, str) else _named.__wrapped__(emulate)
    if world_size is not None and node.count < world_size:
        given, rest = (repr(emulate), emulate.split("x", 1)[-1]) if isinstance(emulate, str) else ("a Node", "H100-nvlink")
        raise ValueError(f"world_size={world_size} ranks do not fit on emulate={given} ({node}); name a node "
                         f"with at least {world_size} devices, e.g. emulate='{world_size}x{rest}'")
    return node


@functools.lru_cache(maxsize=None)
def _named(emulate) -> Any:
    from pipelab.emulate.specs import parse_node

    return parse_node(emulate)


def environment(emulate=None, nccl_rule: bool = False, world_size: int | None = None) -> dict[str, str]:
    """The environment variables that tell spawned ranks to emulate `emulate` (a node name or
    Node) or to run under NCCL's rule alone; checked here, before any process starts."""
    if emulate is None:
        return {ENV_RULE: "1"} if nccl_rule else {}
    return {ENV_NODE: node_of(emulate, world_size).to_json(), ENV_RULE: "1"}


def install_from_environment(ctx: "RankContext") -> None:
    """Install what the environment asks for into the rank `ctx` (a `worker.RankContext`): on an
    emulated node, the logical clock (the recorder reads it), the timed communication under NCCL's
    rule, and `ctx.emulator`; with the rule alone, the rule on the rank's own clock."""
    node_json, rule_wanted = os.environ.get(ENV_NODE), os.environ.get(ENV_RULE) == "1"
    if not (node_json or rule_wanted) or ctx.backend != "gloo":  # on NCCL the rule is NCCL's own
        return
    if not node_json:
        comm.install(ctx.rank, ctx.world_size, RealClock())
        return
    from pipelab.emulate.memory import MemoryMeter
    from pipelab.emulate.specs import Node

    node = Node.from_json(node_json)
    clock = LogicalClock()
    rule = comm.install(ctx.rank, ctx.world_size, clock, node.link)
    ctx.emulator = Emulator(node, clock, rule, MemoryMeter(node.device))
    clock.seconds_of = ctx.emulator.seconds
    ctx.rec.clock = clock


def finished() -> None:
    """This rank's function returned: tell the other ranks' watchdogs it waits for nobody."""
    rule = comm.active()
    if rule is not None:
        rule.watchdog.finish()

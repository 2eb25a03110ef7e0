"""Automatic splitting: trace a model into a graph, cut it at split points, one module per stage.

A model that is not a list of layers (a Transformer: embedding, blocks, norm, head) can still be
pipelined if we can see its forward as a graph of calls. `torch.fx` records one by running the
forward on stand-in values (`trace`). `split` then cuts the graph's node list where the named
submodules are first called: stage s gets the nodes between cut s and cut s+1.

What crosses a cut is every value made before it and used after it. A value that skips a stage (a
residual made on stage 0 and used on stage 2) is **forwarded through** stage 1: stage 1 receives it
and sends it on unchanged. We forward rather than send it straight to stage 2 because then every
stage talks only to its neighbours, as pipelab's schedules and messages assume (`p2p`): a stage
receives from s-1 and sends to s+1, and gradients come back the same way (autograd sums the
forwarded value's gradient from both of its uses). The cost is the extra bytes through stage 1;
torch.distributed.pipelining sends such a value directly instead.

A parameter is not a value that crosses: every stage that uses one (tied weights) holds it, and
the gradients of its copies add up to the model's gradient.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Sequence

from torch import fx, nn


@dataclass
class Split:
    """A traced model cut into stages: `stages[s]` is a module; `receives[s]` names the values it
    takes in (stage 0: the model's inputs), `sends[s]` those it passes to stage s+1 (the last
    stage: the model's output). A stage with one input and one output is called like a layer."""

    stages: list[fx.GraphModule]
    receives: list[list[str]]
    sends: list[list[str]]

    def __len__(self) -> int:
        return len(self.stages)

    def table(self) -> str:
        """One line per stage: what it receives, what it sends, its parameters."""
        lines = []
        for s, stage in enumerate(self.stages):
            n = sum(p.numel() for p in stage.parameters())
            lines.append(f"stage {s}: receives {self.receives[s]}, sends {self.sends[s]}, {n:,} parameters")
        return "\n".join(lines)


def trace(module: nn.Module) -> fx.GraphModule:
    """The forward of `module` as an fx graph. torch.nn layers stay whole (one call node each). A
    forward whose control flow depends on tensor values cannot be traced: the error names the line."""
    try:
        return fx.symbolic_trace(module)
    except (fx.proxy.TraceError, TypeError, RuntimeError) as err:
        raise ValueError(f"cannot trace {type(module).__name__}: {err} (at {user_line(err)}). The forward "
                         "must not branch or loop on tensor values; move such code into a leaf "
                         "module or make it depend on Python values only") from err


def user_line(err: BaseException) -> str:
    """The file:line of the model code where tracing failed (the last frame outside torch)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/" not in f.filename]
    if not frames:
        return "unknown line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def calls_module(node: fx.Node, name: str) -> bool:
    """Whether `node` calls the submodule `name` or one inside it."""
    return node.op == "call_module" and (node.target == name or node.target.startswith(name + "."))


def cut_indices(module: nn.Module, gm: fx.GraphModule, split_points: Sequence[str]) -> list[int]:
    """The index in the graph's node list of each split point's first call, checked: the point
    names a submodule, the forward calls it, and the points come in the order the forward runs them."""
    nodes = list(gm.graph.nodes)
    cuts = []
    for name in split_points:
        try:
            module.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in module.named_children()]
            raise ValueError(f"split point {name!r} names no submodule of {type(module).__name__} "
                             f"(its children: {children})") from None
        found = next((i for i, n in enumerate(nodes) if calls_module(n, name)), None)
        if found is None:
            raise ValueError(f"split point {name!r} is never called by the traced forward")
        if cuts and found <= cuts[-1]:
            raise ValueError(f"split points out of order: {name!r} runs before {split_points[len(cuts) - 1]!r}; "
                             f"list them in the order the forward calls them")
        cuts.append(found)
    bounds = [0, *cuts, len(nodes)]
    for s, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        if not any(n.op.startswith("call_") for n in nodes[start:stop]):
            raise ValueError(f"split points {list(split_points)} leave stage {s} with nothing to compute; "
                             f"drop {split_points[max(s - 1, 0)]!r} or move it later")
    return cuts


def stage_of_nodes(nodes: list[fx.Node], cuts: list[int]) -> dict[fx.Node, int]:
    """Each node's stage: how many cuts come at or before it."""
    return {n: sum(1 for c in cuts if c <= i) for i, n in enumerate(nodes)}


def crossing(nodes: list[fx.Node], stage: dict[fx.Node, int], s: int) -> list[fx.Node]:
    """The values that cross cut s (into stage s): made before it, used at or after it. Parameters
    (get_attr) do not cross: each stage that uses one holds it."""
    return [n for n in nodes if stage[n] < s and n.op not in ("get_attr", "output")
            and any(stage[u] >= s for u in n.users)]


def build_stage(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs, s: int,
                stage: dict[fx.Node, int]) -> fx.GraphModule:
    """Stage s as its own GraphModule: placeholders for `inputs`, a copy of its nodes, and an
    output of `outputs` (one value, or a tuple). Submodules keep their names in the whole model."""
    graph, env = fx.Graph(), {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":  # a parameter used here: this stage holds it too
            env[n] = graph.get_attr(n.target)
        return env[n]

    for n in nodes:
        if stage[n] == s and n.op != "output" and not (n.op == "placeholder" and n in env):
            if n.op == "get_attr":
                lookup(n)
            else:
                env[n] = graph.node_copy(n, lookup)
    graph.output(fx.map_arg(outputs, lookup))
    return fx.GraphModule(gm, graph, class_name=f"Stage{s}")


def split(module: nn.Module, split_points: Sequence[str]) -> Split:
    """Trace `module` and cut it before each submodule named in `split_points` (torch's
    `SplitPoint.BEGINNING`): len(split_points) + 1 stages."""
    gm = trace(module)
    nodes = list(gm.graph.nodes)
    cuts = cut_indices(module, gm, split_points)
    stage = stage_of_nodes(nodes, cuts)
    output = next(n for n in nodes if n.op == "output")
    stage[output] = len(cuts)
    num_stages = len(cuts) + 1
    inputs = [[n for n in nodes if n.op == "placeholder"]] + [crossing(nodes, stage, s) for s in range(1, num_stages)]
    stages, sends = [], []
    for s in range(num_stages):
        last = s == num_stages - 1
        outs = output.args[0] if last else tuple(inputs[s + 1])
        if not last and len(outs) == 1:
            outs = outs[0]
        stages.append(build_stage(gm, nodes, inputs[s], outs, s, stage))
        sends.append(["output"] if last else [n.name for n in inputs[s + 1]])
    return Split(stages, [[n.name for n in ins] for ins in inputs], sends)


def check_stages(num_stages: int, world_size: int) -> None:
    """Refuse a split whose stages do not match the processes one to one (one stage per process here)."""
    if num_stages > world_size:
        raise ValueError(f"{num_stages} stages but {world_size} processes: give fewer split points "
                         f"(at most {world_size - 1}) or more processes")
    if num_stages < world_size:
        raise ValueError(f"{num_stages} stage(s) but {world_size} processes, and each process runs one stage: "
                         f"give {world_size - 1} split points, or world_size={num_stages}")

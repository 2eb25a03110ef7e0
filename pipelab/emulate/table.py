"""What each piece of work lasts on an emulated node, looked up by what the work is.

The emulator builds a `CostTable` once, in the parent, from the model at the emulated size (counted
on the meta device), and installs it on each emulated rank's logical clock. The algorithms record
their spans exactly as they do on real hardware (`rec.span("F", stage=1, mb=0)`, `rec.ran("B",
layer="net.3")`); the clock looks the span up here by its kind and where it ran (stage, layer,
bucket, bytes) and moves by that cost. So modelled time lives in one place, and the code a student
reads carries none of it.

A pipeline's table also says what a micro-batch's forward stashes at the emulated size: the clock
stashes it on the rank's memory meter when the forward (or its recomputation) ends and releases it
when the backward (B, or W) of that stage and micro-batch ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

WHERE = ("stage", "layer", "bucket")  # what a span's position is named by, most specific first


@dataclass
class CostTable:
    """Modelled costs by `(kind,)` or `(kind, where, value)` (e.g. `("F", "stage", 1)`): seconds,
    `cost.Counts`, or a function of the span's fields (`bytes=`...) giving one. `stash[stage]`:
    the bytes one micro-batch's forward keeps at the emulated size (all of it, its input alone),
    the input alone when `checkpoint`."""

    costs: dict[tuple, Any] = field(default_factory=dict)
    stash: dict[int, tuple[float, float]] = field(default_factory=dict)
    checkpoint: bool = False
    held: dict[tuple, float] = field(default_factory=dict, repr=False)  # (stage, mb) -> bytes stashed

    def cost(self, kind: str, where: Mapping[str, Any]) -> Any:
        """The modelled cost of work of `kind` at `where` (a span's fields), or None: not modelled."""
        for name in WHERE:
            if name in where and (kind, name, where[name]) in self.costs:
                return self.resolve(self.costs[kind, name, where[name]], where)
        return self.resolve(self.costs.get((kind,)), where)

    @staticmethod
    def resolve(entry, where: Mapping[str, Any]):
        return entry(where) if callable(entry) else entry

    def ended(self, kind: str, mb, where: Mapping[str, Any], memory) -> None:
        """Work of `kind` ended: a forward stashes its micro-batch's activations on `memory` (a
        `memory.MemoryMeter`), a backward that frees them releases them."""
        stage = where.get("stage")
        if memory is None or stage not in self.stash:
            return
        if kind in ("F", "R"):
            nbytes = self.stash[stage][1 if kind == "F" and self.checkpoint else 0]
            self.held[stage, mb] = self.held.get((stage, mb), 0.0) + nbytes
            memory.stash(nbytes)
        elif kind in ("B", "W"):
            memory.release(self.held.pop((stage, mb), 0.0))


def total(costs: list):
    """The sum of several costs (seconds or `cost.Counts`), in their order; 0.0 for none."""
    return sum(costs[1:], costs[0]) if costs else 0.0


def stage_table(seconds: Mapping[int, Mapping[str, float]], stash: Mapping[int, tuple[float, float]] | None = None,
                checkpoint: bool = False) -> CostTable:
    """A pipeline's table: each stage's modelled seconds of F, B, I and W (a recomputation R lasts
    its forward's), and what a micro-batch's forward stashes at the emulated size."""
    costs: dict[tuple, Any] = {}
    for s, kinds in seconds.items():
        for kind, value in kinds.items():
            costs[kind, "stage", s] = value
        if "F" in kinds:
            costs["R", "stage", s] = kinds["F"]
    return CostTable(costs, dict(stash or {}), checkpoint)


def layer_table(forward: Mapping[str, Any], backward: Mapping[str, Any], optimizer: Any = 0.0,
                copy: Callable[[Mapping[str, Any]], Any] | None = None) -> CostTable:
    """A data-parallel replica's table: the whole forward ("F"), each layer's backward ("B" by
    layer name), the optimizer's step, and a copy of gradients by its bytes."""
    costs: dict[tuple, Any] = {("F",): total(list(forward.values())), ("optimizer",): optimizer}
    costs.update({("B", "layer", name): value for name, value in backward.items()})
    if copy is not None:
        costs["copy",] = copy
    return CostTable(costs)


def sharded_table(names: list[str], per_layer: list[tuple]) -> CostTable:
    """A sharded model's table: each layer's forward and backward by name, and the whole model's
    ("F", "B" without a layer) as their sums."""
    costs: dict[tuple, Any] = {("F",): total([c[0] for c in per_layer]), ("B",): total([c[1] for c in per_layer])}
    for name, (forward, backward) in zip(names, per_layer):
        costs["F", "layer", name] = forward
        costs["B", "layer", name] = backward
    return CostTable(costs)


@dataclass
class LayerCosts:
    """What a data-parallel replica's work lasts at the emulated size: each layer's forward and
    backward (seconds, or FLOPs and bytes as `cost.Counts`) by layer name, the optimizer step's
    cost, and `bytes_scale`, the emulated bytes of gradient per real byte (what a copy of
    gradients moves, `copy`)."""

    forward: dict[str, Any]
    backward: dict[str, Any]
    optimizer: Any = 0.0
    bytes_scale: float = 1.0

    def copy(self, nbytes: int):
        """The cost of copying `nbytes` real bytes of gradient: read and write them at the emulated size."""
        from pipelab.emulate.cost import Counts

        return Counts(0.0, 2.0 * nbytes * self.bytes_scale, 1)

    def table(self) -> CostTable:
        """These costs as the clock looks them up: "F" the whole forward, "B" by layer, "optimizer",
        and "copy" by the bytes it moves."""
        return layer_table(self.forward, self.backward, self.optimizer, lambda where: self.copy(where["bytes"]))

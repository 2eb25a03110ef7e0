"""A rank's clock: the machine's own, or a logical one that runs on modelled time.

On an emulated node a rank does its real (small) math at full speed, but its *recorded* time is a
logical clock: it stands still while Python runs, and moves only by what the models say an
operation lasts -- a compute span by its modelled duration (`spend`), a wait for a message or a
collective up to that operation's modelled end (`wait_until`). So an emulated timeline is
deterministic: the same program draws the same picture on a loaded laptop and an idle server.

On an emulated node the clock also holds the rank's cost table (`emulate.table`): a span is looked
up there by what it is (its kind, stage, layer or bucket, bytes), so the code that records the span
names no cost. Both clocks have the same methods, so a `Recorder` and `measure.time_steps` read either.
"""

from __future__ import annotations

import time
from typing import Callable


class RealClock:
    """The machine's clock (`time.perf_counter`, shared by every process): time passes by itself,
    so `spend` and `wait_until` have nothing to do."""

    def now(self) -> float:
        return time.perf_counter()

    def spend(self, cost) -> None:
        """Nothing: the work itself took the time."""

    def wait_until(self, t: float) -> None:
        """Nothing: the wait itself took the time."""

    def cost_of(self, kind: str, where: dict):
        """Nothing is modelled: the work takes what it takes."""
        return None

    def ended(self, kind: str, mb, where: dict) -> None:
        """Nothing to keep: memory is the machine's own."""


class LogicalClock:
    """Modelled seconds since the rank started, moved only by the models. `seconds_of(cost)` turns
    a compute cost (seconds, or a `cost.Counts` of FLOPs and bytes) into modelled seconds."""

    def __init__(self, seconds_of: Callable[[object], float] = float):
        from pipelab.emulate.table import CostTable

        self.t = 0.0
        self.seconds_of = seconds_of
        self.table = CostTable()  # what each span lasts, installed by the emulator (`Emulator.use`)
        self.memory = None  # the rank's `memory.MemoryMeter` at the emulated size

    def cost_of(self, kind: str, where: dict):
        """The modelled cost of work of `kind` at `where` (a span's fields), from the cost table."""
        return self.table.cost(kind, where)

    def ended(self, kind: str, mb, where: dict) -> None:
        """Work of `kind` ended: what it stashes or frees at the emulated size goes on the memory meter."""
        self.table.ended(kind, mb, where, self.memory)

    def now(self) -> float:
        return self.t

    def spend(self, cost) -> None:
        """A compute operation of `cost` ran: the clock moves by its modelled duration."""
        seconds = self.seconds_of(cost)
        if seconds < 0:
            raise ValueError(f"a modelled duration must be >= 0 seconds, got {seconds!r} for {cost!r}")
        self.t += seconds

    def wait_until(self, t: float) -> None:
        """The rank waited for something that ends at modelled time `t` (never backwards)."""
        self.t = max(self.t, t)

"""Running a lesson from a notebook, in one shape for every lesson family:

    cfg = experiments.pipeline.Config(schedules=["1f1b"], world_size=2, ...)  # refuses bad input here
    run = experiments.run(experiments.pipeline.worker, cfg, experiments.pipeline.gather)

A `Config` is a frozen dataclass that checks itself when built, so a typo fails before any process
starts; `worker(ctx: RankContext, cfg) -> Result` runs on each rank and returns a typed `Result`;
`gather(cfg, results)` builds the `Run` the notebook reads (every figure a `Measured`); the lesson's
verdict functions turn a `Run` into the sentences the notebook concludes.

One file per lesson family. The algorithms these run live below (`pipelab.ddp`,
`pipelab.pipeline`, `pipelab.model_parallel`, ...) and never import from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence, TypeVar

from pipelab.checks import positive_number, ranks_fit
from pipelab.emulate import Emulated, node_name, node_of, size_of

R = TypeVar("R")

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class Config:
    """What every lesson that runs workers needs: how many ranks, which backend, how long to wait.
    A lesson's own `Config` adds its fields and extends `check()`; building one runs the checks."""

    world_size: int = 2
    backend: str = "auto"
    timeout: float = 120.0
    # e.g. "4xH100-nvlink", or Emulated("4xH100-nvlink", width=8192): run on an emulated node, timing
    # the lesson's model at its emulated size (`SIZE`'s names and defaults; `pipelab.emulate.emulated`)
    emulate: str | Emulated | None = None
    SIZE: ClassVar[Mapping[str, Any]] = {}

    @property
    def node(self):
        """The node this Config runs on (a `specs.Node`, parsed once); None on the machine's own."""
        return node_of(self.emulate)

    @property
    def node_name(self) -> str | None:
        """The emulated node's name as given (e.g. "4xH100-nvlink"); None on the machine's own."""
        name = node_name(self.emulate)
        return None if name is None else str(name)

    @property
    def size(self):
        """The size an emulated node times this lesson's model at: `SIZE`, overridden by `emulate`'s."""
        return size_of(self.SIZE, self.emulate)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise a ValueError naming the bad value and the fix; subclasses call super().check()."""
        from pipelab.build import check_config

        check_config(self)  # a model built on meta must be one its ranks can give weights to
        ranks_fit(self.world_size)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        positive_number("timeout", self.timeout, example="timeout=120", unit="seconds")
        node_of(self.emulate, self.world_size)  # a bad name lists the known devices and links
        size_of(self.SIZE, self.emulate)  # a size the lesson does not have is named


def run(worker: Callable[..., Any], cfg: Config, gather: Callable[[Any, Sequence[Any]], R] | None = None) -> R:
    """Start `cfg.world_size` ranks running `worker(ctx, cfg)` and hand their results (by rank)
    to `gather(cfg, results)`; without a gather, return the results as they are."""
    from pipelab.launch import spawn

    results = spawn(worker, cfg.world_size, cfg, backend=cfg.backend, timeout=cfg.timeout, emulate=cfg.emulate)
    return gather(cfg, results) if gather is not None else results

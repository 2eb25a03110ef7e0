"""pipelab: distributed deep-learning training, taught by running it.

Submodules are imported on first use (`pipelab.timeline`, `pipelab.launch`, ...) so that
`import pipelab` stays fast in worker processes and in notebooks.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = {
    "batch", "checks", "cli", "collectives", "data", "ddp", "display", "emulate", "experiments", "expert_parallel", "hardware", "hybrid",
    "launch", "lm", "measure", "model_parallel", "models", "pipeline", "plots", "reference", "sharding", "streams", "tensor_parallel",
    "timeline", "transformer", "widgets", "worker",
}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"pipelab.{name}")
    if name in ("show", "headline", "conclude"):
        return getattr(importlib.import_module("pipelab.display"), name)
    raise AttributeError(f"module 'pipelab' has no attribute {name!r}")

"""Lesson workers as torchrun targets, for tests/test_multinode.py.

`python -m pipelab.launch MODULE:FUNCTION` calls `FUNCTION(ctx)` and nothing else, so each target
here builds its lesson's inputs itself (fixed seed: every process, and the test, builds the same
ones), calls the lesson's worker, and saves what the worker returned to
`$PIPELAB_MULTINODE_OUT/<target>-rank<R>.pt` for the test to read. Run by hand:

    PYTHONPATH=tests PIPELAB_MULTINODE_OUT=/tmp/out python -m torch.distributed.run --nproc-per-node 2 \
        -m pipelab.launch multinode_targets:ddp_step
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pipelab import models
from pipelab.experiments import ddp as ddp_experiment
from pipelab.pipeline.partition import split_model
from pipelab.experiments import pipeline as pipeline_experiment
from pipelab.pipeline.schedules import Schedule, make_schedule
from pipelab.worker import RankContext

OUT_DIR = "PIPELAB_MULTINODE_OUT"  # the environment variable naming the output folder
DDP_BUCKET_CAP_MB = 0.005  # a few buckets for this small model, so BucketedDDP overlaps
DDP_LR = 0.1


def ddp_inputs() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Lesson 01's step, small: an MLP and a batch that splits over 2 ranks."""
    torch.manual_seed(0)
    model = models.mlp([32] * 5)
    return model, torch.randn(16, 32), torch.randn(16, 32)


def ddp_config(world_size: int, backend: str = "auto") -> ddp_experiment.Config:
    """Lesson 01's Config for that step: one checked SGD step of each variant (naive, bucketed, torch)."""
    model, x, y = ddp_inputs()
    return ddp_experiment.Config(model=model, x=x, y=y, world_size=world_size, backend=backend,
                                 bucket_cap_mb=DDP_BUCKET_CAP_MB, lr=DDP_LR, steps=1)


def gpipe_inputs() -> tuple[list[nn.Module], Schedule, torch.Tensor, torch.Tensor]:
    """Lesson 06's step, small: an MLP cut into 2 stages, GPipe with 4 micro-batches."""
    torch.manual_seed(0)
    stages = split_model(models.mlp([32] * 5), 2)
    return stages, make_schedule("gpipe", 2, 4), torch.randn(16, 32), torch.randn(16, 32)


def ddp_step(ctx: RankContext) -> str:
    """Lesson 01's worker: one checked SGD step of each variant (naive, bucketed, torch)."""
    result = ddp_experiment.worker(ctx, ddp_config(ctx.world_size))
    return _save(ctx, "ddp_step", result)


def gpipe_step(ctx: RankContext) -> str:
    """Lesson 06's worker: one GPipe step (forward and backward, no optimizer)."""
    stages, schedule, x, y = gpipe_inputs()
    cfg = pipeline_experiment.Config(world_size=ctx.world_size, stages=stages, schedules=[schedule], x=x, y=y,
                                     loss_fn=nn.MSELoss(), steps=1)
    result = pipeline_experiment.worker(ctx, cfg)
    return _save(ctx, "gpipe_step", result)


def _save(ctx: RankContext, name: str, result) -> str:
    """Write this rank's result where the test looks (write aside, then rename: never half a file)."""
    path = os.path.join(os.environ[OUT_DIR], f"{name}-rank{ctx.rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    return f"{name}: rank {ctx.rank} of {ctx.world_size} saved {os.path.basename(path)}"

"""Bad input to the pipeline, the engine, DDP, partitioning, topologies and schedules (issue 11,
defects 5 and 6): each is refused with a ValueError that names the value and the fix, before any
process starts. (No case here may start one: `spawn` is replaced by a function that fails.)"""

import pytest
import torch
from torch import nn

from pipelab import models
from pipelab.experiments import ddp as ddp_experiment
from pipelab.experiments import deepspeed as deepspeed_experiment
from pipelab.experiments.deepspeed import DeepSpeedConfig, PartitionsConfig
from pipelab.experiments import pipeline as pipeline_experiment
from pipelab.pipeline.module import LayerSpec, PipelineModule
from pipelab.pipeline.partition import partition_layers, split_model
from pipelab.pipeline.schedules import Schedule, make_schedule
from pipelab.pipeline.simulate import gpipe_bubble
from pipelab.pipeline.topology import PipeDataParallelTopology, ProcessTopology


@pytest.fixture(autouse=True)
def no_process_starts(monkeypatch):
    def spawn(*args, **kwargs):
        raise AssertionError("a process was started: the bad input was not refused before")

    monkeypatch.setattr("pipelab.launch.spawn", spawn)
    monkeypatch.setattr(deepspeed_experiment, "deepspeed_available", lambda: True)


def pipeline_problem():
    torch.manual_seed(0)
    return split_model(models.mlp([8, 16, 16, 4]), 2), torch.randn(8, 8), torch.randn(8, 4)


def engine_module(**kwargs) -> PipelineModule:
    layers = [LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 16, 4)]
    return PipelineModule(layers, **{"num_stages": 2, "loss_fn": nn.MSELoss(), "verbose": False, **kwargs})


def train(module, x, y, num_microbatches, config=deepspeed_experiment.Config):
    """The engine's run (or DeepSpeed's, with config=DeepSpeedConfig) through experiments.run."""
    from pipelab import experiments

    cfg = config(module=module, inputs=x, targets=y, num_microbatches=num_microbatches)
    return experiments.run(deepspeed_experiment.worker, cfg, deepspeed_experiment.gather)


def deepspeed_partitions(layers, cuts):
    from pipelab import experiments

    cfg = PartitionsConfig(layers=layers, cuts=cuts)
    return experiments.run(deepspeed_experiment.partitions_worker, cfg, deepspeed_experiment.gather_partitions)


STAGES, X, Y = pipeline_problem()
GPIPE = make_schedule("gpipe", 2, 2)


def pipeline(stages=STAGES, schedule=GPIPE, x=X, y=Y, loss_fn=nn.MSELoss(), schedules=None):
    config = pipeline_experiment.Config
    return lambda: pipeline_experiment.run(config(stages=stages, schedules=schedules or [schedule], x=x, y=y,
                                                  loss_fn=loss_fn))


CASES = {
    # defect 5: silently wrong results
    "pipeline, batch of 0 rows": (pipeline(x=X[:0], y=Y[:0]), r"the batch is empty \(0 samples\)"),
    "DDP, batch of 0 rows": (lambda: ddp_experiment.Config(model=models.mlp([8, 4]), x=X[:0], y=Y[:0]),
                             r"the batch is empty \(0 samples\)"),
    "engine, batch of 0 rows": (lambda: train(engine_module(), X[:0], Y[:0], num_microbatches=2),
                                r"the batch is empty \(0 samples\)"),
    "profile with 6 times for 4 layers": (
        lambda: partition_layers([nn.Linear(2, 2)] * 4, 2, "profile", profile=lambda: [1.0] * 6),
        "the profile gave 6 times for 4 layers; it must give one per layer"),
    "profile with a NaN": (
        lambda: partition_layers([nn.Linear(2, 2)] * 2, 2, "profile", profile=lambda: [1.0, float("nan")]),
        "time of layer 1 is nan"),
    # defect 6: errors that arrived late or deep
    "pipeline, loss with reduction='none'": (pipeline(loss_fn=nn.MSELoss(reduction="none")), "reduction='none'"),
    "pipeline, loss with reduction='sum'": (pipeline(loss_fn=nn.MSELoss(reduction="sum")),
                                            "reduction='sum'.*use reduction='mean'"),
    "pipeline, loss function returning a vector": (pipeline(loss_fn=lambda out, y: ((out - y) ** 2).mean(1)),
                                                   r"one number per micro-batch.*shape \[4\]"),
    "DDP, loss with reduction='none'": (
        lambda: ddp_experiment.Config(model=models.mlp([8, 4]), x=X, y=Y, loss_fn=nn.MSELoss(reduction="none")),
        "reduction='none'"),
    "engine, loss with reduction='none'": (
        lambda: train(engine_module(loss_fn=nn.MSELoss(reduction="none")), X, Y, num_microbatches=2),
        "reduction='none'"),
    "engine, loss with reduction='sum'": (
        lambda: train(engine_module(loss_fn=nn.MSELoss(reduction="sum")), X, Y, num_microbatches=2),
        "reduction='sum'.*use reduction='mean'"),
    "a stage that is a plain function": (pipeline(stages=[STAGES[0], lambda h: h @ torch.ones(16, 4)]),
                                         "stage 1 is <function.*not an nn.Module.*wrap a function in a module"),
    "a schedule that is neither a name nor a Schedule": (pipeline(schedule=5),
                                                         "a schedule is a name .* or a pipelab Schedule, got 5"),
    "schedules given as a string": (pipeline(schedules="gpipe"),
                                    "a list of one or more schedules, got 'gpipe'"),
    "make_schedule(name=None)": (lambda: make_schedule(None, 2, 2), r"unknown schedule None; choose one of"),
    "Schedule(name=5)": (lambda: Schedule(2, 2, actions=[[], []], name=5), "name must be a string, got 5"),
    "gpipe_bubble(1, 0)": (lambda: gpipe_bubble(1, 0), "num_microbatches must be a whole number >= 1, got 0"),
    "a pipe-only topology in the engine": (
        lambda: train(engine_module(num_stages=None, topology=ProcessTopology(["pipe"], [2])), X, Y,
                      num_microbatches=2),
        r"axes \['pipe'\]; build it with PipeDataParallelTopology\(num_pp=2, num_dp=1\)"),
    "a bad partition_method for DeepSpeed": (lambda: deepspeed_partitions([nn.Linear(8, 8)] * 2, [(2, "bogus")]),
                                             "unknown partition method 'bogus'; use one of"),
    "partition_method='profile' for DeepSpeed": (
        lambda: deepspeed_partitions([nn.Linear(8, 8)] * 2, [(2, "profile")]), "does not implement"),
    "cuts not given as a list for DeepSpeed": (lambda: deepspeed_partitions([nn.Linear(8, 8)] * 2, (2, "uniform")),
                                               r"a list of \(num_stages, partition_method\) pairs"),
    "a summed loss for DeepSpeed": (
        lambda: train(engine_module(loss_fn=nn.MSELoss(reduction="sum")), X, Y, 2, config=DeepSpeedConfig),
        "reduction='sum'.*use reduction='mean'"),
    "partition_method='profile' for DeepSpeed's training": (
        lambda: train(engine_module(partition_method="profile", profile_input=X[:2]), X, Y, 2,
                      config=DeepSpeedConfig), "does not implement"),
    "get_rank(pipe=9)": (lambda: ProcessTopology(["pipe"], [2]).get_rank(pipe=9),
                         r"get_rank\(pipe=9\): axis 'pipe' has positions 0..1"),
    "get_rank(data=-1) on a grid": (lambda: PipeDataParallelTopology(2, 2).get_rank(pipe=0, data=-1),
                                    r"axis 'data' has positions 0..1 in this pipe=2 x data=2 grid"),
    "a topology axis of size 0": (lambda: ProcessTopology(["pipe", "data"], [2, 0]),
                                  "the size of axis 'data' must be a whole number >= 1, got 0"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_before_any_process_starts(case):
    call, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        call()

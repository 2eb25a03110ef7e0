"""Data parallelism over model-parallel replicas (lesson 05): two ways large runs combine them.

* **DDP over a two-device replica.** Each process holds one replica of the model split over two
  devices, as the PyTorch DDP tutorial's `ToyMpModel` does. `ModelParallelReplica` runs the halves
  on their devices (lesson 02's forward, or lesson 03's split-input pipelining) and a
  data-parallel wrapper (`BucketedDDP`, or torch's DDP with `device_ids=None`) averages the
  replicas' gradients while backward runs.
* **The pipe x data grid.** `pipe x data` processes: each column of the grid is one pipeline
  (lessons 06-07) running its schedule over its stages; each row holds the copies of one stage,
  which average that stage's gradients among themselves only. `grid_place` reads both groups off
  lesson 08's `ProcessTopology` and gives the process its place as a `RankContext` of its own
  pipeline. `run_grid_step` is lesson 06's rank loop plus one line: the moment a stage's last
  backward is done, `StageAllReduce.start` sends its gradients, and the pipeline goes on with the
  other stages' work while they travel.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from pipelab import hardware, model_parallel as mp
from pipelab.checks import whole_number
from pipelab.ddp.flat import FlatAllReduce, average_gradients, write_back
from pipelab.models import trainable_parameters
from pipelab.pipeline.p2p import P2P, TensorSpec
from pipelab.pipeline.schedules import Action, Schedule
from pipelab.pipeline.stage import StageRunner
from pipelab.pipeline.topology import PipeDataParallelTopology, ProcessTopology, axis_groups
from pipelab.streams import CudaDevice, Device, VirtualDevice
from pipelab.worker import RankContext

HALVES = ("seq1", "seq2", "fc")  # a two-device model: seq1 on device 0, seq2 and fc on device 1

# ---------------------------------------------------------------------------------------------
# A replica on two devices
# ---------------------------------------------------------------------------------------------


def device_lane(index: int) -> str:
    """The timeline lane (and the device name BucketedDDP plans with) of a replica's device."""
    return f"device {index}"


def gpu_path(world_size: int, devices_per_replica: int = 2, device: str = "auto") -> bool:
    """Whether each replica gets real GPUs: `device`="cuda", or "auto" on a node with
    `devices_per_replica x world_size` GPUs. Otherwise each process drives virtual CPU devices
    (lessons 02-04). Refuses what the machine cannot give, before any process starts."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    whole_number("world_size", world_size, example="world_size=2")
    whole_number("devices_per_replica", devices_per_replica, example="devices_per_replica=2")
    if devices_per_replica != 2:
        raise ValueError(f"devices_per_replica={devices_per_replica}, but a replica here is a model in two "
                         "halves (seq1 | seq2, fc), one per device: use devices_per_replica=2")
    wanted, gpus = devices_per_replica * world_size, hardware.gpu_count()
    if device == "cuda" and gpus < wanted:
        fewer = f", or world_size <= {gpus // devices_per_replica}" if gpus >= devices_per_replica else ""
        raise ValueError(f"{world_size} replica(s) x {devices_per_replica} GPUs need {wanted} GPUs, and this "
                         f"machine has {gpus}: use device='auto' (virtual CPU devices where GPUs are "
                         f"missing){fewer}")
    return device == "cuda" or (device == "auto" and gpus >= wanted)


def replica_devices(rank: int, world_size: int, device: str = "auto") -> list[Device]:
    """The two devices of `rank`'s replica: GPUs 2*rank and 2*rank+1 on the GPU path, else two
    virtual CPU devices of this process. Their rows on the timeline are "device 0" and "device 1"."""
    if gpu_path(world_size, 2, device):
        return [CudaDevice(f"cuda:{2 * rank + i}", label=device_lane(i)) for i in range(2)]
    return [VirtualDevice(f"cpu:{i}", label=device_lane(i)) for i in range(2)]


class ModelParallelReplica(nn.Module):
    """One replica split over two devices: `seq1` runs on device 0, `seq2` and `fc` on device 1
    (the halves of lessons 02-04's models). The DDP tutorial's `ToyMpModel`, for any such model.

    `split_size=None` runs the halves one after the other (lesson 02: one device always idles);
    a number cuts the batch into splits, so that device 1 works on split i while device 0 works
    on split i+1 (lesson 03). The parameters keep the model's names (`seq1.0.weight`, ...), so a
    single-process reference on the model names its gradients the same way."""

    def __init__(self, model: nn.Module, devs: list[Device], split_size: int | None = None):
        super().__init__()
        mp.check_devices(devs)
        if split_size is not None:
            whole_number("split_size", split_size, example="split_size=8")
        self.seq1, self.seq2, self.fc = model.seq1, model.seq2, model.fc
        mp.place(self, devs)
        self.devs = devs  # a plain attribute: devices are not modules, and are not copied or saved
        self.split_size = split_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_size is None:
            return mp.forward_naive(self, x, self.devs)
        return mp.forward_pipelined(self, x, self.devs, self.split_size)

    def device_of(self) -> dict[str, str]:
        """Each parameter's device, by name ("device 0" or "device 1"). Virtual devices all live in
        CPU memory, so `p.device` cannot tell them apart: `BucketedDDP(..., device_of=...)` needs this
        to keep its buckets on one device each and to draw each layer's backward on its device."""
        return {f"{half}.{name}": device_lane(0 if half == "seq1" else 1)
                for half in HALVES for name, _ in getattr(self, half).named_parameters()}


# ---------------------------------------------------------------------------------------------
# The pipe x data grid
# ---------------------------------------------------------------------------------------------


def check_grid(pipe: int, data: int, world_size: int | None = None) -> ProcessTopology:
    """The pipe x data topology, refusing a grid that does not fill the world (before any start)."""
    whole_number("pipe", pipe, example="pipe=2")
    whole_number("data", data, example="data=2")
    if world_size is not None and pipe * data != world_size:
        raise ValueError(f"a grid of pipe={pipe} x data={data} holds {pipe * data} ranks, not world_size="
                         f"{world_size}; pick pipe and data whose product is {world_size}, e.g. "
                         f"{', '.join(f'{p} x {world_size // p}' for p in range(1, world_size + 1) if world_size % p == 0)}")
    return PipeDataParallelTopology(num_pp=pipe, num_dp=data)


def grid_place(ctx: RankContext, topology: ProcessTopology) -> RankContext:
    """This process's place in the grid, as lesson 06's stage runner and messages see it: a
    `RankContext` of its own pipeline. Its `rank` is its pipe coordinate (what a schedule calls a
    rank) of `world_size` = pipe ranks; `groups["pipe"]` holds the processes of its pipeline (their
    group ranks are their stages' order) and `groups["data"]` the copies of its stage, each None
    where that axis has one process. Device and recorder stay the process's. Every process must
    call this (creating a process group is collective)."""
    coord = topology.get_coord(ctx.rank)
    groups = {axis: axis_groups(topology, axis, ctx.rank) if topology.get_dim(axis) > 1 else None
              for axis in ("pipe", "data")}
    return replace(ctx, rank=coord.pipe, world_size=topology.get_dim("pipe"), groups={**ctx.groups, **groups})


def pipeline_processes(place: RankContext) -> list[int] | None:
    """The processes of `place`'s pipeline, by stage order: where its messages go (None: one stage)."""
    group = place.groups.get("pipe")
    return dist.get_process_group_ranks(group) if group is not None else None


class StageAllReduce:
    """Averages each stage's gradients over the stage's data-parallel group: one flat all-reduce
    per stage, launched the moment the stage's gradients are final and waited for at the end of
    the step, so it travels while the pipeline does its remaining work.

    It is `pipelab.ddp.flat`'s all-reduce, as in `BucketedDDP`: the gradients are divided by the
    group size as they are flattened, so the all-reduce's sum is the average, and each all-reduce
    is drawn on the `comm` lane from launch to arrival, on the rank's one clock: on a GPU both ends
    are CUDA events (the arrival recorded on a stream that waits for the all-reduce, never a
    future's callback, which NCCL fires when the work is enqueued), on a logical clock the
    times it gives."""

    def __init__(self, place: RankContext, modules: dict[int, nn.Module]):
        self.place, self.modules = place, modules
        self.group = place.groups.get("data")  # the copies of this process's stages (None: no copies)
        self.inflight: list[tuple[int, FlatAllReduce]] = []  # (stage, its all-reduce in flight)

    def params(self, stage: int) -> list[nn.Parameter]:
        return [p for _, p in trainable_parameters(self.modules[stage])]

    def start(self, stage: int) -> None:
        """Launch the all-reduce of `stage`'s gradients and return at once."""
        if self.group is None:
            return  # one replica: nothing to average
        self.inflight.append((stage, average_gradients(self.params(stage), self.group, rec=self.place.rec,
                                                       stage=stage)))

    def finish(self) -> None:
        """Wait for every stage's average and write it into `.grad`."""
        for stage, op in self.inflight:
            write_back(op.wait(), self.params(stage))
        self.inflight = []


def last_backwards(actions: list[Action]) -> dict[int, int]:
    """For each stage in a rank's action list, the index of its last action that writes weight
    gradients (a full backward `B`, or `W`): after it, the stage's gradients are final."""
    return {a.stage: i for i, a in enumerate(actions) if a.kind in ("B", "W")}


def run_grid_step(place: RankContext, schedule: Schedule, modules: dict[int, nn.Module], loss_fn: Callable,
                  x: torch.Tensor, y: torch.Tensor, specs: list[list[TensorSpec]]) -> StageRunner:
    """One training step of this process of the grid (no optimizer): lesson 06's rank loop over
    its own pipeline, plus the all-reduce of each stage's gradients over its data-parallel group,
    started as soon as that stage's last backward is done. `place` is this process's `grid_place`;
    `specs` are the messages' shapes (`p2p.message_specs` of the stages on this pipeline's share of
    the batch). The runner it returns holds the last stage's micro-batch losses."""
    m = schedule.num_microbatches
    p2p = P2P(place, schedule, specs, ranks=pipeline_processes(place))  # messages stay within this pipeline
    runner = StageRunner(place, schedule, modules, loss_fn, p2p, list(x.chunk(m)), list(y.chunk(m)))
    reducer = StageAllReduce(place, modules)
    actions = schedule.actions[place.rank]
    final = last_backwards(actions)
    for i, action in enumerate(actions):
        runner.run(action)
        if final.get(action.stage) == i:
            reducer.start(action.stage)  # the pipeline carries on while it travels
    p2p.finish()
    reducer.finish()
    return runner


def microbatch_losses(runner: StageRunner) -> list[float]:
    """Each micro-batch's loss as the last stage computed it, in micro-batch order ([] on a process
    without the last stage). The runner keeps them divided by its divisor, so that they add up to
    the batch's loss; this undoes that division."""
    return [float(loss) * runner.divisor for loss in runner.losses]

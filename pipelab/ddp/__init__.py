"""Data parallelism built by hand (lesson 01): the bucket plan (`buckets`), equal replicas
(`replicas`), the flat all-reduce (`flat`: flatten, divide, all-reduce asynchronously, write back;
also used by the grid's stage all-reduce and DeepSpeed's engine) and the two wrappers, `NaiveDDP`
and `BucketedDDP` (`wrappers`).

What runs them from a notebook (the lesson's Config, worker, gather and verdicts) lives in
`pipelab.experiments.ddp` and `pipelab.experiments.bucket_sweep`, the pictures in `pipelab.plots.ddp`.
"""

from pipelab.ddp.buckets import MIB, Bucket, check_bucket_cap, module_bucket_plan, parameter_devices, plan_buckets
from pipelab.ddp.flat import FlatAllReduce, average_gradients, flatten, write_back
from pipelab.ddp.replicas import broadcast_from_rank0, check_replicas
from pipelab.ddp.base import DDPBase
from pipelab.ddp.wrappers import BucketedDDP, NaiveDDP
from pipelab.models import trainable_parameters

__all__ = [
    "MIB", "Bucket", "BucketedDDP", "DDPBase", "FlatAllReduce", "NaiveDDP", "average_gradients", "broadcast_from_rank0",
    "check_bucket_cap", "check_replicas", "flatten", "module_bucket_plan", "parameter_devices", "plan_buckets",
    "trainable_parameters", "write_back",
]

"""Data parallelism built by hand (lesson 01): the bucket plan (`buckets`), equal replicas
(`replicas`) and the two wrappers, `NaiveDDP` and `BucketedDDP` (`wrappers`).

What runs them from a notebook (workers, `run_ddp`, the bucket sweep) lives in
`pipelab.experiments.ddp`, the pictures in `pipelab.plots.ddp`.
"""

from pipelab.ddp.buckets import (MIB, Bucket, check_bucket_cap, module_bucket_plan, parameter_devices, plan_buckets,
                                 trainable_parameters)
from pipelab.ddp.replicas import broadcast_from_rank0, check_replicas
from pipelab.ddp.base import DDPBase
from pipelab.ddp.wrappers import BucketedDDP, NaiveDDP

__all__ = [
    "MIB", "Bucket", "BucketedDDP", "DDPBase", "NaiveDDP", "broadcast_from_rank0", "check_bucket_cap",
    "check_replicas", "module_bucket_plan", "parameter_devices", "plan_buckets", "trainable_parameters",
]

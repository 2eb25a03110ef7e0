"""The bucket plan: which gradients travel together in one all-reduce, and in which order.

Backward produces gradients last layer first, so the plan walks the parameters in reverse
registration order and closes a bucket once it holds `bucket_cap_mb` MiB, as torch's
`DistributedDataParallel` does. A module spread over several devices gets buckets that never mix
devices (torch's rule too): a bucket is one flat buffer, and one buffer lives on one device. The
planner is a pure function: it needs no processes, so a notebook can print the plan before
anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from torch import nn

from pipelab.checks import positive_number
from pipelab.models import trainable_parameters

MIB = 1024 * 1024  # torch's bucket_cap_mb counts MiB: 25 "MB" are 25 * 2**20 bytes


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients travel together, flattened into one all-reduce."""

    index: int  # launch order: bucket 0 is sent first
    names: tuple[str, ...]  # in the order backward is expected to produce their gradients
    sizes: tuple[int, ...]  # bytes of each parameter's gradient
    device: str | None = None  # the device all its parameters live on (None: not told)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def check_bucket_cap(bucket_cap_mb: float) -> int:
    """The bucket cap in bytes; refuse a cap that is not a positive number of MiB."""
    positive_number("bucket_cap_mb", bucket_cap_mb, unit="MiB",
                    example="bucket_cap_mb=25 (torch's default), or a tiny value such as 0.001 for "
                            "one bucket per parameter")
    return max(1, int(bucket_cap_mb * MIB))


def _check_params(params: list[tuple[str, int]]) -> None:
    """Refuse an empty list, a name given twice, or a size that is not a whole number of bytes."""
    if not params:
        raise ValueError("no parameters to plan buckets for: the module has no parameters that "
                         "require gradients, so there is nothing to average; wrap the model you "
                         "train (e.g. pipelab.models.mlp([8, 16, 4]))")
    names = [name for name, _ in params]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names must be unique, got {twice} more than once")
    for name, nbytes in params:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"parameter {name!r} has size {nbytes!r}; give sizes as whole numbers "
                             "of bytes >= 0, e.g. p.numel() * p.element_size()")


def plan_buckets(params: Sequence[tuple[str, int]], bucket_cap_mb: float,
                 devices: Sequence[str] | None = None) -> list[Bucket]:
    """Group parameters, given as (name, bytes) in registration order, into buckets of about
    `bucket_cap_mb` MiB, walking them in reverse.

    Backward meets the layers last-first, so the first bucket is the first to fill and to be sent.
    A bucket closes as soon as it holds `bucket_cap_mb` or more (torch's rule), so a parameter
    larger than the cap gets a bucket of its own.

    `devices` (one per parameter) keeps one open bucket per device, as torch's reducer does: a
    parameter joins its own device's bucket, so no bucket mixes devices, and buckets are numbered
    in the order they fill, which is the order backward completes them."""
    cap = check_bucket_cap(bucket_cap_mb)
    params = list(params)
    _check_params(params)
    devices = _check_devices(devices, len(params))
    buckets: list[Bucket] = []
    open_: dict[str | None, tuple[list[str], list[int]]] = {}  # device -> its open bucket
    for (name, nbytes), device in zip(reversed(params), reversed(devices)):
        names, sizes = open_.setdefault(device, ([], []))
        open_[device] = open_.pop(device)  # last touched last: leftovers close in walk order
        names.append(name)
        sizes.append(nbytes)
        if sum(sizes) >= cap:
            buckets.append(Bucket(len(buckets), tuple(names), tuple(sizes), device))
            del open_[device]
    for device, (names, sizes) in open_.items():  # the first layers' leftovers: the last, smaller buckets
        buckets.append(Bucket(len(buckets), tuple(names), tuple(sizes), device))
    return buckets


def _check_devices(devices: Sequence[str] | None, count: int) -> list[str | None]:
    """One device per parameter (all None when not told)."""
    if devices is None:
        return [None] * count
    devices = list(devices)
    if len(devices) != count:
        raise ValueError(f"got {len(devices)} devices for {count} parameters; give one device per "
                         "parameter, in the same order")
    return devices


def module_bucket_plan(module: nn.Module, bucket_cap_mb: float = 25.0,
                       device_of: Mapping[str, str] | None = None) -> list[Bucket]:
    """The buckets `BucketedDDP(module, bucket_cap_mb, device_of=...)` will use (no processes needed).

    A module spread over devices gets buckets that never mix them: `device_of` names each
    parameter's device (by parameter name); by default each parameter's own `p.device`, or no
    device at all when the whole module lives on one."""
    params = trainable_parameters(module)
    return plan_buckets([(n, p.numel() * p.element_size()) for n, p in params], bucket_cap_mb,
                        parameter_devices(module, device_of))


def parameter_devices(module: nn.Module, device_of: Mapping[str, str] | None = None) -> list[str] | None:
    """The device of each trainable parameter, in registration order: `device_of[name]` when
    given (virtual devices all live in CPU memory, so only the caller can tell them apart), else
    `str(p.device)`; None when they all share one (the plan then names no device)."""
    params = trainable_parameters(module)
    if device_of is not None:
        missing = [n for n, _ in params if n not in device_of]
        if missing:
            raise ValueError(f"device_of names no device for {missing[:4]}; give every trainable "
                             "parameter's device, e.g. {name: 'device 0'}")
        devices = [str(device_of[n]) for n, _ in params]
    else:
        devices = [str(p.device) for _, p in params]
    return devices if len(set(devices)) > 1 else None

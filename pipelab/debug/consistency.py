"""A collective-consistency check: before each collective, the ranks of its group compare what
they are about to call, and a mismatch raises at once, naming it and both ranks' calls.

A collective only works when every rank of the group calls the same one, on the same group, with
tensors of the same shape and dtype, in the same order. When one rank does not (a branch taken on
one rank only, a shape that depends on the rank's data), gloo hangs or fails far from the cause,
and NCCL hangs until its watchdog fires minutes later. So before the real collective each rank
writes a short description of its call -- (kind, group, shape, dtype) -- in the rendezvous store
under the call's number in its group, and reads its peers' descriptions of the same number. The
store is not the collective's channel, so this exchange works even when the collective would hang.
(torch's `TORCH_DISTRIBUTED_DEBUG=DETAIL` wraps the process group in the same kind of check, which
torch documents for NCCL.)

    with collective_check(seconds=5):
        dist.all_reduce(grad)           # raises CollectiveMismatch if a peer calls something else
"""

from __future__ import annotations

import contextlib
import datetime
import json
from typing import Iterator

import torch
import torch.distributed as dist

CHECKED = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
           "reduce_scatter", "barrier")


class CollectiveMismatch(RuntimeError):
    """Ranks of one group are about to call different collectives: on GPUs this would hang."""


def describe_call(kind: str, args: tuple, kwargs: dict) -> dict:
    """What must agree across ranks: the collective, its group, its tensor's shape and dtype."""
    group = kwargs.get("group")
    tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if tensor is None:  # all_gather(list, tensor): the tensor is the second argument
        tensor = next((a for a in args if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)), [None])[0]
    return {"kind": kind, "group": group_name(group),
            "shape": list(tensor.shape) if tensor is not None else None,
            "dtype": str(tensor.dtype).replace("torch.", "") if tensor is not None else None}


def group_name(group) -> str:
    """A name every rank of the group computes alike: its global ranks."""
    if group is None or group is dist.group.WORLD:
        return "world"
    return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))


def call_text(call: dict) -> str:
    """'all_reduce of a float32 tensor of shape (4, 8) on group world'."""
    if call["shape"] is None:
        return f"{call['kind']} on group {call['group']}"
    return f"{call['kind']} of a {call['dtype']} tensor of shape {tuple(call['shape'])} on group {call['group']}"


class CollectiveCheck:
    """One rank's side of the check: numbers its collectives per group and compares each with its
    peers' call of the same number, through the rendezvous store, waiting at most `seconds`."""

    def __init__(self, store, rank: int, seconds: float = 5.0):
        self.store, self.rank, self.seconds = store, rank, seconds
        self.count: dict[str, int] = {}  # collectives issued so far, per group

    def before(self, kind: str, args: tuple, kwargs: dict) -> None:
        """Publish this call, then compare it with every peer's call of the same number."""
        call = describe_call(kind, args, kwargs)
        group = kwargs.get("group")
        number = self.count.get(call["group"], 0)
        self.count[call["group"]] = number + 1
        key = f"pipelab/debug/collective/{call['group']}/{number}/"
        self.store.set(key + str(self.rank), json.dumps(call))
        peers = [r for r in (dist.get_process_group_ranks(group) if group is not None else
                             range(dist.get_world_size())) if r != self.rank]
        for peer in peers:
            theirs = self.peer_call(key, peer, number, call)
            if theirs != call:
                raise CollectiveMismatch(
                    f"collective {number} of group {call['group']}: rank {self.rank} calls {call_text(call)}, "
                    f"but rank {peer} calls {call_text(theirs)}")

    def peer_call(self, key: str, peer: int, number: int, call: dict) -> dict:
        """The peer's description of its call number `number`; raise if it does not come in time."""
        try:
            self.store.wait([key + str(peer)], datetime.timedelta(seconds=self.seconds))
        except Exception as e:  # noqa: BLE001 - the store's timeout error, whatever its type
            raise CollectiveMismatch(
                f"collective {number} of group {call['group']}: rank {self.rank} calls {call_text(call)}, "
                f"but rank {peer} has not called collective {number} of that group within {self.seconds:g} s "
                "(it stopped before it, or waits on something else)") from e
        return json.loads(self.store.get(key + str(peer)))


@contextlib.contextmanager
def collective_check(seconds: float = 5.0) -> Iterator[CollectiveCheck]:
    """Check every collective this rank calls inside the block (torch.distributed's functions are
    wrapped for its duration; every rank of a group must use the check for that group)."""
    check = CollectiveCheck(dist.distributed_c10d._get_default_store(), dist.get_rank(), seconds)
    originals = {name: getattr(dist, name) for name in CHECKED}

    def wrap(name, original):
        def checked(*args, **kwargs):
            check.before(name, args, kwargs)
            return original(*args, **kwargs)
        return checked

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        yield check
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)

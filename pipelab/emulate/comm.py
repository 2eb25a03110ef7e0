"""NCCL's ordering rule on gloo: the communication of a rank, wrapped so that a program that would
hang on GPUs hangs here too -- and is reported within seconds instead.

NCCL runs a rank's operations on GPU streams, in the order the rank issued them:

* **point to point**: every operation between the same two ranks runs on one stream (PyTorch gives
  each pair of ranks its own communicator), one after another in issue order; a send does not
  finish until its receiver has reached the matching receive (NCCL's rendezvous for large
  messages). Sends and receives match in order, whatever their tags (NCCL has none).
* **batches**: the operations of one `batch_isend_irecv` are one group call: those toward the same
  peer take one place in that pair's queue and progress together, a send beside a receive.
* **collectives**: the collectives of one process group run in issue order.

Gloo has no such rule: its `isend`/`irecv` post at once and never block each other, so a pipeline
whose first operation toward its peer is a receive runs on gloo and hangs on NCCL. `install` wraps
`torch.distributed`'s send, recv, isend, irecv, batch_isend_irecv and the collectives for the
rank's lifetime. Each operation joins a queue (one per peer, one per group) that a thread works
through in order, doing the real gloo transfer only when the rule lets the operation run. A
receive at the head of its queue tells its sender so (a tiny "ready" message); a send waits for
that before it moves its data. Two ranks whose heads are both receives, or both sends, wait for
each other for ever -- as on NCCL.

A *watchdog* on each rank (`deadlock`) raises a `DeadlockError` within seconds when the ranks wait
for each other, naming every stuck rank and what it waits on. The queues, their operations and
handles are in `queues`.

On an emulated node the same queues also carry time: every message brings its sender's modelled
end time (a small header before the data), so a receive completes at max(its post, the send, the
link free) + latency + bytes / bandwidth, the same on both ranks; a collective starts when the
last rank of the group has issued it (a tiny all-reduce(MAX) of the ranks' issue times, in order
on the same group) and lasts the ring formula of lesson 00. Waiting on a handle moves the rank's
logical clock to the operation's modelled end.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from typing import Callable

import torch

from pipelab.emulate.deadlock import WATCHDOG_SECONDS, DeadlockError, Watchdog
from pipelab.emulate.queues import Channel, GroupQueue, Handle, Op

P2P_NAMES = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather",
                    "broadcast", "barrier", "reduce_scatter_single", "all_gather_single", "all_to_all_single")
# torch 2.13 renamed two collectives; the old names call the new ones, so both run the new one's
# original (were the old one's to call the wrapped new one, the group's queue would wait on itself).
RENAMED = {"reduce_scatter_tensor": "reduce_scatter_single", "all_gather_into_tensor": "all_gather_single"}
# The cost model's name of each collective (cost.collective_seconds).
RING_KIND = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
             "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
             "broadcast": "broadcast", "barrier": "barrier", "reduce_scatter_single": "reduce_scatter",
             "all_gather_single": "all_gather",
             # each rank sends (n-1)/n of its input, as in an all-gather of that many bytes: nccl-tests
             # gives all-to-all the same bus factor, (n-1)/n
             "all_to_all_single": "all_gather"}

_active: "Rule | None" = None


def active() -> "Rule | None":
    """The rule installed in this process, if any."""
    return _active


class Rule:
    """NCCL's ordering rule for this rank's torch.distributed calls (see the module's docstring).
    `clock` is the rank's clock; `link` (a `specs.Link`) models messages and collectives on an
    emulated node (None: real time, the rule alone)."""

    def __init__(self, rank: int, world_size: int, clock, link=None, watchdog_seconds: float = WATCHDOG_SECONDS,
                 store=None):
        self.rank, self.world_size, self.clock, self.link = rank, world_size, clock, link
        self.modelled = link is not None
        # Modelled bytes per real byte: a lesson that computes small and emulates large sets it
        # (e.g. emulated activation bytes over real ones), so messages last their emulated size.
        self.bytes_scale = 1.0
        self.original: dict[str, Callable] = {}
        self.channels: dict[int, Channel] = {}
        self.groups: dict[int, GroupQueue] = {}
        self.lock = threading.Lock()
        self.deadlock: DeadlockError | None = None
        self.watchdog = Watchdog(self, store, watchdog_seconds)

    # ---- time -------------------------------------------------------------------------------
    def message_seconds(self, nbytes: int) -> float:
        from pipelab.emulate.cost import message_seconds

        return message_seconds(nbytes * self.bytes_scale, self.link) if self.modelled else 0.0

    def collective_seconds(self, name: str, nbytes: int, ranks: int) -> float:
        from pipelab.emulate.cost import collective_seconds

        return collective_seconds(RING_KIND[name], nbytes * self.bytes_scale, ranks, self.link)

    # ---- queues -----------------------------------------------------------------------------
    def channel(self, peer: int) -> Channel:
        if peer == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to or receive from itself")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"no rank {peer}: ranks are 0..{self.world_size - 1}")
        with self.lock:
            if peer not in self.channels:
                self.channels[peer] = Channel(self, peer)
            return self.channels[peer]

    def group_queue(self, group) -> GroupQueue:
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        with self.lock:
            if id(group) not in self.groups:
                self.groups[id(group)] = GroupQueue(self, group)
            return self.groups[id(group)]

    def post(self, ops: list[tuple[str, torch.Tensor, int]]) -> list[Op]:
        """Issue point-to-point operations together: those toward one peer as one entry."""
        issued = self.clock.now()
        made, by_peer = [], {}
        for kind, tensor, peer in ops:
            channel = self.channel(peer)
            op = Op(kind, tensor, issued, channel.number(), channel.name, peer)
            op.queue = channel
            made.append(op)
            by_peer.setdefault(peer, []).append(op)
        for peer, entry in by_peer.items():
            self.channels[peer].put(entry)
        return made

    def wait(self, op: Op) -> None:
        """Block until `op` ran (or the watchdog finds the ranks deadlocked), then move the clock."""
        if not op.done.is_set():
            self.watchdog.wait_starts(op)
            try:
                while not op.done.wait(0.5):
                    if self.deadlock is not None:
                        raise self.deadlock
            finally:
                self.watchdog.wait_ends()
        if op.error is not None and self.deadlock is None:  # a peer that found the deadlock may have left
            self.deadlock = self.watchdog.found_elsewhere()
        if op.error is not None and self.deadlock is not None:  # the deadlock is the cause, not its echo
            raise self.deadlock
        if op.error is not None:
            raise RuntimeError(f"rank {self.rank}'s {op.describe()} failed: {op.error}") from op.error
        self.clock.wait_until(op.end)

    def progressed(self) -> None:
        self.watchdog.progress = time.monotonic()

    # ---- the wrapped torch.distributed functions ---------------------------------------------
    def peer(self, group, rank: int | None, group_rank: int | None, what: str) -> int:
        import torch.distributed as dist

        if group_rank is not None:
            return dist.get_global_rank(group, group_rank)
        if rank is None:
            raise ValueError(f"{what} needs its peer: NCCL has no receive from any source; name src")
        return rank

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        (op,) = self.post([("send", tensor, self.peer(group, dst, group_dst, "isend"))])
        return Handle(self, op)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        (op,) = self.post([("recv", tensor, self.peer(group, src, group_src, "irecv"))])
        return Handle(self, op)

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None) -> None:
        self.isend(tensor, dst, group, tag, group_dst).wait()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None) -> int:
        handle = self.irecv(tensor, src, group, tag, group_src)
        handle.wait()
        return handle.op.peer

    def batch_isend_irecv(self, p2p_op_list) -> list[Handle]:
        """The operations issued together, as NCCL's group call (`ncclGroupStart/End`) does."""
        if not p2p_op_list:
            raise ValueError("batch_isend_irecv needs at least one P2POp")
        ops = []
        for p in p2p_op_list:
            name = getattr(p.op, "__name__", "")
            if name not in ("isend", "irecv"):
                raise ValueError(f"a P2POp's op must be dist.isend or dist.irecv, got {p.op!r}")
            ops.append(("send" if name == "isend" else "recv", p.tensor, p.peer))
        return [Handle(self, op) for op in self.post(ops)]

    def collective(self, name: str) -> Callable:
        """The wrapped collective `name`: queued on its group's queue, run there in issue order."""
        original, signature = self.actual[name], inspect.signature(self.original[name])

        def wrapped(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            async_op = a.get("async_op", False)
            a["async_op"] = False
            if name == "barrier" and a.get("device_ids") is None:
                a.pop("device_ids", None)
            group = a.get("group")
            group_queue = self.group_queue(group if group is not None and group is not _world() else None)
            op = Op(name, _main_tensor(name, a), self.clock.now(), group_queue.number(), group_queue.name)
            op.queue = group_queue
            op.nbytes = _collective_bytes(name, a, len(group_queue.ranks))
            op.call = lambda: original(*bound.args, **bound.kwargs)
            group_queue.put([op])
            handle = Handle(self, op)
            if async_op:
                return handle
            handle.wait()
            return op.result

        wrapped.__name__ = wrapped.__qualname__ = name
        wrapped.__doc__ = f"torch.distributed.{name} under NCCL's ordering rule (pipelab.emulate.comm)."
        return wrapped

    def patch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        names = [n for n in P2P_NAMES + COLLECTIVE_NAMES if hasattr(c10d, n)]
        self.original = {n: getattr(c10d, n) for n in names}
        self.actual = {n: getattr(c10d, RENAMED.get(n, n), None) or getattr(c10d, n) for n in names}
        for name in names:
            fn = self.collective(name) if name in COLLECTIVE_NAMES else getattr(self, name)
            for module in (dist, c10d):
                setattr(module, name, fn)


def _world():
    import torch.distributed as dist

    return dist.group.WORLD


def _main_tensor(name: str, a: dict) -> torch.Tensor | None:
    """The tensor a collective's handle gives back: the one it fills."""
    return {"all_reduce": a.get("tensor"), "broadcast": a.get("tensor"),
            "reduce_scatter_tensor": a.get("output"), "all_gather_into_tensor": a.get("output_tensor"),
            "reduce_scatter_single": a.get("output"), "all_gather_single": a.get("output_tensor"),
            "all_to_all_single": a.get("output")}.get(name)


def _collective_bytes(name: str, a: dict, ranks: int) -> int:
    """The whole tensor's bytes, as `cost.collective_seconds` takes them."""
    if name in ("all_reduce", "broadcast"):
        return a["tensor"].nbytes
    if name in ("reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single"):
        return a["input"].nbytes
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return a["output_tensor"].nbytes
    if name == "all_gather":
        return a["tensor"].nbytes * ranks
    return 0  # barrier


def install(rank: int, world_size: int, clock, link=None, watchdog_seconds: float = WATCHDOG_SECONDS) -> Rule:
    """Put this rank's torch.distributed calls under NCCL's ordering rule (after the process group
    formed). The watchdog talks through the rendezvous store of MASTER_ADDR/MASTER_PORT."""
    global _active
    import datetime

    import torch.distributed as dist

    if _active is not None:
        raise RuntimeError("NCCL's ordering rule is installed already in this process")
    store = None
    if world_size > 1:
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=datetime.timedelta(seconds=60))
        store = dist.PrefixStore("pipelab/nccl-rule/", client)
    rule = Rule(rank, world_size, clock, link, watchdog_seconds, store)
    rule.patch()
    _active = rule
    return rule

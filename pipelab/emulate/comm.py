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

A *watchdog* thread on each rank publishes what the rank waits on in the rendezvous store; when
every rank that has not finished has waited `watchdog_seconds` without any progress, each raises a
`DeadlockError` naming every stuck rank and the operation it waits on. spawn reports it as a
`WorkerError`. (A single transfer that really takes longer than that would be misread as a
deadlock; the lessons' messages take milliseconds.)

On an emulated node the same queues also carry time: every message brings its sender's modelled
end time (a small header before the data), so a receive completes at max(its post, the send, the
link free) + latency + bytes / bandwidth, the same on both ranks; a collective starts when the
last rank of the group has issued it (a tiny all-reduce(MAX) of the ranks' issue times, in order
on the same group) and lasts the ring formula of lesson 00. Waiting on a handle moves the rank's
logical clock to the operation's modelled end.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import threading
import time
from typing import Any, Callable

import torch

WATCHDOG_SECONDS = 5.0  # without progress on any rank for this long, the ranks are deadlocked
_TICK = 0.2  # how often the watchdog publishes this rank's state and looks at the others'
READY, HEADER, DATA = 1, 2, 3  # gloo tags of the rule's own messages (user tags are ignored, as on NCCL)
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


class DeadlockError(RuntimeError):
    """The ranks wait for each other under NCCL's ordering rule: on GPUs this program hangs."""


def active() -> "Rule | None":
    """The rule installed in this process, if any."""
    return _active


class Op:
    """One operation as a rank issued it: a send or receive toward `peer`, or a collective."""

    def __init__(self, kind: str, tensor: torch.Tensor | None, issued: float, number: int, where: str,
                 peer: int | None = None):
        self.kind, self.tensor, self.issued, self.number, self.where, self.peer = kind, tensor, issued, number, where, peer
        self.end: float | None = None  # on the rank's clock (modelled end when emulated)
        self.error: BaseException | None = None
        self.result: Any = None
        self.done = threading.Event()
        self.callbacks: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.queue: Queue | None = None  # the queue it runs on

    def describe(self) -> str:
        if self.kind == "send":
            return f"send to rank {self.peer} (op {self.number} on {self.where})"
        if self.kind == "recv":
            return f"receive from rank {self.peer} (op {self.number} on {self.where})"
        return f"{self.kind} (collective {self.number} of {self.where})"

    def complete(self) -> None:
        with self.lock:
            self.done.set()
            callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()

    def on_done(self, callback: Callable[[], None]) -> None:
        with self.lock:
            if not self.done.is_set():
                self.callbacks.append(callback)
                return
        callback()


class Handle:
    """What an asynchronous operation returns under the rule (in place of torch's `Work`):
    `wait()` blocks until the operation ran and moves the rank's clock to its end."""

    def __init__(self, rule: "Rule", op: Op):
        self.rule, self.op = rule, op

    def wait(self, timeout=None) -> bool:
        self.rule.wait(self.op)
        return True

    def is_completed(self) -> bool:
        return self.op.done.is_set()

    def is_success(self) -> bool:
        return self.op.done.is_set() and self.op.error is None

    def result(self) -> list:
        self.wait()
        return [self.op.tensor] if self.op.tensor is not None else []

    def get_future(self) -> torch.futures.Future:
        """A future set when the operation has run (on the queue's thread), as gloo's is."""
        future = torch.futures.Future()

        def settle():
            if self.op.error is not None:
                future.set_exception(self.op.error)
            else:
                future.set_result([self.op.tensor] if self.op.tensor is not None else [])

        self.op.on_done(settle)
        return future

    @property
    def start(self) -> float:
        """When the rank issued it (its clock)."""
        return self.op.issued

    @property
    def end(self) -> float | None:
        """When it finished (its clock; the modelled end when emulated), None while it runs."""
        return self.op.end


class Queue:
    """Operations that run one after another in issue order, worked through by one thread."""

    def __init__(self, rule: "Rule", name: str):
        self.rule, self.name = rule, name
        self.entries: queue.SimpleQueue = queue.SimpleQueue()
        self.current: list[Op] = []  # the entry at the head, running
        self.pending: list[Op] = []  # issued and not finished, in issue order
        self.lock = threading.Lock()
        self.busy_until = 0.0  # when the last entry ended (rank's clock)
        self.issued = 0
        self.broken: BaseException | None = None
        threading.Thread(target=self.work, name=f"nccl-rule {name}", daemon=True).start()

    def number(self) -> int:
        self.issued += 1
        return self.issued

    def put(self, entry: list[Op]) -> None:
        with self.lock:
            self.pending += entry
        self.entries.put(entry)

    def work(self) -> None:
        while True:
            entry = self.entries.get()
            self.current = entry
            try:
                if self.broken is not None:
                    raise self.broken
                self.run(entry)
                self.busy_until = max(op.end for op in entry)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the operation
                self.broken = self.broken or e
                for op in entry:
                    op.error = e
            finally:
                self.current = []
                with self.lock:
                    self.pending = [op for op in self.pending if op not in entry]
                self.rule.progressed()
                for op in entry:
                    op.complete()

    def run(self, entry: list[Op]) -> None:
        raise NotImplementedError


class Channel(Queue):
    """This rank's point-to-point operations toward one peer, in issue order (NCCL's stream of
    the pair). A receive at the head sends its sender a READY message carrying the time it became
    ready; a send at the head waits for that READY, then sends a HEADER (the message's end time)
    and the DATA. The operations of one entry (a batch) run together."""

    def __init__(self, rule: "Rule", peer: int):
        lo, hi = sorted((rule.rank, peer))
        super().__init__(rule, f"channel {lo}<->{hi}")
        self.peer = peer
        self.link_free = 0.0  # when our direction of the link is free again (modelled)

    def run(self, entry: list[Op]) -> None:
        rule, peer, real = self.rule, self.peer, self.rule.original
        ready = max([self.busy_until] + [op.issued for op in entry])  # at the head of the stream
        works, waiting_sends = [], []
        for op in entry:
            if op.kind == "recv":
                works.append(real["isend"](torch.tensor([ready], dtype=torch.float64), peer, tag=READY))
                op.header = torch.zeros(1, dtype=torch.float64)
                works.append(real["irecv"](op.header, peer, tag=HEADER))
                works.append(real["irecv"](op.tensor, peer, tag=DATA))
            else:
                op.ready = torch.zeros(1, dtype=torch.float64)
                waiting_sends.append((op, real["irecv"](op.ready, peer, tag=READY)))
        for op, receiver_ready in waiting_sends:  # each send waits until its receive is at the head
            receiver_ready.wait()
            start = max(ready, op.ready.item(), self.link_free)
            op.end = self.link_free = start + rule.message_seconds(op.tensor.nbytes)
            works.append(real["isend"](torch.tensor([op.end], dtype=torch.float64), peer, tag=HEADER))
            works.append(real["isend"](op.tensor, peer, tag=DATA))
        for work in works:
            work.wait()
        for op in entry:
            if op.kind == "recv":
                op.end = op.header.item()
            if not rule.modelled:
                op.end = rule.clock.now()


class GroupQueue(Queue):
    """The collectives of one process group, in issue order."""

    def __init__(self, rule: "Rule", group):
        import torch.distributed as dist

        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        super().__init__(rule, f"group {self.ranks}")

    def run(self, entry: list[Op]) -> None:
        import torch.distributed as dist

        (op,) = entry
        rule = self.rule
        start = max(op.issued, self.busy_until)
        if rule.modelled:  # it starts when the group's last rank has issued it
            t = torch.tensor([start], dtype=torch.float64)
            rule.original["all_reduce"](t, op=dist.ReduceOp.MAX, group=self.group)
            start = t.item()
        op.result = op.call()
        op.end = start + rule.collective_seconds(op.kind, op.nbytes, len(self.ranks)) if rule.modelled else rule.clock.now()


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

    def unpatch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, fn in self.original.items():
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


class Watchdog:
    """Publishes what this rank waits on (in the rendezvous store) and raises the alarm when every
    rank that has not finished has waited `seconds` without progress anywhere."""

    def __init__(self, rule: Rule, store, seconds: float):
        self.rule, self.store, self.seconds = rule, store, seconds
        self.waiting_on: Op | None = None
        self.since = time.monotonic()
        self.progress = time.monotonic()
        self.finished = False
        self.published = None
        if store is not None:
            self.publish()
            threading.Thread(target=self.watch, name="nccl-rule watchdog", daemon=True).start()

    def wait_starts(self, op: Op) -> None:
        self.since, self.waiting_on = time.monotonic(), op

    def wait_ends(self) -> None:
        self.waiting_on = None

    def finish(self) -> None:
        """This rank's function returned: it waits for nobody any more."""
        self.finished = True
        if self.store is not None:
            self.publish()

    def state(self) -> dict:
        if self.finished:
            return {"state": "finished"}
        op = self.waiting_on
        if op is None:
            return {"state": "running"}
        return {"state": "waiting", "what": self.describe(op), "since": max(self.since, self.progress)}

    def describe(self, op: Op) -> str:
        """"rank 0 waits for its send to rank 1 (op 2 on channel 0<->1), queued behind its ...\""""
        text = f"rank {self.rule.rank} waits for its {op.describe()}"
        head = op.queue.current if op.queue is not None else []
        if head and op not in head:
            text += ", queued behind its " + " and ".join(h.describe() for h in head)
        elif op.queue is not None and (behind := [o for o in list(op.queue.pending) if o not in head and o is not op]):
            text += f", before it can run its {behind[0].describe()}"
        return text

    def publish(self) -> None:
        state = self.state()
        if state != self.published:
            self.store.set(str(self.rule.rank), json.dumps(state))
            self.published = state

    def everyone(self) -> list[dict]:
        """Every rank's published state (a rank that has not published yet is still starting)."""
        return [json.loads(self.store.get(str(r))) if self.store.check([str(r)]) else {"state": "running"}
                for r in range(self.rule.world_size)]

    def stuck(self, states: list[dict]) -> bool:
        """Every rank finished or waiting, at least one waiting, none progressed for `seconds`."""
        now = time.monotonic()
        waiting = [s for s in states if s["state"] == "waiting"]
        return (bool(waiting) and all(s["state"] in ("waiting", "finished") for s in states)
                and all(now - s["since"] > self.seconds for s in waiting))

    def watch(self) -> None:
        while self.rule.deadlock is None:
            time.sleep(_TICK)
            try:
                self.publish()
                if self.waiting_on is None or time.monotonic() - self.state().get("since", 0) <= self.seconds:
                    continue
                first = self.everyone()
                if not self.stuck(first):
                    continue
                time.sleep(2 * _TICK)  # confirm: a rank that just moved on has published it by now
                if self.everyone() == first and self.waiting_on is not None:
                    self.rule.deadlock = DeadlockError(self.report(first))
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending
                return

    def report(self, states: list[dict]) -> str:
        lines = [s["what"] if s["state"] == "waiting" else f"rank {r} has finished its function"
                 for r, s in enumerate(states)]
        return (f"deadlock under NCCL's ordering rule: no rank made progress for {self.seconds:g} s.\n  "
                + ";\n  ".join(lines) + ".\nOn GPUs this program hangs: NCCL runs the operations between two "
                "ranks one after another in the order each rank issued them, and a send waits until its "
                "receiver has reached the matching receive. Issue each step's matched sends and receives "
                "together (dist.batch_isend_irecv), or post a receive only after the sends its peer is "
                "waiting for.")


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


def uninstall() -> None:
    """Give the process its own torch.distributed functions back."""
    global _active
    if _active is not None:
        _active.unpatch()
        _active = None

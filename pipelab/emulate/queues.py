"""The queues of NCCL's ordering rule (`pipelab.emulate.comm`): each rank's operations as it
issued them (`Op`), what an asynchronous call returns (`Handle`), and the queues that run them
one after another in issue order, each worked through by one thread: a `Channel` per peer (NCCL's
stream of a pair of ranks) and a `GroupQueue` per process group (its collectives).

A queue's `rule` is the rank's `comm.Rule`: it holds torch's own functions (`original`), the clock,
and, on an emulated node, the link model that gives each message and collective its modelled time.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch

READY, HEADER, DATA = 1, 2, 3  # gloo tags of the rule's own messages (user tags are ignored, as on NCCL)


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

    def __init__(self, rule, op: Op):
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

    def __init__(self, rule, name: str):
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

    def __init__(self, rule, peer: int):
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

    def __init__(self, rule, group):
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

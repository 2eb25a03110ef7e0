"""What a rank's student code asked of torch.distributed, recorded during a check.

A thin wrapper is put around the collectives and point-to-point calls of `torch.distributed` on
each rank while the student's function runs (above NCCL's ordering rule, which stays on). Every
call is recorded (which operation, which peer, which group, which tensor), every request an
asynchronous call returns is followed until it is waited for, and sends start late on purpose, so
an answer that reads a received tensor before waiting for it sees the old values every time. A
checker then asks what the task asks: "one reduce-scatter", "sends and receives only", "every
request waited for", "over this group".
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


class Wrong(Exception):
    """Raised inside a checker to end it with a failing grade; its text is the message."""


P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
               "broadcast", "reduce", "gather", "scatter", "all_to_all_single", "all_to_all", "barrier")
SEND_DELAY = 0.02  # seconds a send starts late: a receive read before its wait then holds stale values

# torch 2.13 names some collectives twice (an old name calling the new one): record both under one
SAME_AS = {"reduce_scatter_single": "reduce_scatter_tensor", "all_gather_single": "all_gather_into_tensor"}


@dataclass
class Call:
    """One torch.distributed call a rank made: its operation, peer (p2p), group ranks, main tensor."""

    number: int
    op: str
    peer: int | None = None
    group: tuple[int, ...] | None = None  # the group's global ranks; None: every rank
    numel: int = 0
    ptr: int = 0  # the data pointer of the tensor it read or wrote
    async_op: bool = False
    waited: bool = True
    extra: dict = field(default_factory=dict)

    def describe(self) -> str:
        where = "" if self.peer is None else (" to" if "send" in self.op else " from") + f" rank {self.peer}"
        return f"{self.op}{where} (call {self.number + 1})"


class Request:
    """The student's handle on an asynchronous call: waiting on it marks the call waited."""

    def __init__(self, work, call: Call):
        self._work, self._call = work, call

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._call.waited = True
        return result

    def __getattr__(self, name):
        if name in ("get_future", "result", "synchronize"):
            self._call.waited = True
        return getattr(self._work, name)


class Recorder:
    """Record this rank's torch.distributed calls while installed (`with Recorder(rank) as rec:`).

    `refuse(call) -> message or None`: a checker's rule checked before the call is issued (a call
    that would deadlock, e.g. on the wrong group, fails at once with the message instead)."""

    def __init__(self, rank: int, refuse: Callable[[Call], str | None] | None = None, send_delay: float = SEND_DELAY):
        self.rank, self.refuse, self.send_delay = rank, refuse, send_delay
        self.calls: list[Call] = []
        self.requests: list[Request] = []
        self.saved: dict[str, Callable] = {}

    # ---- what the checkers ask --------------------------------------------------------------
    def ops(self) -> list[str]:
        return [c.op for c in self.calls]

    def collectives(self) -> list[Call]:
        return [c for c in self.calls if c.op in COLLECTIVES]

    def unwaited(self) -> list[Call]:
        return [c for c in self.calls if not c.waited]

    def finish(self) -> None:
        """Wait for what the student left unwaited (so the peers end cleanly), then fail saying so."""

        left = self.unwaited()
        for request in self.requests:
            if not request._call.waited:
                try:
                    request._work.wait()
                except Exception:  # noqa: BLE001 - the failure to report is the missing wait
                    pass
        if left:
            raise Wrong(unwaited_message(self.rank, left))

    def touched(self, tensor: torch.Tensor) -> bool:
        """Whether a recorded call read or wrote `tensor`'s memory (not a copy of it)."""
        start = tensor.untyped_storage().data_ptr()
        end = start + tensor.untyped_storage().nbytes()
        return any(start <= c.ptr < end for c in self.calls if c.ptr)

    def summary(self) -> dict:
        """What travels back from the rank: the calls, as plain data."""
        return {"calls": [c.__dict__ | {"extra": {}} for c in self.calls]}

    # ---- the wrapper ------------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        import torch.distributed as dist

        for name in P2P + COLLECTIVES + ("batch_isend_irecv", *SAME_AS):
            if hasattr(dist, name):
                self.saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str, original: Callable) -> Callable:
        if name == "batch_isend_irecv":
            return self._batch(original)
        try:
            signature = inspect.signature(_unwrapped(name, original))
        except (TypeError, ValueError):
            signature = None
        op = SAME_AS.get(name, name)

        def wrapped(*args, **kwargs):
            a = _bind(signature, args, kwargs)
            call = Call(len(self.calls), op, peer=_peer(a) if op in P2P else None, group=_group_ranks(a.get("group")),
                        async_op=bool(a.get("async_op", False)) or op in ("isend", "irecv"))
            tensor = _main_tensor(a)
            if tensor is not None:
                call.numel, call.ptr = tensor.numel(), tensor.data_ptr()
            self._issue(call)
            if op in ("send", "isend") and self.send_delay:
                time.sleep(self.send_delay)
            result = original(*args, **kwargs)
            if call.async_op:
                call.waited = False
                self.requests.append(Request(result, call))
                return self.requests[-1]
            return result

        wrapped.__name__ = wrapped.__qualname__ = name
        return wrapped

    def _batch(self, original: Callable) -> Callable:
        def batch_isend_irecv(p2p_op_list):
            calls = []
            for p in p2p_op_list:
                kind = "isend" if getattr(p.op, "__name__", "") == "isend" else "irecv"
                call = Call(len(self.calls), kind, peer=p.peer, numel=p.tensor.numel(), ptr=p.tensor.data_ptr(),
                            async_op=True, waited=False, extra={"batched": True})
                self._issue(call)
                calls.append(call)
            if any(c.op == "isend" for c in calls) and self.send_delay:
                time.sleep(self.send_delay)
            requests = [Request(w, c) for w, c in zip(original(p2p_op_list), calls)]
            self.requests += requests
            return requests

        return batch_isend_irecv

    def _issue(self, call: Call) -> None:

        self.calls.append(call)
        problem = self.refuse(call) if self.refuse else None
        if problem:
            raise Wrong(problem)


def _unwrapped(name: str, fn: Callable) -> Callable:
    """torch's own function of `name` (NCCL's rule wraps it as f(*args, **kwargs))."""
    from pipelab.emulate import comm

    rule = comm.active()
    if rule is not None and name in getattr(rule, "original", {}):
        return rule.original[name]
    return fn


def _bind(signature, args, kwargs) -> dict:
    if signature is None:
        return dict(kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _peer(a: dict) -> int | None:
    for key in ("dst", "src"):
        if a.get(key) is not None:
            return int(a[key])
    return None


def _main_tensor(a: dict) -> torch.Tensor | None:
    for key in ("tensor", "output", "output_tensor", "inputs"):
        value = a.get(key)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _group_ranks(group) -> tuple[int, ...] | None:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group this rank is not in
        return ()


def unwaited_message(rank: int, calls: list[Call]) -> str:
    """What a rank that left requests unwaited is told."""
    names = ", ".join(c.describe() for c in calls[:3]) + (" ..." if len(calls) > 3 else "")
    return (f"rank {rank} never waited for {len(calls)} request(s): {names}. An unwaited request may not have "
            "run when its tensor is read or the rank ends (a race: it passes only sometimes); call .wait() on "
            "every request an isend, irecv or async_op=True returns")

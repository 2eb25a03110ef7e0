"""A flight recorder: each rank keeps its last N communication operations in a ring buffer and
writes them to a file when one of them has waited too long, so a hang can be read after the fact.

This is the idea of torch's NCCL flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE, dumped by the NCCL
watchdog on a timeout and read with `torch.distributed.flight_recorder`): a record per operation
-- its kind, its peer or group, its tensor's shape, its number in its channel, and its state,
issued or completed -- costs almost nothing to keep, and when the job hangs it is the only place
that says what every rank was doing. The records of all ranks are read together by
`pipelab.debug.reader`.

    with flight_recorder(d, capacity=32, timeout=10.0):
        ...                                  # sends, receives and collectives are recorded
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")


@dataclass
class Record:
    """One operation as this rank issued it. `channel` is 'to 1' / 'from 1' for point to point and
    the group ('world' or 'ranks 0,1') for a collective; `number` counts operations on the channel."""

    kind: str
    channel: str
    number: int
    shape: list[int] | None
    issued: float  # time.time() when issued
    state: str = "issued"  # then "completed"
    completed: float | None = field(default=None)


class FlightRecorder:
    """The ring buffer of one rank: the last `capacity` operations, oldest first."""

    def __init__(self, rank: int, capacity: int = 32):
        self.rank = rank
        self.records: collections.deque[Record] = collections.deque(maxlen=capacity)
        self.counts: dict[str, int] = collections.Counter()
        self.lock = threading.Lock()
        self.dumped = False

    def issue(self, kind: str, channel: str, tensor: torch.Tensor | None) -> Record:
        with self.lock:
            record = Record(kind, channel, self.counts[channel], list(tensor.shape) if tensor is not None else None,
                            time.time())
            self.counts[channel] += 1
            self.records.append(record)
        return record

    def complete(self, record: Record) -> None:
        record.state, record.completed = "completed", time.time()

    def oldest_waiting(self) -> Record | None:
        with self.lock:
            return next((r for r in self.records if r.state == "issued"), None)

    def dump(self, path: str, why: str) -> None:
        """Write the buffer as JSON, once (written aside, then renamed, so a reader never sees half)."""
        with self.lock:
            if self.dumped:
                return
            self.dumped = True
            data = {"rank": self.rank, "why": why, "dumped": time.time(), "records": [asdict(r) for r in self.records]}
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)


class RecordedWork:
    """An asynchronous operation's handle whose `wait()` also marks its record completed."""

    def __init__(self, work, recorder: FlightRecorder, record: Record):
        self.work, self.recorder, self.record = work, recorder, record

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        self.recorder.complete(self.record)
        return result

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def channel_of(kind: str, args: tuple, kwargs: dict) -> str:
    """'to 1' or 'from 1' for a send or receive; the group's name for a collective."""
    if kind in P2P:
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
        return f"{'to' if 'send' in kind else 'from'} {peer}"
    from pipelab.debug.consistency import group_name

    return group_name(kwargs.get("group"))


DUMP_KEY = "pipelab/debug/flight-recorder/dump"
DUMPED_KEY = "pipelab/debug/flight-recorder/dumped"
EXIT_TIMEOUT = 3  # the exit code of a rank whose operation timed out, once the dumps are written


def _watch(recorder: FlightRecorder, path: str, timeout: float, stop: threading.Event, store) -> None:
    """Torch's NCCL watchdog in small: when one of this rank's operations has waited `timeout`
    seconds, dump, tell every rank to dump (through the store), give them a moment, then end this
    rank, as the watchdog aborts a process whose collective timed out. A rank told to dump dumps."""
    while not stop.wait(0.1):
        oldest = recorder.oldest_waiting()
        if oldest is not None and time.time() - oldest.issued > timeout:
            why = f"rank {recorder.rank}'s {oldest.kind} {oldest.channel} #{oldest.number} waited over {timeout:g} s"
            recorder.dump(path, why)
            store.set(DUMP_KEY, why)
            store.add(DUMPED_KEY, 1)
            deadline = time.time() + 2.0
            try:
                while store.add(DUMPED_KEY, 0) < dist.get_world_size() and time.time() < deadline:
                    time.sleep(0.05)
            except RuntimeError:  # the store's host rank ended first (DistNetworkError): its dump is written
                pass
            print(f"flight recorder: {why}; every rank's buffer dumped to {os.path.dirname(path)}; ending rank "
                  f"{recorder.rank} with exit code {EXIT_TIMEOUT}", flush=True)
            os._exit(EXIT_TIMEOUT)
        if store.check([DUMP_KEY]):
            recorder.dump(path, store.get(DUMP_KEY).decode())
            store.add(DUMPED_KEY, 1)
            return


def _own_store():
    """A connection of this thread's own to the rendezvous store (MASTER_ADDR/PORT, as set by
    spawn or torchrun), so the watcher never shares the process group's."""
    import datetime

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=30))


@contextlib.contextmanager
def flight_recorder(dump_dir: str, capacity: int = 32, timeout: float = 10.0) -> Iterator[FlightRecorder]:
    """Record this rank's sends, receives and collectives inside the block. When one waits over
    `timeout` seconds, every rank dumps its buffer to `dump_dir/rank-R.json` and the waiting rank
    ends (exit code 3); a rank also dumps when the block raises. Every rank of the job must use it."""
    recorder = FlightRecorder(dist.get_rank(), capacity)
    path = os.path.join(dump_dir, f"rank-{recorder.rank}.json")
    originals = {name: getattr(dist, name) for name in (*P2P, *COLLECTIVES)}

    def wrap(name, original):
        def recorded(*args, **kwargs):
            tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            record = recorder.issue(name.lstrip("i") if name in ("isend", "irecv") else name,
                                    channel_of(name, args, kwargs), tensor)
            result = original(*args, **kwargs)
            if name in ("isend", "irecv") or kwargs.get("async_op"):
                return RecordedWork(result, recorder, record)
            else:
                recorder.complete(record)
            return result
        return recorded

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(recorder, path, timeout, stop, _own_store()), daemon=True)
    watcher.start()
    try:
        yield recorder
    except BaseException as e:
        recorder.dump(path, f"raised {type(e).__name__}")
        raise
    finally:
        stop.set()
        for name, original in originals.items():
            setattr(dist, name, original)

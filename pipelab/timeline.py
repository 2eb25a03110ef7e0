"""One timeline for every lesson: spans, recorders, metrics and trace export.

A `Span` says that one rank (or one device, in single-process lessons) was busy on one lane
(`compute`, `comm`, `copy`, ...) doing one kind of work (`F`, `B`, `W`, `allreduce`, ...) for one
micro-batch, from `start` to `end`. Times are seconds on a clock that all processes of the machine
share (`time.perf_counter`, which is CLOCK_MONOTONIC on Linux), so spans recorded by different
ranks line up on one axis. CUDA work is timed with CUDA events and mapped onto the same clock.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator

now = time.perf_counter  # the shared clock: system-wide monotonic, in seconds


@dataclass(frozen=True)
class Span:
    """One busy interval of one rank (or device) on one lane."""

    rank: int | str  # a rank number, or a device name such as "cpu:1" / "cuda:0"
    lane: str  # "compute", "comm", "copy", ... (a row of the Gantt chart)
    kind: str  # "F", "B", "W", "allreduce", "send", ... (the colour)
    start: float  # seconds on the shared clock
    end: float
    mb: int | None = None  # micro-batch index, when the work belongs to one
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


# ---- interval algebra ------------------------------------------------------------------------
# Time as lists of (start, end) intervals: every metric of a timeline (busy time, utilization,
# overlap, exposed communication, idle gaps) is one of these four operations on a rank's spans.

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time: overlapping or touching ones merged."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[Interval]) -> float:
    """Seconds the intervals cover, overlapping parts counted once."""
    return sum(b - a for a, b in union(intervals))


def overlap(xs: Iterable[Interval], ys: Iterable[Interval]) -> list[Interval]:
    """The time both `xs` and `ys` cover (e.g. communication hidden behind compute)."""
    xs, ys = union(xs), union(ys)
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):  # walk both sorted lists once
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            out.append((lo, hi))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def complement(xs: Iterable[Interval], within: Iterable[Interval]) -> list[Interval]:
    """The gaps: the time of `within` that `xs` does not cover (e.g. a rank's idle time in a step,
    or the communication no compute hides)."""
    xs, out = union(xs), []
    for a, b in union(within):
        t = a
        for c, d in xs:
            if d <= t:
                continue
            if c >= b:
                break
            if c > t:
                out.append((t, c))
            t = d
        if t < b:
            out.append((t, b))
    return out


def _intervals(timeline: "Timeline") -> list[Interval]:
    return [(s.start, s.end) for s in timeline]


@dataclass
class Timeline:
    """The spans of one run, from one rank or merged from many."""

    spans: list[Span] = field(default_factory=list)

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def merge(cls, timelines: Iterable["Timeline"]) -> "Timeline":
        """One timeline holding the spans of all given timelines (e.g. every rank's)."""
        spans = [s for tl in timelines if tl is not None for s in tl.spans]
        return cls(sorted(spans, key=lambda s: (s.start, str(s.rank), s.lane)))

    def filter(self, rank=None, lane=None, kind=None) -> "Timeline":
        """The spans that match every given field (a value or a collection of values)."""

        def ok(value, wanted):
            if wanted is None:
                return True
            if isinstance(wanted, (list, tuple, set, frozenset)):
                return value in wanted
            return value == wanted

        return Timeline([s for s in self.spans if ok(s.rank, rank) and ok(s.lane, lane) and ok(s.kind, kind)])

    def shifted(self, origin: float | None = None) -> "Timeline":
        """The same spans with times measured from `origin` (default: the first start)."""
        origin = self.start if origin is None else origin
        return Timeline([replace(s, start=s.start - origin, end=s.end - origin) for s in self.spans])

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self) -> Iterator[Span]:
        return iter(self.spans)

    # ---- shape ----------------------------------------------------------------------------
    @property
    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @property
    def makespan(self) -> float:
        """Seconds from the first span's start to the last span's end: the step time."""
        return self.end - self.start

    @property
    def ranks(self) -> list:
        return sorted({s.rank for s in self.spans}, key=lambda r: (isinstance(r, str), r))

    @property
    def lanes(self) -> list[str]:
        order = {"compute": 0, "comm": 1, "copy": 2}
        return sorted({s.lane for s in self.spans}, key=lambda l: (order.get(l, 9), l))

    def rows(self) -> list[tuple]:
        """(rank, lane) pairs that have spans, in display order: by rank, then lane."""
        have = {(s.rank, s.lane) for s in self.spans}
        return [(r, l) for r in self.ranks for l in self.lanes if (r, l) in have]

    # ---- metrics --------------------------------------------------------------------------
    def busy_time(self, rank=None, lane="compute") -> float:
        """Seconds during which `rank` had work on `lane` (overlapping spans counted once).

        With rank=None, the sum over ranks."""
        ranks = self.ranks if rank is None else [rank]
        return sum(length(_intervals(self.filter(rank=r, lane=lane))) for r in ranks)

    def utilization(self, lane="compute", window: tuple[float, float] | None = None) -> dict:
        """Busy fraction of the step for each rank on `lane`: busy time / step time.

        The step runs from the first to the last span of the whole timeline (all ranks), unless
        `window` = (start, end) is given."""
        lo, hi = window if window is not None else (self.start, self.end)
        out = {}
        for r in self.ranks:
            busy = length(overlap(_intervals(self.filter(rank=r, lane=lane)), [(lo, hi)]))
            out[r] = busy / (hi - lo) if hi > lo else 0.0
        return out

    def bubble_fraction(self, lane="compute", window: tuple[float, float] | None = None) -> float:
        """Idle fraction of the step, averaged over ranks: 1 - mean utilization.

        For a pipeline this is the 'bubble'; GPipe's theory says (p-1)/(m+p-1)."""
        util = self.utilization(lane, window)
        return 1.0 - sum(util.values()) / len(util) if util else 0.0

    def overlap_time(self, lane_a="compute", lane_b="comm", rank=None) -> float:
        """Seconds during which a rank was busy on both lanes at once (summed over ranks)."""
        ranks = self.ranks if rank is None else [rank]
        return sum(length(overlap(_intervals(self.filter(rank=r, lane=lane_a)),
                                  _intervals(self.filter(rank=r, lane=lane_b)))) for r in ranks)

    def overlap(self, lane_a="compute", lane_b="comm", rank=None) -> float:
        """Fraction of `lane_b`'s busy time hidden under `lane_a` (e.g. communication hidden
        behind computation): 1.0 means every byte moved while the rank computed."""
        busy_b = self.busy_time(rank, lane_b)
        return self.overlap_time(lane_a, lane_b, rank) / busy_b if busy_b > 0 else 0.0

    # ---- export ---------------------------------------------------------------------------
    def to_chrome_trace(self, path: str | None = None) -> dict:
        """Chrome trace JSON (open it in https://ui.perfetto.dev or chrome://tracing).

        One complete event ("ph": "X") per span; a process per rank, a thread per lane.
        Returns the dict and writes it to `path` when given."""
        origin = self.start
        pids = {r: i for i, r in enumerate(self.ranks)}
        tids = {l: i for i, l in enumerate(self.lanes)}
        events: list[dict] = []
        for r, pid in pids.items():
            label = f"rank {r}" if isinstance(r, int) else str(r)
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
            for lane, tid in tids.items():
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}})
        for s in self.spans:
            name = s.kind if s.mb is None else f"{s.kind}{s.mb}"
            args = {"mb": s.mb, **{k: v for k, v in s.meta.items() if isinstance(v, (int, float, str, bool))}}
            events.append({
                "name": name, "cat": s.kind, "ph": "X", "pid": pids[s.rank], "tid": tids[s.lane],
                "ts": (s.start - origin) * 1e6, "dur": s.duration * 1e6, "args": args,
            })
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace


class Recorder:
    """Records spans for one rank (or device): `with rec.span("F", mb=0): ...`.

    On CPU a span is timed with the shared clock around the block. On a CUDA device the block
    only *enqueues* kernels, so the span is timed with CUDA events recorded on the current stream
    (or `stream`), and resolved to the shared clock when `timeline()` is called. On an emulated
    node `clock` is the rank's logical clock (`pipelab.emulate.clock`): a span runs from the
    clock's time before the block to its time after, and the clock moves by what its cost table
    gives for the span (by its kind, stage, layer or bucket), so the recording code names no cost."""

    def __init__(self, rank: int | str = 0, device=None, enabled: bool = True, clock=None):
        self.rank = rank
        self.device = device
        self.enabled = enabled
        self.clock = clock  # None: the shared clock `now` (or CUDA events); else a logical clock
        self._spans: list[Span] = []
        self._pending: list[tuple] = []  # CUDA spans: (start_event, end_event, fields)
        self._cuda_ref = None  # (event, host time) pair mapping event times onto the clock

    def _is_cuda(self) -> bool:
        return self.device is not None and getattr(self.device, "type", str(self.device)).startswith("cuda")

    def now(self) -> float:
        """This recorder's time: the logical clock on an emulated node, else the shared clock."""
        return self.clock.now() if self.clock is not None else now()

    @contextmanager
    def span(self, kind: str, lane: str = "compute", mb: int | None = None, stream=None,
             rank: int | str | None = None, cost=None, **meta):
        """Time the block as one span of `kind` on `lane` (`meta`: where it ran, e.g. stage=1). On
        a logical clock the span lasts `cost`, or else what the clock's cost table gives for it."""
        if self.clock is not None:
            t0 = self.clock.now()
            yield
            cost = self.clock.cost_of(kind, meta) if cost is None else cost
            if cost is not None:
                self.clock.spend(cost)
            if self.enabled:
                self._spans.append(Span(self.rank if rank is None else rank, lane, kind, t0, self.clock.now(), mb, meta))
            self.clock.ended(kind, mb, meta)
            return
        if not self.enabled:
            yield
            return
        who = self.rank if rank is None else rank
        if self._is_cuda():
            import torch

            start_ev = torch.cuda.Event(enable_timing=True)
            end_ev = torch.cuda.Event(enable_timing=True)
            self._ensure_cuda_ref()
            start_ev.record(stream)
            yield
            end_ev.record(stream)
            self._pending.append((start_ev, end_ev, dict(rank=who, lane=lane, kind=kind, mb=mb, meta=meta)))
        else:
            t0 = now()
            yield
            self._spans.append(Span(who, lane, kind, t0, now(), mb, meta))

    def add(self, kind: str, start: float, end: float, lane: str = "compute", mb: int | None = None,
            rank: int | str | None = None, **meta) -> None:
        """Add a span timed elsewhere (times on the shared clock)."""
        if self.enabled:
            self._spans.append(Span(self.rank if rank is None else rank, lane, kind, start, end, mb, meta))

    def ran(self, kind: str, **where) -> None:
        """Work of `kind` (at `where`: its layer, bucket, bytes) has just run, timed between two
        stamps: a logical clock moves by what its cost table gives for it; a real one already has."""
        if self.clock is not None:
            cost = self.clock.cost_of(kind, where)
            if cost:
                self.clock.spend(cost)

    def stamp(self, stream=None):
        """A point in this rank's time, to open or close a span with `add_stamped`: on a CUDA
        device a CUDA event recorded on `stream` (default: the current one), which fires when that
        stream's earlier work is done; elsewhere the recorder's time (`now`)."""
        if self.clock is not None or not self._is_cuda():
            return self.now()
        import torch

        self._ensure_cuda_ref()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def add_stamped(self, kind: str, start, end, lane: str = "compute", mb: int | None = None,
                    rank: int | str | None = None, **meta) -> None:
        """Add a span between two stamps (`stamp`): CUDA events are resolved onto the clock when
        `timeline()` is called, times are added as they are."""
        if not self.enabled:
            return
        who = self.rank if rank is None else rank
        if isinstance(start, (int, float)) and isinstance(end, (int, float)):
            self._spans.append(Span(who, lane, kind, start, end, mb, meta))
        else:
            self._pending.append((start, end, dict(rank=who, lane=lane, kind=kind, mb=mb, meta=meta)))

    def _ensure_cuda_ref(self) -> None:
        if self._cuda_ref is None:
            import torch

            ref = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            ref.record()
            torch.cuda.synchronize(self.device)
            self._cuda_ref = (ref, now())

    def timeline(self) -> Timeline:
        """All spans recorded so far (waits for pending CUDA work to be timed)."""
        if self._pending:
            import torch

            torch.cuda.synchronize(self.device)
            ref, host = self._cuda_ref
            for start_ev, end_ev, f in self._pending:
                start = host + ref.elapsed_time(start_ev) / 1e3
                end = host + ref.elapsed_time(end_ev) / 1e3
                self._spans.append(Span(f["rank"], f["lane"], f["kind"], start, end, f["mb"], f["meta"]))
            self._pending.clear()
        return Timeline(sorted(self._spans, key=lambda s: s.start))

    def clear(self) -> None:
        """Forget recorded spans (e.g. after a warm-up step)."""
        self._spans.clear()
        self._pending.clear()

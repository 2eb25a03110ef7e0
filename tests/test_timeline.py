"""Timeline metrics on hand-built spans whose answers are known, and the trace export."""

import json

import pytest

from pipelab.timeline import Recorder, Span, Timeline, complement, length, overlap, union


def two_rank_pipeline() -> Timeline:
    """Rank 0 computes 0-4 s; rank 1 computes 2-6 s; rank 0 sends 3-5 s (under its compute 3-4)."""
    return Timeline([
        Span(0, "compute", "F", 0.0, 2.0, mb=0),
        Span(0, "compute", "F", 2.0, 4.0, mb=1),
        Span(1, "compute", "F", 2.0, 4.0, mb=0),
        Span(1, "compute", "F", 4.0, 6.0, mb=1),
        Span(0, "comm", "send", 3.0, 5.0, mb=1),
    ])


def test_makespan_rows_and_busy_time():
    tl = two_rank_pipeline()
    assert tl.makespan == 6.0
    assert tl.rows() == [(0, "compute"), (0, "comm"), (1, "compute")]
    assert tl.busy_time(0) == 4.0
    assert tl.busy_time(lane="compute") == 8.0


def test_overlapping_spans_are_counted_once():
    tl = Timeline([Span(0, "compute", "F", 0, 3), Span(0, "compute", "B", 2, 4), Span(0, "compute", "W", 6, 7)])
    assert tl.busy_time(0) == 5.0


def test_utilization_and_bubble():
    tl = two_rank_pipeline()
    assert tl.utilization() == {0: pytest.approx(4 / 6), 1: pytest.approx(4 / 6)}
    assert tl.bubble_fraction() == pytest.approx(1 / 3)
    # GPipe with p=2, m=2 and unit costs: bubble = (p-1)/(m+p-1) = 1/3, exactly this picture.
    assert tl.utilization(window=(2.0, 4.0)) == {0: 1.0, 1: 1.0}


def test_overlap_of_two_lanes():
    tl = two_rank_pipeline()
    assert tl.overlap_time("compute", "comm") == pytest.approx(1.0)
    assert tl.overlap("compute", "comm") == pytest.approx(0.5)  # half the send hid under compute
    assert tl.overlap("compute", "comm", rank=1) == 0.0  # rank 1 has no comm


def test_interval_algebra():
    xs = [(3.0, 5.0), (0.0, 2.0), (1.0, 2.5), (5.0, 6.0)]  # unsorted, overlapping, touching
    assert union(xs) == [(0.0, 2.5), (3.0, 6.0)]
    assert length(xs) == 5.5
    assert overlap(xs, [(2.0, 4.0), (5.5, 9.0)]) == [(2.0, 2.5), (3.0, 4.0), (5.5, 6.0)]
    assert complement(xs, [(-1.0, 7.0)]) == [(-1.0, 0.0), (2.5, 3.0), (6.0, 7.0)]  # the gaps
    assert complement([], [(1.0, 2.0)]) == [(1.0, 2.0)] and complement(xs, [(0.5, 2.0)]) == []
    assert union([]) == [] and length([]) == 0 and overlap([], xs) == []


def test_merge_filter_shift():
    a = Timeline([Span(0, "compute", "F", 1.0, 2.0)])
    b = Timeline([Span(1, "compute", "F", 0.5, 1.5), Span(1, "comm", "recv", 1.5, 1.6)])
    merged = Timeline.merge([a, b])
    assert len(merged) == 3 and merged.ranks == [0, 1]
    assert [s.rank for s in merged] == [1, 0, 1]  # sorted by start time
    assert len(merged.filter(lane="comm")) == 1
    assert len(merged.filter(rank=[0, 1], kind="F")) == 2
    shifted = merged.shifted()
    assert shifted.start == 0.0 and shifted.makespan == pytest.approx(merged.makespan)


def test_chrome_trace_has_one_event_per_span(tmp_path):
    tl = two_rank_pipeline()
    path = tmp_path / "step.trace.json"
    tl.to_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(tl)
    send = next(e for e in complete if e["cat"] == "send")
    assert send["ts"] == pytest.approx(3e6) and send["dur"] == pytest.approx(2e6)
    assert send["name"] == "send1" and send["args"]["mb"] == 1
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"rank 0", "rank 1", "compute", "comm"} <= names


def test_recorder_times_blocks_on_the_shared_clock():
    rec = Recorder(rank=3)
    with rec.span("F", mb=2, stage=1):
        sum(range(10000))
    rec.add("send", 10.0, 10.5, lane="comm")
    tl = rec.timeline()
    f = tl.filter(kind="F").spans[0]
    assert (f.rank, f.lane, f.mb, f.meta["stage"]) == (3, "compute", 2, 1) and f.duration > 0
    assert tl.filter(kind="send").spans[0].duration == 0.5
    off = Recorder(enabled=False)
    with off.span("F"):
        pass
    assert len(off.timeline()) == 0

"""The plots draw what the timeline holds: a row per rank and lane, labels and a legend."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from pipelab import plots  # noqa: E402
from pipelab.timeline import Span, Timeline  # noqa: E402


def sample() -> Timeline:
    return Timeline([
        Span(0, "compute", "F", 0.000, 0.002, mb=0),
        Span(0, "compute", "B", 0.004, 0.006, mb=0),
        Span(0, "comm", "send", 0.002, 0.003, mb=0),
        Span(1, "compute", "F", 0.003, 0.004, mb=0),
        Span(1, "compute", "B", 0.004, 0.005, mb=0),
    ])


def test_gantt_rows_labels_and_legend():
    ax = plots.gantt(sample(), title="step")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["rank 0 · compute", "rank 0 · comm", "rank 1 · compute"]
    assert ax.get_xlabel() == "time (ms)" and ax.get_title() == "step"
    assert len(ax.patches) == 5  # one box per span
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["B", "F", "send"]
    assert any(t.get_text() == "0" for t in ax.texts)  # micro-batch numbers in the boxes
    first = min(ax.patches, key=lambda p: p.get_x())
    assert first.get_x() == 0.0 and abs(first.get_width() - 2.0) < 1e-9  # milliseconds
    plt.close("all")


def test_utilization_bars():
    ax = plots.utilization_bars(sample())
    heights = [round(p.get_height(), 6) for p in ax.patches]
    assert heights == [round(100 * 4 / 6, 6), round(100 * 2 / 6, 6)]
    assert "utilization" in ax.get_ylabel()
    plt.close("all")


def test_sweep_marks_the_best_point():
    ax = plots.sweep([1, 2, 4], {"step time": [3.0, 1.0, 2.0]}, "bucket (MB)", "ms", "sweep", mark_best="step time")
    assert any("best step time: 1 at 2" in t.get_text() for t in ax.get_legend().get_texts())
    plt.close("all")


def test_hazard_gantt_outlines_the_early_reads():
    from pipelab.plots.model_parallel import hazard_gantt

    tl = Timeline([
        Span("cpu:1", "compute", "F", 0.000, 0.001, mb=0),  # read before its copy (0.002) landed
        Span("cpu:1", "compute", "F", 0.003, 0.004, mb=1),
        Span("cpu:1", "copy", "copy", 0.001, 0.002, mb=0),
        Span("cpu:1", "copy", "copy", 0.002, 0.003, mb=1),
    ])
    ax = hazard_gantt(tl, "cpu:1", [0], title="race")
    outlined = [p for p in ax.patches if not p.get_fill()]
    assert len(outlined) == 1 and outlined[0].get_x() == 0.0 and outlined[0].get_y() == -0.4  # row 0
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["F", "copy", "read before its copy landed"] and ax.get_title() == "race"
    plt.close("all")


def test_speedup_curve_marks_this_run():
    from pipelab.plots.model_parallel import speedup_curve

    ax = speedup_curve({"speedup": {4: 1.2, 1: 0.5, 16: 0.9}}, this_run=(8, 1.1))
    curve, star = ax.get_lines()
    assert list(curve.get_xdata()) == [1, 4, 16] and list(star.get_xdata()) == [8]
    assert ax.get_xscale() == "log" and "speedup" in ax.get_ylabel()
    plt.close("all")

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
    assert len(ax.patches) == 6  # one box per span, and the exposed send hatched over its box
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [
        "B", "F", "exposed: no compute hides it", "send"]
    assert any(t.get_text() == "0" for t in ax.texts)  # micro-batch numbers in the boxes
    first = min(ax.patches, key=lambda p: p.get_x())
    assert first.get_x() == 0.0 and abs(first.get_width() - 2.0) < 1e-9  # milliseconds
    plt.close("all")


def test_exposed_spans_are_the_comm_no_compute_hides():
    tl = Timeline([
        Span(0, "compute", "F", 0.000, 0.002),
        Span(0, "compute", "B", 0.004, 0.006),
        Span(0, "comm", "send", 0.001, 0.005),  # hidden 1-2 and 4-5 ms, exposed 2-4 ms
        Span(1, "comm", "recv", 0.000, 0.003),  # rank 1 has no compute lane: nothing to mark
    ])
    exposed = plots.exposed_spans(tl)
    assert [(s.rank, s.kind, round(s.start, 6), round(s.end, 6)) for s in exposed] == [(0, "send", 0.002, 0.004)]
    ax = plots.gantt(tl, mark_exposed=False)
    assert len(ax.patches) == 4 and "exposed" not in " ".join(t.get_text() for t in ax.get_legend().get_texts())
    plt.close("all")


def test_gantt_unit_and_stage_labels_of_interleaved_boxes():
    tl = Timeline([
        Span(0, "compute", "F", 0.0, 1.0, mb=0, meta={"stage": 0}),
        Span(0, "compute", "F", 1.0, 2.0, mb=0, meta={"stage": 2}),
        Span(1, "compute", "F", 0.5, 1.5, mb=0, meta={"stage": 1}),
    ])
    ax = plots.gantt(tl, unit="cost units")
    assert ax.get_xlabel() == "time (cost units)" and ax.get_title() == "Timeline: 2000.0 cost units"
    assert sorted(t.get_text() for t in ax.texts) == ["0F0", "1F0", "2F0"]
    ax = plots.gantt(Timeline([Span(0, "compute", "F", 0.0, 1.0, mb=3, meta={"stage": 0})]))
    assert [t.get_text() for t in ax.texts] == ["3"]  # one stage per rank: the micro-batch alone
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


def test_sweep_draws_repeats_as_error_bars_and_keeps_overlapping_lines_apart():
    from pipelab.measure import Measured

    ax = plots.sweep([1, 2], {"a": [Measured.of([1, 2, 4]), Measured.of([3, 3, 3])], "b": [2.0, 3.0]},
                     "x", "y", "t", mark_best="a")
    first, second = ax.get_lines()[0], ax.get_lines()[-1]
    assert list(first.get_ydata()) == [2.0, 3.0]  # medians
    assert first.get_marker() != second.get_marker() and first.get_linestyle() != second.get_linestyle()
    assert len(ax.containers) == 1  # one error-bar set, for the measured line
    assert any("best a: 2 at 1" in t.get_text() for t in ax.get_legend().get_texts())
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
    assert labels == ["F", "copy", "exposed: no compute hides it", "read before its copy landed"]
    assert ax.get_title() == "race"
    plt.close("all")


def test_speedup_curve_marks_this_run():
    from pipelab.plots.model_parallel import speedup_curve

    ax = speedup_curve({"speedup": {4: 1.2, 1: 0.5, 16: 0.9}}, this_run=(8, 1.1))
    curve, star = ax.get_lines()
    assert list(curve.get_xdata()) == [1, 4, 16] and list(star.get_xdata()) == [8]
    assert ax.get_xscale() == "log" and "speedup" in ax.get_ylabel()
    plt.close("all")


def test_schedule_figures_share_one_time_axis_and_show_the_spread():
    from pipelab.measure import Measured
    from pipelab.plots.schedules import draw_schedule, plot_bubbles, plot_on_one_axis

    _, ax = draw_schedule("interleaved", 2, 4, 2)
    assert ax.get_xlabel() == "time (cost units)" and "cost units" in ax.get_title()
    assert any(t.get_text() == "2F0" for t in ax.texts)  # interleaved boxes carry their stage
    fig = plot_on_one_axis({"ours": sample(), "torch": Timeline([Span(0, "compute", "F", 5.0, 5.004, mb=0)])})
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    ax = plot_bubbles({"GPipe": Measured.of([0.2, 0.3, 0.4])}, {"GPipe": 0.25}, {"GPipe": 0.2})
    assert [round(p.get_height(), 6) for p in ax.patches] == [0.3, 0.25, 0.2]
    plt.close("all")

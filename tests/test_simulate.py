"""The simulator reproduces the textbook numbers: GPipe's bubble, 1F1B's bounded stash,
interleaving's smaller bubble, and zero-bubble's W filling the holes."""

import pytest

from pipelab.display import format_table
from pipelab.pipeline.schedules import B, F, I, W, Schedule, ScheduleInterleaved1F1B, make_schedule
from pipelab.pipeline.simulate import Costs, gpipe_bubble, simulate
from pipelab.plots.schedules import draw_schedule
from pipelab.timeline import Span, Timeline


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (4, 13)])
@pytest.mark.parametrize("costs", [Costs(), Costs(1.0, 2.0, 0.5)])
def test_gpipe_bubble_equals_the_formula(p, m, costs):
    sim = simulate(make_schedule("gpipe", p, m), costs)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    per_mb = costs.forward + costs.backward_input + costs.backward_weight
    assert sim.makespan_ms == pytest.approx((m + p - 1) * per_mb)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2)])
def test_1f1b_has_gpipe_bubble_but_stashes_at_most_p(p, m):
    gpipe, one_f_one_b = simulate(make_schedule("gpipe", p, m)), simulate(make_schedule("1f1b", p, m))
    assert one_f_one_b.bubble_fraction == pytest.approx(gpipe.bubble_fraction)
    assert gpipe.peak_stash == {r: m for r in range(p)}
    assert one_f_one_b.peak_stash == {r: min(m, p - r) for r in range(p)}


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaved_bubble_shrinks_by_v(p, m, v):
    # v stages per rank, each 1/v of the work: the pipe fills v times faster.
    costs = Costs(1.0 / v, 1.0 / v, 1.0 / v)
    sim = simulate(ScheduleInterleaved1F1B(p, m, v), costs)
    assert sim.bubble_fraction == pytest.approx(gpipe_bubble(p, m, v))
    assert sim.bubble_fraction < gpipe_bubble(p, m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12)])
def test_zero_bubble_fills_the_cooldown(p, m):
    zb, base = simulate(make_schedule("zb-h1", p, m)), simulate(make_schedule("1f1b", p, m))
    assert zb.bubble_fraction < base.bubble_fraction / 2
    assert max(zb.peak_stash.values()) <= p
    # ZB-H1 with F = B = W: each rank idles p-1 slots, against 3(p-1) for 1F1B.
    assert zb.makespan_ms == pytest.approx(3 * m + p - 1)


def test_transfer_time_lengthens_the_step():
    s = make_schedule("gpipe", 3, 6)
    free, slow = simulate(s, Costs(transfer=0.0)), simulate(s, Costs(transfer=0.5))
    # GPipe crosses each of the 2 hops twice (fill, then drain) on its critical path.
    assert slow.makespan_ms == pytest.approx(free.makespan_ms + 4 * 0.5)


@pytest.mark.parametrize("name", ["interleaved", "zb-h1"])
def test_simulated_timeline_respects_dependencies(name):
    s = make_schedule(name, 2, 4)
    tl = simulate(s, Costs(transfer=0.1)).timeline
    at = {(sp.kind, sp.meta["stage"], sp.mb): sp for sp in tl}
    grad = "I" if name == "zb-h1" else "B"  # the action that makes a stage's input gradient
    for (kind, stage, mb), span in at.items():
        if kind == "F" and stage > 0:
            assert span.start >= at["F", stage - 1, mb].end + 0.1e-3 - 1e-12
        if kind == grad and stage < s.num_stages - 1:
            assert span.start >= at[grad, stage + 1, mb].end + 0.1e-3 - 1e-12
        if kind == "W":
            assert span.start >= at["I", stage, mb].end - 1e-12


def test_costs_from_a_measured_timeline():
    tl = Timeline([Span(0, "compute", "F", 0.0, 0.002, 0), Span(0, "compute", "F", 0.002, 0.006, 1),
                   Span(0, "compute", "B", 0.006, 0.012, 0)])
    costs = Costs.from_timeline(tl)
    assert costs.forward == pytest.approx(3.0)
    assert costs.backward_input == costs.backward_weight == pytest.approx(3.0)  # B shared half and half


def test_costs_from_a_timeline_with_split_backwards_use_its_i_and_w():
    tl = Timeline([Span(0, "compute", "F", 0.0, 0.002, 0), Span(0, "compute", "I", 0.002, 0.005, 0),
                   Span(0, "compute", "W", 0.005, 0.006, 0)])
    costs = Costs.from_timeline(tl)
    assert (costs.forward, costs.backward_input, costs.backward_weight) == pytest.approx((2.0, 3.0, 1.0))


def test_cost_of_each_kind():
    costs = Costs(forward=1.0, backward_input=2.0, backward_weight=0.5, per_stage={1: (3.0, 4.0, 5.0)})
    assert [costs.of(a(0, 0)) for a in (F, B, I, W)] == [1.0, 2.5, 2.0, 0.5]
    assert [costs.of(a(1, 0)) for a in (F, B, I, W)] == [3.0, 9.0, 4.0, 5.0]


def test_split_backward_frees_the_stash_at_w_and_sends_the_gradient_after_i():
    # Two ranks, one micro-batch: stage 1's I unblocks stage 0 before stage 1's W runs.
    s = Schedule(2, 1, actions=[[F(0, 0), B(0, 0)], [F(1, 0), I(1, 0), W(1, 0)]])
    sim = simulate(s, Costs(1.0, 1.0, 1.0))
    at = {(sp.kind, sp.meta["stage"]): sp for sp in sim.timeline}
    assert at["B", 0].start == pytest.approx(at["I", 1].end)  # not after W
    assert at["W", 1].start == pytest.approx(at["I", 1].end)
    assert sim.makespan_ms == pytest.approx(1 + 1 + 1 + 2)  # F, F, I, then stage 0's B (W alongside)
    assert sim.peak_stash == {0: 1, 1: 1}


def test_simulate_refuses_an_invalid_schedule():
    with pytest.raises(ValueError, match="appears 0 times"):
        simulate(Schedule(1, 1, actions=[[]]))


def test_draw_schedule_scales_interleaved_stages_and_refuses_bad_input():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim, ax = draw_schedule("interleaved", 2, 4, stages_per_rank=2, backward_ratio=2.0)
    # Each of the v=2 stages per rank does half the work: F costs 0.5, B+W 1.0.
    assert {round(s.duration * 1e3, 6) for s in sim.timeline.filter(kind="F")} == {0.5}
    assert sim.bubble_fraction == pytest.approx(gpipe_bubble(2, 4, 2))
    assert "bubble 0.11" in ax.get_title()
    plt.close("all")
    with pytest.raises(ValueError, match="cannot take num_microbatches=5"):
        draw_schedule("interleaved", 2, 5)


def test_format_table_aligns_columns():
    text = format_table([{"schedule": "GPipe", "bubble": 0.2}, {"schedule": "ZB-H1", "bubble": 0.077}])
    lines = text.splitlines()
    assert lines[0].split() == ["schedule", "bubble"]
    assert len({len(line) for line in lines}) == 1


def test_per_stage_costs_show_unequal_stages():
    spans = [Span(0, "compute", "F", 0.0, 0.001, 0, {"stage": 0}), Span(0, "compute", "B", 0.0, 0.002, 0, {"stage": 0}),
             Span(1, "compute", "F", 0.0, 0.003, 0, {"stage": 1}), Span(1, "compute", "B", 0.0, 0.006, 0, {"stage": 1})]
    costs = Costs.from_timeline(Timeline(spans), per_stage=True)
    assert costs.per_stage[0] == pytest.approx((1.0, 1.0, 1.0))
    assert costs.per_stage[1] == pytest.approx((3.0, 3.0, 3.0))
    schedule = make_schedule("gpipe", 2, 4)
    # The slow stage sets the pace: rank 0 idles more than the equal-stage formula says.
    assert simulate(schedule, costs).bubble_fraction > gpipe_bubble(2, 4)
    assert simulate(schedule, Costs.from_timeline(Timeline(spans))).bubble_fraction == pytest.approx(gpipe_bubble(2, 4))


def test_schedule_explorer_redraws_and_explains_refusals():
    import matplotlib

    matplotlib.use("Agg")
    from pipelab.widgets import schedule_explorer

    box = schedule_explorer("gpipe", num_ranks=2, num_microbatches=4)
    controls = [w for row in box.children[:2] for w in row.children]
    by_name = {w.description: w for w in controls}
    assert set(by_name) >= {"schedule", "ranks p", "micro-batches m", "transfer / F"}
    by_name["schedule"].value = "interleaved"
    by_name["micro-batches m"].value = 5  # p=2, m=5: refused with a reason, not an exception
    by_name["micro-batches m"].value = 6


# ---------------------------------------------------------------------------------------------
# Activation checkpointing: each backward first recomputes its forward (issue 16)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p,m", [(2, 4), (3, 5)])
def test_recompute_adds_a_forward_before_each_backward(p, m):
    s = make_schedule("gpipe", p, m)
    costs = Costs(1.0, 1.0, 1.0)
    plain, ckpt = simulate(s, costs), simulate(s, costs.with_recompute())
    assert plain.makespan_ms == pytest.approx((m + p - 1) * 3)  # F, then B = I + W
    assert ckpt.makespan_ms == pytest.approx((m + p - 1) * 4)  # and R, one more forward
    recomputes = ckpt.timeline.filter(kind="R")
    assert len(recomputes) == len(ckpt.timeline.filter(kind="B")) == p * m
    at = {(sp.kind, sp.meta["stage"], sp.mb): sp for sp in ckpt.timeline}
    for r in recomputes:  # right before its own backward, one forward long
        assert r.end == pytest.approx(at["B", r.meta["stage"], r.mb].start)
        assert r.duration == pytest.approx(1e-3)
    assert ckpt.peak_stash == plain.peak_stash  # the count of stashed micro-batches is the order's


def test_recompute_comes_before_i_and_not_before_w():
    costs = Costs(forward=2.0, backward_input=1.0, backward_weight=0.5, per_stage={1: (3.0, 1.0, 1.0)}).with_recompute()
    assert costs.parts(B(0, 0)) == [("R", 2.0), ("B", 1.5)]
    assert costs.parts(I(1, 0)) == [("R", 3.0), ("I", 1.0)]  # stage 1 recomputes its own forward
    assert costs.parts(W(1, 0)) == [("W", 1.0)]
    assert costs.of(F(0, 0)) == 2.0 and Costs().parts(B(0, 0)) == [("B", 2.0)]


def test_costs_from_a_checkpointed_timeline_take_the_recompute_from_its_r_spans():
    tl = Timeline([Span(0, "compute", "F", 0.0, 0.002, 0, {"stage": 0}),
                   Span(0, "compute", "R", 0.002, 0.005, 0, {"stage": 0}),
                   Span(0, "compute", "B", 0.005, 0.009, 0, {"stage": 0})])
    costs = Costs.from_timeline(tl, per_stage=True)
    assert (costs.forward, costs.recompute) == pytest.approx((2.0, 3.0))
    assert costs.per_stage[0] == pytest.approx((2.0, 2.0, 2.0, 3.0))
    assert simulate(make_schedule("gpipe", 1, 1), costs).makespan_ms == pytest.approx(9.0)


def test_the_fill_drain_picture_numbers_m_plus_p_minus_1_slots_per_phase():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipelab.plots import gantt
    from pipelab.plots.pipeline import mark_slots

    p, m = 3, 4
    schedule, costs = make_schedule("gpipe", p, m), Costs(1.0, 1.0, 1.0)
    ax = gantt(simulate(schedule, costs).timeline, unit="cost units", label_mb=False)
    assert mark_slots(ax, schedule, costs) == m + p - 1
    numbers = [t.get_text() for t in ax.texts if t.get_text().isdigit()]
    assert numbers == [str(i) for i in range(1, m + p)] * 2  # forward slots, then backward slots
    assert ax.get_xlabel() == "time (cost units)"
    plt.close("all")

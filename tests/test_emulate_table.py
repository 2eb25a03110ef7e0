"""The cost table a rank's logical clock looks spans up in (`pipelab.emulate.table`)."""

import pytest

from pipelab.emulate.clock import LogicalClock, RealClock
from pipelab.emulate.memory import MemoryMeter
from pipelab.emulate.specs import parse_node
from pipelab.emulate.table import CostTable, LayerCosts, sharded_table, stage_table
from pipelab.timeline import Recorder


def test_a_span_lasts_what_the_table_gives_for_its_kind_and_place():
    clock = LogicalClock()
    clock.table = stage_table({0: {"F": 1.0, "B": 2.0}, 1: {"F": 3.0, "B": 4.0}})
    rec = Recorder(0, clock=clock)
    with rec.span("F", mb=0, stage=1):
        pass
    with rec.span("R", mb=0, stage=0):  # a recomputation lasts its forward's
        pass
    with rec.span("send", lane="comm", mb=0):  # not in the table: no modelled time of its own
        pass
    with rec.span("B", mb=0, stage=1, cost=0.5):  # a cost given by hand wins
        pass
    spans = [(s.kind, s.duration) for s in rec.timeline()]
    assert spans == [("F", 3.0), ("R", 1.0), ("send", 0.0), ("B", 0.5)]


def test_work_timed_between_stamps_moves_the_clock_by_the_table_and_a_real_clock_not_at_all():
    clock = LogicalClock()
    clock.table = sharded_table(["0", "2"], [(1.0, 2.0), (10.0, 20.0)])
    rec = Recorder(0, clock=clock)
    rec.ran("B", layer="2")
    assert clock.now() == 20.0
    assert clock.table.cost("F", {}) == 11.0 and clock.table.cost("B", {"layer": "9"}) == 22.0  # the whole model's
    real = Recorder(0)
    real.ran("B", layer="2")  # nothing to do: the machine's clock already moved
    assert RealClock().cost_of("F", {}) is None


def test_a_replica_table_prices_a_copy_by_its_bytes():
    from pipelab.emulate.cost import Counts

    table = LayerCosts({"0": 1.0, "2": 2.0}, {"0": 3.0}, optimizer=0.25, bytes_scale=4.0).table()
    assert table.cost("F", {}) == 3.0 and table.cost("B", {"layer": "0"}) == 3.0
    assert table.cost("optimizer", {}) == 0.25
    assert table.cost("copy", {"bytes": 10}) == Counts(0.0, 80.0, 1)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_stash_at_the_emulated_size_follows_the_spans(checkpoint):
    meter = MemoryMeter(parse_node("2xH100-nvlink").device, fixed_bytes=100.0)
    table = stage_table({0: {"F": 1.0, "B": 1.0, "W": 1.0}}, {0: (50.0, 5.0)}, checkpoint)
    for mb in (0, 1):
        table.ended("F", mb, {"stage": 0}, meter)
    held = 2 * (5.0 if checkpoint else 50.0)
    assert meter.current == 100.0 + held
    if checkpoint:  # the backward first recomputes: the micro-batch's activations join its input
        table.ended("R", 0, {"stage": 0}, meter)
        assert meter.current == 100.0 + held + 50.0
    table.ended("B", 0, {"stage": 0}, meter)
    table.ended("W", 1, {"stage": 0}, meter)
    assert meter.current == 100.0 and meter.peak == 100.0 + held + (50.0 if checkpoint else 0.0)
    table.ended("F", 0, {"stage": 3}, meter)  # another rank's stage: not this meter's
    assert meter.current == 100.0 and CostTable().cost("F", {"stage": 0}) is None

"""Streams and events on virtual devices: in-order queues, cross-stream waits, copies, bad input."""

import threading
import time

import pytest
import torch

from pipelab.streams import Device, Event, devices, timeline


def test_stream_runs_work_in_order():
    dev = Device("cpu:0")
    order = []
    s = dev.stream("compute")
    futs = [s.submit(lambda i=i: order.append(i), kind="F", mb=i) for i in range(5)]
    futs[-1].result()
    assert order == [0, 1, 2, 3, 4]
    assert len(dev.timeline().filter(lane="compute")) == 5
    dev.close()


def test_work_waits_for_event_recorded_on_another_stream():
    dev = Device("cpu:0")
    a, b = dev.stream("compute"), dev.stream("copy")
    gate, log = threading.Event(), []
    a.submit(lambda: (gate.wait(5), log.append("a")))
    ev = Event()
    ev.record(a)
    b.wait(ev)
    done = b.submit(lambda: log.append("b"))
    time.sleep(0.05)
    assert log == []  # b is blocked behind the event
    gate.set()
    done.result(timeout=5)
    assert log == ["a", "b"]
    dev.close()


def test_copy_between_devices_and_timeline_lanes():
    d0, d1 = Device("cpu:0"), Device("cpu:1")
    x = d0.own(torch.arange(6.0))
    y = d0.stream("compute").submit(lambda t: t * 2, x)
    z = d1.stream("copy").copy(y).result()
    torch.testing.assert_close(z, torch.arange(6.0) * 2)
    tl = timeline([d0, d1])
    assert set(tl.ranks) == {"cpu:0", "cpu:1"}
    assert tl.filter(rank="cpu:1", lane="copy").spans[0].kind == "copy"
    d0.close(), d1.close()


def test_tensor_of_other_device_needs_a_copy():
    d0, d1 = Device("cpu:0"), Device("cpu:1")
    x = d0.own(torch.ones(3))
    with pytest.raises(ValueError, match="copy it first"):
        d1.stream("compute").submit(torch.relu, x)
    d0.close(), d1.close()


def test_devices_bad_count():
    with pytest.raises(ValueError, match="n=0"):
        devices(0)

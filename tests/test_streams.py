"""Streams and events on virtual devices: in-order queues, cross-stream waits, copies into
buffers, what orders a reader after a copy, bad input."""

import gc
import threading
import time

import pytest
import torch

from pipelab.streams import (CudaDevice, CudaStream, Device, Event, Pace, Stream, VirtualDevice, VirtualStream,
                             chunk_rows, device, devices, timeline)


@pytest.fixture
def two():
    ds = [VirtualDevice("cpu:0"), VirtualDevice("cpu:1")]
    yield ds
    for d in ds:
        d.close()


def test_stream_runs_work_in_order():
    dev = VirtualDevice("cpu:0")
    order = []
    s = dev.stream("compute")
    futs = [s.submit(lambda i=i: order.append(i), kind="F", mb=i) for i in range(5)]
    futs[-1].result()
    assert order == [0, 1, 2, 3, 4]
    assert len(dev.timeline().filter(lane="compute")) == 5
    dev.close()


def test_work_waits_for_event_recorded_on_another_stream():
    dev = VirtualDevice("cpu:0")
    a, b = dev.stream("compute"), dev.stream("copy")
    gate, log = threading.Event(), []
    a.submit(lambda: (gate.wait(5), log.append("a")))
    ev = Event()
    ev.record(a)
    b.wait(ev)
    done = b.submit(lambda: log.append("b"))
    time.sleep(0.05)
    assert log == [] and not ev.query()  # b is blocked behind the event
    gate.set()
    done.result(timeout=5)
    assert log == ["a", "b"] and ev.query()
    dev.close()


def test_waiting_for_an_event_never_recorded_returns_at_once():
    dev = VirtualDevice("cpu:0")
    s = dev.stream("compute")
    s.wait(Event())  # as on CUDA: nothing recorded, nothing to wait for
    assert s.submit(lambda: 7).result(timeout=5) == 7
    dev.close()


def test_work_runs_with_the_callers_grad_mode(two):
    s = two[0].stream("compute")
    with torch.no_grad():
        off = s.submit(torch.is_grad_enabled).result()
    assert off is False and s.submit(torch.is_grad_enabled).result() is True


def test_copy_between_devices_and_timeline_lanes(two):
    d0, d1 = two
    x = d0.own(torch.arange(6.0))
    y = d0.stream("compute").submit(lambda t: t * 2, x)
    z = d1.stream("copy").copy(y).result()
    torch.testing.assert_close(z, torch.arange(6.0) * 2)
    assert d1.owner(z) == "cpu:1"
    tl = timeline([d0, d1])
    assert set(tl.ranks) == {"cpu:0", "cpu:1"}
    assert tl.filter(rank="cpu:1", lane="copy").spans[0].kind == "copy"


def test_copy_into_a_buffer_in_chunks(two):
    d0, d1 = two
    src = d0.own(torch.randn(10, 3, 4))
    copy = d1.stream("copy")
    buf = copy.empty((10, 3, 4), fill=float("nan"))
    assert buf.isnan().all() and d1.owner(buf) == "cpu:1"
    landed = copy.copy(src, out=buf, mb=0, chunk_bytes=2 * 3 * 4 * 4)  # two rows per chunk
    assert landed.result() is buf
    torch.testing.assert_close(buf, src)
    assert chunk_rows(buf, 2 * 3 * 4 * 4) == 2 and chunk_rows(buf, 1) == 1
    spans = d1.timeline().filter(lane="copy")
    assert len(spans) == 1 and spans.spans[0].mb == 0  # one span per copy, however many chunks


def test_chunked_copy_passes_gradients(two):
    d0, d1 = two
    w = torch.randn(6, 4, requires_grad=True)
    h = d0.stream("compute").submit(lambda t: t * 3, d0.own(w))
    copy = d1.stream("copy")
    buf = copy.empty((6, 4))
    copy.copy(h, out=buf, chunk_bytes=4 * 4).result()  # one row per chunk
    (buf * torch.arange(24.0).view(6, 4)).sum().backward()
    torch.testing.assert_close(w.grad, 3 * torch.arange(24.0).view(6, 4))


def test_reader_of_a_buffer_is_ordered_only_by_the_event(two):
    d0, d1 = two
    gate = threading.Event()
    # the producer on device 0 is held until we open the gate: the copy cannot run before
    src = d0.stream("compute").submit(lambda: (gate.wait(5), torch.arange(6.0))[1])
    copy, compute = d1.stream("copy"), d1.stream("compute")
    buf = copy.empty((6,), fill=float("nan"))
    copy.copy(src, out=buf)
    landed = Event()
    landed.record(copy)
    early = compute.submit(torch.clone, buf)  # no wait: reads the buffer now, before the copy
    assert early.result(timeout=5).isnan().all()
    compute.wait(landed)
    late = compute.submit(torch.clone, buf)
    assert not late.done()  # held behind the event while the copy cannot run
    gate.set()
    torch.testing.assert_close(late.result(timeout=5), torch.arange(6.0))
    tl = d1.timeline()
    copy_span = tl.filter(lane="copy").spans[0]
    reads = tl.filter(lane="compute").spans
    assert reads[0].start < copy_span.end <= reads[1].start


def test_buffers_are_reused_once_free(two):
    copy = two[1].stream("copy")
    a = copy.empty((256, 256))
    ptr = a.data_ptr()
    del a
    b = copy.empty((256, 256))
    assert b.data_ptr() == ptr  # the freed block came back, as from a caching allocator
    c = copy.empty((256, 256))
    assert c.data_ptr() != b.data_ptr()  # b is still in use


def test_tensor_of_other_device_needs_a_copy(two):
    d0, d1 = two
    x = d0.own(torch.ones(3))
    with pytest.raises(ValueError, match="copy it first"):
        d1.stream("compute").submit(torch.relu, x)
    with pytest.raises(ValueError, match="already on 'cpu:0'"):
        d1.own(x)


def test_copy_into_a_bad_buffer(two):
    d0, d1 = two
    src = d0.own(torch.ones(4, 2))
    with pytest.raises(ValueError, match="buffer on 'cpu:0'"):
        d1.stream("copy").copy(src, out=d0.stream("copy").empty((4, 2)))
    with pytest.raises(ValueError, match="shape"):
        d1.stream("copy").copy(src, out=d1.stream("copy").empty((2, 4)))
    with pytest.raises(ValueError, match="buffer on None"):
        d1.stream("copy").copy(src, out=torch.empty(4, 2))  # a host tensor nobody owns
    # a Future source is checked when the copy runs: the error reaches its result
    fut = d0.stream("compute").submit(torch.ones, 3)
    bad = d1.stream("copy").copy(fut, out=d1.stream("copy").empty((4,)))
    with pytest.raises(ValueError, match="shape"):
        bad.result(timeout=5)


def test_device_label_names_its_timeline_rows():
    a, b = VirtualDevice("cpu:0"), VirtualDevice("cpu:0", label="cpu:0/b")
    a.stream().submit(torch.ones, 2).result()
    b.stream().submit(torch.ones, 2).result()
    assert timeline([a, b]).ranks == ["cpu:0", "cpu:0/b"]
    a.close(), b.close()


def test_devices_bad_count():
    with pytest.raises(ValueError, match="n must be .* got 0"):
        devices(0)


def test_device_picks_its_kind_by_name():
    dev = device("cpu:0", label="here")
    assert type(dev) is VirtualDevice and dev.label == "here"
    assert type(dev.stream("compute")) is VirtualStream and dev.stream("compute") is dev.stream()
    # both kinds implement the whole interface (no abstract method left over)
    for kind, stream_kind in ((VirtualDevice, VirtualStream), (CudaDevice, CudaStream)):
        assert issubclass(kind, Device) and not kind.__abstractmethods__ and kind.stream_class is stream_kind
        assert issubclass(stream_kind, Stream) and not stream_kind.__abstractmethods__
    with pytest.raises(ValueError, match="'tpu:0'.*'cuda:0' or 'cpu:0'"):
        device("tpu:0")
    with pytest.raises(TypeError):
        Device("cpu:0")  # the interface: a device is one kind or the other
    dev.close()


def test_each_kind_of_device_lives_in_its_own_module_without_an_import_circle():
    # device.py chooses between the kinds; the kinds (and their streams) never import it back
    import ast
    import inspect

    from pipelab.streams import base, cuda, virtual

    for module in (base, cuda, virtual):
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "pipelab.streams.device" not in imported, module.__name__
        assert "is_cuda" not in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                 and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert VirtualDevice.__module__ == VirtualStream.__module__ == "pipelab.streams.virtual"
    assert CudaDevice.__module__ == CudaStream.__module__ == "pipelab.streams.cuda"


def test_hold_keeps_a_stream_busy_until_released():
    dev = VirtualDevice("cpu:0")
    s = dev.stream("compute")
    release = s.hold()
    later = s.submit(lambda: 7)
    time.sleep(0.05)
    assert not later.done()
    release()
    assert later.result(timeout=5) == 7
    assert [sp.kind for sp in dev.timeline()] == ["held", "F"]
    dev.close()


@pytest.mark.parametrize("bad", [True, 2.5, 0])
def test_devices_refuse_what_is_not_a_count(bad):
    with pytest.raises(ValueError, match=f"n must be a whole number .* got {bad!r}"):
        devices(bad)


def _stream_threads() -> list[threading.Thread]:
    """The live threads of virtual streams (named "<device label>/<stream name>")."""
    return [t for t in threading.enumerate() if t.name.startswith("cpu:") and t.is_alive()]


def _use(devs) -> None:
    """Work on three streams, as a dual-stream forward does: compute on both devices, one copy stream."""
    h = devs[0].stream("compute").submit(torch.ones, 4)
    h1 = devs[1].stream("copy").copy(h)
    devs[1].stream("compute").submit(torch.neg, h1).result()


def test_devices_in_a_with_block_leave_no_thread():
    gc.collect()
    before = len(_stream_threads())
    for _ in range(20):
        with devices(2) as devs:
            _use(devs)
        assert all(d.closed for d in devs)
    assert len(_stream_threads()) == before  # flat: close joins the threads


def test_devices_garbage_collected_stop_their_threads():
    gc.collect()
    before = len(_stream_threads())
    for _ in range(20):
        _use(devices(2))  # never closed: dropped at once
    gc.collect()  # a device and its streams refer to each other: the cycle collector frees them
    deadline = time.monotonic() + 10
    while len(_stream_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)  # the finalizer queued the stop; each thread ends after its queue
    assert len(_stream_threads()) == before


def test_a_closed_device_finishes_its_work_then_refuses_more():
    dev = VirtualDevice("cpu:0")
    s = dev.stream("compute")
    release = s.hold()
    later = s.submit(lambda: 7)
    threading.Timer(0.05, release).start()
    dev.close()  # waits for the queued work
    assert later.done() and later.result() == 7
    assert len(dev.timeline()) == 2 and dev.timeline()  # synchronize after close returns at once
    with pytest.raises(ValueError, match="closed"):
        s.submit(lambda: 8)
    with pytest.raises(ValueError, match="closed"):
        dev.stream("copy")
    dev.close()  # twice is fine


def test_device_as_context_manager():
    with VirtualDevice("cpu:0") as dev:
        assert dev.stream().submit(lambda: 3).result() == 3
    assert dev.closed and not _stream_threads_of(dev)


def _stream_threads_of(dev) -> list[threading.Thread]:
    return [t for t in _stream_threads() if t.name.startswith(dev.label + "/")]


EXIT_SCRIPT = """
import torch
from pipelab import streams
devs = streams.devices(2)  # never closed: the interpreter must still exit at once, cleanly
s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
h = s0.submit(torch.mm, devs[0].own(torch.randn(300, 300)), devs[0].own(torch.randn(300, 300)))
out = s1.submit(torch.relu, s1.copy(h))
for _ in range(20):
    out = s1.submit(torch.mm, out, out.result().clone())  # work still queued when the script ends
print("done")
"""


def test_interpreter_exits_cleanly_with_devices_left_open():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done" and r.stderr == ""


def test_describe_devices_names_the_path_streams_devices_takes():
    # lessons 02-04 run one process driving devices through streams, not ranks with gloo
    from pipelab import hardware

    line = hardware.describe_devices(2)
    assert "ranks" not in line and "gloo" not in line and "one process drives 2" in line
    with devices(2) as devs:
        assert ("virtual CPU devices" in line) == isinstance(devs[0], VirtualDevice)


def test_the_shared_gpu_choice_is_explicit_and_refused_without_a_gpu(monkeypatch):
    # devices(2, device="cuda") on a machine with fewer GPUs: two sets of streams of cuda:0, asked for by
    # name; without CUDA it is refused before any device (or stream thread) exists
    from pipelab import hardware
    from pipelab.streams import Pace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda': this machine has no CUDA GPU; use device='auto'"):
        devices(2, device="cuda")
    with pytest.raises(ValueError, match=r"device='gpu': use 'auto'.*'cuda'.*'cpu'"):
        devices(2, device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="emulated node paces virtual devices: pass emulate=None"):
        devices(2, pace=Pace(), device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with devices(2, device="cpu") as devs:  # "cpu" and "auto" without a GPU: the virtual devices, as before
        assert [d.name for d in devs] == ["cpu:0", "cpu:1"] and all(isinstance(d, VirtualDevice) for d in devs)
    assert hardware.lesson_node(2, "auto", device="cuda") is None  # the devices are real: nothing emulated
    assert hardware.lesson_node(2, "auto") == "2xH100-nvlink" and hardware.lesson_node(2, None, device="cuda") is None


def test_describe_devices_calls_one_gpus_streams_no_two_gpus(monkeypatch):
    from pipelab import hardware

    monkeypatch.setattr(hardware, "detect", lambda: hardware.Hardware(2, ("Tesla T4",), torch.__version__, "12.4"))
    line = hardware.describe_devices(2, device="cuda")
    assert line.startswith("one-GPU path: one process drives 2 devices as sets of CUDA streams of cuda:0 (measured")
    assert "not 2 GPUs" in line and "GPU path: one process drives 2 GPUs" not in line
    assert hardware.describe_devices(2, device="auto").startswith("CPU path")  # auto never shares one GPU


# ---------------------------------------------------------------------------------------------
# Paced virtual devices: a logical clock per stream, ordered by Futures and events only
# ---------------------------------------------------------------------------------------------


class _FixedPace(Pace):
    """Compute 2 s, a copy 1 s: small round figures to reason about."""

    def seconds(self, kind, fn, args):
        return 1.0 if kind == "copy" else 2.0


@pytest.fixture
def paced():
    pace = _FixedPace()
    ds = devices(2, pace=pace)
    yield ds
    ds.close()


def _spans(dev, kind):
    return sorted((s.start, s.end) for s in dev.timeline().filter(kind=kind))


def test_paced_work_lasts_the_modelled_time_and_a_copy_waits_for_the_compute_it_follows(paced):
    d0, d1 = paced
    h = d0.stream("compute").submit(torch.relu, d0.own(torch.ones(3)), kind="F")
    moved = d1.stream("copy").copy(h)  # handed the Future: starts when the compute ends
    out = d1.stream("compute").submit(torch.neg, moved, kind="F")
    assert torch.equal(out.result(), -torch.ones(3))
    assert _spans(d0, "F") == [(0.0, 2.0)]
    assert _spans(d1, "copy") == [(2.0, 3.0)]
    assert _spans(d1, "F") == [(3.0, 5.0)]
    assert out.modelled_end == 5.0


def test_an_events_time_is_the_modelled_time_and_without_it_the_reader_starts_early(paced):
    d0, d1 = paced
    for wait in (True, False):
        for d in paced:
            d.synchronize()
            d.rec.clear()
            d.restart_clock()
        h = d0.stream("compute").submit(torch.relu, d0.own(torch.ones(3)), kind="F", mb=0)
        buf = d1.stream("copy").empty((3,))
        d1.stream("copy").copy(h, out=buf, mb=0)
        landed = Event()
        landed.record(d1.stream("copy"))
        if wait:
            d1.stream("compute").wait(landed)
        d1.stream("compute").submit(torch.neg, buf, kind="F", mb=0).result()
        landed.synchronize()
        assert landed._marker.t == 3.0  # the copy stream's modelled time at the marker
        assert _spans(d1, "F") == ([(3.0, 5.0)] if wait else [(0.0, 2.0)])
        from pipelab.model_parallel import raw_hazards
        assert raw_hazards(d1.timeline(), d1.label) == ([] if wait else [0])


def test_paced_timeline_is_the_same_every_run_and_a_held_stream_is_let_go_after_the_rest(paced):
    d0, d1 = paced
    release = d0.stream("compute").hold()
    d1.stream("compute").submit(torch.neg, d1.own(torch.ones(2)), kind="F").result()
    release()
    d0.stream("compute").submit(torch.neg, d0.own(torch.ones(2)), kind="F").result()
    assert _spans(d0, "held") == [(0.0, 2.0)]  # let go when device 1's 2 s had passed
    assert _spans(d0, "F") == [(2.0, 4.0)]


def test_devices_with_a_pace_are_virtual_and_paced():
    pace = _FixedPace()
    with devices(2, pace=pace) as ds:
        assert all(isinstance(d, VirtualDevice) and d.pace is pace for d in ds)
    with devices(2) as ds:
        assert all(getattr(d, "pace", None) is None for d in ds)

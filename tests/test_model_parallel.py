"""Every model-parallel variant equals the one-device model: outputs and gradients; what the
dual-stream events guarantee and what goes wrong without them; timing in rounds; bad input."""

import threading

import pytest
import torch

from pipelab import model_parallel as mp
from pipelab.experiments.model_parallel import (Timed, check_against_one_device, hazard_report, simulated_forwards,
                                                speed_verdict, split_costs, split_sweep, split_sweeps,
                                                time_forward, time_forwards, train_step)
from pipelab.measure import Measured, best_of
from pipelab.models import SplitResNet, ToyModel
from pipelab.reference import reference_run
from pipelab.streams import Device, timeline


@pytest.fixture
def devs():
    ds = [Device("cpu:0"), Device("cpu:1")]
    yield ds
    for d in ds:
        d.close()


def _reference(model, x, y):
    ref = reference_run(model, x, y, torch.nn.functional.cross_entropy, lr=None)
    return torch.tensor(ref.loss), ref.grads


def _data(kind):
    torch.manual_seed(0)
    if kind == "toy":
        return ToyModel(), torch.randn(12, 10), torch.randint(0, 5, (12,))
    if kind == "wide":  # cut in the wide middle of an inverted bottleneck
        model = SplitResNet(channels=4, blocks_per_half=1, expansion=4)
        return model, torch.randn(12, 3, 8, 8), torch.randint(0, 10, (12,))
    return SplitResNet(channels=8, blocks_per_half=1), torch.randn(12, 3, 8, 8), torch.randint(0, 10, (12,))


@pytest.mark.parametrize("kind", ["toy", "resnet", "wide"])
@pytest.mark.parametrize("variant,split", [("one_device", None), ("naive", None), ("pipelined", 5),
                                           ("pipelined", 1), ("dual_stream", 4), ("dual_stream", 5)])
def test_variant_matches_one_device(devs, kind, variant, split):
    model, x, y = _data(kind)
    ref_loss, ref_grads = _reference(model, x, y)
    loss, tl = train_step(model, x, y, devs, variant=variant, split_size=split)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-5)
    if variant in ("pipelined", "dual_stream"):
        splits = -(-x.shape[0] // split)
        assert len(tl.filter(rank="cpu:0", lane="compute", kind="F")) == splits
    if variant == "dual_stream":
        assert len(tl.filter(rank="cpu:1", lane="copy")) == splits


def test_consecutive_training_steps_reuse_receive_buffers(devs):
    # the second step gets the first step's buffers back: no autograd history may come with them
    model, x, y = _data("wide")
    for _ in range(2):
        check_against_one_device(model, x, y, devs, "dual_stream", 4)


def test_wide_cut_crosses_expansion_times_the_channels():
    model, x, _ = _data("wide")
    assert mp.cut_shape(model, x[:5]) == (5, 16, 8, 8)  # 4 channels x expansion 4, worked out on meta
    assert mp.cut_shape(ToyModel(), torch.randn(3, 10)) == (3, 10)


def test_dual_stream_compute_starts_after_its_copy_lands(devs):
    model, x, _ = _data("resnet")
    report = hazard_report(model, x, devs, 4, use_events=True)
    assert report["wrong_splits"] == [] and report["raw_hazards"] == []
    tl = report["timeline"].filter(rank="cpu:1")
    for i in range(report["splits"]):
        copy_span = tl.filter(lane="copy", kind="copy").spans[i]
        compute_span = [s for s in tl.filter(lane="compute", kind="F") if s.mb == i][0]
        assert copy_span.mb == i and compute_span.start >= copy_span.end


def test_dual_stream_with_events_waits_for_a_late_producer(devs):
    model, x, _ = _data("resnet")
    gate = threading.Event()
    devs[0].stream("compute").submit(gate.wait, 10)  # device 0 is busy until we open the gate
    result = {}
    with torch.no_grad():
        worker = threading.Thread(target=lambda: result.update(out=mp.forward_dual_stream(model, x, devs, 4)))
        worker.start()
        worker.join(0.1)
        assert worker.is_alive()  # device 1 cannot finish: every split waits for its copy
        gate.set()
        worker.join(10)
        torch.testing.assert_close(result["out"], model(x))


def test_without_events_compute_reads_buffers_before_the_copies_land(devs):
    model, x, _ = _data("resnet")
    gate = threading.Event()
    devs[0].stream("compute").submit(gate.wait, 10)  # no split can be produced, so no copy can run
    with torch.no_grad():
        out = mp.forward_dual_stream(model, x, devs, 4, use_events=False)
    # device 1 finished all three splits while device 0 was held: it read unfilled (NaN) buffers
    assert out.isnan().all()
    gate.set()
    timeline(devs)  # let the copies land
    assert mp.raw_hazards(devs[1].timeline(), "cpu:1") == [0, 1, 2]
    assert mp.raw_hazards(devs[0].timeline(), "cpu:0") == []


def test_hazard_report_with_a_late_producer_sees_every_read_too_early(devs):
    model, x, _ = _data("wide")
    report = hazard_report(model, x, devs, 4, use_events=False, late_producer=True)
    assert report["raw_hazards"] == report["wrong_splits"] == [0, 1, 2]
    assert report["output"].isnan().all()
    assert len(report["timeline"].filter(rank="cpu:0", kind="held")) == 1  # the hold shows on device 0
    with pytest.raises(ValueError, match="late_producer=True with use_events=True"):
        hazard_report(model, x, devs, 4, use_events=True, late_producer=True)


def test_pipelined_copies_never_race(devs):
    model, x, _ = _data("resnet")
    tl = time_forward(model, x, devs, "pipelined", 4, repeats=1).typical
    assert mp.raw_hazards(tl, "cpu:1") == []  # copy and compute share one in-order stream


def test_race_demo_refuses_autograd(devs):
    model, x, _ = _data("toy")
    with pytest.raises(ValueError, match="no_grad"):
        mp.forward_dual_stream(model, x, devs, 4, use_events=False)


def test_split_sweep_variants(devs):
    model, x, _ = _data("toy")
    sweep = split_sweep(model, x, devs, [3, 6], repeats=1, variant="dual_stream")
    assert set(sweep["seconds"]) == {3, 6} and sweep["best_split"] in (3, 6)
    with pytest.raises(ValueError, match="variant='naive'"):
        split_sweep(model, x, devs, [3], variant="naive")


def test_split_by_split_equals_one_device(devs):
    model, x, y = _data("resnet")
    with torch.no_grad():
        torch.testing.assert_close(mp.forward_split_by_split(model, x, devs[0], 5), model(x))
    check_against_one_device(model, x, y, devs, "split_by_split", 5)


def test_time_forwards_alternates_and_keeps_every_round(devs, monkeypatch):
    model, x, _ = _data("toy")
    calls = []
    real = mp.forward_pipelined
    monkeypatch.setattr(mp, "forward_pipelined", lambda m, x, d, s: calls.append(s) or real(m, x, d, s))
    runs = time_forwards(model, x, devs, {"a": ("pipelined", 3), "b": ("pipelined", 6)}, repeats=3)
    assert calls == [3, 6] * 4  # one warm-up round, then three rounds, A B A B ...
    for r in runs.values():
        assert len(r.seconds) == len(r.timelines) == 3 and r.measured.values == tuple(r.seconds)
    with pytest.raises(ValueError, match="variant='sideways'"):
        time_forwards(model, x, devs, {"a": ("sideways", 3)})


def test_typical_is_the_median_round():
    timed = Timed([0.3, 0.1, 0.5, 0.2], ["t0", "t1", "t2", "t3"])
    assert timed.typical_index == 3 and timed.typical == "t3"  # 0.2: the lower middle of four
    assert Timed([0.3, 0.1, 0.5], ["a", "b", "c"]).typical == "a"


def test_split_sweep_speedups_are_round_by_round_ratios(devs):
    model, x, _ = _data("toy")
    sweeps = split_sweeps(model, x, devs, [3, 12], ("split_by_split", "pipelined"), repeats=2)
    piped = sweeps["pipelined"]
    base = piped["one_device"].seconds
    for s in (3, 12):
        expected = [b / t for b, t in zip(base, piped["timed"][s].seconds)]
        assert piped["speedup"][s].values == pytest.approx(expected)
        assert piped["seconds"][s].median == piped["timed"][s].measured.median
    assert sweeps["split_by_split"]["one_device"] is piped["one_device"]  # one baseline for both
    assert piped["best_split"] == max((3, 12), key=lambda s: piped["speedup"][s].median)


def test_ideal_speedup_and_pipeline_time():
    assert mp.ideal_speedup(1) == 1.0 and mp.ideal_speedup(2) == pytest.approx(4 / 3)
    assert mp.ideal_speedup(1000) < 2.0
    # two equal halves of cost 1 per split, k splits: 2 + (k-1); one device: 2k
    for k in (1, 2, 8):
        assert 2 * k / mp.pipeline_time([1.0, 1.0], k) == pytest.approx(mp.ideal_speedup(k))
    assert mp.pipeline_time([1.0, 3.0, 2.0], 4) == 6 + 3 * 3
    with pytest.raises(ValueError, match="splits"):
        mp.ideal_speedup(0)


def test_simulated_forwards_hide_the_copy_on_its_own_stream():
    costs = {"device 0": 1.0, "copy": 0.5, "device 1": 1.0}
    sim = simulated_forwards(costs, 8)
    assert sim["pipelined"] == pytest.approx(2.5 + 7 * 1.5) and sim["dual_stream"] == pytest.approx(2.5 + 7)
    no_copy = simulated_forwards({**costs, "copy": 0.0}, 8)
    assert no_copy["pipelined"] == no_copy["dual_stream"]


def test_split_costs_reads_the_median_boxes(devs):
    model, x, _ = _data("wide")
    tl = time_forward(model, x, devs, "dual_stream", 4, repeats=1).typical
    costs = split_costs(tl, devs)
    copies = sorted(s.duration for s in tl.filter(rank="cpu:1", kind="copy"))
    assert len(copies) == 3 and costs["copy"] == copies[1]
    assert costs["device 0"] > 0 and costs["device 1"] > 0


def test_speed_verdict_claims_a_direction_only_when_every_round_agrees():
    assert speed_verdict(Measured.of([1.1, 1.2, 1.3])) == "faster"
    assert speed_verdict(Measured.of([0.8, 0.9, 0.95])) == "slower"
    assert speed_verdict(Measured.of([0.9, 1.2, 1.3])) == "within noise"


def test_split_size_out_of_range(devs):
    model, x, _ = _data("toy")
    for bad in (0, -1, 13, 2.5, True):
        with pytest.raises(ValueError, match=f"split_size.*{bad}"):
            mp.forward_pipelined(model, x, devs, bad)
        with pytest.raises(ValueError, match=f"split_size.*{bad}"):
            mp.forward_dual_stream(model, x, devs, bad)
    with pytest.raises(ValueError, match="repeats"):
        time_forward(model, x, devs, "pipelined", 4, repeats=0)


def test_more_devices_than_halves(devs):
    model, x, _ = _data("toy")
    with pytest.raises(ValueError, match="3 devices"):
        mp.forward_naive(model, x, devs + [Device("cpu:2")])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_dual_stream_on_two_gpus():
    from pipelab.streams import devices

    ds = devices(2)
    model, x, y = _data("resnet")
    ref_loss, ref_grads = _reference(model, x, y)
    mp.place(model, ds)
    loss, tl = train_step(model, x, y, ds, variant="dual_stream", split_size=4)
    torch.testing.assert_close(loss.cpu(), ref_loss, atol=1e-4, rtol=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref_grads[n], atol=1e-4, rtol=1e-4)
    assert {"cuda:0", "cuda:1"} <= set(tl.ranks)


def test_check_against_one_device_catches_a_wrong_gradient(devs, monkeypatch):
    model, x, y = _data("toy")
    real = train_step

    def wrong_step(*args, **kwargs):
        loss, tl = real(*args, **kwargs)
        model.seq2.weight.grad.mul_(1.01)  # one gradient off by 1 %
        return loss, tl

    monkeypatch.setattr("pipelab.experiments.model_parallel.train_step", wrong_step)
    with pytest.raises(AssertionError, match="seq2.weight"):
        check_against_one_device(model, x, y, devs, "naive")


def test_best_of_times_every_run_in_each_round():
    calls = []
    runs = {name: (lambda name=name: calls.append(name) or name.upper()) for name in ("a", "b")}
    best = best_of(runs, repeats=3, prepare=lambda: calls.append("prepare"), warmup=1)
    assert calls == ["prepare", "a", "prepare", "b"] * 4  # one warm-up round, then three rounds
    assert {k: v[1] for k, v in best.items()} == {"a": "A", "b": "B"}
    assert all(0 <= v[0] < float("inf") for v in best.values())


@pytest.mark.parametrize("variant", ["pipelined", "dual_stream", "naive", "one_device"])
@pytest.mark.parametrize("bad", [0, True, -2, 13])
def test_split_size_refused_by_train_step_and_check(devs, variant, bad):
    # 0 once read as "no split size" and ran as one split; True passed as 1
    model, x, y = _data("toy")
    with pytest.raises(ValueError, match=f"split_size.*{bad!r}"):
        train_step(model, x, y, devs, variant, bad)
    with pytest.raises(ValueError, match=f"split_size.*{bad!r}"):
        check_against_one_device(model, x, y, devs, variant, bad)


def test_speedup_curve_draws_medians_with_their_spread_and_the_bound():
    import matplotlib.pyplot as plt

    from pipelab.plots.model_parallel import speedup_curve

    curve = {1: Measured.of([0.4, 0.5, 0.6]), 8: Measured.of([1.2, 1.3, 1.5])}
    ax = speedup_curve({"pipelined": curve}, batch=16, this_run=(8, Measured.of([1.1, 1.2, 1.4])))
    assert len(ax.containers) == 2  # error bars: the curve and this run
    medians = ax.containers[0].lines[0]
    assert list(medians.get_ydata()) == [0.5, 1.3]
    bound = [line for line in ax.get_lines() if line.get_linestyle() == "--"][0]
    assert list(bound.get_ydata()) == [mp.ideal_speedup(16), mp.ideal_speedup(2)]
    plt.close("all")

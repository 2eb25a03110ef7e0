"""Every model-parallel variant equals the one-device model: outputs and gradients; what the
dual-stream events guarantee and what goes wrong without them; timing in rounds; bad input."""

import threading

import pytest
import torch

from pipelab import model_parallel as mp
from pipelab.experiments import split_pipelining as lesson
from pipelab.experiments.model_parallel import Config, Forward, Timed, check_against_one_device, speed_verdict, time_forwards, train_step
from pipelab.experiments.split_pipelining import hazard_report, simulated_forwards, split_costs, split_sweep
from pipelab.measure import Measured, Steps, best_of
from pipelab.models import SplitResNet, ToyModel
from pipelab.reference import reference_run
from pipelab.streams import VirtualDevice, timeline


@pytest.fixture
def devs():
    ds = [VirtualDevice("cpu:0"), VirtualDevice("cpu:1")]
    yield ds
    for d in ds:
        d.close()


def _cfg(kind, devs, repeats=3):
    model, x, y = _data(kind)
    return Config(model=model, x=x, y=y, devs=devs, repeats=repeats)


def _timed(cfg, f: Forward) -> Timed:
    return time_forwards(cfg, {"it": f})["it"]


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
    loss, tl = train_step(Config(model=model, x=x, y=y, devs=devs), Forward(variant, split))
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
    cfg = _cfg("wide", devs)
    for _ in range(2):
        check_against_one_device(cfg, Forward("dual_stream", 4))


def test_wide_cut_crosses_expansion_times_the_channels():
    model, x, _ = _data("wide")
    assert mp.cut_shape(model, x[:5]) == (5, 16, 8, 8)  # 4 channels x expansion 4, worked out on meta
    assert mp.cut_shape(ToyModel(), torch.randn(3, 10)) == (3, 10)


def test_dual_stream_compute_starts_after_its_copy_lands(devs):
    report = hazard_report(_cfg("resnet", devs), 4, use_events=True)
    assert report.wrong_splits == [] and report.raw_hazards == [] and report.nan_rows == 0
    tl = report.timeline.filter(rank="cpu:1")
    for i in range(report.splits):
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
    cfg = _cfg("wide", devs)
    report = hazard_report(cfg, 4, use_events=False, late_producer=True)
    assert report.raw_hazards == report.wrong_splits == [0, 1, 2]
    assert report.output.isnan().all() and report.nan_rows == 12
    assert len(report.timeline.filter(rank="cpu:0", kind="held")) == 1  # the hold shows on device 0
    with pytest.raises(ValueError, match="late_producer=True with use_events=True"):
        hazard_report(cfg, 4, use_events=True, late_producer=True)
    with pytest.raises(ValueError, match="split_size=13"):
        hazard_report(cfg, 13, use_events=False)


def test_pipelined_copies_never_race(devs):
    timed = _timed(_cfg("resnet", devs, repeats=1), Forward("pipelined", 4))
    assert mp.raw_hazards(timed.timeline, "cpu:1") == []  # copy and compute share one in-order stream
    assert timed.overlap.values == (0.0,) and 0 < timed.copy_share.median < 1  # the copies sit in compute


def test_race_demo_refuses_autograd(devs):
    model, x, _ = _data("toy")
    with pytest.raises(ValueError, match="no_grad"):
        mp.forward_dual_stream(model, x, devs, 4, use_events=False)


def test_split_sweep_variants(devs):
    cfg = _cfg("toy", devs, repeats=1)
    run = split_sweep(cfg, [3, 6], variants=("dual_stream",))
    assert set(run["dual_stream"].seconds) == {3, 6} and run["dual_stream"].best_split in (3, 6)
    assert run.split_sizes == [3, 6] and run.repeats == 1
    for bad in (("naive",), ()):
        with pytest.raises(ValueError, match="variants=.*split_by_split, pipelined, dual_stream"):
            split_sweep(cfg, [3], variants=bad)
    with pytest.raises(ValueError, match="split_sizes is empty"):
        split_sweep(cfg, [])
    with pytest.raises(ValueError, match="split_size=13"):
        split_sweep(cfg, [3, 13])  # refused before anything is timed


def test_split_by_split_equals_one_device(devs):
    cfg = _cfg("resnet", devs)
    with torch.no_grad():
        torch.testing.assert_close(mp.forward_split_by_split(cfg.model, cfg.x, devs[0], 5), cfg.model(cfg.x))
    check_against_one_device(cfg, Forward("split_by_split", 5))


def test_time_forwards_alternates_and_keeps_every_round(devs, monkeypatch):
    cfg = _cfg("toy", devs, repeats=3)
    calls = []
    real = mp.forward_pipelined
    monkeypatch.setattr(mp, "forward_pipelined", lambda m, x, d, s: calls.append(s) or real(m, x, d, s))
    runs = time_forwards(cfg, {"a": Forward("pipelined", 3), "b": Forward("pipelined", 6)})
    assert calls == [3, 6] * 4  # one warm-up round, then three rounds, A B A B ...
    for r in runs.values():
        assert len(r.step_time.values) == len(r.steps.timelines) == 3 and r.devices == ("cpu:0", "cpu:1")
    with pytest.raises(ValueError, match="variant='sideways'"):
        Forward("sideways", 3)


def test_typical_is_the_round_of_median_makespan():
    from pipelab.timeline import Span, Timeline

    rounds = [Timeline([Span("cpu:0", "compute", "F", 0.0, t)]) for t in (0.3, 0.1, 0.5, 0.2)]
    timed = Timed(Steps([0.3, 0.1, 0.5, 0.2], rounds), ("cpu:0", "cpu:1"))
    assert timed.timeline is rounds[3] and timed.step_time.values == (0.3, 0.1, 0.5, 0.2)  # 0.2: the lower middle


def test_split_sweep_speedups_are_round_by_round_ratios(devs):
    run = split_sweep(_cfg("toy", devs, repeats=2), [3, 12], ("split_by_split", "pipelined"))
    piped, by_split = run["pipelined"], run["split_by_split"]
    base = run.one_device.step_time.values  # one baseline for both variants
    for s in (3, 12):
        assert piped.speedup[s].values == pytest.approx([b / t for b, t in zip(base, piped.timed[s].step_time.values)])
        assert piped.seconds[s] == piped.timed[s].step_time
        gain = [b / p for b, p in zip(by_split.timed[s].step_time.values, piped.timed[s].step_time.values)]
        assert run.overlap_gain(s).values == pytest.approx(gain)
    assert piped.best_split == max((3, 12), key=lambda s: piped.speedup[s].median)
    assert run.splits(3) == 4 and run.bound(12) == 1.0


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
    timed = _timed(_cfg("wide", devs, repeats=1), Forward("dual_stream", 4))
    costs = split_costs(timed)
    copies = sorted(s.duration for s in timed.timeline.filter(rank="cpu:1", kind="copy"))
    assert len(copies) == 3 and costs["copy"] == copies[1]
    assert costs["device 0"] > 0 and costs["device 1"] > 0


def test_speed_verdict_claims_a_direction_only_when_every_round_agrees():
    assert speed_verdict(Measured.of([1.1, 1.2, 1.3])) == "faster"
    assert speed_verdict(Measured.of([0.8, 0.9, 0.95])) == "slower"
    assert speed_verdict(Measured.of([0.9, 1.2, 1.3])) == "within noise"


def test_split_size_out_of_range(devs):
    model, x, y = _data("toy")
    for bad in (0, -1, 13, 2.5, True):
        with pytest.raises(ValueError, match=f"split_size.*{bad}"):
            mp.forward_pipelined(model, x, devs, bad)
        with pytest.raises(ValueError, match=f"split_size.*{bad}"):
            mp.forward_dual_stream(model, x, devs, bad)
    with pytest.raises(ValueError, match="repeats"):
        Config(model=model, x=x, y=y, devs=devs, repeats=0)


def test_more_devices_than_halves(devs):
    model, x, _ = _data("toy")
    with pytest.raises(ValueError, match="3 devices"):
        mp.forward_naive(model, x, devs + [VirtualDevice("cpu:2")])
    with pytest.raises(ValueError, match="3 devices"):
        Config(model=model, x=x, y=torch.zeros(12), devs=devs + [VirtualDevice("cpu:2")])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_dual_stream_on_two_gpus():
    from pipelab.streams import devices

    ds = devices(2)
    model, x, y = _data("resnet")
    ref_loss, ref_grads = _reference(model, x, y)
    mp.place(model, ds)
    loss, tl = train_step(Config(model=model, x=x, y=y, devs=ds), Forward("dual_stream", 4))
    torch.testing.assert_close(loss.cpu(), ref_loss, atol=1e-4, rtol=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref_grads[n], atol=1e-4, rtol=1e-4)
    assert {"cuda:0", "cuda:1"} <= set(tl.ranks)


def test_check_against_one_device_catches_a_wrong_gradient(devs, monkeypatch):
    cfg = _cfg("toy", devs)
    real = train_step

    def wrong_step(*args, **kwargs):
        loss, tl = real(*args, **kwargs)
        cfg.model.seq2.weight.grad.mul_(1.01)  # one gradient off by 1 %
        return loss, tl

    monkeypatch.setattr("pipelab.experiments.model_parallel.train_step", wrong_step)
    with pytest.raises(AssertionError, match="seq2.weight"):
        check_against_one_device(cfg, Forward("naive"))


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
    cfg = _cfg("toy", devs)
    with pytest.raises(ValueError, match=f"split_size.*{bad!r}"):
        train_step(cfg, Forward(variant, bad))
    with pytest.raises(ValueError, match=f"split_size.*{bad!r}"):
        check_against_one_device(cfg, Forward(variant, bad))


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


@pytest.mark.parametrize("bad,match", [
    (dict(channels=0), "channels must be a whole number"), (dict(blocks=(1,)), "blocks must be a number"),
    (dict(blocks=(1, 0)), "blocks must be a whole number"), (dict(blocks="2"), "blocks must be a number"),
    (dict(batch=0), "batch must be"), (dict(size=2.5), "size must be"), (dict(expansion=True), "expansion must be"),
    (dict(repeats=0), "repeats must be"), (dict(seed=-1), "seed must be")])
def test_config_refuses_every_bad_parameter_before_anything_runs(devs, bad, match):
    params = dict(channels=4, blocks=1, batch=8, size=8, repeats=1) | bad
    with pytest.raises(ValueError, match=match):
        Config.resnet(devs, **params)


def test_config_builds_the_same_seeded_model_and_batch(devs):
    a = Config.resnet(devs, channels=4, blocks=(1, 2), batch=6, size=8, expansion=2)
    b = Config.resnet(devs, channels=4, blocks=(1, 2), batch=6, size=8, expansion=2)
    assert a.batch == 6 and len(a.model.seq2) == 2 + 2 + 2  # narrow (conv, relu), two blocks, pool, flatten
    torch.testing.assert_close(a.x, b.x)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q)


def test_config_refuses_a_model_without_halves_and_a_mismatched_batch(devs):
    model, x, y = _data("toy")
    with pytest.raises(ValueError, match="no seq1, seq2, fc"):
        Config(model=torch.nn.Linear(10, 5), x=x, y=y, devs=devs)
    with pytest.raises(ValueError, match="inputs have 12 samples but targets have 11"):
        Config(model=model, x=x, y=y[:11], devs=devs)


def _timed_of(seconds) -> Timed:
    """Made-up rounds, each with one split: device 0 1 ms, its copy 0.5 ms, device 1 1 ms."""
    from pipelab.timeline import Span, Timeline

    tl = Timeline([Span("cpu:0", "compute", "F", 0.0, 1e-3, 0), Span("cpu:1", "compute", "copy", 1e-3, 1.5e-3, 0),
                   Span("cpu:1", "compute", "F", 1.5e-3, 2.5e-3, 0)])
    return Timed(Steps(list(seconds), [tl] * len(seconds)), ("cpu:0", "cpu:1"))


def test_naive_verdict_claims_faster_only_when_every_round_was():
    from pipelab.experiments.model_parallel import NaiveRun, naive_verdict

    key, verdict, text, figures = naive_verdict(NaiveRun(_timed_of([1.0, 1.0, 1.0]), _timed_of([1.1, 0.9, 1.0])))
    assert (key, verdict) == ("02.naive_speedup", "no faster") and "as predicted" in text and len(text.split()) <= 30
    assert figures["repeats"] == 3 and figures["speedup"].median == pytest.approx(1.0)
    assert naive_verdict(NaiveRun(_timed_of([1.0, 1.0]), _timed_of([0.8, 0.9])))[1] == "faster"
    # two streams of one GPU (device="cuda" on a one-GPU machine): where it ran says so, and why it was faster
    shared = "two streams of one Tesla T4 (shared SMs)"
    text = naive_verdict(NaiveRun(_timed_of([1.0, 1.0]), _timed_of([0.8, 0.9]), shared))[2]
    assert text.startswith(f"on {shared}, naive") and text.endswith("took turns, kernels overlapping on its SMs.")
    assert "working set per core" not in text and len(text.split()) <= 32  # the CPU's says more


def _sweep_run(one_device, variants: dict, batch=16):
    """A SweepRun from made-up times: variant -> {split size: seconds per round}."""
    from pipelab.experiments.model_parallel import speedup
    from pipelab.experiments.split_pipelining import SplitSweep, SweepRun

    base = _timed_of(one_device)
    sweeps = {}
    for v, sizes in variants.items():
        timed = {s: _timed_of(t) for s, t in sizes.items()}
        speedups = {s: speedup(base, t) for s, t in timed.items()}
        sweeps[v] = SplitSweep(v, timed, speedups, max(speedups, key=lambda s: speedups[s].median))
    return SweepRun(base, sweeps, batch)


def test_curve_and_bound_verdicts_read_the_rounds():
    from pipelab.experiments.split_pipelining import bound_verdict, curve_verdict

    run = _sweep_run([2.0, 2.0], {"pipelined": {1: [2.5, 2.6], 4: [1.2, 1.3], 16: [2.1, 2.2]},
                                  "split_by_split": {1: [3.0, 3.0], 4: [2.0, 2.0], 16: [2.0, 2.0]}})
    key, shape, text, figures = curve_verdict(run)
    assert (key, shape, figures["best_split"]) == ("03.curve_shape", "rises then falls", 4)
    assert "rises then falls; the best, split_size=4" in text
    flat = _sweep_run([2.0, 2.0], {"pipelined": {1: [1.9, 2.1], 4: [1.8, 2.2]}})
    assert curve_verdict(flat)[1] == "flat within noise"
    key, verdict, text, figures = bound_verdict(run)
    # split 4: k = 4 splits, bound 1.6; speedup 2/1.2..2/1.3 = 1.54-1.67; overlap 2/1.2..2/1.3 too
    assert key == "03.bound" and figures["split_size"] == 4 and figures["bound"] == pytest.approx(1.6)
    assert verdict == "overlap within the bound" and "stayed within the bound" in text
    fast = _sweep_run([2.0, 2.0], {"pipelined": {4: [0.5, 0.6], 16: [2.0, 2.0]},
                                   "split_by_split": {4: [1.0, 1.0], 16: [2.0, 2.0]}})
    key, verdict, text, figures = bound_verdict(fast)
    assert verdict == "overlap above the bound" and figures["above_in_every_round"] == [4]
    assert "beat the bound 2k/(k+1): 1.83x against 1.60" in text  # the median of 2.00 and 1.67: one number


def test_copy_stream_verdict_needs_every_round_and_more_than_run_to_run_noise():
    from pipelab.experiments.split_pipelining import copy_stream_rows, copy_stream_speedup, copy_stream_verdict

    def run(dual):
        return _sweep_run([2.0, 2.0, 2.0], {"pipelined": {4: [1.0, 1.0, 1.0]}, "dual_stream": {4: dual}})
    assert copy_stream_verdict(run([0.5, 0.6, 0.7]))[1] == "faster"
    assert copy_stream_verdict(run([1.5, 1.6, 1.7]))[1] == "slower"
    key, verdict, text, figures = copy_stream_verdict(run([0.9, 0.95, 0.97]))  # faster each round, but by < 30 %
    assert (key, verdict) == ("04.copy_stream", "within noise") and figures["every_round"] == "faster"
    assert copy_stream_speedup(run([0.5, 1.0, 2.0])).values == pytest.approx((2.0, 1.0, 0.5))
    timed = _timed_of([1.0, 1.0])  # the copy sits in device 1's compute stream: 0.5 of its 1.5 ms, hidden by nothing
    assert timed.copy_share.values == pytest.approx((1 / 3, 1 / 3)) and timed.overlap.values == (0.0, 0.0)
    assert figures["split_03"] == figures["split_04"] == 4
    # split 4 of a batch of 16: k = 4; (1 + 0.5 + 1) + 3 x 1.5 = 7 ms before, 2.5 + 3 x 1 = 5.5 ms after
    assert [r["value"] for r in copy_stream_rows(run([0.9, 0.95, 0.97]))] == ["1.00", "0.50", "1.00", "7.0", "5.5"]


def test_split_size_explorer_reruns_the_split_the_slider_picks(devs, monkeypatch):
    import matplotlib.pyplot as plt

    from pipelab import widgets

    cfg = _cfg("toy", devs, repeats=1)
    run = split_sweep(cfg, [3, 6], ("pipelined",))
    picked = []
    real = widgets.time_forwards
    monkeypatch.setattr(widgets, "time_forwards", lambda c, fs: picked.append(fs["split"]) or real(c, fs))
    slider = widgets.split_size_explorer(cfg, run).children[0]
    assert list(slider.options) == [3, 6] and slider.value == run["pipelined"].best_split
    slider.value = 9 - slider.value  # the other split size
    assert picked == [Forward("pipelined", s) for s in (9 - slider.value, slider.value)]
    plt.close("all")


def test_explorers_set_their_output_state_without_capturing_output(devs):
    # A capture (`with out:`) makes nbclient send the widget's state back on the shell socket while
    # it waits there for the cell's reply: a reply landing during that send went unseen and papermill
    # waited on an idle kernel for ever. The explorers set the Output's outputs from the kernel instead.
    import matplotlib.pyplot as plt

    from pipelab import widgets

    cfg = _cfg("toy", devs, repeats=1)
    run = split_sweep(cfg, [3, 6], ("pipelined",))
    slider, out = widgets.split_size_explorer(cfg, run).children
    for split_size in (slider.value, 9 - slider.value):
        slider.value = split_size
        image, text = out.outputs  # the last draw's only: the one before was replaced
        assert "image/png" in image["data"] and text["text"].startswith(f"split_size={split_size}: speedup")
    assert out.msg_id == ""  # nothing was ever captured
    schedule = widgets.schedule_explorer("1f1b", 2, 4).children[-1]
    assert [o["output_type"] for o in schedule.outputs] == ["display_data"] and schedule.msg_id == ""
    assert not plt.get_fignums()  # every figure drawn was closed


# ---------------------------------------------------------------------------------------------
# The emulated node: the tutorial's ResNet-50 paces the virtual devices
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulated():
    from pipelab.experiments import model_parallel as ex
    from pipelab.streams import devices

    pace = ex.ResNet50Pace("2xH100-nvlink", 12)
    ds = devices(2, pace=pace)
    torch.manual_seed(0)
    cfg = Config.resnet(ds, channels=4, blocks=1, batch=12, size=8, repeats=2)
    yield ex, pace, cfg
    ds.close()


def test_half_counts_are_affine_in_the_images():
    from pipelab.emulate import cost
    from pipelab.experiments import model_parallel as ex

    pace = ex.ResNet50Pace("2xH100-nvlink", 120)
    from pipelab.emulate.resnet50 import resnet50_halves

    first, _ = resnet50_halves("layer2")
    three = cost.count(first, torch.empty(3, 3, 128, 128))
    assert pace.half("seq1", 3).flops == pytest.approx(three.flops)
    assert pace.half("seq1", 3).bytes == pytest.approx(three.bytes)
    assert pace.counts["cut"] == (512, 16, 16)  # the tutorial's cut after layer2
    with pytest.raises(ValueError, match="layer2"):
        resnet50_halves("layer9")


def test_emulated_sweep_is_the_pipeline_formula_and_the_same_every_round(emulated):
    ex, pace, cfg = emulated
    sizes = [1, 2, 3, 4, 6, 12]
    run = split_sweep(cfg, sizes, ("split_by_split", "pipelined"))
    piped = run["pipelined"]
    from pipelab.emulate.resnet50 import modelled_speedups

    formula = modelled_speedups(pace.node, "layer2", sizes, batch=12)
    for s in sizes:
        assert piped.speedup[s].low == piped.speedup[s].high  # modelled time: no noise
        assert piped.speedup[s].median == pytest.approx(formula[s])
    assert run["split_by_split"].speedup[12].values == (1.0, 1.0)  # one split IS the baseline
    assert run.where.startswith("the emulated")
    key, verdict, text, figures = lesson.curve_verdict(run)
    assert "emulated" in text and figures["best_split"] == piped.best_split


def test_emulated_naive_is_slower_by_the_copy_and_prints_the_figures_it_is_computed_from(emulated):
    ex, pace, cfg = emulated
    run = ex.naive_run(cfg)
    copy_s = pace.copy_seconds(12 * pace.images_per_row)
    assert run.naive.step_time.median - run.one_device.step_time.median == pytest.approx(copy_s)
    rows = run.rounds()
    assert len(rows) == 2 and float(rows[0]["one device / naive"]) == pytest.approx(run.speedup.median, abs=1e-3)
    key, verdict, text, figures = ex.naive_verdict(run)
    rows = ex.naive_anchor_rows(run)
    assert verdict == "no faster" and rows[0]["tutorial (training steps; GPUs not named)"] == "7%" and "PCIe 4" in rows[2]["figure"]


def test_emulated_pace_refuses_work_it_cannot_time(emulated):
    ex, pace, cfg = emulated
    with pytest.raises(ValueError, match="run on this machine's cores"):
        pace.seconds("F", torch.relu, (torch.ones(2),))


def test_emulated_checks_still_hold_against_the_one_device_model(emulated):
    ex, pace, cfg = emulated
    check_against_one_device(cfg, Forward("dual_stream", 5))
    late = hazard_report(cfg, 3, use_events=False, late_producer=True)
    assert late.raw_hazards == list(range(late.splits))


def test_copy_stream_verdict_names_the_devices_and_never_blames_cpu_cores_when_emulated(emulated):
    ex, pace, cfg = emulated
    run = split_sweep(cfg, [3, 6], ("pipelined", "dual_stream"))
    key, verdict, text, figures = lesson.copy_stream_verdict(run)
    assert "emulated" in text and "CPU cores" not in text and verdict in ("faster", "slower", "within noise")


def test_anchor_rows_and_verdict_put_the_tutorial_beside_the_run(emulated):
    ex, pace, cfg = emulated
    run = split_sweep(cfg, [1, 3, 12], ("split_by_split", "pipelined"))
    rows = lesson.anchor_rows(run)
    published = "tutorial (GPUs not named)"  # the column says the tutorial's hardware is unknown
    assert rows[0][published] == "1.49x" and rows[1][published] == "1.54x" and "T4" in rows[-1]["figure"]
    key, verdict, text, figures = lesson.anchor_verdict(run)
    assert "the tutorial's best of 12" in text


def test_gpu_checks_turn_tf32_off_and_use_the_stated_tolerance(devs):
    from pipelab.experiments.model_parallel import GPU_TOLERANCE, tolerance
    from pipelab.reference import exact_fp32

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with exact_fp32():
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == saved
    assert tolerance(devs) == 1e-5

    class FakeGpu:
        torch_device = torch.device("cuda", 0)
    assert tolerance([FakeGpu()]) == GPU_TOLERANCE


def test_input_is_moved_to_the_first_device_once(devs):
    cfg = _cfg("resnet", devs)
    assert cfg.x_first is cfg.x_first  # placed once, before any timing
    assert devs[0].owner(cfg.x_first) == devs[0].name


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_copy_on_the_destinations_stream_from_pinned_memory():
    from pipelab.streams import devices

    with devices(2) as ds:
        x = torch.randn(4, 8)
        on0 = ds[0].own(x)
        assert on0.device == ds[0].torch_device
        moved = ds[1].stream("copy").copy(on0).result()
        assert moved.device == ds[1].torch_device and torch.equal(moved.cpu(), x)
        torch.manual_seed(0)
        cfg = Config.resnet(ds, channels=4, blocks=1, batch=12, size=8)
        check_against_one_device(cfg, Forward("dual_stream", 5))


@pytest.mark.parametrize("modelled", [True, False])
def test_forward_time_curves_star_each_best_split_and_draw_ranges_only_when_measured(modelled):
    import matplotlib.pyplot as plt

    from pipelab.plots.model_parallel import forward_time_curves

    run = _sweep_run([1.0, 1.0], {"pipelined": {4: [0.9, 0.8], 8: [0.7, 0.7]}, "dual_stream": {4: [0.6, 0.6], 8: [0.65, 0.7]}})
    ax = forward_time_curves(run, modelled=modelled)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    stars = [label for label in labels if label.startswith("best")]
    assert "best, lesson 03: split 8 (700.0 ms" in stars[0] and "best, copy stream: split 4 (600.0 ms" in stars[1]
    assert all(("modelled" in label) == modelled for label in stars)
    assert any("min-max" in label for label in labels) != modelled  # a modelled time cannot vary: no range
    plt.close("all")

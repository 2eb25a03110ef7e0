"""Lesson 05: BucketedDDP on a module spread over two devices, the overlaps read off a timeline,
the pipe x data grid's groups, gradients and micro-batch losses against one process, and the
inputs refused when a Config is built, before any process starts."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipelab import experiments, hardware, models
from pipelab.ddp import MIB, Bucket, module_bucket_plan, plan_buckets
from pipelab.emulate import Emulated
from pipelab.emulate.widened import stage_inputs, widen
from pipelab.experiments import grid as grid_experiment
from pipelab.experiments import hybrid as hybrid_experiment
from pipelab.experiments import layouts as layouts_experiment
from pipelab.experiments.grid import Layout, hidden_behind_pipeline, layouts_of
from pipelab.experiments.hybrid import allreduce_overlap, copy_overlap, device_concurrency, hidden_share, shares
from pipelab.hybrid import ModelParallelReplica, check_grid, gpu_path, grid_place, last_backwards, pipeline_processes
from pipelab.launch import spawn
from pipelab.measure import Steps
from pipelab.pipeline.schedules import B, F, I, W, make_schedule
from pipelab.reference import assert_same, reference_run
from pipelab.streams import devices
from pipelab.timeline import Span, Timeline
from pipelab.worker import RankContext


def toy_problem(batch: int = 16):
    """The DDP tutorial's ToyMpModel (Linear 10->10, ReLU | Linear 10->5) and a batch for it."""
    torch.manual_seed(0)
    return models.ToyModel(), torch.randn(batch, 10), torch.randn(batch, 5)


def mlp_problem(batch: int = 32, width: int = 16):
    torch.manual_seed(0)
    return models.mlp([width] * 9), torch.randn(batch, width), torch.randn(batch, width)


def run_replicas(model, x, y, **settings) -> dict:
    cfg = hybrid_experiment.Config(model=model, x=x, y=y, **settings)
    return experiments.run(hybrid_experiment.worker, cfg, hybrid_experiment.gather)


def grid_config(model, x, y, pipe=2, data=2, num_microbatches=4, **settings) -> grid_experiment.Config:
    return grid_experiment.Config(model=model, x=x, y=y, layouts=(Layout(pipe, data, num_microbatches),), **settings)


# ---------------------------------------------------------------------------------------------
# Buckets on a module spread over devices (pure)
# ---------------------------------------------------------------------------------------------

def test_buckets_never_mix_devices_and_fill_in_backward_order():
    params = [("a", 100), ("b", 300), ("c", 50), ("d", 600)]
    buckets = plan_buckets(params, 400 / MIB, devices=["x", "y", "x", "y"])
    assert buckets == [Bucket(0, ("d",), (600,), "y"), Bucket(1, ("b",), (300,), "y"),
                       Bucket(2, ("c", "a"), (50, 100), "x")]
    # one device: the plan of one device, with that device named
    same = plan_buckets(params, 400 / MIB, devices=["x"] * 4)
    assert [(b.names, b.device) for b in same] == [(("d",), "x"), (("c", "b", "a"), "x")]
    with pytest.raises(ValueError, match="got 3 devices for 4 parameters"):
        plan_buckets(params, 1, devices=["x", "y", "x"])


def test_a_two_device_replica_names_each_parameter_s_device():
    devs = devices(2)
    try:
        replica = ModelParallelReplica(models.SplitMLP(8, 2, 3), devs)
        where = replica.device_of()
        assert set(where) == {n for n, _ in replica.named_parameters()}
        assert {n.split(".")[0]: d for n, d in where.items()} == {"seq1": "device 0", "seq2": "device 1", "fc": "device 1"}
        buckets = module_bucket_plan(replica, 1.0, where)
        assert [b.device for b in buckets] == ["device 1", "device 0"]  # the second half's gradients come first
        assert buckets[0].names == ("fc.bias", "fc.weight", "seq2.0.bias", "seq2.0.weight")
        with pytest.raises(ValueError, match="names no device for"):
            module_bucket_plan(replica, 1.0, {"fc.weight": "device 1"})
        assert module_bucket_plan(replica, 1.0) == module_bucket_plan(models.SplitMLP(8, 2, 3), 1.0)  # no device told
    finally:
        for d in devs:
            d.close()


# ---------------------------------------------------------------------------------------------
# Overlaps read off hand-made timelines (pure)
# ---------------------------------------------------------------------------------------------

def test_the_three_overlaps_of_a_hand_made_step():
    spans = [
        Span(0, "device 0", "F", 0, 4, mb=0), Span(0, "device 1", "copy", 4, 5, mb=0),
        Span(0, "device 0", "F", 4, 8, mb=1), Span(0, "device 1", "F", 5, 9, mb=0),
        Span(0, "device 1", "copy", 9, 10, mb=1), Span(0, "device 1", "F", 10, 14, mb=1),
        Span(0, "device 1", "B", 14, 18), Span(0, "device 0", "B", 18, 22),
        Span(0, "comm", "allreduce", 18, 26, meta={"bucket": 0}),
        Span(0, "device 1", "copy", 26, 27, meta={"bucket": 0}),  # the wrapper's write-back: no activation copy
    ]
    tl = Timeline(spans)
    assert copy_overlap(tl) == pytest.approx(0.5)  # copy 0 under device 0's F 1; copy 1 under nothing
    assert device_concurrency(tl) == pytest.approx(3 / 21)  # both computed 5..8; one or both 0..9 and 10..22
    assert allreduce_overlap(tl) == pytest.approx(0.5)  # 18..22 of 18..26


def test_hidden_behind_pipeline_counts_flight_from_the_last_launch_and_any_process():
    spans = [Span(0, "compute", "B", 0, 10, meta={"stage": 0}), Span(1, "compute", "B", 0, 4, meta={"stage": 1}),
             Span(1, "comm", "allreduce", 4, 12, meta={"stage": 1}),
             Span(3, "comm", "allreduce", 6, 12, meta={"stage": 1})]
    tl = Timeline(spans)
    # process 1's all-reduce waits for process 3's launch at 6: flight 6..12 on both, 6..10 under process 0's B
    assert hidden_behind_pipeline(tl) == pytest.approx(8 / 12)
    assert hidden_share(tl, lambda s: s.kind == "allreduce", lambda s: s.kind == "B") == pytest.approx(0.0)


def test_simulated_hidden_share_with_the_measured_costs_and_flights():
    # F 1 ms, B 2 ms on both stages; each stage's all-reduce flies 1 ms (stage 0: launched at 10
    # and 10.5 by its two copies, so its flight counts from 10.5)
    spans = [Span(r, "compute", k, 0.0, d, meta={"stage": r // 2}) for r in range(4) for k, d in (("F", 1e-3), ("B", 2e-3))]
    spans += [Span(0, "comm", "allreduce", 0.010, 0.0115, meta={"stage": 0}),
              Span(1, "comm", "allreduce", 0.0105, 0.0115, meta={"stage": 0}),
              Span(2, "comm", "allreduce", 0.020, 0.021, meta={"stage": 1}),
              Span(3, "comm", "allreduce", 0.020, 0.021, meta={"stage": 1})]
    tl = Timeline(spans)
    run = grid_experiment.GridRun(Layout(2, 2, 4), "1f1b", [], [], [], [], 0.0, Steps([0.03, 0.04], [tl, tl]), rounds=2)
    assert run.flights() == pytest.approx({0: 1e-3, 1: 1e-3})
    # 1F1B: stage 1's last B ends one B (2 ms) before stage 0's, long enough to hide its 1 ms
    # flight; stage 0's all-reduce hides behind nothing: half of the all-reduce time
    assert run.simulated_overlap() == pytest.approx(0.5)
    assert run.round_times == [0.03, 0.04] and run.step_time.values == (0.03, 0.04)
    assert len(run.overlap.values) == 2


def test_last_backwards_is_where_a_stage_s_gradients_are_final():
    one = make_schedule("1f1b", 2, 4)
    for rank, actions in enumerate(one.actions):
        (stage, index), = last_backwards(actions).items()
        assert stage == rank and actions[index] == B(rank, 3) and index == len(actions) - 1
    assert last_backwards([F(0, 0), I(0, 0), F(0, 1), W(0, 0), I(0, 1), W(0, 1)]) == {0: 5}
    inter = make_schedule("interleaved", 2, 4)
    last = last_backwards(inter.actions[0])
    assert set(last) == {0, 2} and last[2] < last[0]  # the later stage is done first: its all-reduce overlaps


# ---------------------------------------------------------------------------------------------
# DDP over two-device replicas, on real processes
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_runs():
    model, x, y = toy_problem()
    return {split: run_replicas(model, x, y, world_size=2, split_size=split, bucket_cap_mb=1e-9, steps=3)
            for split in (None, 2)}, model, x, y


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("variant", ["bucketed", "torch"])
def test_ddp_over_two_device_replicas_equals_one_process(toy_runs, split, variant):
    runs, model, x, y = toy_runs
    run = runs[split][variant]
    assert_same(run, reference_run(model, x, y, nn.MSELoss(), steps=3, lr=0.1))
    assert len(run.losses) == 3 and run.replica_spread == 0.0  # ranks started elsewhere: the broadcast fixed that
    assert run.devices == [["cpu:0", "cpu:1"]] * 2 or hardware.gpu_count() >= 4


@pytest.mark.parametrize("split", [None, 2])
def test_bucketed_timeline_has_both_devices_and_the_all_reduce_lane(toy_runs, split):
    runs, _, _, _ = toy_runs
    run = runs[split]["bucketed"]
    assert [b.device for b in run.buckets] == ["device 1", "device 1", "device 0", "device 0"]
    splits = 1 if split is None else 16 // 2 // split
    for tl in run.steps.timelines:
        for rank in (0, 1):
            mine = tl.filter(rank=rank)
            assert {s.lane for s in mine} == {"device 0", "device 1", "comm"}
            assert sorted(s.mb for s in mine.filter(lane="device 0", kind="F")) == list(range(splits))
            assert sorted(s.mb for s in mine.filter(lane="device 1", kind="copy") if s.mb is not None) == list(range(splits))
            assert [s.meta["layer"] for s in mine.filter(kind="B")] == ["seq2", "seq1.0"]
            assert [s.lane for s in mine.filter(kind="B")] == ["device 1", "device 0"]
            assert sorted(s.meta["bucket"] for s in mine.filter(kind="allreduce")) == [0, 1, 2, 3]
            # device 1's buckets leave before device 0's backward is over
            first = min(s.start for s in mine.filter(kind="allreduce") if s.meta["bucket"] < 2)
            assert first <= mine.filter(lane="device 0", kind="B").spans[0].end
    for kind, share in shares(run).items():
        assert len(share.values) == len(run.steps.timelines)  # one figure per timed step
        assert 0.0 <= share.low <= share.median <= share.high <= 1.0
    assert run.overlap.values == shares(run)["all-reduce/compute"].values
    if split is None:
        assert run.copy_overlap.values == (0.0,) * len(run.steps.timelines)  # lesson 02's forward: nothing to hide a copy under
    assert run.step_time.values == tuple(run.steps.seconds)


# ---------------------------------------------------------------------------------------------
# The pipe x data grid, on real processes
# ---------------------------------------------------------------------------------------------

def groups_worker(ctx: RankContext, pipe: int, data: int):
    place = grid_place(ctx, check_grid(pipe, data, ctx.world_size))
    group = place.groups["data"]
    data_ranks = dist.get_process_group_ranks(group) if group is not None else None
    ctx.barrier()  # rank 0 holds the store the others build their groups with: stay until all are done
    assert type(place) is type(ctx) and place.device == ctx.device and place.rec is ctx.rec
    return place.rank, place.world_size, pipeline_processes(place), data_ranks


def test_grid_place_is_a_rank_context_of_its_pipeline_with_groups_from_the_topology():
    got = spawn(groups_worker, 4, 2, 2)
    # rank = pipe * data_size + data: pipelines are columns, stage copies are rows
    assert got == [(0, 2, [0, 2], [0, 1]), (0, 2, [1, 3], [0, 1]), (1, 2, [0, 2], [2, 3]), (1, 2, [1, 3], [2, 3])]
    assert spawn(groups_worker, 4, 4, 1) == [(r, 4, [0, 1, 2, 3], None) for r in range(4)]
    assert spawn(groups_worker, 4, 1, 4) == [(0, 1, None, [0, 1, 2, 3])] * 4


@pytest.fixture(scope="module")
def layout_runs():
    model, x, y = mlp_problem()
    cfg = grid_experiment.Config(model=model, x=x, y=y, layouts=layouts_of(2, 2, 4), steps=2, rounds=1)
    return experiments.run(grid_experiment.worker, cfg, grid_experiment.gather), model, x, y


def test_every_layout_equals_one_process_after_optimizer_steps(layout_runs):
    runs, model, x, y = layout_runs
    assert [r.name for r in runs] == ["one pipeline (4 x 1)", "grid (2 x 2)", "data parallel (1 x 4)"]
    for run in runs:
        assert len(run.losses) == 3  # one checked warm-up step, two timed
        assert_same(run, reference_run(model, x, y, nn.MSELoss(), steps=3, lr=0.1))
        assert run.replica_spread == 0.0


def test_every_layout_returns_each_micro_batch_s_loss_as_one_process_computes_it(layout_runs):
    runs, model, x, y = layout_runs
    for run in runs:
        parts = run.layout.data * run.layout.num_microbatches  # batch order: pipeline by pipeline
        want = [nn.MSELoss()(model(xm), ym).item() for xm, ym in zip(x.chunk(parts), y.chunk(parts))]
        assert len(run.mb_losses) == len(run.losses) and len(run.mb_losses[0]) == parts
        assert run.mb_losses[0] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert [sum(step) / len(step) for step in run.mb_losses] == pytest.approx(run.losses, rel=1e-6)
    one_pipe, grid, dp = runs
    assert one_pipe.pipelines == [[0, 1, 2, 3]] and grid.pipelines == [[0, 2], [1, 3]]
    assert grid.stages == [[0], [0], [1], [1]] and dp.stages == [[0]] * 4


def test_the_stage_all_reduce_starts_after_its_last_backward_and_only_in_data_groups(layout_runs):
    runs, _, _, _ = layout_runs
    one_pipe, grid, dp = runs
    for tl in one_pipe.steps.timelines:
        assert not tl.filter(kind="allreduce")  # one pipeline: no copies to average with
    for run in (grid, dp):
        for tl in run.steps.timelines:
            reduces = tl.filter(kind="allreduce")
            assert sorted(s.rank for s in reduces) == [0, 1, 2, 3]  # one per process and step
            for a in reduces:
                backwards = [b for b in tl.filter(rank=a.rank, kind="B") if b.meta["stage"] == a.meta["stage"]]
                assert len(backwards) == run.layout.num_microbatches and a.start >= max(b.end for b in backwards)
        overlap = run.overlap
        assert len(overlap.values) == len(run.steps.timelines)
        assert 0.0 <= overlap.low <= overlap.median <= overlap.high <= 1.0
        assert grid_experiment.launched_after_last_backward(run)
    for row in grid.launches():
        launched, _, arrived = (v for k, v in row.items() if "(ms" in k)
        assert launched <= arrived
    assert one_pipe.flights() == {} and set(grid.flights()) == {0, 1}  # one pipeline has nothing to average
    assert 0.0 <= grid.simulated_overlap() <= 1.0
    assert all(len(r.round_times) == 1 for r in runs)  # one round of timed steps


def test_interleaved_grid_overlaps_its_own_process_s_remaining_work():
    model, x, y = mlp_problem()
    cfg = grid_config(model, x, y, pipe=2, data=2, num_microbatches=4, schedule="interleaved", steps=1)
    run, = experiments.run(grid_experiment.worker, cfg, grid_experiment.gather)
    assert len(run.losses) == 2  # the checked warm-up step and one timed step
    assert_same(run, reference_run(model, x, y, nn.MSELoss(), steps=2, lr=0.1))
    assert run.stages == [[0, 2], [0, 2], [1, 3], [1, 3]]
    tl = run.timeline
    for rank in range(4):
        later = [a for a in tl.filter(rank=rank, kind="allreduce") if a.meta["stage"] >= 2]
        assert later and all(a.start < max(s.end for s in tl.filter(rank=rank, lane="compute")) for a in later)


# ---------------------------------------------------------------------------------------------
# Refused when the Config is built, before any process starts
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for input that should have been refused")
    monkeypatch.setattr("pipelab.launch.spawn", refuse)


def test_bad_replica_input_is_refused(no_spawn):
    model, x, y = toy_problem()
    too_many = hardware.gpu_count() // 2 + 1
    with pytest.raises(ValueError, match=f"need {2 * too_many} GPUs, and this machine has {hardware.gpu_count()}"):
        run_replicas(model, x[:2 * too_many], y[:2 * too_many], world_size=too_many, device="cuda")
    with pytest.raises(ValueError, match="devices_per_replica=3, but a replica here is a model in two halves"):
        gpu_path(2, 3)
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda'"):
        run_replicas(model, x, y, device="tpu")
    with pytest.raises(ValueError, match="has no seq1, seq2, fc"):
        run_replicas(nn.Linear(10, 5), x, y)
    with pytest.raises(ValueError, match="batch=16 does not divide evenly by world_size=3"):
        run_replicas(model, x, y, world_size=3)
    with pytest.raises(ValueError, match="split_size=9 is larger than a replica's slice"):
        run_replicas(model, x, y, split_size=9)
    with pytest.raises(ValueError, match="variants must be some of"):
        run_replicas(model, x, y, variants=("naive",))
    with pytest.raises(ValueError, match="inputs have 16 samples but targets have 15"):
        run_replicas(model, x, y[:15])
    with pytest.raises(ValueError, match="steps must be a whole number"):
        run_replicas(model, x, y, steps=0)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB > 0"):
        run_replicas(model, x, y, bucket_cap_mb=0)


def test_a_summed_loss_is_refused_by_the_replicas_before_any_process_starts(no_spawn):
    model, x, y = toy_problem()
    with pytest.raises(ValueError, match="reduction='sum'.*use reduction='mean'"):
        run_replicas(model, x, y, loss_fn=nn.MSELoss(reduction="sum"))


def test_a_summed_loss_is_refused_by_the_grid_before_any_process_starts(no_spawn):
    model, x, y = mlp_problem()
    with pytest.raises(ValueError, match="reduction='sum'.*use reduction='mean'"):
        grid_config(model, x, y, loss_fn=nn.MSELoss(reduction="sum"))


def test_bad_grid_input_is_refused(no_spawn):
    model, x, y = mlp_problem()
    with pytest.raises(ValueError, match=r"holds 2 ranks, not world_size=4.*1 x 4, 2 x 2, 4 x 1"):
        grid_experiment.Config(model=model, x=x, y=y, layouts=(Layout(2, 2, 4), Layout(2, 1, 4)))
    with pytest.raises(ValueError, match=r"batch of 30 samples does not split over data=2 replicas x 4 micro-batches"
                                         r".*multiple of 8, or num_microbatches in \[1, 3, 5, 15\]"):
        grid_config(model, x[:30], y[:30], pipe=2, data=2, num_microbatches=4)
    with pytest.raises(ValueError, match="pass an nn.Sequential"):
        grid_config(models.ToyModel(), x, y)
    with pytest.raises(ValueError, match="cannot cut a model with 8 layers into 16 stages"):
        grid_config(model, x, y, pipe=16, data=1, num_microbatches=1)
    with pytest.raises(ValueError, match="unknown schedule"):
        grid_config(model, x, y, schedule="pipedream")
    with pytest.raises(ValueError, match="pipe must be a whole number"):
        grid_config(model, x, y, pipe=0)
    with pytest.raises(ValueError, match="num_microbatches must be a whole number"):
        grid_config(model, x, y, num_microbatches=0)
    with pytest.raises(ValueError, match="layouts must be one or more Layout"):
        grid_experiment.Config(model=model, x=x, y=y, layouts=())
    with pytest.raises(ValueError, match="rounds must be a whole number"):
        grid_config(model, x, y, rounds=0)
    cfg = grid_config(model, x, y)
    assert cfg.world_size == 4
    with pytest.raises(ValueError, match="unknown schedule"):  # a changed copy is checked too
        replace(cfg, schedule="1f1b ")


def test_the_groups_verdict_reads_the_topology(capsys):
    from pipelab.pipeline.topology import ProcessTopology

    assert grid_experiment.groups_verdict(check_grid(2, 2))[1] == "as predicted"
    assert grid_experiment.groups_verdict(check_grid(4, 1))[1] == "as predicted"
    # pipe fastest: the numbering no longer gives the groups the lesson predicts
    key, verdict, text, _ = grid_experiment.groups_verdict(ProcessTopology(["data", "pipe"], [2, 2]))
    assert verdict == "not as predicted" and "not as predicted" in text


def test_predicted_step_of_a_layout():
    assert layouts_of(2, 2, 4) == (Layout(4, 1, 4), Layout(2, 2, 4), Layout(1, 4, 1))
    assert layouts_experiment.ideal_fraction(Layout(4, 1, 4)) == pytest.approx(7 / 16)
    assert layouts_experiment.ideal_fraction(Layout(2, 2, 4)) == pytest.approx(5 / 16)
    assert layouts_experiment.ideal_fraction(Layout(1, 4, 1)) == pytest.approx(1 / 4)
    # fewer devices than processes: a bubble is filled by another process's work
    assert layouts_experiment.predicted_seconds(Layout(4, 1, 4), 1.0, devices=2) == pytest.approx(0.5)
    assert layouts_experiment.predicted_seconds(Layout(4, 1, 4), 1.0, devices=4) == pytest.approx(7 / 16)
    model = models.mlp([4, 4])  # 20 parameters, 80 bytes of gradients
    assert layouts_experiment.allreduce_bytes(Layout(1, 4, 1), model) == pytest.approx(120)
    assert layouts_experiment.allreduce_bytes(Layout(4, 1, 1), model) == 0


# ---------------------------------------------------------------------------------------------
# The grid on an emulated node: every span timed by the device and link models
# ---------------------------------------------------------------------------------------------


def test_an_emulated_model_is_the_same_layers_wider_on_meta():
    """`emulate.widened`: the grid's model as its emulated node times it."""
    model = models.mlp([4, 6, 2])
    big = widen(model, 8)
    assert [type(m) for m in big] == [nn.Linear, nn.ReLU, nn.Linear]
    assert (big[0].in_features, big[0].out_features, big[2].out_features) == (32, 48, 16)
    assert all(p.device.type == "meta" for p in big.parameters())
    with pytest.raises(ValueError, match="widens Linear layers, and the model has a LayerNorm"):
        widen(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), 2)
    shapes = [tuple(x.shape) for x in stage_inputs(split_model_of(big, 2), 5, 32)]
    assert shapes == [(5, 32), (5, 48)]


def split_model_of(model, stages):
    from pipelab.pipeline.partition import split_model

    return split_model(model, stages)


def test_an_emulated_grid_refuses_layers_it_cannot_widen_before_any_process_starts(no_spawn):
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match="widens Linear layers"):
        grid_config(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)), x, x, pipe=2, data=2,
                    num_microbatches=2, emulate="4xH100-nvlink")
    with pytest.raises(ValueError, match="scale must be a whole number"):
        grid_config(models.mlp([4] * 5), x, x, num_microbatches=2, emulate=Emulated("4xH100-nvlink", scale=0))
    with pytest.raises(ValueError, match="gives emulated_scale, which this lesson's emulated size does not have"):
        grid_config(models.mlp([4] * 5), x, x, num_microbatches=2, emulate=Emulated("4xH100-nvlink", emulated_scale=2))


def test_the_emulated_prediction_is_the_device_model_s_forward_and_backward():
    from pipelab.emulate.cost import stage_seconds
    from pipelab.emulate.specs import parse_node

    model, x, y = mlp_problem(batch=8, width=4)
    cfg = grid_config(model, x, y, num_microbatches=2, emulate=Emulated("4xH100-nvlink", scale=16))
    prediction = layouts_experiment.predict(cfg)
    big = widen(model, 16)
    seconds = stage_seconds(big, torch.empty(128, 64, device="meta"), parse_node("4xH100-nvlink").device, "bfloat16")
    assert prediction.one_device == pytest.approx(seconds["F"] + seconds["B"])
    assert prediction.modelled and prediction.here == prediction.world == 4
    assert list(prediction.ms([])) == [prediction.gpu_label]  # one device per process: one prediction
    words = cfg.widened.describe(cfg.model, cfg.x.shape[0])
    assert "64" in words and "128 rows in bfloat16" in words


def test_the_round_verdict_follows_the_rounds():
    from pipelab.measure import Measured

    assert grid_experiment.round_verdict(Measured.of([0.8, 0.9])) == "lower"  # faster in both rounds
    assert grid_experiment.round_verdict(Measured.of([1.1, 1.3])) == "higher"
    assert grid_experiment.round_verdict(Measured.of([0.9, 1.1])) == "within noise"


@pytest.fixture(scope="module")
def emulated_runs():
    model, x, y = mlp_problem(batch=16, width=8)
    cfg = grid_experiment.Config(model=model, x=x, y=y, layouts=layouts_of(2, 2, 2), steps=1, rounds=2,
                                 emulate=Emulated("4xH100-nvlink", scale=32))
    return experiments.run(grid_experiment.worker, cfg, grid_experiment.gather), cfg


def test_an_emulated_grid_computes_what_one_process_does_and_lasts_what_the_models_give(emulated_runs):
    from pipelab.emulate.cost import stage_seconds

    runs, cfg = emulated_runs
    device = cfg.node.device
    for run in runs:
        assert_same(run, grid_experiment.reference(cfg), atol=1e-5, rtol=1e-4)
        assert run.node == cfg.node_name == "4xH100-nvlink"
        assert run.steps.seconds == pytest.approx([run.steps.seconds[0]] * len(run.steps.seconds), rel=1e-9)  # logical
        assert run.round_times[0] == pytest.approx(run.round_times[1], rel=1e-9)  # every round alike
        schedule = run.layout.schedule(cfg.schedule)
        big = split_model_of(widen(cfg.model, cfg.size.scale), schedule.num_stages)
        rows = cfg.x.shape[0] * cfg.size.scale // (run.layout.data * run.layout.num_microbatches)
        inputs = stage_inputs(big, rows, 8 * cfg.size.scale)
        for span in run.timeline.filter(kind=("F", "B")):
            want = stage_seconds(big[span.meta["stage"]], inputs[span.meta["stage"]], device, "bfloat16")[span.kind]
            assert span.duration == pytest.approx(want, rel=1e-6)
    one_pipe, grid, dp = runs
    assert not one_pipe.timeline.filter(kind="allreduce") and grid.timeline.filter(kind="allreduce")
    assert grid_experiment.launched_after_last_backward(grid)
    # the data-parallel all-reduce carries the whole model's gradients at the emulated size: it
    # takes longer than the grid's, which carries half of them over half the processes
    dp_flight = max(s.duration for s in dp.timeline.filter(kind="allreduce"))
    assert dp_flight > max(s.duration for s in grid.timeline.filter(kind="allreduce")) > 0


def test_the_emulated_grid_s_verdicts_are_computed_from_the_models(emulated_runs, capsys):
    runs, cfg = emulated_runs
    prediction = layouts_experiment.predict(cfg)
    grid = runs[1]
    for other, key in ((runs[0], "05.grid_vs_one_pipeline"), (runs[2], "05.grid_vs_data_parallel")):
        ratio = grid.step_time.median / other.step_time.median
        got = grid_experiment.grid_vs(runs, other)
        assert got[:2] == (key, "lower" if ratio < 1 else "higher" if ratio > 1 else "within noise")
        assert "modelled on the emulated node" in got[2]
    key, verdict, text, _ = grid_experiment.overlap_verdict(grid)
    assert verdict in ("as simulated", "lower", "higher") and "modelled on the emulated node" in text
    assert layouts_experiment.layouts_vs_prediction(runs, prediction)[1] in ("slower than predicted", "not all slower")
    outlook = layouts_experiment.gpu_outlook(runs, prediction)
    assert f"{layouts_experiment.order(runs)[0]} came first (modelled" in outlook
    rows = layouts_experiment.layouts_table(cfg, runs, prediction)
    assert rows[0]["all-reduce per process"] == "0 B" and rows[2]["all-reduce per process"] != "0 B"


def test_the_contrast_with_this_machine_s_cores_names_both_orders(emulated_runs, capsys):
    runs, _ = emulated_runs
    slower = [replace(r, node=None, steps=Steps([s * f for s in r.steps.seconds], r.steps.timelines))
              for r, f in zip(runs, (1.0, 5.0, 2.0))]  # the grid slowest, as time-slicing can make it
    assert layouts_experiment.cores_contrast(slower, runs, cores=2)[1] == "cores shared"  # 4 processes on 2 cores
    assert layouts_experiment.order(slower) != layouts_experiment.order(runs)
    assert layouts_experiment.cores_contrast(slower, runs, cores=4)[1] == "different order"
    rows = layouts_experiment.cores_rows(slower, runs)
    assert [r["layout"] for r in rows] == [r.name for r in runs]


def test_lesson_05_s_gpu_profile_counts_its_flops():
    import json
    import os

    from pipelab.models import SplitMLP

    # every Linear layer of `rows` x `w` x `w`: forward 2 rows w^2, backward twice that
    w, rows = 8, 4
    linear = 6 * rows * w * w
    layers = sum(isinstance(m, nn.Linear) for m in SplitMLP(w, 2, w).modules())
    want = layers * linear * (3 * 2 * 2 + 3) + 4 * linear * (2 * 3 * (2 * 1 + 1) + 3)
    assert grid_experiment.run_flops(dict(width=w, layers_per_half=2, batch=rows, steps=3, grid_width=w, grid_layers=4,
                                          grid_batch=rows, grid_steps=1, rounds=2)) == pytest.approx(want)
    path = os.path.join(os.path.dirname(__file__), "..", "notebooks", "05_ddp_model_parallel_hybrid.ipynb")
    meta = json.load(open(path))["metadata"]["pipelab"]
    gpu = meta["profiles"]["gpu"]
    cell = [c for c in json.load(open(path))["cells"] if "parameters" in c["metadata"].get("tags", [])][0]
    defaults: dict = {}
    exec("".join(cell["source"]), {}, defaults)
    assert {k: defaults[k] for k in grid_experiment.DEFAULTS} == grid_experiment.DEFAULTS
    counted = grid_experiment.run_flops(gpu)
    assert meta["needs"]["gpu"]["flops"] == pytest.approx(counted, rel=1e-3)
    assert gpu["emulate"] is None  # GPU sizes never run emulated on CPU


# ---------------------------------------------------------------------------------------------
# One clock per rank on CUDA: the stage all-reduce's span from CUDA events (pipelab.ddp.flat)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL, one per process)")
def test_on_gpus_the_stage_all_reduce_is_timed_on_the_gpu_after_its_last_backward():
    model, x, y = mlp_problem()
    cfg = grid_config(model, x, y, pipe=1, data=2, num_microbatches=1, backend="nccl", steps=2)
    [run] = experiments.run(grid_experiment.worker, cfg, grid_experiment.gather)
    assert_same(run, grid_experiment.reference(cfg), atol=1e-4, rtol=1e-3)
    assert grid_experiment.launched_after_last_backward(run)  # both ends on the clock of the backward's events
    for tl in run.steps.timelines:
        reduces = tl.filter(kind="allreduce").spans
        assert len(reduces) == 2 and all(a.duration > 1e-6 for a in reduces)  # its arrival, not its enqueueing

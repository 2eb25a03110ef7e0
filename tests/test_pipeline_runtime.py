"""The pipeline runtime on real processes: every schedule gives the single-process loss and
gradients; stashes and messages are counted; torch.distributed.pipelining agrees with us."""

import pytest
import torch

from pipelab import models
from pipelab.pipeline.runtime import (assert_matches_reference, run_pipeline, run_pipelines,
                                      run_torch_pipelines, split_model)
from pipelab.pipeline.schedules import ScheduleInterleaved1F1B, make_schedule
from pipelab.pipeline.simulate import simulate

BATCH = 24  # divisible by every micro-batch count used below


def problem(num_stages: int):
    torch.manual_seed(0)
    model = models.mlp([8] + [16] * 8 + [4])  # 9 Linear layers: up to 9 stages
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 4)
    return split_model(model, num_stages), x, y, torch.nn.MSELoss()


# p -> micro-batch counts: m = 1, m not a multiple of p, m a multiple of p
MICROBATCHES = {2: [1, 3, 4], 3: [1, 4, 6], 4: [1, 6, 8]}


@pytest.mark.parametrize("p", [2, 3, 4])
def test_one_stage_per_rank_schedules_match_the_reference(p):
    stages, x, y, loss_fn = problem(p)
    schedules = [make_schedule(name, p, m) for name in ("gpipe", "1f1b", "zb-h1") for m in MICROBATCHES[p]]
    runs = run_pipelines(stages, schedules, x, y, loss_fn, steps=1)
    for schedule, run in zip(schedules, runs):
        assert_matches_reference(run, stages, x, y, loss_fn)
        # The stash count follows from the order alone, so it must equal the simulator's.
        assert run.peak_stash == simulate(schedule).peak_stash, schedule
        kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
        assert len(run.timeline.filter(lane="compute")) == len(kinds) * p * schedule.num_microbatches
        assert run.messages_sent == 2 * (p - 1) * schedule.num_microbatches


@pytest.mark.parametrize("p", [2, 3, 4])
def test_interleaved_matches_the_reference(p):
    stages, x, y, loss_fn = problem(2 * p)
    schedules = [ScheduleInterleaved1F1B(p, m, 2) for m in MICROBATCHES[p]]
    runs = run_pipelines(stages, schedules, x, y, loss_fn, steps=1)
    for schedule, run in zip(schedules, runs):
        assert_matches_reference(run, stages, x, y, loss_fn)
        assert run.peak_stash == simulate(schedule).peak_stash
        assert run.messages_sent == 2 * (2 * p - 1) * schedule.num_microbatches


def test_stages_on_one_rank_hand_over_without_messages():
    stages, x, y, loss_fn = problem(3)
    schedule = ScheduleInterleaved1F1B(1, 4, 3)  # one rank holding all three stages
    run = run_pipeline(stages, schedule, x, y, loss_fn, steps=1)
    assert_matches_reference(run, stages, x, y, loss_fn)
    assert run.messages_sent == 0 and not run.timeline.filter(lane="comm").spans


def test_gpipe_stash_grows_with_m_and_1f1b_stays_bounded():
    p, m = 2, 6
    stages, x, y, loss_fn = problem(p)
    gpipe, one_f_one_b = run_pipelines(stages, [make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)],
                                       x, y, loss_fn, steps=1)
    assert gpipe.peak_stash == {0: m, 1: m}
    assert one_f_one_b.peak_stash == {0: 2, 1: 1}
    for rank in range(p):  # the bytes scale with the count: measured, per micro-batch the same
        per_mb = gpipe.peak_stash_bytes[rank] / m
        assert per_mb > 0
        assert one_f_one_b.peak_stash_bytes[rank] == per_mb * one_f_one_b.peak_stash[rank]
    recvs = gpipe.timeline.filter(lane="comm", kind="recv")
    assert len(recvs) == 2 * m  # activations into rank 1, gradients into rank 0


def test_torch_pipelining_runs_the_same_order_and_loss():
    p, m = 3, 4
    stages, x, y, loss_fn = problem(p)
    schedules = [make_schedule(name, p, m) for name in ("gpipe", "1f1b", "zb-h1")]
    theirs = run_torch_pipelines(stages, schedules, x, y, loss_fn, steps=1)
    for schedule, run in zip(schedules, theirs):
        assert_matches_reference(run, stages, x, y, loss_fn)
        for rank in range(p):  # the order torch executed, recorded span by span
            executed = [(s.kind, s.meta["stage"], s.mb) for s in run.timeline.filter(rank=rank, lane="compute")]
            planned = [(a.kind, a.stage, a.mb) for a in schedule.actions[rank]]
            assert executed == planned, (schedule, rank)


def test_torch_interleaved_matches_ours():
    p, m = 2, 4
    stages, x, y, loss_fn = problem(2 * p)
    schedule = make_schedule("interleaved", p, m)
    ours = run_pipeline(stages, schedule, x, y, loss_fn, steps=1)
    theirs = run_torch_pipelines(stages, [schedule], x, y, loss_fn, steps=1)[0]
    assert theirs.loss == pytest.approx(ours.loss, rel=1e-5)
    for rank in range(p):
        executed = [(s.kind, s.meta["stage"], s.mb) for s in theirs.timeline.filter(rank=rank, lane="compute")]
        assert executed == [(a.kind, a.stage, a.mb) for a in schedule.actions[rank]]


def test_bad_input_is_refused_before_workers_start():
    stages, x, y, loss_fn = problem(2)
    with pytest.raises(ValueError, match="num_microbatches=5 does not divide the batch of 24"):
        run_pipeline(stages, make_schedule("gpipe", 2, 5), x, y, loss_fn)
    with pytest.raises(ValueError, match="cannot cut a model with 9 layers into 10 stages"):
        split_model(models.mlp([8] + [16] * 8 + [4]), 10)
    with pytest.raises(ValueError, match="cannot take num_microbatches=5"):
        make_schedule("interleaved", 2, 5)
    with pytest.raises(ValueError, match="the last stage needs a loss function"):
        run_pipeline(stages, make_schedule("1f1b", 2, 4), x, y, None)
    with pytest.raises(ValueError, match="runs 4 stages"):
        run_pipeline(stages, make_schedule("interleaved", 2, 4), x, y, loss_fn)
    with pytest.raises(ValueError, match="targets have 23"):
        run_pipeline(stages, make_schedule("gpipe", 2, 4), x, y[:23], loss_fn)

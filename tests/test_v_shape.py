"""Lesson 13's schedules: ZB-V, DualPipeV (with its overlapped F&B pairs) and looped BFS plan the
order torch 2.13 plans, are valid, refuse what torch refuses, and run on real ranks with the same
gradients and losses as one process."""

import copy

import pytest
import torch
from torch import nn

from pipelab.launch import spawn
from pipelab.pipeline.actions import validate
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.runtime import run_step
from pipelab.pipeline.v_shape import Overlap, ScheduleDualPipeV, ScheduleLoopedBFS, ScheduleZBV, VSchedule

SIZES = [(p, m) for p in (2, 3, 4) for m in range(1, 13)]


def torch_schedules():
    """torch's pipelining schedules, imported when a test compares with them: the ranks of
    step_worker import this file, and would pay about 1.5 s of CPU each for them."""
    from torch.distributed.pipelining import schedules

    return schedules


def torch_order(cls, p: int, m: int, v: int = 2) -> dict[int, list[str]]:
    """The per-rank compute actions torch's schedule class plans, asked without stages or a group."""
    sched = object.__new__(cls)
    sched._num_stages, sched._n_microbatches = p * v, m
    sched.pp_group_size, sched.n_local_stages, sched.num_stages = p, v, p * v
    sched._stages = [None] * v  # only their number is read
    return {r: [str(a) for a in sched._calculate_single_rank_operations(r) if a is not None and a.is_compute_op]
            for r in range(p)}


def our_order(schedule) -> dict[int, list[str]]:
    return {r: [str(a) for a in acts] for r, acts in enumerate(schedule.actions)}


def flat(schedule):
    """The schedule with its overlapped pairs written out: what validate, play and the runtime read."""
    if isinstance(schedule, VSchedule):
        return type(schedule)(schedule.num_ranks, schedule.num_microbatches, actions=schedule.expanded())
    return schedule


@pytest.mark.parametrize("p,m", SIZES)
def test_zbv_plans_torchs_order_and_is_valid(p, m):
    ours = ScheduleZBV(p, m)
    assert our_order(ours) == torch_order(torch_schedules().ScheduleZBVZeroBubble, p, m)
    validate(flat(ours))


@pytest.mark.parametrize("p,m", SIZES)
def test_dualpipev_plans_torchs_order_or_refuses_as_torch_does(p, m):
    if m < 2 * p:  # torch's constructor refuses fewer micro-batches than stages, and so do we
        with pytest.raises(ValueError, match=f"num_microbatches >= {2 * p}"):
            ScheduleDualPipeV(p, m)
        return
    ours = ScheduleDualPipeV(p, m)
    assert our_order(ours) == torch_order(torch_schedules().ScheduleDualPipeV, p, m)
    assert any(isinstance(a, Overlap) for acts in ours.actions for a in acts)
    validate(flat(ours))


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", SIZES)
def test_looped_bfs_plans_torchs_order_and_is_valid(p, m, v):
    ours = ScheduleLoopedBFS(p, m, v)
    assert our_order(ours) == torch_order(torch_schedules().ScheduleLoopedBFS, p, m, v)
    validate(ours)


def test_a_v_places_the_first_and_last_stage_on_rank_0_and_the_turn_on_the_last_rank():
    s = ScheduleZBV(4, 8)
    assert [s.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [s.rank_of(stage) for stage in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_a_v_with_other_than_two_stages_per_rank_is_refused():
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        ScheduleZBV(2, 4, stages_per_rank=3)


def stages_of_model(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(num_stages)]


def step_worker(ctx, schedule, stages, x, y):
    modules = {s: stages[s] for s in schedule.stages_of(ctx.rank)}
    step = run_step(ctx, schedule, modules, nn.MSELoss(), x, y, message_specs(stages, x, schedule.num_microbatches))
    return {s: [p.grad for p in m.parameters()] for s, m in modules.items()}, [float(l) for l in step.losses]


@pytest.mark.parametrize("make", [ScheduleZBV, ScheduleDualPipeV, lambda p, m: ScheduleLoopedBFS(p, m, 2)],
                         ids=["zb-v", "dualpipev", "looped-bfs"])
@pytest.mark.parametrize("p", [2, 4])
def test_runs_on_real_ranks_like_one_process(make, p):
    m = 2 * p
    schedule = flat(make(p, m))
    stages = stages_of_model(schedule.num_stages)
    x, y = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
    reference = copy.deepcopy(nn.Sequential(*stages))
    losses = [nn.MSELoss()(reference(xs), ys).item() for xs, ys in zip(x.chunk(m), y.chunk(m))]
    nn.MSELoss()(reference(x), y).backward()
    results = spawn(step_worker, p, schedule, stages, x, y)
    grads = {s: g for per_rank, _ in results for s, g in per_rank.items()}
    for s in range(schedule.num_stages):
        for got, want in zip(grads[s], reference[s].parameters()):
            torch.testing.assert_close(got, want.grad, atol=1e-6, rtol=1e-5)
    last_rank = schedule.rank_of(schedule.num_stages - 1)
    assert results[last_rank][1] == pytest.approx(losses, abs=1e-6)


def test_the_lesson_checks_against_one_process_and_torchs_own_zbv_and_dualpipev():
    from pipelab.experiments import v_schedules as vx

    run = vx.run(vx.Config(world_size=2, num_microbatches=4, layers=4, batch=8, width=16, steps=1,
                           emulate="2xH100-nvlink"))
    assert vx.same_as_one_process(run)[1] == "same"
    assert run["ZB-V"].torch_loss_difference == 0.0 and run["DualPipeV"].torch_loss_difference == 0.0
    assert max(run["DualPipeV"].stash_peak.values()) == 2 * 2 + 1  # the README's PP + 1 chunks
    rows = {r["schedule"]: r for r in vx.bubble_times(run)}
    assert rows["DualPipeV"]["run (ms)"] < rows["ZB-H1"]["run (ms)"] < rows["1F1B"]["run (ms)"]
    # the published formulas, named as DeepSeek-V3's Table 2 and the DualPipe README print them
    assert rows["ZB-H1"]["published"] == "ZB1P: (PP-1)(F+B-2W)" and rows["ZB-V"]["published"] == "-"
    key, _, text, figures = vx.published_verdict(run)
    assert key == "13.published_DualPipeV_p2" and "(PP/2-1)(F&B+B-3W)" in text
    assert figures["ratio"] == pytest.approx(rows["DualPipeV"]["run (ms)"] / rows["DualPipeV"]["formula (ms)"])


@pytest.mark.parametrize("bad,match", [(dict(num_microbatches=2), "num_microbatches >= 4"),
                                       (dict(layers=6), "layers=6 does not divide evenly"),
                                       (dict(schedules=("1F1B", "ZB-X")), "schedules must be some of"),
                                       (dict(world_size=1), "at least 2 ranks")])
def test_the_lesson_refuses_what_its_schedules_cannot_run(bad, match):
    from pipelab.experiments import v_schedules as vx

    with pytest.raises(ValueError, match=match):
        vx.Config(**bad)


class _Context:
    """What a stage runner needs of a rank with one stage and no peers."""

    def __init__(self):
        from pipelab.timeline import Recorder

        self.rank, self.world_size, self.device, self.rec = 0, 1, torch.device("cpu"), Recorder(0)


def test_after_i_a_stage_keeps_only_each_layers_input_and_output_gradient():
    from pipelab.pipeline.p2p import P2P
    from pipelab.pipeline.schedules import ScheduleZeroBubble
    from pipelab.pipeline.stage import StageRunner

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    reference = copy.deepcopy(stage)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    schedule = ScheduleZeroBubble(1, 1)
    ctx = _Context()
    runner = StageRunner(ctx, schedule, {0: stage}, nn.MSELoss(), P2P(ctx, schedule, [[]]), [x], [y])
    runner.F(0, 0)
    runner.I(0, 0)
    st = runner.stash[0, 0]
    assert st.outputs is None and all(layer.output is None for layer in st.layers)  # the graph is gone
    activation = 4 * 8 * 4  # one (4, 8) float32 tensor
    assert st.nbytes == 2 * 2 * activation - activation  # 2 inputs (x is the batch: not stash) + 2 gradients
    runner.W(0, 0)
    nn.MSELoss()(reference(x), y).backward()
    for got, want in zip(stage.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad)

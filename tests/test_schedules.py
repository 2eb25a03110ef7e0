"""Schedules: every built-in schedule is valid, matches the order torch.distributed.pipelining
uses, and the validator rejects broken ones."""

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from pipelab.pipeline.schedules import (B, F, I, W, Action, Schedule, Schedule1F1B, ScheduleError,
                                        ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZeroBubble,
                                        dependencies, make_schedule, messages_per_step, play,
                                        validate)

SIZES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 6, 8, 12)]


def torch_order(cls, p: int, m: int, v: int | None = None) -> dict[int, list[str]]:
    """The per-rank compute actions torch's schedule class plans, asked without running it."""
    sched = object.__new__(cls)  # no stages or process group needed to compute the order
    sched._num_stages, sched._n_microbatches = p, m
    if v is None:
        order = cls._get_pipeline_order(sched)
    else:
        sched.pp_group_size, sched.n_local_stages = p, v
        sched.number_of_rounds = max(1, m // p)
        sched.microbatches_per_round = m // sched.number_of_rounds
        order = {r: sched._calculate_single_rank_operations(r) for r in range(p)}
    return {r: [str(a) for a in acts if a is not None and a.is_compute_op] for r, acts in order.items()}


def our_order(schedule: Schedule) -> dict[int, list[str]]:
    # Same notation as torch, kinds included: F, B (full backward), I (input gradient), W (weights).
    return {r: [str(a) for a in acts] for r, acts in enumerate(schedule.actions)}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("p,m", SIZES)
def test_builtin_schedules_are_valid(name, p, m):
    schedule = make_schedule(name, p, m)
    validate(schedule)
    assert schedule.num_stages == p


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", SIZES)
def test_interleaved_is_valid_or_refused_with_a_reason(p, m, v):
    rounds = max(1, m // p)
    if m % rounds:
        with pytest.raises(ValueError, match=f"num_microbatches={m}"):
            ScheduleInterleaved1F1B(p, m, v)
    else:
        validate(ScheduleInterleaved1F1B(p, m, v))


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_order_equals_torch(p, m):
    assert our_order(ScheduleGPipe(p, m)) == torch_order(torch_schedules.ScheduleGPipe, p, m)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m >= p])
def test_1f1b_order_equals_torch_plan(p, m):
    # torch's plan for 1F1B (pipeline_order) misnumbers the last rank's forwards (it starts at
    # micro-batch 1); its executed order, which the runtime test records, is right for every rank.
    ours, theirs = our_order(Schedule1F1B(p, m)), torch_order(torch_schedules.Schedule1F1B, p, m)
    for rank in range(p - 1):
        assert ours[rank] == theirs[rank]


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if p > 1 and m % max(1, m // p) == 0])
def test_interleaved_order_equals_torch(p, m, v):
    ours = our_order(ScheduleInterleaved1F1B(p, m, v))
    assert ours == torch_order(torch_schedules.ScheduleInterleaved1F1B, p, m, v)


@pytest.mark.parametrize("p,m", SIZES)
def test_zero_bubble_order_equals_torch_with_one_stage_per_rank(p, m):
    assert our_order(ScheduleZeroBubble(p, m)) == torch_order(torch_schedules.ScheduleInterleavedZeroBubble, p, m, 1)


def test_1f1b_bounds_warmup_forwards_by_distance_to_the_end():
    s = Schedule1F1B(4, 8)
    for rank, actions in enumerate(s.actions):
        first_b = next(i for i, a in enumerate(actions) if a.kind == "B")
        assert first_b == 4 - rank  # p - rank forwards before the first backward


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 4)])
def test_messages_per_step_is_two_per_boundary_and_micro_batch(p, m):
    # Every stage boundary crosses ranks: an activation forward and a gradient back per micro-batch.
    for name in ("gpipe", "1f1b", "zb-h1"):
        assert messages_per_step(make_schedule(name, p, m)) == 2 * m * (p - 1)
    for v in (2, 3):
        interleaved = make_schedule("interleaved", p, m, v)
        assert messages_per_step(interleaved) == 2 * m * (v * p - 1)  # (vp-1)/(p-1) times 1F1B's, not v
    assert messages_per_step(make_schedule("1f1b", 1, m)) == 0


def test_zero_bubble_stashes_p_micro_batches_on_every_rank_and_1f1b_p_minus_rank():
    # Live from F to the action that frees the stash: B for 1F1B, W for ZB-H1 (rank r holds back r W's).
    from pipelab.pipeline.simulate import simulate

    p, m = 4, 8
    assert simulate(make_schedule("1f1b", p, m)).peak_stash == {r: p - r for r in range(p)}
    assert simulate(make_schedule("zb-h1", p, m)).peak_stash == {r: p for r in range(p)}


def test_validator_rejects_a_missing_backward():
    good = ScheduleGPipe(2, 2).actions
    broken = [good[0], [a for a in good[1] if a != B(1, 1)]]
    with pytest.raises(ScheduleError, match="1B1 appears 0 times"):
        validate(Schedule(2, 2, actions=broken))


def test_validator_rejects_a_repeated_forward():
    good = ScheduleGPipe(2, 2).actions
    with pytest.raises(ScheduleError, match="0F0 appears 2 times"):
        validate(Schedule(2, 2, actions=[[F(0, 0)] + good[0], good[1]]))


def test_validator_rejects_a_stage_on_the_wrong_rank():
    good = ScheduleGPipe(2, 1).actions
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate(Schedule(2, 1, actions=[good[0] + [F(1, 0)], good[1]]))


def test_validator_rejects_a_deadlock():
    # Rank 0 waits for the gradient of micro-batch 1 before sending micro-batch 1's activation.
    actions = [[F(0, 0), B(0, 1), F(0, 1), B(0, 0)], [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]]
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(Schedule(2, 2, actions=actions))


def test_validator_rejects_backward_before_forward_on_one_rank():
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(Schedule(1, 1, actions=[[B(0, 0), F(0, 0)]]))


def test_validator_wants_one_b_or_one_i_and_one_w():
    validate(Schedule(1, 1, actions=[[F(0, 0), I(0, 0), W(0, 0)]]))
    with pytest.raises(ScheduleError, match="0W0 appears 0 times"):
        validate(Schedule(1, 1, actions=[[F(0, 0), I(0, 0)]]))
    with pytest.raises(ScheduleError, match="0I0 appears 0 times"):
        validate(Schedule(1, 1, actions=[[F(0, 0), W(0, 0)]]))
    with pytest.raises(ScheduleError, match="0B0 and 0W0 both appear"):
        validate(Schedule(1, 1, actions=[[F(0, 0), B(0, 0), W(0, 0)]]))
    with pytest.raises(ScheduleError, match="is not an action"):
        validate(Schedule(1, 1, actions=[[F(0, 0), Action("X", 0, 0)]]))


def test_validator_rejects_a_weight_gradient_before_its_input_gradient():
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(Schedule(1, 1, actions=[[F(0, 0), W(0, 0), I(0, 0)]]))


def test_a_stage_may_mix_full_and_split_backwards():
    # Stage 1 splits micro-batch 0's backward; stage 0's B(0, 0) then waits for I(1, 0), not B(1, 0).
    actions = [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), I(1, 0), F(1, 1), B(1, 1), W(1, 0)]]
    schedule = Schedule(2, 2, actions=actions)
    validate(schedule)
    assert schedule.split_backwards() == {(1, 0)}
    assert dependencies(B(0, 0), 2, schedule.split_backwards()) == [F(0, 0), I(1, 0)]
    assert dependencies(B(0, 1), 2, schedule.split_backwards()) == [F(0, 1), B(1, 1)]
    assert dependencies(W(1, 0), 2) == [I(1, 0)]


def test_play_runs_each_action_after_its_dependencies_and_its_rank_predecessors():
    schedule = make_schedule("interleaved", 2, 4)
    played = list(play(schedule))
    everything = [str(a) for acts in schedule.actions for a in acts]
    assert sorted(str(a) for _, a, _ in played) == sorted(everything)
    when = {a: i for i, (_, a, _) in enumerate(played)}
    for rank, a, deps in played:
        assert schedule.rank_of(a.stage) == rank
        assert all(when[d] < when[a] for d in deps)
    for acts in schedule.actions:
        assert [when[a] for a in acts] == sorted(when[a] for a in acts)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        make_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="num_microbatches must be"):
        ScheduleGPipe(2, 0)
    with pytest.raises(ValueError, match="num_ranks must be"):
        ScheduleInterleaved1F1B(True, 4)
    with pytest.raises(ValueError, match="cannot take num_microbatches=5"):
        make_schedule("interleaved", 2, 5)

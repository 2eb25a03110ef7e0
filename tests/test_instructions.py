"""The DeepSpeed instruction stream for small pipelines, against tables worked out by hand, and
lowered to actions: DeepSpeed's TrainSchedule is 1F1B."""
import pytest

from pipelab.pipeline import instructions
from pipelab.pipeline.instructions import (BackwardPass, ForwardPass, InferenceSchedule, Instruction,
                                           LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad,
                                           ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
                                           TrainSchedule, format_instruction_table, to_actions)
from pipelab.pipeline.schedules import B, F, Schedule1F1B, ScheduleError, validate
from pipelab.pipeline.simulate import simulate

END = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def test_train_two_stages_two_micro_batches():
    first = list(TrainSchedule(2, 2, 0).steps())
    assert first == [
        [LoadMicroBatch(0), ForwardPass(0)],
        [SendActivation(0)],
        [LoadMicroBatch(1), ForwardPass(1)],
        [RecvGrad(0), SendActivation(1), BackwardPass(0)],
        [],
        [RecvGrad(1), BackwardPass(1)] + END,
    ]
    last = list(TrainSchedule(2, 2, 1).steps())
    assert last == [
        [],
        [RecvActivation(0), LoadMicroBatch(0), ForwardPass(0)],
        [BackwardPass(0)],
        [SendGrad(0), RecvActivation(1), LoadMicroBatch(1), ForwardPass(1)],
        [BackwardPass(1)],
        [SendGrad(1)] + END,
    ]


def test_train_middle_of_three_stages():
    # Stage 1 of 3 computes forwards on odd steps and backwards on even ones; two buffers.
    assert TrainSchedule(2, 3, 1).num_pipe_buffers() == 2
    assert list(TrainSchedule(2, 3, 1).steps()) == [
        [],
        [RecvActivation(0), ForwardPass(0)],
        [SendActivation(0)],
        [RecvActivation(1), ForwardPass(1)],
        [RecvGrad(0), SendActivation(1), BackwardPass(0)],
        [SendGrad(0)],
        [RecvGrad(1), BackwardPass(1)],
        [SendGrad(1)] + END,
    ]


def test_buffers_and_printing():
    assert [TrainSchedule(8, 4, s).num_pipe_buffers() for s in range(4)] == [4, 3, 2, 2]
    assert repr(ForwardPass(1)) == "ForwardPass(buffer_id=1)" and str(ForwardPass(1)) == "ForwardPass(1)"
    assert ForwardPass(1).kwargs == {"buffer_id": 1} and OptimizerStep().kwargs == {}
    table = format_instruction_table(TrainSchedule, 4, 2).splitlines()
    assert table[0].split() == ["step", "stage", "0", "stage", "1"]
    assert len(table) == 2 + 2 * (4 + 2 - 1)
    assert table[2].split() == ["0", "LoadMicroBatch(0),", "ForwardPass(0)", "-"]


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (3, 5), (4, 4), (4, 2)])
def test_every_micro_batch_runs_forward_then_backward_once_per_stage(stages, micro_batches):
    for s in range(stages):
        sched = TrainSchedule(micro_batches, stages, s)
        flat = [c for step in sched.steps() for c in step]
        fwd = [c for c in flat if isinstance(c, ForwardPass)]
        bwd = [c for c in flat if isinstance(c, BackwardPass)]
        assert len(fwd) == len(bwd) == micro_batches
        assert all(c.buffer_id < sched.num_pipe_buffers() for c in flat if c.buffer_id is not None)
        # Sends on one stage pair up with receives on its neighbour, in the same order.
        if s + 1 < stages:
            nxt = [c for step in TrainSchedule(micro_batches, stages, s + 1).steps() for c in step]
            assert sum(isinstance(c, SendActivation) for c in flat) == \
                   sum(isinstance(c, RecvActivation) for c in nxt) == micro_batches
            assert sum(isinstance(c, RecvGrad) for c in flat) == \
                   sum(isinstance(c, SendGrad) for c in nxt) == micro_batches


def test_inference_two_stages():
    assert list(InferenceSchedule(3, 2, 0).steps()) == [
        [LoadMicroBatch(0), ForwardPass(0)],
        [LoadMicroBatch(1), SendActivation(0), ForwardPass(1)],
        [LoadMicroBatch(0), SendActivation(1), ForwardPass(0)],
        [SendActivation(0)],
    ]
    assert list(InferenceSchedule(3, 2, 1).steps()) == [
        [],
        [LoadMicroBatch(0), RecvActivation(0), ForwardPass(0)],
        [LoadMicroBatch(1), RecvActivation(1), ForwardPass(1)],
        [LoadMicroBatch(0), RecvActivation(0), ForwardPass(0)],
    ]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="stage_id=2"):
        TrainSchedule(4, 2, 2)
    with pytest.raises(ValueError, match="micro_batches must be"):
        TrainSchedule(0, 2, 0)


@pytest.mark.parametrize("stages", range(1, 7))
@pytest.mark.parametrize("micro_batches", range(1, 13))
def test_train_schedule_lowers_to_1f1b(stages, micro_batches):
    lowered = to_actions(micro_batches, stages)
    assert lowered.name == "DeepSpeed TrainSchedule"
    validate(lowered)
    assert lowered.actions == Schedule1F1B(stages, micro_batches).actions


def test_lowering_maps_buffer_ids_back_to_micro_batches():
    # Stage 0 of 2 has two buffers: micro-batch 2 reuses buffer 0, after micro-batch 0's backward.
    assert to_actions(4, 2).actions[0] == [F(0, 0), F(0, 1), B(0, 0), F(0, 2), B(0, 1), F(0, 3),
                                           B(0, 2), B(0, 3)]
    sim = simulate(to_actions(4, 2))
    assert sim.makespan_ms == simulate(Schedule1F1B(2, 4)).makespan_ms


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (3, 5), (4, 8), (5, 3)])
def test_each_instruction_notes_the_micro_batch_its_buffer_holds(stages, micro_batches):
    lowered = to_actions(micro_batches, stages)  # buffer ids mapped back to micro-batches
    for s in range(stages):
        sched = TrainSchedule(micro_batches, stages, s)
        flat = [c for step in sched.steps() for c in step if c.buffer_id is not None]
        assert all(c.buffer_id == c.micro_batch % sched.num_pipe_buffers() for c in flat)
        computed = [(type(c), c.micro_batch) for c in flat if isinstance(c, (ForwardPass, BackwardPass))]
        assert computed == [(ForwardPass if a.kind == "F" else BackwardPass, a.mb) for a in lowered.actions[s]]
    # The micro-batch is a note for tables: DeepSpeed's instructions compare and print without it.
    noted = ForwardPass(0, micro_batch=2)
    assert noted == ForwardPass(0) and repr(noted) == "ForwardPass(buffer_id=0)" and noted.kwargs == {"buffer_id": 0}


def test_table_with_micro_batches_tells_buffer_ids_from_micro_batches():
    table = format_instruction_table(TrainSchedule, 4, 2, show_micro_batches=True).splitlines()
    # Step 4 of stage 0: micro-batch 2 goes into buffer 0, which micro-batch 0 freed at step 3.
    assert table[2 + 4].split()[:5] == ["4", "LoadMicroBatch(0)", "mb2,", "ForwardPass(0)", "mb2"]
    assert "RecvGrad(0) mb0" in table[2 + 3] and "OptimizerStep()" in table[-1]
    inference = format_instruction_table(InferenceSchedule, 3, 2, show_micro_batches=True)
    assert "ForwardPass(0) mb2" in inference


def test_inference_lowers_to_forwards_only():
    lowered = to_actions(3, 2, InferenceSchedule)
    assert lowered.actions == [[F(0, 0), F(0, 1), F(0, 2)], [F(1, 0), F(1, 1), F(1, 2)]]
    with pytest.raises(ScheduleError, match="0B0 appears 0 times"):
        validate(lowered)


def test_every_instruction_says_roughly_what_it_does_in_torch():
    kinds = [c for c in vars(instructions).values()
             if isinstance(c, type) and issubclass(c, Instruction) and c is not Instruction]
    assert len(kinds) == 10
    for cls in kinds:
        assert "roughly: `" in cls.__doc__, cls.__name__


def test_matches_deepspeed_schedule():
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for S, M in [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (5, 3)]:
        for s in range(S):
            for ours_cls, theirs_cls in ((TrainSchedule, ds.TrainSchedule), (InferenceSchedule, ds.InferenceSchedule)):
                ours, theirs = ours_cls(M, S, s), theirs_cls(M, S, s)
                assert ours.num_pipe_buffers() == theirs.num_pipe_buffers()
                assert [[repr(c) for c in step] for step in ours.steps()] == \
                       [[repr(c) for c in step] for step in theirs.steps()], (ours_cls.__name__, S, M, s)

"""The DeepSpeed instruction stream for small pipelines, against tables worked out by hand."""
import pytest

from pipelab.pipeline.instructions import (BackwardPass, ForwardPass, InferenceSchedule,
                                           LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad,
                                           ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
                                           TrainSchedule)

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


def test_bad_stage_id_raises():
    with pytest.raises(ValueError, match="stage_id=2"):
        TrainSchedule(4, 2, 2)


def test_matches_deepspeed_schedule():
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for S, M in [(2, 4), (3, 5), (4, 8)]:
        for s in range(S):
            ours = [[repr(c) for c in step] for step in TrainSchedule(M, S, s).steps()]
            theirs = [[repr(c) for c in step] for step in ds.TrainSchedule(M, S, s).steps()]
            assert ours == theirs

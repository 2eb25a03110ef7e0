"""Lesson 07: one rank's 1F1B actions. num_ranks - rank forwards fill the pipe, then one backward
and one forward alternate, then the backwards drain it. With fewer micro-batches than stages the
pipe never fills: refuse it, naming both numbers and the fix (torch's schedules refuse it too)."""

from pipelab.pipeline.actions import B, F


def my_1f1b_actions(rank, num_ranks, num_microbatches):
    if num_microbatches < num_ranks:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: got num_microbatches="
                         f"{num_microbatches} for {num_ranks} stages; use num_microbatches >= {num_ranks}")
    warmup = num_ranks - rank
    actions = [F(rank, mb) for mb in range(warmup)]
    for mb in range(num_microbatches):
        actions.append(B(rank, mb))
        if warmup + mb < num_microbatches:
            actions.append(F(rank, warmup + mb))
    return actions

"""The lessons' graded exercises: one checker per exercise, called in the cell after the student's.

    grade = exercises.check_ddp_average(my_average)    # prints PASS/FAIL and why; returns a Grade

A checker runs the student's function on real ranks where the lesson is multi-process (never
hanging: a rank stuck on a message stops and names it), records what each rank asked of
torch.distributed, compares with the single-process reference, and answers in a line or two
computed from the run. `solution("01_ddp_average")` loads the worked solution from `solutions/`
(notebooks do with `solutions = True`, as CI does); `EXERCISES` lists them; `grading` grades a
folder of submitted notebooks; `assignment` writes a lesson's exercises as an nbgrader assignment.

How an exercise is written (lessons 14 and later follow the same convention):

- The name is `NN_topic` (NN the lesson). `solutions/NN_topic.py` holds a worked solution: a
  module docstring saying why it is right, and exactly one function `my_...`. `EXERCISES` maps the
  name to (that function's name, its checker).
- The checker is `@checker("NN_topic") def check_topic(my_fn) -> str`: it returns the pass message
  and raises `Wrong(message)` on a wrong answer. The message names the class of mistake the check
  detected (scale, layout, order, a missing part, a temporary, a wrong group, an input changed in
  place, a request never waited for); where it cannot tell, it shows what differs and where
  (`how_far`), without guessing. The task's own requirement is checked, not only the numbers.
- On ranks: `on_ranks(body, world_size, my_fn, ...)` runs `body(ctx, my_fn, ...)` under NCCL's
  rule; inside, call the student's function through `student_call(ctx, my_fn, *args, refuse=...)`,
  which records every torch.distributed call (`recorder.Recorder`: op, peer, group, tensor), starts
  sends late, fails a request never waited for, and lets `refuse(call)` stop a call the task
  forbids (a collective in a send/receive exercise, a wrong group) before it can deadlock. Return
  plain data from the ranks (tensors, op names), judge in the checker. Races are forced, not
  hoped for (hold a stream, land copies late) so a wrong answer fails every run.
- Inputs the caller keeps are passed as they are and checked with `unchanged(...)` afterwards.
- In the lesson notebook: a markdown cell `## Exercise: ...` (task; a `<details><summary>Hint`
  cell may follow the student cell), the student cell tagged `student` with metadata
  `{"pipelab": {"exercise": "NN_topic"}}` whose function body is `raise NotImplementedError("your
  code here")` (or a line `# your code here` to complete), then the checker cell with metadata
  `{"pipelab": {"exercise": "NN_topic", "points": P}}`:
  `if solutions: my_fn = exercises.solution("NN_topic")` / `grade = exercises.check_topic(my_fn)` /
  `assert grade.passed or not solutions, grade.message`. Only cells a student writes are tagged
  `student`.
- tests/exercise_answers.py holds at least four wrong answers per exercise (with the words their
  message must contain) and one right answer written otherwise; benchmarks/exercise_sweep.py runs
  each five times.
"""

from pipelab.exercises.capstone import check_perplexity, check_split_point
from pipelab.exercises.context_parallel import check_online_softmax_merge
from pipelab.exercises.core import Grade, solution, solution_text
from pipelab.exercises.expert_parallel import check_dispatch
from pipelab.exercises.devices import check_event_wait, check_naive_forward, check_split_forward
from pipelab.exercises.debug import check_find_the_bug
from pipelab.exercises.data_parallel import (check_broadcast, check_ddp_average, check_grid_groups,
                                             check_row_parallel, check_zero2_shard)
from pipelab.exercises.p2p import check_send_recv_order
from pipelab.exercises.pipeline import (check_accumulation, check_few_microbatches, check_partition, check_split_backward,
                                        check_tied_weights)
from pipelab.exercises.precision import check_loss_scale_update

# exercise name (its solution's file) -> (the function the student writes, its checker)
EXERCISES = {
    "00_broadcast": ("my_broadcast", check_broadcast),
    "01_ddp_average": ("my_average", check_ddp_average),
    "02_naive_forward": ("my_forward_naive", check_naive_forward),
    "03_split_forward": ("my_forward_pipelined", check_split_forward),
    "04_event_wait": ("my_dual_stream", check_event_wait),
    "05_grid_groups": ("my_grid_groups", check_grid_groups),
    "06_accumulation": ("my_backward", check_accumulation),
    "07_few_microbatches": ("my_1f1b_actions", check_few_microbatches),
    "07_send_recv_order": ("my_pipeline_loop", check_send_recv_order),
    "08_partition": ("my_partition", check_partition),
    "08_tied_weights": ("my_tied_grads", check_tied_weights),
    "09_split_point": ("my_split_point", check_split_point),
    "10_perplexity": ("my_perplexity", check_perplexity),
    "11_zero2_shard": ("my_gradient_shard", check_zero2_shard),
    "12_row_parallel": ("my_row_parallel", check_row_parallel),
    "13_split_backward": ("my_split_backward", check_split_backward),
    "14_online_softmax_merge": ("my_merge", check_online_softmax_merge),
    "15_dispatch": ("my_dispatch", check_dispatch),
    "16_loss_scale_update": ("my_update_scale", check_loss_scale_update),
    "17_find_the_bug": ("my_step", check_find_the_bug),
}

__all__ = ["EXERCISES", "Grade", "solution", "solution_text", *(c.__name__ for _, c in EXERCISES.values())]

"""The graded exercises: every checker passes its solution (solutions/) and fails a typical wrong
answer with the message that names the mistake; `pipelab exercises` lists and grades notebooks."""

from __future__ import annotations

import csv
import math

import nbformat
import pytest
import torch
import torch.distributed as dist

from pipelab import exercises
from pipelab.cli import main
from pipelab.exercises.debug import broken_step
from pipelab.model_parallel import cut_shape, second_half
from pipelab.pipeline.schedules import Schedule1F1B


@pytest.mark.parametrize("name", list(exercises.EXERCISES))
def test_every_checker_passes_its_solution(name):
    function, check = exercises.EXERCISES[name]
    fn = exercises.solution(name)
    assert fn.__name__ == function
    grade = check(fn, quiet=True)
    assert grade.passed, grade.message


# ---- typical wrong answers, one or more per exercise --------------------------------------------


def broadcast_from_rank0(ctx, tensor, src):  # assumes src is rank 0, sends to one peer only
    if ctx.rank == 0:
        dist.send(tensor, dst=1)
    else:
        dist.recv(tensor, src=0)


def average_divided_twice(params, world_size):
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= world_size * world_size


def average_not_written(params, world_size):
    raise NotImplementedError("your code here")


def forward_on_one_device(model, x, devs):
    return devs[0].stream("compute").submit(model, devs[0].own(x)).result()


def pipelined_drops_remainder(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i in range(len(x) // split_size):
        h = s0.submit(model.seq1, devs[0].own(x[i * split_size:(i + 1) * split_size]), kind="F", mb=i)
        outs.append(s1.submit(second_half, model, s1.copy(h, mb=i), kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


def dual_stream_without_event(model, x, devs, split_size):
    s0, s1, copy_stream = devs[0].stream("compute"), devs[1].stream("compute"), devs[1].stream("copy")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        buf = copy_stream.empty(cut_shape(model, xs), xs.dtype, fill=float("nan"))
        copy_stream.copy(h, out=buf, mb=i)
        outs.append(s1.submit(second_half, model, buf, kind="F", mb=i))
    return torch.cat([o.result() for o in outs])


def groups_pipe_fastest(pipe, data):
    return {"pipe": [[s * data + r for r in range(data)] for s in range(pipe)],
            "data": [[s * data + r for s in range(pipe)] for r in range(data)]}


def backward_divided_on_every_stage(output, grad_output, num_microbatches):
    (output / num_microbatches).backward(grad_output)


def one_f_one_b_accepting_anything(rank, num_ranks, num_microbatches):
    return Schedule1F1B(num_ranks, num_microbatches).rank_actions(rank)


def gpipe_order_deadlocks(rank, num_microbatches, stage, send, recv):
    if rank == 0:
        for mb in range(num_microbatches):
            send("activation", mb, stage.forward(mb))
        for mb in range(num_microbatches):
            stage.backward(mb, recv("gradient", mb))
    else:
        for mb in range(num_microbatches):
            stage.forward(mb, recv("activation", mb))
            send("gradient", mb, stage.backward(mb))


def partition_by_layer_count(weights, num_stages):
    k = len(weights) // num_stages
    return [i * k for i in range(num_stages)] + [len(weights)]


def tied_grads_averaged(weight, group):
    dist.all_reduce(weight.grad, op=dist.ReduceOp.AVG, group=group)


def split_in_the_middle(model):
    return "blocks.1"


def perplexity_mean_of_means(mb_losses, mb_tokens):
    return math.exp(sum(mb_losses) / len(mb_losses))


def shard_summed_not_averaged(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size)
    dist.reduce_scatter_single(shard, flat_grad)
    return shard


def row_parallel_bias_on_every_rank(x_shard, weight_shard, bias):
    partial = x_shard @ weight_shard.T + bias
    dist.all_reduce(partial)
    return partial


def loss_scale_doubled_on_overflow(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale * 2, 0
    return (scale * 2, 0) if good_steps + 1 == growth_interval else (scale, good_steps + 1)


def split_backward_all_at_once(output, x, weights, grad_output):
    output.backward(grad_output)
    return x.grad, lambda: None


def split_backward_graph_freed(output, x, weights, grad_output):
    (x_grad,) = torch.autograd.grad(output, [x], grad_output)
    return x_grad, lambda: torch.autograd.grad(output, weights, grad_output)


def merge_by_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def dispatch_even_split(rows, expert, experts_per_rank):
    out = torch.empty_like(rows)
    dist.all_to_all_single(out, rows[torch.argsort(expert, stable=True)])
    return out


WRONG = [
    ("00_broadcast", broadcast_from_rank0, ["deadlock", "rank 2 waits for its receive from rank 0"]),
    ("01_ddp_average", average_divided_twice, ["rank 0, parameter 0.weight", "0.50x the reference",
                                               "divided by the world size twice"]),
    ("01_ddp_average", average_not_written, ["average_not_written is not written yet (your code here)"]),
    ("02_naive_forward", forward_on_one_device, ["device cpu:1 ran no forward"]),
    ("03_split_forward", pipelined_drops_remainder, ["8 rows where the batch has 10", "last, shorter split"]),
    ("04_event_wait", dual_stream_without_event, ["read-after-write race", "Event recorded"]),
    ("05_grid_groups", groups_pipe_fastest, ["pipe=2 x data=2", "should be [[0, 2], [1, 3]]", "data-fastest"]),
    ("06_accumulation", backward_divided_on_every_stage, ["rank 0 (stage 0)", "0.25x the reference",
                                                          "divided by the micro-batch count on every stage"]),
    ("07_few_microbatches", one_f_one_b_accepting_anything, ["accepted 2 micro-batch(es) on 4 ranks"]),
    ("07_send_recv_order", gpipe_order_deadlocks, ["ranks 0 and 1 wait on each other", "rank 0 waits to send activation 1",
                                                   "rank 1 waits to send gradient 0"]),
    ("08_partition", partition_by_layer_count, ["stages [10, 55, 35]", "the best split's heaviest holds 50"]),
    ("08_tied_weights", tied_grads_averaged, ["0.50x the reference", "SUM of the stages' parts"]),
    ("09_split_point", split_in_the_middle, ["1,344 and 4,224 parameters", "heaviest stage holds 3,168"]),
    ("10_perplexity", perplexity_mean_of_means, ["mean loss", "weight each loss by its tokens ([24, 24, 12])"]),
    ("11_zero2_shard", shard_summed_not_averaged, ["2.00x the reference", "divide by the world size"]),
    ("12_row_parallel", row_parallel_bias_on_every_rank, ["plus 1x the bias", "added 2 times"]),
    ("13_split_backward", split_backward_all_at_once, ["after I, 0.weight already has its gradient"]),
    ("13_split_backward", split_backward_graph_freed, ["W raised RuntimeError", "retain_graph=True"]),
    ("14_online_softmax_merge", merge_by_average, ["plain average", "exp(L_a - L)"]),  # more in test_context_parallel
    ("16_loss_scale_update", loss_scale_doubled_on_overflow, ["you doubled the scale", "halve it"]),
    ("15_dispatch", dispatch_even_split, ["an even split", "[6, 6]", "exchanged first"]),
    ("17_find_the_bug", broken_step, ["last micro-batch only"]),  # more wrong answers: tests/test_debug.py
]


def test_every_exercise_has_a_wrong_answer():
    assert {name for name, _, _ in WRONG} == set(exercises.EXERCISES)


@pytest.mark.parametrize("name, wrong, expected", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_a_wrong_answer_fails_with_its_message(name, wrong, expected, capsys):
    grade = exercises.EXERCISES[name][1](wrong)
    assert not grade.passed
    for text in expected:
        assert text in grade.message, grade.message
    assert str(grade) in capsys.readouterr().out  # the checker prints its verdict


def test_a_missing_solution_is_named():
    with pytest.raises(ValueError, match="no solution '99_nothing'"):
        exercises.solution("99_nothing")


# ---- the instructor's view ----------------------------------------------------------------------


def submitted(path, body: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import math\nfrom pipelab import exercises", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(f"def my_perplexity(mb_losses, mb_tokens):\n{body}",
                                          metadata={"tags": ["student"]}),
                nbformat.v4.new_code_cell("exercises.check_perplexity(my_perplexity)")]
    nbformat.write(nb, str(path))


def test_cli_lists_the_exercises_per_lesson(capsys):
    assert main(["exercises"]) == 0
    out = capsys.readouterr().out
    for name, (function, _) in exercises.EXERCISES.items():
        assert f"lesson {name[:2]}  {name}" in out and function in out


def test_cli_grades_a_folder_into_a_table_and_csv(tmp_path, capsys):
    folder = tmp_path / "submissions"
    folder.mkdir()
    submitted(folder / "ada.ipynb", "    return math.exp(sum(l * n for l, n in zip(mb_losses, mb_tokens)) / sum(mb_tokens))")
    submitted(folder / "bob.ipynb", "    return math.exp(sum(mb_losses) / len(mb_losses))")
    assert main(["exercises", "grade", str(folder), "--csv", str(tmp_path / "grades.csv")]) == 0
    out = capsys.readouterr().out
    assert "ada" in out and "bob" in out and "FAIL" in out
    with open(tmp_path / "grades.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert rows["ada"]["exercise"] == rows["bob"]["exercise"] == "10_perplexity"
    assert rows["ada"]["passed"] == "pass" and rows["bob"]["passed"] == "fail"
    assert "weight each loss by its tokens" in rows["bob"]["message"]


def test_cli_grade_needs_a_folder(tmp_path, capsys):
    assert main(["exercises", "grade"]) == 2
    assert main(["exercises", "grade", str(tmp_path / "missing")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_notebook_exercise_cells_are_complete():
    """Each exercise a notebook states has its student cell, a checker cell that loads the solution
    when `solutions` is True, and the `solutions = False` parameter."""
    import glob
    import os

    from pipelab.exercises.grading import submitted_code

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in sorted(glob.glob(os.path.join(root, "notebooks", "*.ipynb"))):
        nb = nbformat.read(path, as_version=4)
        found = submitted_code(path)
        sources = "\n".join(c.source for c in nb.cells)
        for name in found:
            check = exercises.EXERCISES[name][1].__name__
            assert f'exercises.solution("{name}")' in sources and f"exercises.{check}(" in sources, (path, name)
        if found:
            params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
            assert "solutions = False" in params.source, path

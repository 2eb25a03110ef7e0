"""Lesson 17: the debugging tools find what they claim on real gloo ranks, every planted hang ends
in seconds and leaves no process behind, and the exercise's checker names each wrong answer's mistake."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipelab import exercises
from pipelab.debug import bugs, check_replicas, collective_check, compare_with_one_process, diagnose
from pipelab.debug.flight_recorder import FlightRecorder
from pipelab.debug.runs import attempt, short_timeout
from pipelab.experiments import debug as dx
from pipelab.exercises.debug import broken_step
from pipelab.launch import spawn
from processes import live_processes

CFG = dx.Config(hang_seconds=3.0)  # a busy machine's slowest pipeline step must not look like a hang
FAST = dx.Config()  # for hangs at the first operation

# ---- the collective check ------------------------------------------------------------------------


def shapes_differ(ctx, seconds: float):
    short_timeout(5.0)
    with collective_check(seconds):
        dist.all_reduce(torch.ones(4, 8) if ctx.rank == 0 else torch.ones(4))


def matching_collectives(ctx):
    """Collectives that agree, on the world and on a subgroup: the check lets them run unchanged."""
    sub = dist.new_group([0, 1])
    with collective_check(2.0) as check:
        t = torch.full((3,), float(ctx.rank + 1))
        dist.all_reduce(t)
        dist.broadcast(t, src=1, group=sub)
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, torch.full((3,), float(ctx.rank)))
    return t, out, dict(check.count)


def test_the_check_names_a_shape_mismatch_and_leaves_nothing_behind():
    shape = attempt("shape", shapes_differ, 2, 2.0)
    assert "shape (4, 8)" in shape.message and "shape (4,)" in shape.message and "CollectiveMismatch" in shape.message
    assert live_processes(os.getpid()) == []


def test_matching_collectives_run_as_without_the_check():
    for rank, (t, out, count) in enumerate(spawn(matching_collectives, 2, timeout=120)):
        torch.testing.assert_close(t, torch.full((3,), 3.0))  # 1 + 2, then rank 1's copy
        torch.testing.assert_close(out, torch.tensor([0.0, 0, 0, 1, 1, 1]))
        assert count == {"world": 2, "ranks 0,1": 1}


def test_torchs_own_settings_beside_ours_are_run_not_assumed():
    outcomes = dx.collective_mismatch(FAST)
    assert "rank 0 calls all_reduce of a float32 tensor of shape (4, 8) on group world, but rank 1 calls broadcast" in \
        outcomes[-1].message
    assert [o.name for o in outcomes] == ["gloo", "gloo, TORCH_DISTRIBUTED_DEBUG=DETAIL", "pipelab.debug.collective_check"]
    assert all(o.ended != "finished" for o in outcomes)  # a mismatch never passes silently here
    key, verdict, text, _ = dx.mismatch_verdict(outcomes)
    assert verdict == "named" and "Our check named both ranks' calls" in text
    assert "TORCH_DISTRIBUTED_DEBUG" not in os.environ  # the setting was the runs', not the caller's
    assert live_processes(os.getpid()) == []


# ---- point to point under NCCL's rule --------------------------------------------------------------


def test_receive_first_runs_on_gloo_and_deadlocks_under_nccls_rule():
    gloo, rule = dx.p2p_deadlock(FAST)
    assert gloo.ended == "finished"
    assert rule.ended == "raised" and "DeadlockError" in rule.message
    assert live_processes(os.getpid()) == []


# ---- the flight recorder and its reader ------------------------------------------------------------


def test_the_ring_buffer_keeps_the_last_n_and_counts_past_them():
    rec = FlightRecorder(rank=0, capacity=3)
    records = [rec.issue("send", "to 1", torch.ones(2)) for _ in range(5)]
    for r in records[:4]:
        rec.complete(r)
    assert [r.number for r in rec.records] == [2, 3, 4]
    assert rec.oldest_waiting().number == 4


def dump(rank, *records):
    return {"rank": rank, "why": "", "records": [{"kind": k, "channel": c, "number": n, "shape": [2], "state": s}
                                                 for k, c, n, s in records]}


def test_the_reader_on_written_dumps():
    behind = diagnose({0: dump(0, ("all_reduce", "world", 0, "completed"), ("all_reduce", "world", 1, "issued")),
                       1: dump(1, ("all_reduce", "world", 0, "completed"))})
    assert behind.behind == [1] and behind.cycle == []
    assert "rank 0 waits for rank 1: its all_reduce world #1 (shape (2,)) is issued" in str(behind)
    cycle = diagnose({0: dump(0, ("recv", "from 1", 0, "issued")), 1: dump(1, ("recv", "from 0", 0, "issued"))})
    assert cycle.cycle == [0, 1] and "wait for each other" in str(cycle)
    fine = diagnose({0: dump(0, ("send", "to 1", 0, "completed")), 1: dump(1, ("recv", "from 0", 0, "completed"))})
    assert str(fine) == "no rank waits on an operation"


@pytest.mark.parametrize("plant, kind", [("microbatches", "cycle"), ("stall", "behind")])
def test_a_planted_pipeline_hang_is_read_from_every_ranks_dump(plant, kind):
    run = dx.planted_hang(CFG, plant)
    assert run.outcome.ended == "timed out" and sorted(run.dumps) == [0, 1]
    key, verdict, text, figures = dx.recorder_verdict(run)
    assert verdict == kind
    if plant == "stall":
        assert run.diagnosis.behind == [1]  # rank 1 sleeps: rank 0 waits for it
    else:  # rank 1 waits for the activation rank 0 never sends
        wait = next(w for w in run.diagnosis.waits if w.rank == 1)
        assert wait.what.startswith("recv from 0") and wait.peer_count == wait.wanted - 1
    assert live_processes(os.getpid()) == []


# ---- silent bugs -----------------------------------------------------------------------------------


def test_each_bug_keeps_the_loss_is_caught_and_its_fix_equals_one_process():
    rows = dx.silent_bugs(CFG)
    by = {(r.name, r.fixed): r for r in rows}
    assert all(r.loss_same for r in rows)  # the symptom: the loss looks fine
    assert by["zero_bubble_w_pass", False].replicas == "differ"
    assert by["shard_group_of_one", False].replicas == "differ"
    assert by["expert_gradients", False].replicas == "agree"  # doubled alike on every rank
    assert "2.00x the one-process gradient" in str(by["expert_gradients", False].comparison)
    assert not by["pipeline_accumulation", False].comparison.same
    assert all(by[name, True].comparison.same for name in dx.ISSUES)
    assert dx.bugs_verdict(rows)[1] == "caught"


def replicas_after_a_nudge(ctx):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    same = check_replicas(model, what="weight")
    if ctx.rank == 1:
        with torch.no_grad():
            model[1].bias[0] += 1e-3
    return same, check_replicas(model, what="weight")


def test_check_replicas_names_the_replica_and_its_first_differing_parameter():
    same, nudged = spawn(replicas_after_a_nudge, 2, timeout=120)[0]
    assert same.agree and str(same) == "the 2 replicas' weights agree"
    assert nudged.differ == {1: "1.bias"}
    assert str(nudged) == "rank 1's weights differ from rank 0's, first at parameter '1.bias'"


def test_compare_with_one_process_names_a_factor_and_refuses_bad_input():
    x, y = CFG.data()
    moe = dx.case_model(CFG, "expert_gradients")
    c = compare_with_one_process(functools.partial(bugs.expert_gradients, fixed=False), moe, dx.mse, x, y)
    assert not c.same and "'experts.1.weight': 2.00x the one-process gradient" in str(c)
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        compare_with_one_process(bugs.expert_gradients, "moe", dx.mse, x, y)
    with pytest.raises(ValueError, match="world_size=3"):
        dx.Config(world_size=3)


# ---- the exercise: find the bug ---------------------------------------------------------------------


def no_division_by_world_size(ctx, model, loss_fn, x, y, num_microbatches=4):
    xs, ys = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
    total = 0.0
    for xm, ym in zip(xs.chunk(num_microbatches), ys.chunk(num_microbatches)):
        loss = loss_fn(model, xm, ym) / num_microbatches
        loss.backward()
        total += loss.item()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return total


def no_division_by_microbatches(ctx, model, loss_fn, x, y, num_microbatches=4):
    xs, ys = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
    total = 0.0
    for xm, ym in zip(xs.chunk(num_microbatches), ys.chunk(num_microbatches)):
        loss = loss_fn(model, xm, ym)
        loss.backward()
        total += loss.item() / num_microbatches
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= ctx.world_size
    return total


def no_sync(ctx, model, loss_fn, x, y, num_microbatches=4):
    xs, ys = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
    total = 0.0
    for xm, ym in zip(xs.chunk(num_microbatches), ys.chunk(num_microbatches)):
        loss = loss_fn(model, xm, ym) / num_microbatches
        loss.backward()
        total += loss.item()
    return total


def sync_on_rank_zero_only(ctx, model, loss_fn, x, y, num_microbatches=4):
    xs, ys = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
    total = 0.0
    for xm, ym in zip(xs.chunk(num_microbatches), ys.chunk(num_microbatches)):
        loss = loss_fn(model, xm, ym) / num_microbatches
        loss.backward()
        total += loss.item()
    if ctx.rank == 0:  # "only rank 0 steps the optimizer, so only it needs the average"
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
    return total


def flat_accumulate_then_average(ctx, model, loss_fn, x, y, num_microbatches=4):
    """Correct, written otherwise: gradients summed by hand with autograd.grad, one flat all-reduce."""
    params = list(model.parameters())
    rows = x.shape[0] // ctx.world_size
    mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    acc = [torch.zeros_like(p) for p in params]
    total = 0.0
    for xm, ym in zip(x[mine].split(rows // num_microbatches), y[mine].split(rows // num_microbatches)):
        loss = loss_fn(model, xm, ym) / num_microbatches
        acc = [a + g for a, g in zip(acc, torch.autograd.grad(loss, params))]
        total += loss.item()
    flat = torch.cat([a.flatten() for a in acc])
    dist.all_reduce(flat)
    flat /= ctx.world_size
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)
    return total


WRONG = [
    (broken_step, ["last micro-batch only", "model.zero_grad() inside the micro-batch loop"]),
    (no_division_by_world_size, ["2.00x the reference", "summed over the 2 ranks, not averaged"]),
    (no_division_by_microbatches, ["4.00x the reference", "divided by num_microbatches"]),
    (no_sync, ["rank 0's and rank 1's gradients of '0.weight' differ", "never averaged"]),
    (sync_on_rank_zero_only, ["rank 0 calls all_reduce", "rank 1 has not called collective 0", "on GPUs this hangs"]),
]


WRONG_ANSWERS, RIGHT_ANSWERS = WRONG, [flat_accumulate_then_average]


@pytest.mark.parametrize("wrong, expected", WRONG, ids=[w.__name__ for w, _ in WRONG])
def test_a_wrong_fix_fails_naming_its_mistake(wrong, expected):
    grade = exercises.check_find_the_bug(wrong, quiet=True)
    assert not grade.passed
    for text in expected:
        assert text in grade.message, grade.message


def test_a_right_fix_written_otherwise_passes():  # the solution passes in test_exercises.py
    grade = exercises.check_find_the_bug(flat_accumulate_then_average, quiet=True)
    assert grade.passed, grade.message

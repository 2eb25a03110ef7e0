"""Every pipeline schedule is NCCL-safe: run under NCCL's ordering rule on gloo
(`spawn(..., nccl_rule=True)`: operations between two ranks in issue order, a send waiting for its
receiver), each gives the single-process reference's gradients. Posting receives ahead, as the
pipeline once did, deadlocks under the same rule."""

import copy

import pytest
import torch

from pipelab import models
from pipelab.launch import WorkerError, spawn
from pipelab.pipeline import p2p
from pipelab.pipeline.p2p import message_specs, plan
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.runtime import run_step
from pipelab.pipeline.schedules import make_schedule
from pipelab.reference import reference_run
from pipelab.worker import RankContext

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]


def problem():
    torch.manual_seed(0)
    model = models.mlp([8] + [16] * 8 + [4])  # 9 Linear layers: up to 9 stages
    return model, torch.randn(16, 8), torch.randn(16, 4)


def gradients_of_every_schedule(ctx: RankContext, model, x, y, m: int, runs, receives_first: bool = False):
    """Run one step of each (schedule, checkpoint) in `runs`; return this rank's stages' gradients.
    With `receives_first`, every receive of the step is posted before the rank's first send, as the
    pipeline's old receive-ahead did (the send its peer waits for then queues behind a receive)."""
    if receives_first:
        in_order = p2p.plan
        p2p.plan = lambda *a: sorted(in_order(*a), key=lambda op: op[0] != "recv")
    out = {}
    for name, checkpoint in runs:
        schedule = make_schedule(name, ctx.world_size, m)
        stages = split_model(copy.deepcopy(model), schedule.num_stages)
        modules = {s: stages[s] for s in range(schedule.num_stages) if schedule.rank_of(s) == ctx.rank}
        run_step(ctx, schedule, modules, torch.nn.MSELoss(), x, y, message_specs(stages, x, m), checkpoint=checkpoint)
        out[name, checkpoint] = {s: [p.grad for p in mod.parameters()] for s, mod in modules.items()}
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_runs_under_nccls_rule_and_gives_the_reference(p):
    model, x, y = problem()
    want = list(reference_run(model, x, y, torch.nn.MSELoss(), lr=None).grads.values())
    runs = [(name, checkpoint) for name in SCHEDULES for checkpoint in (False, True)]
    results = spawn(gradients_of_every_schedule, p, model, x, y, 2 * p, runs, nccl_rule=True, timeout=300)
    for run in runs:
        by_stage = {s: grads for rank in results for s, grads in rank[run].items()}
        got = [g for s in sorted(by_stage) for g in by_stage[s]]
        assert len(got) == len(want), run
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda text: f"{run}: {text}")


def test_receives_posted_ahead_deadlock_under_nccls_rule():
    model, x, y = problem()
    with pytest.raises(WorkerError, match="deadlock under NCCL's ordering rule") as info:
        spawn(gradients_of_every_schedule, 2, model, x, y, 4, [("1f1b", False)], True, nccl_rule=True, timeout=120)
    assert "rank 0 waits" in str(info.value) and "rank 1 waits" in str(info.value)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_both_ends_of_every_pair_plan_their_messages_in_one_order(name, p):
    schedule = make_schedule(name, p, 2 * p)
    plans = [plan(schedule, rank) for rank in range(p)]
    for a in range(p):
        for b in range(p):
            if a != b:
                toward_b = [msg for kind, msg in plans[a] if p2p.destination(msg, schedule) in (a, b)
                            and schedule.rank_of(msg.stage) in (a, b)]
                toward_a = [msg for kind, msg in plans[b] if p2p.destination(msg, schedule) in (a, b)
                            and schedule.rank_of(msg.stage) in (a, b)]
                assert toward_b == toward_a, (name, p, a, b)
    # every message that crosses ranks is sent once and received once
    sent = sorted(str(m) for pl in plans for kind, m in pl if kind == "send")
    received = sorted(str(m) for pl in plans for kind, m in pl if kind == "recv")
    assert sent == received and sent

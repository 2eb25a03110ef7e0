"""The pipeline runtime on real processes: every schedule gives the single-process loss and
gradients; stashes and messages are counted; torch.distributed.pipelining agrees with us, down to
each micro-batch's loss."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from pipelab import models
from pipelab.emulate import Emulated
from pipelab.experiments.pipeline import Config, run
from pipelab.pipeline.p2p import message_specs
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.runtime import run_step
from pipelab.pipeline.schedules import B, F, I, W, Schedule, ScheduleInterleaved1F1B, make_schedule
from pipelab.pipeline.simulate import simulate
from pipelab.reference import assert_same, reference_run
from pipelab.timeline import Recorder

BATCH = 24  # divisible by every micro-batch count used below


def problem(num_stages: int):
    torch.manual_seed(0)
    model = models.mlp([8] + [16] * 8 + [4])  # 9 Linear layers: up to 9 stages
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 4)
    return split_model(model, num_stages), x, y, torch.nn.MSELoss()


def pipelines(stages, schedules, x, y, loss_fn, **options):
    """Every schedule (all on one number of ranks) in one set of processes, one step each by default."""
    cfg = Config(world_size=schedules[0].num_ranks, stages=stages, schedules=schedules, x=x, y=y, loss_fn=loss_fn,
                 **{"steps": 1, **options})
    return run(cfg)


def torch_pipelines(stages, schedules, x, y, loss_fn, **options):
    return pipelines(stages, schedules, x, y, loss_fn, engine="torch", **options)


def reference(stages, x, y, loss_fn):
    """The whole model (the stages in a row) on the whole batch in one process, no optimizer step."""
    return reference_run(torch.nn.Sequential(*stages), x, y, loss_fn, lr=None)


# p -> micro-batch counts: m = 1, m not a multiple of p, m a multiple of p
MICROBATCHES = {2: [1, 3, 4], 3: [1, 4, 6], 4: [1, 6, 8]}


@pytest.mark.parametrize("p", [2, 3, 4])
def test_one_stage_per_rank_schedules_match_the_reference(p):
    stages, x, y, loss_fn = problem(p)
    schedules = [make_schedule(name, p, m) for name in ("gpipe", "1f1b", "zb-h1") for m in MICROBATCHES[p]]
    runs = pipelines(stages, schedules, x, y, loss_fn)
    for schedule, run in zip(schedules, runs):
        assert_same(run, reference(stages, x, y, loss_fn))
        # The stash count follows from the order alone, so it must equal the simulator's.
        assert run.peak_stash == simulate(schedule).peak_stash, schedule
        kinds = {a.kind for actions in schedule.actions for a in actions}  # F, B or F, I, W
        assert len(run.timeline.filter(lane="compute")) == len(kinds) * p * schedule.num_microbatches
        assert run.messages_sent == 2 * (p - 1) * schedule.num_microbatches


@pytest.mark.parametrize("p", [2, 3, 4])
def test_interleaved_matches_the_reference(p):
    stages, x, y, loss_fn = problem(2 * p)
    schedules = [ScheduleInterleaved1F1B(p, m, 2) for m in MICROBATCHES[p]]
    runs = pipelines(stages, schedules, x, y, loss_fn)
    for schedule, run in zip(schedules, runs):
        assert_same(run, reference(stages, x, y, loss_fn))
        assert run.peak_stash == simulate(schedule).peak_stash
        assert run.messages_sent == 2 * (2 * p - 1) * schedule.num_microbatches


def test_full_and_split_backwards_mix_in_one_schedule():
    stages, x, y, loss_fn = problem(2)
    # Stage 1 splits micro-batch 0's backward into I and W; everything else runs a full B.
    actions = [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), I(1, 0), F(1, 1), B(1, 1), W(1, 0)]]
    [run] = pipelines(stages, [Schedule(2, 2, actions=actions)], x, y, loss_fn)
    assert_same(run, reference(stages, x, y, loss_fn))
    spans = sorted(run.timeline.filter(rank=1, lane="compute"), key=lambda s: s.start)
    assert [f"{s.meta['stage']}{s.kind}{s.mb}" for s in spans] == [str(a) for a in actions[1]]
    assert run.peak_stash == {0: 2, 1: 2}  # micro-batch 0 stays stashed on rank 1 until its W


def test_stages_on_one_rank_hand_over_without_messages():
    stages, x, y, loss_fn = problem(3)
    schedule = ScheduleInterleaved1F1B(1, 4, 3)  # one rank holding all three stages
    [run] = pipelines(stages, [schedule], x, y, loss_fn)
    assert_same(run, reference(stages, x, y, loss_fn))
    assert run.messages_sent == 0 and not run.timeline.filter(lane="comm").spans


def test_gpipe_stash_grows_with_m_and_1f1b_stays_bounded():
    p, m = 2, 6
    stages, x, y, loss_fn = problem(p)
    gpipe, one_f_one_b = pipelines(stages, [make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)], x, y, loss_fn)
    assert gpipe.peak_stash == {0: m, 1: m}
    assert one_f_one_b.peak_stash == {0: 2, 1: 1}
    for rank in range(p):  # the bytes scale with the count: measured, per micro-batch the same
        per_mb = gpipe.peak_stash_bytes[rank] / m
        assert per_mb > 0
        assert one_f_one_b.peak_stash_bytes[rank] == per_mb * one_f_one_b.peak_stash[rank]
    recvs = gpipe.timeline.filter(lane="comm", kind="recv")
    assert len(recvs) == 2 * m  # activations into rank 1, gradients into rank 0


@pytest.mark.parametrize("p", [2, 3])
def test_activation_checkpointing_gives_the_reference_and_keeps_only_the_inputs(p):
    m = 6
    stages, x, y, loss_fn = problem(p)
    schedules = [make_schedule(name, p, m) for name in ("gpipe", "1f1b")]
    runs = pipelines(stages, schedules * 2, x, y, loss_fn, checkpoint=[False, False, True, True])
    plain, ckpt = runs[:2], runs[2:]
    for a, b in zip(plain, ckpt):
        assert not a.checkpoint and b.checkpoint
        assert_same(b, reference(stages, x, y, loss_fn))
        assert b.peak_stash == a.peak_stash  # as many micro-batches stashed, each much smaller
        assert not a.timeline.filter(kind="R").spans
        spans = {(s.kind, s.meta["stage"], s.mb): s for s in b.timeline.filter(lane="compute")}
        recomputes = [k for k in spans if k[0] == "R"]
        assert len(recomputes) == p * m  # one recompute per backward, just before it
        for _, stage, mb in recomputes:
            assert spans["R", stage, mb].end <= spans["B", stage, mb].start
    gpipe, gpipe_ckpt = plain[0], ckpt[0]
    input_bytes = BATCH // m * 16 * 4  # a received activation: 4 samples x 16 float32
    for rank in range(p):  # measured: one micro-batch's full stash, plus the other inputs kept
        full = gpipe.peak_stash_bytes[rank] // m
        kept_input = input_bytes if rank > 0 else 0  # stage 0's input is the batch, which lives anyway
        assert gpipe_ckpt.peak_stash_bytes[rank] == full + (m - 1) * kept_input
        assert gpipe_ckpt.peak_stash_bytes[rank] < gpipe.peak_stash_bytes[rank]


def test_a_recomputed_forward_draws_the_same_dropout_masks():
    """Two stages on one rank, in this process, so both runs start from the same random state."""
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5)),
              torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))]
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 4)
    schedule = ScheduleInterleaved1F1B(1, 4, 2)
    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"), rec=Recorder(0))
    results = []
    for checkpoint in (False, True):
        modules = {s: copy.deepcopy(stage) for s, stage in enumerate(stages)}
        torch.manual_seed(1)
        step = run_step(ctx, schedule, modules, torch.nn.MSELoss(), x, y, message_specs(stages, x, 4), checkpoint)
        results.append((step.losses, [p.grad for m in modules.values() for p in m.parameters()]))
    (loss, grads), (loss_ckpt, grads_ckpt) = results
    assert loss_ckpt == loss
    for a, b in zip(grads, grads_ckpt):
        torch.testing.assert_close(b, a)
    assert ctx.rec.timeline().filter(kind="R").spans


def test_run_step_returns_each_micro_batch_loss_as_the_last_stage_computed_it():
    """In one process (one rank holding both stages): the losses of run_step are the loss function
    on each micro-batch, not the share of the batch's loss the runner backpropagates."""
    stages, x, y, loss_fn = problem(2)
    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"), rec=Recorder(0))
    modules = {s: copy.deepcopy(stage) for s, stage in enumerate(stages)}
    step = run_step(ctx, ScheduleInterleaved1F1B(1, 3, 2), modules, loss_fn, x, y, message_specs(stages, x, 3))
    whole = torch.nn.Sequential(*stages)
    expected = [loss_fn(whole(xm), ym) for xm, ym in zip(x.chunk(3), y.chunk(3))]
    torch.testing.assert_close(step.losses, expected)


def test_torch_pipelining_runs_the_same_order_and_losses():
    p, m = 3, 4
    stages, x, y, loss_fn = problem(p)
    schedules = [make_schedule(name, p, m) for name in ("gpipe", "1f1b", "zb-h1")]
    theirs = torch_pipelines(stages, schedules, x, y, loss_fn)
    ours = pipelines(stages, schedules, x, y, loss_fn)
    for schedule, run, mine in zip(schedules, theirs, ours):
        assert_same(run, reference(stages, x, y, loss_fn))
        # each micro-batch's loss, as torch's schedule.step(..., losses=[]) gives them
        assert len(run.mb_losses) == m
        torch.testing.assert_close(mine.mb_losses, run.mb_losses)
        for rank in range(p):  # the order torch executed, recorded span by span
            executed = [(s.kind, s.meta["stage"], s.mb) for s in run.timeline.filter(rank=rank, lane="compute")]
            planned = [(a.kind, a.stage, a.mb) for a in schedule.actions[rank]]
            assert executed == planned, (schedule, rank)


def test_torch_interleaved_matches_ours():
    p, m = 2, 4
    stages, x, y, loss_fn = problem(2 * p)
    schedule = make_schedule("interleaved", p, m)
    [ours] = pipelines(stages, [schedule], x, y, loss_fn)
    [theirs] = torch_pipelines(stages, [schedule], x, y, loss_fn)
    assert theirs.loss == pytest.approx(ours.loss, rel=1e-5)
    torch.testing.assert_close(ours.mb_losses, theirs.mb_losses)
    for rank in range(p):
        executed = [(s.kind, s.meta["stage"], s.mb) for s in theirs.timeline.filter(rank=rank, lane="compute")]
        assert executed == [(a.kind, a.stage, a.mb) for a in schedule.actions[rank]]


BAD_CONFIGS = [  # (field, bad value, what the Config's error says)
    ("schedules", "gpipe", "a list of one or more schedules, got 'gpipe'"),
    ("schedules", ["gpipe", "pipedream"], r"unknown schedule 'pipedream'; choose one of"),
    ("num_microbatches", 5, "batch=24 does not divide evenly by num_microbatches=5"),
    ("num_microbatches", [4], "num_microbatches must be one int for all 2 schedules or one per schedule"),
    ("loss_fn", None, "the last stage needs a loss function"),
    ("loss_fn", torch.nn.MSELoss(reduction="sum"), "reduction='sum'.*use reduction='mean'"),
    ("y", torch.randn(23, 4), "targets have 23"),
    ("checkpoint", [True], "checkpoint must be one bool for all 2 schedules or one per schedule"),
    ("steps", 0, "steps must be a whole number >= 1, got 0"),
    ("engine", "deepspeed", "engine must be one of"),
    ("world_size", 3, r"runs on 2 ranks but world_size=3"),
]


@pytest.mark.parametrize("field, value, message", BAD_CONFIGS)
def test_bad_input_is_refused_by_the_config_before_workers_start(field, value, message, monkeypatch):
    def spawn(*args, **kwargs):
        raise AssertionError("a process was started: the bad input was not refused before")

    monkeypatch.setattr("pipelab.launch.spawn", spawn)
    stages, x, y, loss_fn = problem(2)
    good = dict(stages=stages, schedules=["gpipe", "1f1b"], num_microbatches=4, x=x, y=y, loss_fn=loss_fn)
    if field == "world_size":
        good["schedules"] = [make_schedule("gpipe", 2, 4)]
    with pytest.raises(ValueError, match=message):
        run(Config(**{**good, field: value}))


def test_bad_schedules_and_splits_are_refused():
    stages, x, y, loss_fn = problem(2)
    with pytest.raises(ValueError, match="cannot cut a model with 9 layers into 10 stages"):
        split_model(models.mlp([8] + [16] * 8 + [4]), 10)
    with pytest.raises(ValueError, match="cannot take num_microbatches=5"):
        make_schedule("interleaved", 2, 5)
    with pytest.raises(ValueError, match="runs 4 stages"):
        Config(stages=stages, schedules=[make_schedule("interleaved", 2, 4)], x=x, y=y)
    with pytest.raises(ValueError, match="torch has no counterpart"):
        Config(stages=stages, schedules=[Schedule(2, 1, actions=[[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]])],
               num_microbatches=1, x=x, y=y, engine="torch")


# ---------------------------------------------------------------------------------------------
# Messages of any dtype and shape; the loss's reduction; stages without parameters (issue 11)
# ---------------------------------------------------------------------------------------------

def run_and_check(stages, schedules, x, y, loss_fn, atol=1e-5):
    """Every schedule on real processes, each equal to the stages in a row in one process."""
    for run in pipelines(stages, schedules, x, y, loss_fn):
        assert_same(run, reference(stages, x, y, loss_fn), atol=atol, rtol=atol)


def three_kinds(p: int, m: int) -> list:
    return [make_schedule(name, p, m) for name in ("gpipe", "1f1b", "zb-h1")]


def test_token_ids_feed_an_embedding_stage_and_stay_integers():
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Flatten()), torch.nn.Linear(32, 4)]
    x, y = torch.randint(0, 10, (8, 4)), torch.randn(8, 4)
    run_and_check(stages, three_kinds(2, 4), x, y, torch.nn.MSELoss())


class TrimPadding(torch.nn.Module):
    """Token ids padded with 0 at the end: keep only the columns up to this micro-batch's longest row."""

    def forward(self, tokens):
        return tokens[:, : int((tokens != 0).any(0).nonzero().max()) + 1]


class SumOverTokens(torch.nn.Module):
    def forward(self, h):
        return h.sum(1)


def test_activations_whose_shape_changes_from_one_micro_batch_to_the_next():
    torch.manual_seed(0)
    lengths = torch.tensor([1, 2, 6, 3, 2, 1, 4, 2])  # micro-batches of 2 rows: longest 2, 6, 2, 4
    x = torch.randint(1, 10, (8, 6)) * (torch.arange(6) < lengths[:, None])
    y = torch.randn(8, 4)
    stages = [torch.nn.Sequential(TrimPadding(), torch.nn.Embedding(10, 8, padding_idx=0)),
              torch.nn.Sequential(SumOverTokens(), torch.nn.Linear(8, 4))]
    run_and_check(stages, three_kinds(2, 4), x, y, torch.nn.MSELoss())


class NarrowerOnTheRanks(torch.nn.Module):
    """Drops a column when it runs inside a worker: the trace before the run cannot see that."""

    def forward(self, h):
        return h[:, :3] if torch.distributed.is_initialized() else h


class PadTo4(torch.nn.Module):
    def forward(self, h):
        return torch.nn.functional.pad(h, (0, 4 - h.shape[1]))


def test_a_shape_that_differs_from_the_trace_fails_naming_the_stage_and_the_shapes():
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(8, 4), NarrowerOnTheRanks()),
              torch.nn.Sequential(PadTo4(), torch.nn.Linear(4, 4))]
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with pytest.raises(Exception, match=r"stage 0 made an output of \[2, 3\] float32 on micro-batch 0, but the "
                                        r"trace before the run \(message_specs\) gave \[2, 4\] float32"):
        pipelines(stages, [make_schedule("gpipe", 2, 4)], x, y, torch.nn.MSELoss(), timeout=60)


class To(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, h):
        return h.to(self.dtype)


def test_a_bfloat16_stage_between_float32_stages():
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(8, 16), To(torch.bfloat16)),
              torch.nn.Sequential(torch.nn.Linear(16, 16).to(torch.bfloat16), To(torch.float32)),
              torch.nn.Linear(16, 4)]
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    run_and_check(stages, three_kinds(3, 2), x, y, torch.nn.MSELoss(), atol=2e-2)


def test_a_summed_loss_is_refused_by_ours_and_torchs_before_any_rank_starts(monkeypatch):
    """Every parallel mode averages over micro-batches, which equals one process only for a mean."""
    monkeypatch.setattr("pipelab.launch.spawn", lambda *a, **k: pytest.fail("a rank started"))
    stages, x, y, _ = problem(2)
    for engine in ("pipelab", "torch"):
        with pytest.raises(ValueError, match="reduction='sum'"):
            pipelines(stages, three_kinds(2, 4), x, y, torch.nn.MSELoss(reduction="sum"), engine=engine)


@pytest.mark.parametrize("where", ["first", "middle"])
def test_stages_without_parameters_take_part_like_any_other(where):
    torch.manual_seed(0)
    model = models.mlp([8, 16, 4])
    plain = [torch.nn.Flatten(), *split_model(model, 2)] if where == "first" else [model[0], torch.nn.ReLU(), model[2]]
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    run_and_check(plain, three_kinds(3, 3), x, y, torch.nn.MSELoss())


def test_message_specs_trace_every_micro_batch_and_leave_the_stages_as_they_were():
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.BatchNorm1d(3), torch.nn.Dropout(0.5)),
              torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(24, 4), To(torch.float64))]
    x = torch.randint(0, 10, (6, 3))
    before = [b.clone() for b in stages[0].buffers()]
    rng = torch.get_rng_state()
    specs = message_specs(stages, x, 3)
    assert [[str(s) for s in row] for row in specs] == [["[2, 3, 8] float32", "[2, 4] float64"]] * 3
    assert all(torch.equal(a, b) for a, b in zip(before, stages[0].buffers()))  # BatchNorm's statistics
    assert torch.equal(rng, torch.get_rng_state())  # Dropout drew no numbers from the caller's generator


def test_recv_waits_split_a_receive_into_waiting_for_the_sender_and_for_the_message():
    from pipelab.pipeline.waits import recv_waits
    from pipelab.timeline import Span, Timeline

    tl = Timeline([
        Span(0, "comm", "send", 0.004, 0.0041, 0, {"to": 1}),  # sent 4 ms into a 10 ms wait
        Span(1, "comm", "recv", 0.000, 0.010, 0, {"frm": 0}),
        Span(0, "comm", "send", 0.015, 0.0151, 1, {"to": 1}),  # sent before its receiver asked
        Span(1, "comm", "recv", 0.020, 0.021, 1, {"frm": 0}),
    ])
    for_sender, for_message = recv_waits(tl)
    assert for_sender == pytest.approx(0.004)
    assert for_message == pytest.approx(0.006 + 0.001)


def test_the_stash_counted_from_the_layers_is_the_stash_measured():
    """Lesson 06's count: per micro-batch, each ReLU output, the received activation (not on stage
    0) and the last stage's output, one micro-batch by `width` float32 numbers each."""
    from pipelab.experiments import gpipe

    torch.manual_seed(0)
    width, m = 16, 2
    stages = split_model(models.mlp([width] * 5), 2)
    x, y = torch.randn(8, width), torch.randn(8, width)
    [run] = pipelines(stages, [make_schedule("gpipe", 2, m)], x, y, torch.nn.MSELoss())
    activation = 8 // m * width * 4
    verdict, per_mb = gpipe.stash_per_rank(run, stages, activation)
    assert per_mb == gpipe.stashed_tensors(stages) == {0: 2, 1: 3} and verdict[1] == "as counted"


# ---------------------------------------------------------------------------------------------
# On an emulated node: modelled time and memory at the emulated size
# ---------------------------------------------------------------------------------------------

def emulated_problem(p: int = 2, **size):
    """The MLP of `problem` for real, and an MLP of equal stages at a GPU's size for the cost model."""
    stages, x, y, loss_fn = problem(p)
    size = {"layers": 8, "width": 4096, "rows": 1024, "dtype": "bfloat16", **size}
    from pipelab.experiments.pipeline import emulated_mlp

    return stages, x, y, loss_fn, emulated_mlp(f"{p}xH100-nvlink", num_stages=p, **size)


def test_emulated_gpipe_bubble_follows_the_formula_and_memory_the_estimate():
    """At equal stages the only thing the formula leaves out is the messages' link time: every
    bubble within 0.03 of (p-1)/(m+p-1), the same in every step (a logical clock), and each rank's
    memory meter peaks at the estimate made before the run, checkpointed or not; 1F1B's at
    min(m, p - r) micro-batches in flight."""
    from pipelab.emulate.memory import microbatches_in_flight
    from pipelab.pipeline.simulate import gpipe_bubble

    stages, x, y, loss_fn, emulated = emulated_problem()
    ms = [1, 2, 4, 8]
    cfg = Config(world_size=2, stages=stages, x=x, y=y, loss_fn=loss_fn, steps=2, schedules=["gpipe"] * 5 + ["1f1b"],
                 num_microbatches=ms + [8, 8], checkpoint=[False] * 4 + [True, False], emulate=emulated)
    runs = run(cfg)
    for r in runs:
        assert_same(r, reference(stages, x, y, loss_fn))
        m = r.schedule.num_microbatches
        for rank, peak in r.peak_bytes.items():
            in_flight = microbatches_in_flight(r.schedule.name.lower(), rank, 2, m)
            assert peak == pytest.approx(cfg.emulated.memory(rank, in_flight, r.checkpoint).total, rel=1e-9)
    for r in runs[:4]:
        assert r.bubble_fraction.low == r.bubble_fraction.high  # the same in every step
        assert abs(r.bubble_fraction.median - gpipe_bubble(2, r.schedule.num_microbatches)) <= 0.03
    assert runs[4].step_time.median > runs[3].step_time.median  # each backward recomputed its forward


def test_emulated_step_is_the_simulators_with_the_same_costs():
    """The emulated ranks and the simulator use the same F, I, W seconds: with messages at their
    link time, every schedule's step is within 10 % of the simulator's makespan."""
    stages, x, y, loss_fn, emulated = emulated_problem()
    cfg = Config(world_size=2, stages=stages, x=x, y=y, loss_fn=loss_fn, steps=1,
                 schedules=["gpipe", "1f1b", "zb-h1"], num_microbatches=4, emulate=emulated)
    for r in run(cfg):
        sim = simulate(r.schedule, cfg.simulated_costs(messages=True))
        assert 1.0 - 1e-6 <= r.step_time.median * 1e3 / sim.makespan_ms <= 1.10, r.schedule


def test_emulated_node_refuses_what_it_cannot_time():
    stages, x, y, loss_fn, emulated = emulated_problem()
    with pytest.raises(ValueError, match="needs the 2 stages at the emulated size"):
        Config(world_size=2, stages=stages, x=x, y=y, loss_fn=loss_fn, emulate="2xH100-nvlink")
    with pytest.raises(ValueError, match="needs the 2 stages at the emulated size"):
        Config(world_size=2, stages=stages, x=x, y=y, loss_fn=loss_fn,
               emulate=Emulated(emulated.node, **{**emulated.size, "stages": stages[:1]}))
    with pytest.raises(ValueError, match="needs x="):
        Config(world_size=2, stages=stages, x=x, y=y, loss_fn=loss_fn,
               emulate=Emulated(emulated.node, stages=emulated.size["stages"]))
    with pytest.raises(ValueError, match="gives width, which this lesson's emulated size does not have"):
        Config(world_size=2, stages=stages, x=x, y=y, loss_fn=loss_fn, emulate=Emulated("2xH100-nvlink", width=8))
    with pytest.raises(ValueError, match="emulate=None"):
        Config(world_size=2, stages=stages, x=x, y=y, loss_fn=loss_fn, engine="torch", emulate=emulated)


def test_send_waits_splits_message_time_by_what_the_sender_did():
    from pipelab.pipeline.waits import send_waits
    from pipelab.timeline import Span, Timeline

    tl = Timeline([Span(0, "compute", "F", 0.0, 1.0, 0, {}), Span(0, "comm", "send", 0.5, 2.0, 0, {"to": 1}),
                   Span(0, "comm", "recv", 1.2, 1.6, 1, {"frm": 1}), Span(0, "compute", "B", 1.6, 1.8, 1, {})])
    w = send_waits(tl)
    assert w["in flight"] == pytest.approx(1.5)
    assert w["computing"] == pytest.approx(0.5 + 0.2)
    assert w["in recv"] == pytest.approx(0.4)
    assert w["blocked"] == pytest.approx(0.2 + 0.2)  # 1.0-1.2 between actions, 1.8-2.0 after the last
    assert w["blocked at the end"] == pytest.approx(0.2)


def test_gpu_profiles_of_06_and_07_carry_their_flop_counts():
    """Lessons 06 and 07's `gpu` profiles say their FLOPs as `run_flops` counts them on the meta
    device at the profile's size, and a Linear layer counts 2 x rows x width^2 per product: a
    micro-batch's forward, input gradient and weight gradient, 6 x layers x rows x width^2."""
    import json
    import os

    from pipelab.experiments import gpipe, schedules

    w, layers, rows = 64, 4, 8
    # m = 2 first, a sweep of [1], one step each, no checkpointed rounds: 2 + 1 micro-batches, the
    # hand-written worker's 2, and the two references' 2 + 1.
    assert gpipe.run_flops(dict(width=w, layers=layers, microbatch_size=rows, microbatches=2, sweep=[1], steps=1,
                                     repeats=0)) == pytest.approx(6 * layers * rows * w * w * (3 + 2 + 3))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def profile(name):
        meta = json.load(open(os.path.join(root, "notebooks", name)))["metadata"]["pipelab"]
        source = [c for c in json.load(open(os.path.join(root, "notebooks", name)))["cells"]
                  if "parameters" in c["metadata"].get("tags", [])][0]["source"]
        defaults = {}
        exec("".join(source), {}, defaults)
        return {**defaults, **meta["profiles"]["gpu"]}, meta["needs"]["gpu"]["flops"]

    p, flops = profile("06_gpipe.ipynb")
    counted = gpipe.run_flops(p)
    cell = [c for c in json.load(open(os.path.join(root, "notebooks", "06_gpipe.ipynb")))["cells"]
            if "parameters" in c["metadata"].get("tags", [])][0]
    defaults: dict = {}
    exec("".join(cell["source"]), {}, defaults)
    assert {k: defaults[k] for k in gpipe.DEFAULTS} == gpipe.DEFAULTS  # run_flops' missing names: the notebook's
    assert flops == pytest.approx(counted, rel=1e-3)
    p, flops = profile("07_schedules_1f1b_interleaved_zero_bubble.ipynb")
    counted = schedules.run_flops(p)
    assert flops == pytest.approx(counted, rel=1e-3)

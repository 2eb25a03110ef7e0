"""pipelab.ddp and pipelab.experiments.ddp: the bucket planner (pure), NaiveDDP / BucketedDDP /
torch DDP against the single-process reference on real processes, unused parameters, and bad input."""

import math
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipelab import experiments
from pipelab.emulate import Emulated
from pipelab.ddp import MIB, Bucket, BucketedDDP, NaiveDDP, module_bucket_plan, plan_buckets
from pipelab.display import format_bucket_plan
from pipelab.experiments import bucket_sweep as sweep
from pipelab.experiments import ddp
from pipelab.experiments.ddp import VARIANTS, DDPRun, replica_spread
from pipelab.launch import spawn
from pipelab.reference import assert_same, reference_run
from pipelab.worker import RankContext


def run_ddp(model, x, y, **kwargs) -> dict[str, DDPRun]:
    """Each variant's run on real processes (`ddp.Config` refuses bad input before any starts)."""
    return experiments.run(ddp.worker, ddp.Config(model=model, x=x, y=y, **kwargs), ddp.gather)


def bucket_sweep(model, x, y, caps_mb, **kwargs) -> list[sweep.SweepPoint]:
    return experiments.run(sweep.worker, sweep.Config(model=model, x=x, y=y, caps_mb=caps_mb, **kwargs), sweep.gather)


def uneven_model() -> nn.Sequential:
    """Layers of odd sizes: 7 -> 13 -> 5 -> 3 (bytes per parameter: 364, 52, 260, 20, 60, 12)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))


UNEVEN_CAP_MB = 80 / MIB  # 80 bytes: buckets [4.bias, 4.weight, 2.bias], [2.weight], [0.bias, 0.weight]


class WithUnused(nn.Module):
    """A model with a layer that forward never uses (and one used only when asked)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 4)
        self.never = nn.Linear(6, 4)
        self.head = nn.Linear(4, 2)
        self.sometimes = nn.Linear(4, 2)
        self.use_sometimes = False

    def forward(self, x):
        h = torch.tanh(self.body(x))
        out = self.head(h)
        return out + self.sometimes(h) if self.use_sometimes else out


def batch(n: int, d_in: int, d_out: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


# ---------------------------------------------------------------------------------------------
# The planner: a pure function on hand-made parameter lists
# ---------------------------------------------------------------------------------------------

def test_plan_walks_parameters_in_reverse_and_closes_a_bucket_at_the_cap():
    params = [("a", 100), ("b", 300), ("c", 50), ("d", 600)]
    buckets = plan_buckets(params, 400 / MIB)
    assert buckets == [Bucket(0, ("d",), (600,)), Bucket(1, ("c", "b", "a"), (50, 300, 100))]
    assert [b.nbytes for b in buckets] == [600, 450]


def test_plan_gives_a_parameter_larger_than_the_cap_a_bucket_of_its_own():
    buckets = plan_buckets([("small1", 10), ("huge", 10_000), ("small2", 10)], 100 / MIB)
    assert [b.names for b in buckets] == [("small2", "huge"), ("small1",)]
    buckets = plan_buckets([("small1", 10), ("huge", 10_000), ("small2", 200)], 100 / MIB)
    assert [b.names for b in buckets] == [("small2",), ("huge",), ("small1",)]


def test_plan_from_one_bucket_per_parameter_to_one_bucket_for_all():
    params = [(f"p{i}", 4 * (i + 1)) for i in range(6)]
    tiny = plan_buckets(params, 1e-9)
    assert [b.names for b in tiny] == [(f"p{i}",) for i in reversed(range(6))]
    whole = plan_buckets(params, 1.0)
    assert len(whole) == 1 and whole[0].names == tuple(f"p{i}" for i in reversed(range(6)))


def test_plan_keeps_every_parameter_once_in_gradient_order_when_sizes_do_not_divide():
    rng = random.Random(0)
    params = [(f"layer{i}.weight", rng.randrange(1, 5000) * 4) for i in range(40)]
    for cap_bytes in (7, 1000, 4099, 12345, 10**6):
        buckets = plan_buckets(params, cap_bytes / MIB)
        flat = [n for b in buckets for n in b.names]
        assert flat == [n for n, _ in reversed(params)]
        assert [b.index for b in buckets] == list(range(len(buckets)))
        assert sum(b.nbytes for b in buckets) == sum(s for _, s in params)
        for b in buckets[:-1]:  # every bucket but the last reached the cap, and only with its last parameter
            assert b.nbytes >= cap_bytes and b.nbytes - b.sizes[-1] < cap_bytes


def test_module_bucket_plan_counts_bytes_and_skips_frozen_parameters():
    model = uneven_model()
    model[0].bias.requires_grad_(False)
    buckets = module_bucket_plan(model, UNEVEN_CAP_MB)
    assert [b.names for b in buckets] == [("4.bias", "4.weight", "2.bias"), ("2.weight",), ("0.weight",)]
    assert [b.sizes for b in buckets] == [(12, 60, 20), (260,), (364,)]
    table = format_bucket_plan(buckets)
    assert "4.bias, 4.weight, 2.bias" in table and "3 bucket(s)" in table and "364 B" in table


@pytest.mark.parametrize("cap", [0, -1, -0.5, math.nan, math.inf, True, "25", None])
def test_bad_bucket_cap_is_refused_with_the_value_and_a_fix(cap):
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a number of MiB > 0, got .*bucket_cap_mb=25"):
        plan_buckets([("w", 4)], cap)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedDDP(uneven_model(), bucket_cap_mb=cap)  # refused before it looks for a process group


def test_bad_plan_input():
    with pytest.raises(ValueError, match="no parameters"):
        plan_buckets([], 25)
    with pytest.raises(ValueError, match=r"unique.*\['w'\]"):
        plan_buckets([("w", 4), ("w", 8)], 25)
    with pytest.raises(ValueError, match="'w' has size -4"):
        plan_buckets([("w", -4)], 25)


@pytest.mark.skipif(dist.is_initialized(), reason="this process already joined a process group")
def test_wrappers_need_a_process_group():
    with pytest.raises(RuntimeError, match="needs a process group.*spawn"):
        NaiveDDP(uneven_model())


def test_bad_input_is_refused_before_any_process_starts():
    x, y = batch(12, 7, 3)
    model = uneven_model()
    with pytest.raises(ValueError, match=r"batch=12 does not divide evenly by world_size=5.*\[1, 2, 3, 4, 6, 12\]"):
        run_ddp(model, x, y, world_size=5)
    with pytest.raises(ValueError, match="no parameters that require gradients"):
        run_ddp(nn.ReLU(), x, y)
    with pytest.raises(ValueError, match="variants must be some of"):
        run_ddp(model, x, y, variants=["fsdp"])
    with pytest.raises(ValueError, match="12 samples but targets have 10"):
        run_ddp(model, x, y[:10])
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bucket_sweep(model, x, y, caps_mb=[1, 0])
    with pytest.raises(ValueError, match=r"different bucket sizes, got caps_mb=\[1, 1\]"):
        bucket_sweep(model, x, y, caps_mb=[1, 1])
    with pytest.raises(ValueError, match="rounds must be a whole number"):
        bucket_sweep(model, x, y, caps_mb=[1], rounds=0)
    with pytest.raises(ValueError, match="steps must be a whole number"):
        run_ddp(model, x, y, steps=0)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_a_loss_that_is_not_a_mean_is_refused_before_any_rank_starts(monkeypatch, reduction):
    """With reduction='sum' every variant's gradients would be the reference's divided by the world
    size, and nothing would look wrong: DDP averages over ranks, which matches one process only for
    a mean loss. So the Config refuses it, and no process is started."""
    def spawn(*args, **kwargs):
        raise AssertionError("a process was started: the summed loss was not refused before")

    monkeypatch.setattr("pipelab.launch.spawn", spawn)
    x, y = batch(12, 7, 3)
    for make in (lambda: run_ddp(uneven_model(), x, y, loss_fn=nn.MSELoss(reduction=reduction)),
                 lambda: bucket_sweep(uneven_model(), x, y, caps_mb=[1], loss_fn=nn.MSELoss(reduction=reduction))):
        with pytest.raises(ValueError, match=f"reduction='{reduction}'.*use reduction='mean'"):
            make()


def reference(model: nn.Module, x, y):
    """One process, whole batch, one SGD step: what every variant must reproduce."""
    return reference_run(model, x, y, nn.MSELoss(), steps=1, lr=0.1)


def test_assert_same_catches_a_wrong_gradient_in_a_ddp_run():
    x, y = batch(8, 7, 3)
    ref = reference(uneven_model(), x, y)
    grads = {n: g.clone() for n, g in ref.grads.items()}
    run = DDPRun("fake", ref.losses, grads, ref.weights, 0.0)
    assert assert_same(run, ref) == 0.0
    grads["2.weight"][0, 0] += 0.01
    with pytest.raises(AssertionError, match="fake: gradient of 2.weight"):
        assert_same(run, ref)


# ---------------------------------------------------------------------------------------------
# Real processes: every variant against the single-process reference
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def uneven_runs():
    x, y = batch(12, 7, 3)
    return {ws: (run_ddp(uneven_model(), x, y, world_size=ws, bucket_cap_mb=UNEVEN_CAP_MB, steps=2), x, y)
            for ws in (2, 3)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_and_updated_weights_match_one_process(uneven_runs, world_size, variant):
    runs, x, y = uneven_runs[world_size]
    ref = reference(uneven_model(), x, y)
    assert_same(runs[variant], ref)
    assert runs[variant].replica_spread == 0.0  # ranks 1.. started from other weights: the broadcast fixed that


@pytest.mark.parametrize("world_size", [2, 3])
def test_timelines_show_each_layer_and_each_all_reduce(uneven_runs, world_size):
    runs, _, _ = uneven_runs[world_size]
    bucketed, naive = runs["bucketed"], runs["naive"]
    assert [b.names for b in bucketed.buckets] == [("4.bias", "4.weight", "2.bias"), ("2.weight",),
                                                   ("0.bias", "0.weight")]
    for rank in range(world_size):
        mine = bucketed.timeline.filter(rank=rank)
        assert [s.meta["layer"] for s in mine.filter(kind="B")] == ["4", "2", "0"]
        assert sorted(s.meta["bucket"] for s in mine.filter(lane="comm")) == [0, 1, 2]
        assert len(mine.filter(kind="F")) == 1 and len(mine.filter(kind="copy")) == 3
        comm = naive.timeline.filter(rank=rank, lane="comm")
        assert [s.meta["param"] for s in comm] == ["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]
    assert naive.overlap.values == (0.0,)  # naive sends only after backward (one timed step)
    assert 0.0 <= bucketed.overlap.low <= bucketed.overlap.high <= 1.0
    assert bucketed.step_time.values == tuple(bucketed.steps.seconds) and bucketed.step_time.low > 0
    per_bucket = bucketed.bucket_all_reduce_times()
    assert [len(m.values) for m in per_bucket] == [world_size] * 3  # one timed step, every rank
    assert all(m.low > 0 for m in per_bucket)
    with pytest.raises(ValueError, match="bucketed"):
        naive.bucket_all_reduce_times()


def test_an_unused_parameter_keeps_no_gradient_like_one_process():
    x, y = batch(8, 6, 2)
    torch.manual_seed(0)
    model = WithUnused()
    runs = run_ddp(model, x, y, variants=["bucketed", "torch"], bucket_cap_mb=100 / MIB, steps=2,
                       find_unused_parameters=True)
    ref = reference(model, x, y)
    assert ref.grads["never.weight"] is None
    for run in runs.values():
        assert_same(run, ref)


def edge_cases_worker(ctx: RankContext) -> dict:
    """Several checks in one set of processes; returns what each rank saw."""
    seen = {}
    x, y = batch(8, 6, 2, seed=ctx.rank)

    # Gradients are final when backward() returns: no extra call.
    torch.manual_seed(0)
    model = uneven_model()
    wrapped = BucketedDDP(model, bucket_cap_mb=UNEVEN_CAP_MB)
    xs, ys = batch(4, 7, 3, seed=10 + ctx.rank)
    nn.MSELoss()(wrapped(xs), ys).backward()
    seen["spread_after_backward"] = max(replica_spread([p.grad for p in model.parameters()]), 0.0)

    # A parameter used on rank 0 only (rank 0 misses nothing, rank 1 misses it): every rank gets
    # the average, i.e. rank 0's gradient / world size.
    torch.manual_seed(0)
    model = WithUnused()
    model.never.requires_grad_(False)
    model.use_sometimes = ctx.rank == 0
    local = WithUnused()
    local.load_state_dict(model.state_dict())
    local.use_sometimes = model.use_sometimes
    nn.MSELoss()(local(x), y).backward()
    wrapped = BucketedDDP(model, bucket_cap_mb=1e-9, find_unused_parameters=True)
    nn.MSELoss()(wrapped(x), y).backward()
    local_grad = local.sometimes.weight.grad if ctx.rank == 0 else torch.zeros(2, 4)
    dist.broadcast(local_grad, src=0)
    seen["sometimes_ok"] = torch.allclose(model.sometimes.weight.grad, local_grad / ctx.world_size)
    seen["body_ok"] = replica_spread([model.body.weight.grad]) == 0.0

    # Without find_unused_parameters: a clear error on every rank, no hang, and the next step works.
    torch.manual_seed(0)
    model = WithUnused()
    wrapped = BucketedDDP(model, bucket_cap_mb=1e-9)
    try:
        nn.MSELoss()(wrapped(x), y).backward()
    except RuntimeError as e:
        seen["unused_error"] = str(e)
    model.zero_grad(set_to_none=True)
    model.never.requires_grad_(False)  # the fix the message suggests ...
    model.sometimes.requires_grad_(False)
    wrapped.remove_hooks()
    wrapped = BucketedDDP(model, bucket_cap_mb=1e-9)  # ... applied
    nn.MSELoss()(wrapped(x), y).backward()
    seen["after_fix"] = model.head.weight.grad is not None

    # Buffers are broadcast too, and the wrapper's state dict is the model's under "module.", as torch's.
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(ctx.rank))
    wrapped = BucketedDDP(model)
    seen["buffer_spread"] = replica_spread(model.buffers())
    seen["state_keys"] = sorted(wrapped.state_dict())

    # Bad input, refused on every rank.
    def error(make):
        try:
            make()
        except ValueError as e:
            return str(e)
        return None

    seen["shapes_differ"] = error(lambda: NaiveDDP(nn.Linear(4, 3 + ctx.rank)))
    seen["no_parameters"] = error(lambda: BucketedDDP(nn.ReLU()))
    seen["frozen"] = error(lambda: NaiveDDP(nn.Linear(4, 3).requires_grad_(False)))
    seen["cap"] = error(lambda: BucketedDDP(nn.Linear(4, 3), bucket_cap_mb=0))
    seen["still_in_step"] = replica_spread([torch.ones(3)])  # the group still works after all that
    return seen


def test_edge_cases_on_real_processes():
    results = spawn(edge_cases_worker, 2, timeout=60)
    for rank, seen in enumerate(results):
        assert seen["spread_after_backward"] == 0.0
        assert seen["sometimes_ok"], f"rank {rank}: a parameter used on rank 0 only got the wrong average"
        assert seen["body_ok"]
        assert "never.weight" in seen["unused_error"] and "find_unused_parameters=True" in seen["unused_error"]
        assert seen["after_fix"]
        assert "rank 1's model differs from rank 0's: parameter weight (3, 4)" in seen["shapes_differ"]
        assert "(4, 4)" in seen["shapes_differ"] and "same model" in seen["shapes_differ"]
        assert "no parameters that require gradients" in seen["no_parameters"]
        assert "no parameters that require gradients" in seen["frozen"]
        assert "bucket_cap_mb must be a number of MiB > 0, got 0" in seen["cap"]
        assert seen["still_in_step"] == 0.0
        assert seen["buffer_spread"] == 0.0
        plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        assert seen["state_keys"] == sorted(f"module.{k}" for k in plain.state_dict())


def test_bucket_sweep_runs_every_size_in_one_set_of_processes():
    x, y = batch(8, 7, 3)
    points = bucket_sweep(uneven_model(), x, y, caps_mb=[1e-9, UNEVEN_CAP_MB, 1.0], steps=2, rounds=2)
    assert [p.num_buckets for p in points] == [6, 3, 1]
    for p in points:
        assert p.step_time.low > 0 and p.torch_step_time.low > 0 and 0.0 <= p.overlap.low <= p.overlap.high <= 1.0
        assert len(p.timeline.filter(lane="comm", rank=0)) == p.num_buckets
        # every timed step of both rounds, and one ours / torch ratio per round
        assert len(p.step_time.values) == len(p.torch_step_time.values) == len(p.overlap.values) == 4
        assert len(p.ratio.values) == 2 and p.ratio.low > 0
    alone = bucket_sweep(uneven_model(), x, y, caps_mb=[1.0], steps=1, rounds=1, with_torch=False)
    assert alone[0].torch_step_time is None and alone[0].ratio is None


def buffers_worker(ctx: RankContext) -> dict:
    """A BatchNorm model trained 3 steps with each wrapper, each rank on data of its own scale:
    the running statistics each rank ends with, and how far apart the ranks' are."""
    wrappers = {"naive": NaiveDDP, "bucketed": BucketedDDP, "torch": nn.parallel.DistributedDataParallel,
                "bucketed, broadcast_buffers=False": lambda m: BucketedDDP(m, broadcast_buffers=False)}
    seen = {}
    for name, wrap in wrappers.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        wrapped = wrap(model)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(3):
            optimizer.zero_grad()
            wrapped(torch.randn(8, 4, generator=g) * (1 + ctx.rank)).pow(2).mean().backward()
            optimizer.step()
        stats = [model[1].running_mean, model[1].running_var]
        seen[name] = {"stats": [t.clone() for t in stats], "spread": replica_spread(stats)}
        model.eval()  # BatchNorm reads its running statistics and leaves them as they are
        wrapped(torch.randn(8, 4, generator=g))
        seen[name]["spread_in_next_forward"] = replica_spread(stats)
    return seen


def test_buffers_follow_rank_0_before_each_forward_as_in_torch():
    results = spawn(buffers_worker, 2, timeout=60)
    for rank, seen in enumerate(results):
        for name in ("naive", "bucketed"):  # the same running statistics as torch's DDP, on every rank
            for ours, theirs in zip(seen[name]["stats"], seen["torch"]["stats"]):
                torch.testing.assert_close(ours, theirs, msg=f"{name}, rank {rank}")
            assert seen[name]["spread"] == pytest.approx(seen["torch"]["spread"])
            assert seen[name]["spread_in_next_forward"] == 0.0 == seen["torch"]["spread_in_next_forward"]
        # Without the broadcast, each rank keeps its own statistics, further apart.
        assert seen["bucketed, broadcast_buffers=False"]["spread_in_next_forward"] > 0.1
        assert seen["bucketed, broadcast_buffers=False"]["spread"] > seen["torch"]["spread"]


# ---------------------------------------------------------------------------------------------
# Verdicts: computed from the measured figures, never stated ahead of them
# ---------------------------------------------------------------------------------------------

def fake_run(variant: str, overlaps: list[float], buckets=None) -> DDPRun:
    """A run whose timed steps hid the given fractions of their all-reduce time (1 s each)."""
    from pipelab.measure import Steps
    from pipelab.timeline import Span, Timeline

    timelines = [Timeline([Span(0, "compute", "B", 0.0, hidden), Span(0, "comm", "allreduce", 0.0, 1.0)])
                 for hidden in overlaps]
    return DDPRun(variant, [1.0], {}, {}, 0.0, Steps([1.0] * len(overlaps), timelines), buckets)


def test_overlap_verdict_follows_the_steps_and_the_plan():
    buckets = [Bucket(0, ("a",), (300,)), Bucket(1, ("b",), (100,))]  # estimate: 75 % hidden
    runs = {"naive": fake_run("naive", [0.0, 0.0]), "bucketed": fake_run("bucketed", [0.4, 0.5, 0.6], buckets)}
    key, verdict, text, figures = ddp.overlap_verdict(runs)
    assert (key, verdict) == ("01.overlap_of_reversed_buckets", "higher") and "were below the plan's estimate of 75%" in text
    assert figures["estimate"] == pytest.approx(0.75) and runs["bucketed"].overlap.median == pytest.approx(0.5)
    runs["bucketed"] = fake_run("bucketed", [0.0, 0.9], buckets)
    assert ddp.overlap_verdict(runs)[1] == "within noise"


def point(cap: float, buckets: int, ms: list[float], ratio: list[float] | None = None) -> sweep.SweepPoint:
    from pipelab.measure import Measured
    from pipelab.timeline import Timeline

    seconds = Measured.of(m / 1e3 for m in ms)
    return sweep.SweepPoint(cap, buckets, seconds, Measured.of([0.5]), Timeline(), seconds,
                            Measured.of(ratio or [1.0]))


def test_sweep_and_torch_verdicts_claim_only_what_beats_the_noise():
    points = [point(0.001, 16, [200, 210, 220]), point(2, 4, [100, 101, 102], [1.2, 1.3]), point(8, 1, [110, 120, 130])]
    key, verdict, text, _ = sweep.sweep_verdict(points)
    assert key == "01.bucket_sweep" and verdict == "one bucket per parameter: slower; one bucket for the model: within noise"
    assert "bucket_cap_mb=2 (4 buckets" in text and "only one bucket per parameter was slower" in text
    assert sweep.torch_verdict(points, 2)[1] == "ours slower"
    assert sweep.torch_verdict(points, 5)[2].startswith("at bucket_cap_mb=2,")  # not swept: the fastest size
    points[1] = point(2, 4, [100, 101, 102], [0.95, 1.3])
    assert sweep.torch_verdict(points, 2)[1] == "within noise"


# ---------------------------------------------------------------------------------------------
# On an emulated node: each layer's work and each all-reduce modelled at a larger size
# ---------------------------------------------------------------------------------------------

def emulated_config(**kwargs) -> ddp.Config:
    torch.manual_seed(0)
    from pipelab.models import mlp

    model = mlp([16, 16, 16, 16])  # 3 Linear layers
    x, y = batch(8, 16, 16)
    settings = dict(model=model, x=x, y=y, world_size=2, bucket_cap_mb=16 * 17 * 4 / MIB, steps=3,
                    variants=("naive", "bucketed"), emulate=Emulated("2xH100-ib-ndr", width=256, batch=512))
    return ddp.Config(**{**settings, **kwargs})


def test_emulated_layer_costs_are_the_wider_layers_counted_by_hand():
    from pipelab.emulate.cost import Counts

    cfg = emulated_config()
    from pipelab.emulate.work import layer_costs

    costs = layer_costs(cfg.model, cfg.x[:4], cfg.width_scale, 256)
    scale = costs.bytes_scale
    assert cfg.width_scale == 16 and scale == pytest.approx((256 * 256 + 256) / (16 * 16 + 16))
    assert cfg.bytes_scale == pytest.approx(scale)
    product = 2 * 256 * 256 * 256  # one 256 x 256 matrix product on 256 rows
    assert sorted(costs.forward) == ["0", "2", "4"]
    assert all(c.flops == product for c in costs.forward.values())
    assert costs.backward["0"].flops == product  # fed the batch: only its weights' gradient
    assert costs.backward["2"].flops == costs.backward["4"].flops == 2 * product  # and its input's gradient
    assert isinstance(costs.copy(1000), Counts) and costs.copy(1000).bytes == 2000 * scale
    assert cfg.layer_costs.backward == layer_costs(cfg.model, cfg.x[:4], 16, 256).backward  # counted once
    assert ddp.torch_on_own_cores(cfg).layer_costs is None


def test_emulated_ddp_matches_one_process_and_its_naive_overlap_is_exactly_zero():
    cfg = emulated_config()
    runs = experiments.run(ddp.worker, cfg, ddp.gather)
    ref = reference(cfg.model, cfg.x, cfg.y)
    for run in runs.values():
        assert_same(run, ref)
        assert run.step_time.high - run.step_time.low < 1e-12  # modelled time repeats (up to float rounding)
    naive, bucketed = runs["naive"], runs["bucketed"]
    assert naive.overlap.values == (0.0, 0.0) and bucketed.overlap.low > 0.3
    assert bucketed.step_time.median < naive.step_time.median
    spans = bucketed.timeline.filter(rank=0)
    assert [s.meta["layer"] for s in spans.filter(kind="B")] == ["4", "2", "0"]
    b = [s.duration for s in spans.filter(kind="B")]
    assert b[0] == pytest.approx(b[1]) and b[2] < b[0]  # the first layer computes its weights' gradient only
    from pipelab.emulate.specs import parse_node

    latency, bandwidth, where = ddp.link_figures(cfg, [], 0)  # the modelled link's ring, as the emulator plays it
    assert where == f"the modelled {parse_node(cfg.node_name).link.name}"
    predicted = ddp.bucket_predictions(bucketed, 2, latency, bandwidth, cfg.bytes_scale)
    key, verdict, text, _ = ddp.bucket_model_verdict(bucketed, predicted, latency, bandwidth)
    assert verdict in ("fits", "mixed") and "more than 5 %" not in text


def test_torch_ddp_is_refused_on_an_emulated_node_with_where_to_run_it():
    with pytest.raises(ValueError, match=r"out of the emulator's reach.*torch_on_own_cores"):
        emulated_config(variants=VARIANTS)
    assert ddp.torch_on_own_cores(emulated_config()).emulate is None
    with pytest.raises(ValueError, match="with_torch=False"):
        sweep.Config(**{k: v for k, v in vars(emulated_config()).items() if k not in ("variants", "bucket_cap_mb",
                        "find_unused_parameters", "layer_costs")}, caps_mb=[1])
    with pytest.raises(ValueError, match=r"width=100 must be a whole multiple of the model's width 16"):
        emulated_config(emulate=Emulated("2xH100-ib-ndr", width=100))
    with pytest.raises(ValueError, match=r"gives a size but no node to time it"):
        emulated_config(emulate=Emulated(None, batch=512), variants=VARIANTS)
    with pytest.raises(ValueError, match=r"batch=511 does not divide evenly by world_size=2"):
        emulated_config(emulate=Emulated("2xH100-ib-ndr", batch=511))


def test_registration_verdict_splits_the_overlap_into_backward_and_copies():
    from pipelab.measure import Measured
    from pipelab.timeline import Span, Timeline

    spans = [Span(0, "compute", "B", 0.0, 1.0), Span(0, "compute", "B", 1.0, 2.0), Span(0, "comm", "allreduce", 2.0, 3.0),
             Span(0, "comm", "allreduce", 2.0, 4.0), Span(0, "compute", "copy", 3.0, 3.5)]
    parts = ddp.overlap_parts(Timeline(spans))
    assert parts == {"backward": 0.0, "other": pytest.approx(0.25)}
    key, verdict, text, figures = ddp.registration_verdict(Timeline(spans), Measured.of([0.8]))
    assert verdict == "none behind backward" and figures["other"] == pytest.approx(0.25)
    assert "none of it behind backward" in text
    early = spans + [Span(0, "comm", "allreduce", 1.5, 1.9)]
    assert ddp.registration_verdict(Timeline(early), Measured.of([0.8]))[1] == "some behind backward"


def test_emulated_sweep_calls_an_end_slower_by_one_per_cent_of_modelled_time():
    points = [point(0.001, 16, [100.0]), point(2, 4, [100.5]), point(8, 1, [103.0])]
    for p in points:
        p.node = "2xH100-ib-ndr"
    verdict, text = sweep.sweep_verdict(points)[1:3]
    assert verdict == "one bucket per parameter: within noise; one bucket for the model: slower"
    assert "only one bucket for the model was slower" in text and "modelled" in text


class FakeEvent:
    """A CUDA event's timing interface: `elapsed_time(other)` in ms between two recorded moments."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1e3


def test_recorder_resolves_stamped_event_pairs_onto_one_clock(monkeypatch):
    """On CUDA every span of a rank is a pair of events, resolved against one reference event: the
    recorder's logic, run here with events that only know their time."""
    from pipelab.timeline import Recorder

    rec = Recorder(0, device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    rec._cuda_ref = (FakeEvent(10.0), 500.0)  # event time 10 s is host time 500 s
    rec.add_stamped("B", FakeEvent(10.5), FakeEvent(10.75), layer="2")
    rec.add_stamped("allreduce", FakeEvent(10.75), FakeEvent(11.0), lane="comm", bucket=0)
    rec.add_stamped("note", 1.0, 2.0)  # times (not events) are added as they are
    spans = {s.kind: s for s in rec.timeline()}
    assert (spans["B"].start, spans["B"].end) == (500.5, 500.75) and spans["B"].meta == {"layer": "2"}
    assert (spans["allreduce"].start, spans["allreduce"].end) == (500.75, 501.0)
    assert spans["allreduce"].lane == "comm" and (spans["note"].start, spans["note"].end) == (1.0, 2.0)


def test_stamps_are_the_recorders_time_off_cuda_and_the_logical_clock_when_emulated():
    from pipelab.emulate.clock import LogicalClock
    from pipelab.timeline import Recorder, now

    before = now()
    assert before <= Recorder(0).stamp() <= now()
    clock = LogicalClock()
    clock.spend(2.5)
    assert Recorder(0, device=torch.device("cuda", 0), clock=clock).stamp() == 2.5  # emulated: never an event


def test_reference_run_computes_with_tf32_off_and_restores_the_flags():
    """cuDNN's TF32 is on by default on A100/H100: an fp32 check at 1e-5 must not compute with it."""
    from pipelab.reference import exact_fp32

    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            return super().forward(x)

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        x, y = batch(4, 3, 2)
        reference(Probe(3, 2), x, y)
        assert seen and all(flags == (False, False) for flags in seen)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
        with exact_fp32():
            assert not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

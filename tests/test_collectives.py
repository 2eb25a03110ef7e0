"""pipelab.collectives: the ring all-reduce against torch's all_reduce on real processes, its
schedule and cost model on known numbers, and the latency-bandwidth fit of a ping-pong sweep."""

import pytest
import torch
import torch.distributed as dist

from pipelab import experiments
from pipelab.collectives import (AllReduceTime, MessageTime, all_reduce_sweep, fit_latency_bandwidth, ping_pong,
                                 ring_all_reduce, ring_all_reduce_time, ring_schedule, small_message_latency)
from pipelab.emulate import Emulated
from pipelab.experiments import collectives as lesson
from pipelab.launch import spawn
from pipelab.measure import Measured
from pipelab.timeline import Span, Timeline
from pipelab.worker import RankContext

NUMELS = [1, 2, 3, 5, 8, 1000, 1001]  # fewer elements than ranks, N dividing the length, and not


def ring_against_torch(ctx: RankContext, numels, shape=None):
    """Worker: for each length, whole numbers (exact sums) and random floats on every rank, summed
    by our ring and by dist.all_reduce. Returns (exact, largest float difference) per length."""
    out = []
    for numel in numels:
        gen = torch.Generator().manual_seed(100 * ctx.rank + numel)
        whole = torch.randint(-50, 50, (numel,), generator=gen).float()
        floats = torch.randn(numel, generator=gen)
        if shape is not None:
            whole, floats = whole.reshape(shape), floats.reshape(shape)
        ours_whole, ours_floats = ring_all_reduce(whole.clone()), ring_all_reduce(floats.clone())
        dist.all_reduce(whole)
        dist.all_reduce(floats)
        out.append((torch.equal(ours_whole, whole), (ours_floats - floats).abs().max().item()))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_all_reduce_equals_torch_all_reduce(world_size):
    for per_rank in spawn(ring_against_torch, world_size, NUMELS):
        for numel, (exact, difference) in zip(NUMELS, per_rank):
            assert exact, f"whole-number sums differ at {numel} elements on {world_size} ranks"
            assert difference < 1e-5, (numel, difference)


def test_ring_all_reduce_keeps_the_shape_and_works_in_place():
    for per_rank in spawn(ring_against_torch, 3, [24], shape=(2, 3, 4)):
        assert per_rank == [(True, pytest.approx(0.0, abs=1e-5))]


def ring_in_subgroup(ctx: RankContext) -> list[float]:
    """Worker on 3 ranks: ranks 0 and 2 form a group and ring-reduce within it; rank 1 stays out."""
    group = dist.new_group([0, 2])
    t = torch.full((5,), float(ctx.rank + 1))
    if ctx.rank != 1:
        ring_all_reduce(t, group=group)
    return t.tolist()


def test_ring_all_reduce_within_a_group_uses_the_group_ranks():
    assert spawn(ring_in_subgroup, 3) == [[4.0] * 5, [2.0] * 5, [4.0] * 5]


def test_ring_all_reduce_refuses_a_non_contiguous_tensor():
    def worker(ctx: RankContext) -> bool:
        with pytest.raises(ValueError, match="contiguous"):
            ring_all_reduce(torch.zeros(4, 4).t())
        return True
    assert spawn(worker, 2) == [True, True]


def test_ring_schedule_reduces_every_chunk_on_one_rank_then_spreads_it():
    """Simulate the schedule: every rank ends holding every rank's contribution to every chunk."""
    for n in (1, 2, 3, 4, 5):
        held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][chunk]: contributions in it
        steps = ring_schedule(n)
        assert len(steps) == 2 * (n - 1)
        for s, plan in enumerate(steps):
            sent = [set(held[r][plan[r][0]]) for r in range(n)]
            for r, (_, recv) in enumerate(plan):
                left = (r - 1) % n
                assert plan[left][0] == recv, "a rank receives the chunk its left neighbour sends"
                held[r][recv] = held[r][recv] | sent[left] if s < n - 1 else sent[left]
            if s == n - 2:  # after the reduce-scatter, rank r holds chunk r+1 complete
                assert all(held[r][(r + 1) % n] == set(range(n)) for r in range(n))
        assert all(chunk == set(range(n)) for rank in held for chunk in rank)


def test_ring_all_reduce_time_on_known_numbers():
    # 2 ranks: 2 latencies and the bytes once; 4 ranks: 6 latencies and 1.5 times the bytes.
    assert ring_all_reduce_time(1e6, 2, bandwidth=1e9, latency=1e-5) == pytest.approx(2e-5 + 1e-3)
    assert ring_all_reduce_time(4e6, 4, bandwidth=2e9, latency=5e-6) == pytest.approx(3e-5 + 3e-3)
    assert ring_all_reduce_time(123, 1, bandwidth=1e9, latency=1e-5) == 0.0
    many = ring_all_reduce_time(1e9, 1024, bandwidth=1e9, latency=0.0)
    assert 1.99 < many < 2.0  # the bandwidth term stays below twice the bytes, however many ranks
    with pytest.raises(ValueError):
        ring_all_reduce_time(1e6, 2, bandwidth=0.0, latency=1e-5)


def fake_sweep(latency, bandwidth, sizes, hiccup=None):
    """Ping-pong rows that follow the model exactly, over 3 rounds; `hiccup` spoils one size."""
    rows = []
    for size in sizes:
        t = latency + size / bandwidth
        values = [t * 100, t * 100, t * 100] if size == hiccup else [t * 0.9, t, t * 1.1]
        rows.append(MessageTime(size, Measured.of(values), Measured.of(size / t for t in values)))
    return rows


def test_fit_recovers_latency_and_bandwidth_and_ignores_one_bad_small_size():
    sizes = [8, 32, 128, 512, 2048, 2**20, 2**22]
    latency, bandwidth = fit_latency_bandwidth(fake_sweep(40e-6, 3e9, sizes, hiccup=8))
    assert latency == pytest.approx(40e-6, rel=0.01)
    assert bandwidth == pytest.approx(3e9, rel=0.02)
    small = small_message_latency(fake_sweep(40e-6, 3e9, sizes, hiccup=8))
    assert len(small.values) == 3 and small.median < 41e-6


def test_ping_pong_and_all_reduce_sweep_return_one_measured_row_per_size():
    rows = spawn(ping_pong, 2, [8, 4096], 2, 2)[0]
    assert [r.bytes for r in rows] == [8, 4096]
    assert all(len(r.one_way.values) == 2 and r.one_way.low > 0 for r in rows)
    sweep = spawn(all_reduce_sweep, 2, [8, 40000], 2, 2)[0]
    assert [r.bytes for r in sweep] == [8, 40000]
    assert all(len(r.torch.values) == len(r.ring.values) == 2 for r in sweep)
    assert all(r.max_difference < 1e-5 for r in sweep)


def test_pictures_draw_medians_and_the_ring_ends_with_every_chunk_summed():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipelab.plots.collectives import draw_ring, plot_all_reduce, plot_ping_pong

    rows = fake_sweep(40e-6, 3e9, [8, 2048, 2**20])
    left, _ = plot_ping_pong(rows, 40e-6, 3e9)
    medians = left.containers[0].lines[0].get_ydata()  # the error bars' line goes through the medians
    assert list(medians) == pytest.approx([r.one_way.median * 1e6 for r in rows])
    sweep = [AllReduceTime(r.bytes, r.one_way, r.one_way.scaled(2), 0.0) for r in rows]
    ax = plot_all_reduce(sweep, 2, 40e-6, 3e9)
    assert list(ax.containers[1].lines[0].get_ydata()) == pytest.approx([2e6 * r.one_way.median for r in rows])
    ax = draw_ring(3)
    labels = [t.get_text() for t in ax.texts if t.get_text() == "Σ" or t.get_text().replace("+", "").isdigit()]
    assert labels[-9:] == ["Σ"] * 9  # after the last all-gather step: 3 ranks x 3 chunks, all summed
    assert labels[:9] == ["0", "0", "0", "1", "1", "1", "2", "2", "2"]  # at the start: each rank its own
    plt.close("all")


# ---------------------------------------------------------------------------------------------
# Lesson 00's Config, its runs and its verdicts
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size, message", [
    (1, r"world_size=1: a ping-pong, a ring and a collective need a peer.*world_size=2 or more"),
    (0, r"world_size must be a whole number >= 1, got 0"),
    (64, r"world_size=64 ranks on \d+ CPU core\(s\) is over 8 ranks per core"),
    (2.0, r"world_size must be a whole number >= 1, got 2.0"),
])
def test_lesson_config_refuses_a_world_it_cannot_run_before_any_rank_starts(monkeypatch, world_size, message):
    """world_size 1 used to end in a ZeroDivisionError in the ring model after 12-16 s of work, and
    64 ranks on 2 cores took 9 GB on their way to 14.5 GB: both are refused when the Config is built."""
    monkeypatch.setattr("pipelab.hardware.cpu_cores", lambda: 2)
    monkeypatch.setattr("pipelab.hardware.gpu_count", lambda: 0)
    with pytest.raises(ValueError, match=message):
        lesson.Config(world_size=world_size)


@pytest.mark.parametrize("field, value, message", [
    ("sizes_bytes", [], "sizes_bytes must be a list of one or more sizes"),
    ("sizes_bytes", 1024, "sizes_bytes must be a list"),
    ("allreduce_sizes", [8, -4], r"each of allreduce_sizes must be a whole number >= 1, got -4"),
    ("rounds", 0, "rounds must be a whole number >= 1, got 0; pass e.g. rounds=5"),
    ("trips", 1.5, "trips must be a whole number"),
    ("steps", None, "steps must be a whole number"),
    ("matrix_size", 0, "matrix_size must be a whole number"),
])
def test_lesson_config_refuses_each_bad_parameter(field, value, message):
    with pytest.raises(ValueError, match=message):
        lesson.Config(**{field: value})


def test_lesson_runs_give_typed_results_and_verdicts_from_them():
    cfg = lesson.Config(sizes_bytes=[8, 512, 2**20], rounds=2, trips=2, allreduce_sizes=[8, 2**16],
                        allreduce_rounds=2, matrix_size=32, steps=2)
    pp = experiments.run(lesson.ping_pong_worker, cfg, lesson.gather_ping_pong)
    assert [r.bytes for r in pp.rows] == [8, 512, 2**20] and len(pp.latency.values) == 2 and pp.bandwidth > 0
    key, verdict, text, figures = lesson.bytes_verdict(pp)
    assert key == "00.bytes_cost_time" and verdict in ("higher", "lower", "within noise") and "1.00 MiB" in text
    sweep = lesson.all_reduce_run(cfg, pp)
    assert sweep.max_difference < 1e-5 and len(sweep.predicted) == 2
    assert sweep.predicted[0] == pytest.approx(ring_all_reduce_time(8, 2, pp.bandwidth, pp.latency.median))
    assert lesson.ring_model_verdict(sweep)[0] == "00.ring_model"
    timeline = experiments.run(lesson.step_worker, cfg, lesson.gather_timeline)
    assert {s.rank for s in timeline} == {0, 1} and len(timeline.filter(kind="allreduce")) == 4


def step_timeline(boxes: dict[int, list[float]]) -> Timeline:
    """A made-up timeline: each rank's all-reduce box of each step, in seconds."""
    spans = [Span(rank, "comm", "allreduce", float(step), float(step) + seconds, mb=step)
             for rank, durations in boxes.items() for step, seconds in enumerate(durations)]
    return Timeline(spans)


def test_waiting_verdict_reads_the_sign_of_the_step_by_step_differences():
    waits = lesson.waiting_verdict(step_timeline({0: [0.03, 0.04, 0.05], 1: [0.01, 0.01, 0.01]}))
    assert waits[:2] == ("00.fast_rank_waits", "higher") and "in every step rank 0" in waits[2]
    typical = lesson.waiting_verdict(step_timeline({0: [0.03, 0.04, 0.001], 1: [0.01, 0.01, 0.01]}))
    assert typical[1] == "higher" and "in the typical step rank 0" in typical[2]
    assert lesson.waiting_verdict(step_timeline({0: [0.01, 0.01, 0.03], 1: [0.02, 0.02, 0.01]}))[1] == "lower"
    assert waits[3]["steps"] == 3


# ---------------------------------------------------------------------------------------------
# On an emulated node: the link model's time, so the fits meet the rows they come from
# ---------------------------------------------------------------------------------------------

EMULATED = dict(sizes_bytes=[8, 2048, 2**20, 2**21], rounds=1, trips=1, allreduce_sizes=[8, 2**20], allreduce_rounds=1,
                matrix_size=16, steps=2, emulate=Emulated("2xH100-nvlink", matrix=1024))


def test_emulated_ping_pong_and_ring_follow_the_calibrated_link_model():
    """On the emulated node each message and collective lasts what the calibrated model
    (`pipelab.emulate.seconds`, NCCL's measured protocols) gives; a latency + bytes / bandwidth line
    fitted to the ping-pong then lies within 10 % of every row, the 8 B all-reduce costs 2α, and a
    1 MiB all-reduce takes longer than that line predicts (NCCL's ring is not one message per step)."""
    from pipelab.emulate import seconds

    cfg = lesson.Config(**EMULATED)
    pp = experiments.run(lesson.ping_pong_worker, cfg, lesson.gather_ping_pong)
    for row in pp.rows:
        assert row.one_way.median == pytest.approx(seconds("send", nbytes=row.bytes, node="2xH100-nvlink"), rel=1e-6)
    assert pp.misfit() < 0.1 and lesson.fit_verdict(pp)[1] == "fits"
    assert all(r.bandwidth.median < pp.bandwidth for r in pp.rows)  # a row's bandwidth includes its latency
    sweep = lesson.all_reduce_run(cfg, pp)
    for row in sweep.rows:
        assert row.ring.median == pytest.approx(row.torch.median, rel=1e-6)  # message by message, the same
    key, verdict, text, figures = lesson.ring_model_verdict(sweep)
    assert figures["small_ratio"].median == pytest.approx(1, rel=0.02)  # T ≈ 2α holds at 8 B
    assert verdict == "slower than the model"


def test_emulated_step_lasts_the_counted_matmuls_and_the_light_rank_waits():
    from pipelab.collectives import matmuls
    from pipelab.emulate.cost import compute_seconds, count
    from pipelab.emulate.specs import DEVICES

    cfg = lesson.Config(**EMULATED)
    timeline = experiments.run(lesson.step_worker, cfg, lesson.gather_timeline)
    meta = torch.empty(1024, 1024, device="meta")
    for rank, times in ((0, 4), (1, 8)):
        expected = compute_seconds(count(matmuls, meta, meta, times), DEVICES["h100"])
        assert all(s.duration == pytest.approx(expected) for s in timeline.filter(rank=rank, kind="F"))
    key, verdict, text, figures = lesson.waiting_verdict(timeline)
    assert verdict == "higher" and "in every step" in text
    assert timeline.overlap("compute", "comm") == 0.0


def test_emulated_matrix_needs_an_emulated_node():
    with pytest.raises(ValueError, match=r"gives a size but no node to time it"):
        lesson.Config(emulate=Emulated(None, matrix=4096))
    with pytest.raises(ValueError, match=r"matrix must be a whole number >= 1, got 0.5"):
        lesson.Config(emulate=Emulated("2xH100-nvlink", matrix=0.5))


def test_two_levels_finds_a_bimodal_latency_and_nothing_in_one_level():
    fast, slow = [80e-6, 90e-6, 100e-6, 108e-6], [1.3e-3, 1.9e-3, 1.5e-3]
    low, high = lesson.two_levels(fast + slow)
    assert sorted(low) == sorted(fast) and sorted(high) == sorted(slow)
    assert lesson.two_levels([60e-6, 62e-6, 64e-6, 70e-6, 75e-6]) is None
    assert lesson.two_levels([60e-6, 62e-6, 64e-6, 2e-3]) is None  # one outlier is not a level


def test_own_cores_verdict_compares_with_the_link_and_says_two_levels_only_when_they_are_there():
    from pipelab.emulate.specs import parse_node

    link = parse_node("2xH100-nvlink").link
    sizes = [8, 512, 2048, 2**20]
    emulated = lesson.PingPongRun(fake_sweep(link.latency_s, link.bandwidth_Bps, sizes), Measured.of([link.latency_s]),
                                  link.bandwidth_Bps, "2xH100-nvlink")
    steady = fake_sweep(60e-6, 3e9, sizes)
    own = lesson.PingPongRun(steady, small_message_latency(steady), 3e9)
    key, verdict, text, figures = lesson.own_cores_verdict(emulated, own)
    assert key == "00.own_cores" and verdict == "slower than the link" and not figures["two_levels"]
    assert len(lesson.own_cores_rows(emulated, own)) == 2  # latency and bandwidth: no levels to list
    assert figures["latency_ratio"] == pytest.approx(60 / 3.4, rel=0.1)
    bimodal = [MessageTime(r.bytes, Measured.of([100e-6, 1.5e-3, 90e-6]), r.bandwidth) if r.bytes <= 4096 else r
               for r in steady]
    own = lesson.PingPongRun(bimodal, small_message_latency(bimodal), 3e9)
    verdict, text, figures = lesson.own_cores_verdict(emulated, own)[1:]
    assert verdict == "slower than the link" and figures["two_levels"]
    levels = [row["this machine's cores"] for row in lesson.own_cores_rows(emulated, own)[2:]]
    assert levels[0].startswith("6 near") and levels[1].startswith("3 near")

"""Lesson 11: ZeRO-1, ZeRO-2 and ZeRO-3 equal one process (2 and 4 ranks, a parameter count that
does not divide by the ranks), torch's ZeroRedundancyOptimizer and fully_shard beside them, the
bytes each rank holds and sends, and bad input refused before any rank starts."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from torch import nn

from pipelab import experiments, models
from pipelab.emulate import Emulated
from pipelab.experiments import sharding
from pipelab.sharding import FlatLayout, Held, formula, ring_bytes, storage_bytes
from pipelab.sharding.flat import layers_of


def odd_model() -> nn.Module:
    """Two layers of 35 and 18 values: 53 in all, divisible by neither 2 nor 4."""
    torch.manual_seed(0)
    return models.mlp([6, 5, 3])


def config(world_size: int, variants=sharding.VARIANTS, **kw) -> sharding.Config:
    torch.manual_seed(1)
    kw = {"lr": 1e-2, "steps": 3, **kw}
    return sharding.Config(model=odd_model(), x=torch.randn(8, 6), y=torch.randn(8, 3), world_size=world_size,
                           variants=variants, **kw)


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ran(request):
    cfg = config(request.param)
    return cfg, experiments.run(sharding.worker, cfg, sharding.gather)


# ---- equal to one process ---------------------------------------------------------------------


def test_every_variant_matches_one_process(ran):
    cfg, run = ran
    ref = sharding.reference(cfg)
    worst = sharding.assert_same(run, ref)
    assert set(worst) == set(sharding.VARIANTS)
    assert all(w < 1e-5 for w in worst.values())
    assert len(ref.losses) == 3 and ref.losses[-1] < ref.losses[0]  # Adam trained it: the check has teeth


def test_a_wrong_step_is_caught(ran):
    cfg, run = ran
    ref = sharding.reference(cfg)
    ref.weights["0.bias"] = ref.weights["0.bias"] + 1e-3
    with pytest.raises(AssertionError, match="0.bias"):
        sharding.assert_same(run, ref)


# ---- bytes held -----------------------------------------------------------------------------


def test_bytes_held_are_the_formula_plus_padding(ran):
    cfg, run = ran
    n, layers = cfg.world_size, layers_of(odd_model(), cfg.world_size)
    psi, padded = sum(l.layout.numel for l in layers), sum(l.layout.padded for l in layers)
    shard, tensors = padded // n, sum(len(l.layout.names) for l in layers)
    step = 4  # Adam's step counter: one 4-byte number per tensor it steps
    want = {
        "dp": Held(4 * psi, 4 * padded, 8 * psi + step * tensors),
        "zero1": Held(4 * padded, 4 * padded, 8 * shard + step * len(layers)),
        "zero2": Held(4 * padded, 4 * shard, 8 * shard + step * len(layers)),
        "zero3": Held(4 * shard, 4 * shard, 8 * shard + step * len(layers)),
    }
    for v in ("dp", "zero1", "zero2", "zero3", "zero3_no_prefetch"):
        assert run[v].held == [want[sharding.STAGE[v]]] * n, v
        ideal = run.formula(v)
        assert ideal.total <= run[v].held_per_rank <= ideal.total + 16 * (padded - psi) + 4 * tensors


def test_torch_holds_what_the_stage_says(ran):
    cfg, run = ran
    ideal = {v: run.formula(v).total for v in sharding.TORCH}
    for v in ("fully_shard", "fully_shard_keep"):  # FSDP2 pads each tensor, not each layer
        assert ideal[v] <= run[v].held_per_rank < ideal[v] * 1.5 + 256, v
    zero1 = run["torch_zero1"]  # whole parameters, whole gradients, one rank's tensors' state
    assert all(h.parameters == 4 * run.psi and h.gradients == 4 * run.psi for h in zero1.held)
    assert sum(h.optimizer_state for h in zero1.held) == 8 * run.psi + 4 * 4  # 4 tensors, a step counter each


# ---- bytes sent -----------------------------------------------------------------------------


def test_bytes_sent_dp_zero1_zero2_same_zero3_half_again(ran):
    cfg, run = ran
    n = cfg.world_size
    padded = sum(l.layout.padded for l in layers_of(odd_model(), n))
    dp = ring_bytes("allreduce", 4 * padded, n)
    assert dp == 2 * (n - 1) / n * 4 * padded
    for v in ("dp", "zero1", "zero2"):
        assert run[v].sent == [dp] * n, v
    for v in ("zero3", "zero3_no_prefetch"):
        assert run[v].sent == [1.5 * dp] * n, v
        assert run[v].messages == {"allreduce": 0, "reducescatter": 2, "allgather": 4}
    assert run["zero1"].messages == {"allreduce": 0, "reducescatter": 2, "allgather": 2}
    assert run["dp"].messages == {"allreduce": 2, "reducescatter": 0, "allgather": 0}
    assert run["zero3"].payload == [3 * 4 * padded] * n


def test_prefetch_holds_one_more_layer(ran):
    cfg, run = ran
    sizes = [4 * l.layout.padded for l in layers_of(odd_model(), cfg.world_size)]
    assert max(run["zero3_no_prefetch"].peak_gathered) == max(sizes)
    assert max(run["zero3"].peak_gathered) == sum(sizes)  # two layers: both at once


def test_zero3_timeline_has_gathers_and_scatters_on_the_comm_lane(ran):
    cfg, run = ran
    tl = run["zero3"].timeline
    assert {s.kind for s in tl.filter(lane="comm")} == {"allgather", "reducescatter"}
    assert {s.kind for s in tl.filter(lane="compute")} >= {"F", "B", "optimizer"}
    assert len(tl.filter(kind="F", rank=0)) == 2 and len(tl.filter(kind="allgather", rank=0)) == 4
    assert run["zero3"].exposed_comm.median >= 0


# ---- the pieces -------------------------------------------------------------------------------


def test_flat_layout_pads_to_equal_shards():
    layout = FlatLayout.of(nn.Linear(6, 5), 4)
    assert (layout.numel, layout.shard_numel, layout.padded) == (35, 9, 36)
    layer = nn.Linear(6, 5)
    flat = layout.flatten([layer.weight, layer.bias])
    assert flat[35] == 0 and torch.equal(layout.views(flat)[0], layer.weight.detach())
    assert layout.shard(flat, 3).numel() == 9 and layout.shard(flat, 3).data_ptr() == flat[27:].data_ptr()


def test_storage_bytes_count_a_shared_storage_once():
    flat = torch.zeros(100)
    assert storage_bytes([flat[:50], flat[50:], flat.view(10, 10)]) == 400
    freed = torch.zeros(10)
    freed.untyped_storage().resize_(0)
    assert storage_bytes([freed, torch.zeros(3)]) == 12


def test_formula():
    assert formula("dp", 10, 4).total == 160
    assert formula("zero1", 10, 4) == Held(40, 40, 20)
    assert formula("zero2", 10, 4) == Held(40, 10, 20)
    assert formula("zero3", 10, 4) == Held(10, 10, 20)
    assert formula("zero3", 7.5e9, 4, 2, 2, 12).total == 30e9  # the ZeRO paper's mixed precision
    with pytest.raises(ValueError, match="stage must be one of"):
        formula("zero4", 10, 4)


def test_fit_rows_answer_the_prediction():
    rows = sharding.fit_rows(7.5e9, 4, 48e9)
    assert [r["fits"] for r in rows] == [False, False, True, True]


def test_plots_draw():
    from pipelab.plots.sharding import plot_memory, plot_prefetch

    cfg = config(2, variants=sharding.OURS)
    run = experiments.run(sharding.worker, cfg, sharding.gather)
    assert plot_memory([run]) is not None
    assert len(plot_prefetch(run)) == 2
    key, verdict, text, figures = sharding.prefetch_verdict(run)
    assert key == "11.prefetch" and "step" in verdict and "prefetch" in text


# ---- bad input, before any rank starts --------------------------------------------------------


def test_more_ranks_than_parameters_in_a_layer():
    torch.manual_seed(0)
    model = models.mlp([4, 2, 1])  # the last layer: 2 weights and a bias
    with pytest.raises(ValueError,
                       match=r"layer '2' \(Linear\) has 3 parameters, fewer than world_size=4.*world_size <= 3"):
        sharding.Config(model=model, x=torch.randn(8, 4), y=torch.randn(8, 1), world_size=4)


def test_a_model_that_differs_across_ranks():
    def unseeded():
        return models.mlp([6, 5, 3])  # each call draws new weights: each rank would start elsewhere

    with pytest.raises(ValueError, match="built different weights.*torch.manual_seed"):
        sharding.Config(model=unseeded, x=torch.randn(8, 6), y=torch.randn(8, 3))

    def seeded():
        torch.manual_seed(0)
        return models.mlp([6, 5, 3])

    cfg = sharding.Config(model=seeded, x=torch.randn(8, 6), y=torch.randn(8, 3))
    assert cfg.psi == 53


@pytest.mark.parametrize("name", ["lbfgs", "adafactor", "Adam"])
def test_an_optimizer_sharding_does_not_support(name):
    with pytest.raises(ValueError, match=f"optimizer='{name}' cannot be sharded.*use optimizer='adam'"):
        config(2, optimizer=name)


@pytest.mark.parametrize("kw, message", [
    ({"variants": ("zero4",)}, "variants must be some of"),
    ({"variants": ()}, "variants must be some of"),
    ({"lr": 0}, "lr must be a number"),
    ({"steps": 0}, "steps must be a whole number"),
    ({"world_size": 3}, "batch=8 does not divide evenly by world_size=3"),
    ({"loss_fn": nn.MSELoss(reduction="sum")}, "reduction='sum'"),
])
def test_other_bad_input(kw, message):
    with pytest.raises(ValueError, match=message):
        config(kw.pop("world_size", 2), **kw)


def test_benchmark_races_ours_and_fully_shard_in_turn(monkeypatch, capsys):
    import json
    import runpy
    import sys
    from pathlib import Path

    # The script as `python benchmarks/sharding.py ...` runs it, in this process: its ranks come
    # from the worker server this test run already has, instead of a second Python importing torch.
    script = Path(__file__).parent.parent / "benchmarks" / "sharding.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--width", "6", "--layers", "2", "--batch", "8", "--steps", "2",
                                      "--rounds", "2"])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert (last["ours"], last["theirs"], last["rounds"]) == ("zero3", "fully_shard", 2)
    assert last["ratio_low"] <= last["ratio"] <= last["ratio_high"] and last["max_weight_difference"] < 1e-5
    ideal = last["formula_bytes"]  # shards, plus whole layers in flight
    assert all(ideal <= last[f"peak_bytes_{side}"] < 3 * ideal for side in ("ours", "theirs"))


def _emulation_available() -> bool:
    import inspect

    from pipelab.launch import spawn

    return "emulate" in inspect.signature(spawn).parameters


@pytest.mark.skipif(not _emulation_available(), reason="this checkout's spawn has no emulated nodes")
def test_zero3_on_an_emulated_node_prefetch_hides_the_all_gathers():
    cfg = config(4, variants=("zero3", "zero3_no_prefetch"), emulate=Emulated("4xH100-nvlink4", batch=512))
    run = experiments.run(sharding.worker, cfg, sharding.gather)
    sharding.assert_same(run, sharding.reference(cfg))  # modelled time, real math
    on, off = run["zero3"], run["zero3_no_prefetch"]
    assert on.makespan.relative_spread < 1e-9 and off.makespan.relative_spread < 1e-9  # modelled: repeats
    assert on.makespan.median < off.makespan.median and on.exposed_comm.median < off.exposed_comm.median
    assert on.sent == off.sent  # the same messages, only issued earlier
    key, verdict, text, _ = sharding.prefetch_verdict(run)
    assert verdict == "step lower; exposed communication lower" and "emulated node" in text


def test_emulated_batch_needs_an_emulated_node():
    with pytest.raises(ValueError, match="gives a size but no node to time it"):
        config(2, emulate=Emulated(None, batch=512))


# ---------------------------------------------------------------------------------------------
# One clock per rank: a collective's span is stamped on the rank's clock, events on CUDA
# ---------------------------------------------------------------------------------------------

class _Event:
    """A CUDA event's timing interface (`elapsed_time` in ms), for the recorder's logic on a CPU."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, other: "_Event") -> float:
        return (other.t - self.t) * 1e3


def test_a_synchronous_collective_on_cuda_is_a_pair_of_events_resolved_on_one_clock(monkeypatch):
    """A collective that ran synchronously on NCCL has only been *enqueued* when it returns: its
    span ends at an event the stream records after it, resolved with the compute spans' reference
    event, never at a host time."""
    from pipelab.sharding.comm import Pending
    from pipelab.timeline import Recorder

    rec = Recorder(0, device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    rec._cuda_ref = (_Event(0.0), 100.0)
    stamps = iter([_Event(2.0)])
    monkeypatch.setattr(rec, "stamp", lambda stream=None: next(stamps))
    Pending(None, rec, "allreduce", _Event(1.5), layer="0").wait()
    (span,) = rec.timeline().spans
    assert (span.kind, span.lane, span.start, span.end, span.meta) == ("allreduce", "comm", 101.5, 102.0, {"layer": "0"})


def test_a_collective_off_cuda_keeps_the_recorders_clock():
    from pipelab.sharding.comm import Pending
    from pipelab.timeline import Recorder, now

    rec = Recorder(0)
    start = now()
    Pending(None, rec, "allgather", start).wait()
    (span,) = rec.timeline().spans
    assert span.start == start <= span.end <= now()

"""The instruction-stream engine on real ranks gives the single-process losses, gradients and weights."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from pipelab import experiments
from pipelab.emulate import Emulated
from pipelab.experiments import deepspeed
from pipelab.experiments.deepspeed import Config, in_flight_verdict, peak_in_flight, speedup_verdict
from pipelab.measure import Measured
from pipelab.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from pipelab.reference import assert_same, reference_run


def mlp_specs():
    return [LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, 16, 16),
            LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 16, 4)]


def lm_head(embedding, h):
    """The output projection reuses the input embedding's weight."""
    return h @ embedding.weight.T


def token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def train(module, x, y, num_microbatches, **kwargs):
    """The engine's run on real ranks."""
    cfg = Config(module=module, inputs=x, targets=y, num_microbatches=num_microbatches, **kwargs)
    return experiments.run(deepspeed.worker, cfg, deepspeed.gather)


def tied_specs():
    return [TiedLayerSpec("embed", nn.Embedding, 11, 8), LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, 16, 8), LayerSpec(nn.ReLU, inplace=True),
            TiedLayerSpec("embed", nn.Embedding, 11, 8, forward_fn=lm_head)]


def test_two_stages_train_like_one_process():
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform",
                            activation_checkpoint_interval=1, verbose=False)
    run = train(module, x, y, num_microbatches=4, steps=3, lr=0.1)
    ref = reference_run(module.build_reference(), x, y, module.loss_fn, steps=3, lr=0.1)
    assert_same(run, ref)
    assert run.losses[-1] < run.losses[0]
    # Each micro-batch's loss as the last stage computed it: the first step's are one process's.
    one_process = [module.loss_fn(module.build_reference()(xm), ym).item() for xm, ym in zip(x.chunk(4), y.chunk(4))]
    assert run.mb_losses[0] == pytest.approx(one_process, abs=1e-6)
    assert [sum(mbs) / 4 for mbs in run.mb_losses] == pytest.approx(run.losses, abs=1e-6)
    assert isinstance(run.step_time, Measured) and len(run.step_time.values) == 2
    assert sorted(run.grads[0]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    tl = run.timeline
    assert {s.kind for s in tl.filter(rank=0)} >= {"F", "B", "send", "recv", "optimizer"}
    assert sorted(s.mb for s in tl.filter(rank=1, kind="F")) == [0, 1, 2, 3]
    # 1F1B: stage s holds at most S - s micro-batches between their forward and backward.
    assert peak_in_flight(tl) == {0: 2, 1: 1}
    assert in_flight_verdict(run)[:2] == ("08.in_flight", "as predicted")


def test_tied_embedding_across_three_stages_sums_its_gradient():
    torch.manual_seed(0)
    x, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (6, 5))
    module = PipelineModule(tied_specs(), num_stages=3, loss_fn=token_loss, partition_method="uniform",
                            verbose=False)
    assert module.tied_stages() == {"embed": [0, 2]}
    run = train(module, x, y, num_microbatches=3, steps=2, lr=0.5)
    ref = reference_run(module.build_reference(), x, y, module.loss_fn, steps=2, lr=0.5)
    assert_same(run, ref)
    # Both copies got the summed gradient, so they are still one weight after the steps.
    torch.testing.assert_close(run.weights[0]["tied_modules.embed.weight"], run.weights[2]["tied_modules.embed.weight"])
    assert run.timeline.filter(kind="tied-allreduce").spans


def test_pipe_by_data_grid_with_tied_weights():
    torch.manual_seed(0)
    x, y = torch.randint(0, 11, (8, 5)), torch.randint(0, 11, (8, 5))
    module = PipelineModule(tied_specs(), num_stages=2, loss_fn=token_loss, verbose=False)
    run = train(module, x, y, num_microbatches=2, steps=2, lr=0.5, world_size=4)
    assert run.topology.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert_same(run, reference_run(module.build_reference(), x, y, module.loss_fn, steps=2, lr=0.5))
    # Replica 0's two micro-batches, then replica 1's: the batch's four quarters, in order.
    assert len(run.mb_losses[0]) == 4
    assert sum(run.mb_losses[0]) / 4 == pytest.approx(run.losses[0], abs=1e-6)
    assert {s.rank for s in run.timeline.filter(kind="allreduce")} == {0, 1, 2, 3}


def test_a_speedup_has_a_direction_only_when_every_round_agrees():
    assert speedup_verdict(Measured.of([1.6, 1.2, 1.9]))[0] == "faster"
    assert speedup_verdict(Measured.of([0.7, 0.8, 0.9]))[0] == "slower"
    assert speedup_verdict(Measured.of([1.6, 0.9, 1.9]))[0] == "within noise"
    assert speedup_verdict(Measured.of([1.6, 1.7]))[0] == "within noise"  # too few rounds to tell
    assert speedup_verdict(Measured.of([1.0, 1.0, 1.0]), same_cut=True)[0] == "same cut"
    assert "profile cut's" in speedup_verdict(Measured.of([2.0, 2.1, 2.2]), "profile cut")[1]


def test_bad_runs_are_refused_when_the_config_is_built():
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(), verbose=False)
    with pytest.raises(ValueError, match="num_stages=2 does not divide world_size=3"):
        Config(module=module, inputs=x, targets=y, num_microbatches=2, world_size=3)
    with pytest.raises(ValueError, match="num_stages=2 does not divide world_size=1"):
        Config(module=module, inputs=x, targets=y, num_microbatches=2, world_size=1)
    with pytest.raises(ValueError, match="multiple of 3"):
        Config(module=module, inputs=x, targets=y, num_microbatches=3)
    with pytest.raises(ValueError, match="num_microbatches x 2 replicas=6.*multiple of 6"):
        Config(module=module, inputs=x, targets=y, num_microbatches=3, world_size=4)
    with pytest.raises(ValueError, match="loss_fn="):
        Config(module=PipelineModule(mlp_specs(), num_stages=2, verbose=False), inputs=x, targets=y,
               num_microbatches=2)
    with pytest.raises(ValueError, match="one target per input"):
        Config(module=module, inputs=x, targets=y[:4], num_microbatches=2)
    with pytest.raises(ValueError, match="needs a PipelineModule"):
        Config(module=nn.Sequential(nn.Linear(8, 4)), inputs=x, targets=y, num_microbatches=2)
    with pytest.raises(ValueError, match="reduction='sum'"):
        Config(module=PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(reduction="sum"), verbose=False),
               inputs=x, targets=y, num_microbatches=2)
    with pytest.raises(ValueError, match="inputs must be a tensor with one row per sample, got list"):
        Config(module=module, inputs=x.tolist(), targets=y, num_microbatches=2)
    cfg = Config(module=module, inputs=x, targets=y, num_microbatches=2)
    assert cfg.world_size == 2  # one rank per stage
    with pytest.raises(ValueError, match="steps must be a whole number >= 1, got 0"):
        dataclasses.replace(cfg, steps=0)


def test_deepspeed_trains_the_same_layers_to_the_same_losses_and_weights():
    pytest.importorskip("deepspeed")
    torch.manual_seed(0)
    x, y = torch.randint(0, 11, (8, 5)), torch.randint(0, 11, (8, 5))
    module = PipelineModule(tied_specs(), num_stages=2, loss_fn=token_loss, verbose=False)
    cfg = deepspeed.DeepSpeedConfig(module=module, inputs=x, targets=y, num_microbatches=4, steps=2, lr=0.5)
    ds = experiments.run(deepspeed.deepspeed_worker, cfg, deepspeed.gather_deepspeed)
    ref = reference_run(module.build_reference(), x, y, module.loss_fn, steps=2, lr=0.5)
    assert ds.parts == module.partitions()
    torch.testing.assert_close(torch.tensor(ds.losses), torch.tensor(ref.losses))
    for weights in ds.weights:
        for name, p in weights.items():
            torch.testing.assert_close(p, ref.weights[name], msg=name)


class TrimPadding(nn.Module):
    """Token ids padded with 0 at the end: keep only the columns up to this micro-batch's longest row."""

    def forward(self, tokens):
        return tokens[:, : int((tokens != 0).any(0).nonzero().max()) + 1]


class SumOverTokens(nn.Module):
    def forward(self, h):
        return h.sum(1)


def test_an_output_that_changes_shape_between_micro_batches_fails_naming_the_stage():
    lengths = torch.tensor([1, 2, 6, 3])  # micro-batches of 2 rows: longest 2, then 6
    x, y = torch.randint(1, 10, (4, 6)) * (torch.arange(6) < lengths[:, None]), torch.randn(4, 4)
    layers = [LayerSpec(TrimPadding), LayerSpec(nn.Embedding, 10, 8, padding_idx=0), LayerSpec(SumOverTokens),
              LayerSpec(nn.Linear, 8, 4)]
    module = PipelineModule(layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform", verbose=False)
    with pytest.raises(Exception, match=r"stage 0 output \[2, 6, 8\] torch.float32 on micro-batch 1, but "
                                        r"\[2, 2, 8\] torch.float32 on the first"):
        train(module, x, y, num_microbatches=2, timeout=60)


def test_cuts_are_timed_side_by_side_and_judged_round_by_round():
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)]
    layer_ms = [1.0, 0.0, 3.0, 0.0, 3.0]  # the 'profile' weights, given
    times = deepspeed.time_cuts(layers, torch.randn(8, 16), layer_ms, ["uniform", "parameters", "profile"],
                                stage_counts=(2,), repeats=3)
    assert times.cuts[2, "parameters"] == [0, 2, 5] and times.cuts[2, "profile"] == [0, 4, 5]
    assert all(len(per_stage) == 2 and len(per_stage[0].values) == 3 for per_stage in times.stage_ms.values())
    assert len(times.speedup(2).values) == 3
    key, verdict, text, figures = deepspeed.profile_verdict(times, 2)
    assert key == "08.profile_2_stages" and verdict in ("faster", "slower", "within noise")
    assert figures["predicted"] == pytest.approx(6.0 / 4.0)  # slowest stage by the weights: 3+3 against 1+3
    with pytest.raises(ValueError, match="repeats must be a whole number >= 1, got 0"):
        deepspeed.time_cuts(layers, torch.randn(8, 16), layer_ms, ["uniform"], repeats=0)


def test_lightest_heaviest_is_the_best_cut_of_whole_layers():
    import itertools
    import random

    rng = random.Random(1)
    for _ in range(200):
        weights, S = [rng.randint(0, 9) for _ in range(rng.randint(3, 7))], rng.randint(1, 3)
        n = len(weights)
        best = min(max(sum(weights[a:b]) for a, b in zip((0, *cut), (*cut, n)))
                   for cut in itertools.combinations(range(1, n), S - 1))
        heaviest, parts = deepspeed.lightest_heaviest(weights, S)
        assert heaviest == best and parts[0] == 0 and parts[-1] == n and len(parts) == S + 1
        assert max(sum(weights[a:b]) for a, b in zip(parts[:-1], parts[1:])) == best
    with pytest.raises(ValueError, match="2 layers cannot fill 3 non-empty stages"):
        deepspeed.lightest_heaviest([1, 2], 3)


def test_modelled_cuts_are_exact_and_say_why_the_profile_cut_can_lose():
    """partition_balanced minimises heaviest - lightest: [8 | 6 3 | 9 6] (spread 7, heaviest 15)
    against uniform's [8 6 | 3 9 | 6] (spread 8, heaviest 14)."""
    layers = [nn.Identity() for _ in range(5)]
    times = deepspeed.model_cuts(layers, [8, 6, 3, 9, 6], ["uniform", "parameters", "profile"], stage_counts=(3,))
    assert times.modelled and times.cuts[3, "profile"] == [0, 1, 3, 5] and times.cuts[3, "uniform"] == [0, 2, 4, 5]
    assert [t.values for t in times.stage_ms[3, "profile"]] == [(8.0,), (9.0,), (15.0,)]
    key, verdict, text, figures = deepspeed.profile_verdict(times, 3)
    assert key == "08.profile_3_stages" and figures["fastest"] == "uniform" and figures["best_possible_ms"] == 14
    assert figures["best_cut"] == "[0, 2, 4, 5]" and verdict == "faster"
    assert "the uniform cut's is the fastest, as partition_balanced minimises heaviest minus lightest" in text
    table = times.table().splitlines()  # the figures behind it: each cut's spread by the profile's weights, its slowest stage
    assert [line.split()[-2:] for line in table if "[0, 1, 3, 5]" in line] == [["7", "15"]]  # the profile cut
    assert [line.split()[-2:] for line in table if "[0, 2, 4, 5]" in line] == [["8", "14"]]
    # Where the profile's cut is the lightest possible, the text says no cut could do better.
    times = deepspeed.model_cuts(layers, [1, 1, 1, 1, 4], ["uniform", "parameters", "profile"], stage_counts=(2,))
    key, verdict, text, figures = deepspeed.profile_verdict(times, 2)
    assert figures["fastest"] == "profile" and "no cut of whole layers could" in text


def test_layers_are_modelled_on_the_meta_device_one_after_another():
    from pipelab.emulate.layers import layer_seconds
    from pipelab.emulate.cost import stage_seconds
    from pipelab.emulate.specs import parse_node

    h100 = parse_node("2xH100-nvlink").device
    relu = nn.ReLU(inplace=True)
    huge = LayerSpec(nn.Linear, 1 << 16, 1 << 16)  # 17 GB of float32 weights: only ever built on meta
    layers = [nn.Linear(64, 32), relu, lambda x: x * 2, huge.__class__(nn.Linear, 32, 8)]
    seconds = layer_seconds(layers, torch.empty(16, 64, device="meta"), h100, "bfloat16")
    assert seconds == layer_seconds(layers, torch.empty(16, 64), h100, "bfloat16")
    assert seconds[3] == stage_seconds(nn.Linear(32, 8), torch.empty(16, 32), h100, "bfloat16")  # fed layer 2's output
    assert relu.inplace and all(s["B"] > 0 for s in seconds)
    wide = layer_seconds([huge], torch.empty(4, 1 << 16, device="meta"), h100, "bfloat16")
    assert wide[0]["F"] > 2 * 4 * (1 << 32) / h100.rate("bfloat16")  # the FLOPs of the product, at most the peak


def test_the_engine_on_an_emulated_node_lasts_the_modelled_stage_times():
    from pipelab.emulate.layers import layer_seconds
    from pipelab.emulate.specs import parse_node

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform", verbose=False)
    wide = [LayerSpec(nn.Linear, 1024, 2048), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, 2048, 2048),
            LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 2048, 4)]
    big = torch.empty(512, 1024, device="meta")
    run = train(module, x, y, num_microbatches=4, steps=2, lr=0.1,
                emulate=Emulated("2xH100-nvlink", layers=wide, microbatch=big, dtype="bfloat16"))
    assert_same(run, reference_run(module.build_reference(), x, y, module.loss_fn, steps=2, lr=0.1))
    seconds = layer_seconds(wide, big, parse_node("2xH100-nvlink").device, "bfloat16")
    for stage, (lo, hi) in enumerate(zip(module.parts[:-1], module.parts[1:])):
        for kind in ("F", "B"):
            want = sum(s[kind] for s in seconds[lo:hi])
            spans = run.timeline.filter(rank=stage, kind=kind)
            assert len(spans) == 4 and all(s.end - s.start == pytest.approx(want, rel=1e-9) for s in spans)


def test_an_emulated_run_needs_the_layers_at_the_emulated_size():
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(), verbose=False)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="give the module's layer list at that size"):
        Config(module=module, inputs=x, targets=y, num_microbatches=2, emulate="2xH100-nvlink")
    with pytest.raises(ValueError, match="layers has 1 layers and the module 5"):
        Config(module=module, inputs=x, targets=y, num_microbatches=2,
               emulate=Emulated("2xH100-nvlink", layers=[LayerSpec(nn.Linear, 8, 8)],
                                microbatch=torch.empty(4, 8, device="meta")))
    with pytest.raises(ValueError, match="gives width, which this lesson's emulated size does not have"):
        Config(module=module, inputs=x, targets=y, num_microbatches=2, emulate=Emulated("2xH100-nvlink", width=8))


def test_the_contrast_with_this_machine_names_each_cut_and_why_the_profile_lost():
    layers = [nn.Conv2d(1, 1, 1), nn.Identity(), nn.Linear(1, 1), nn.Identity()]
    measured = [3.0, 1.0, 1.0, 1.0]  # one at a time: the profile cut [3 | 1 1 1] beats uniform's [3 1 | 1 1]
    here = deepspeed.CutTimes({(2, "uniform"): [0, 2, 4], (2, "profile"): [0, 1, 4]},
                              {(2, "uniform"): [Measured.of([3.0, 3.1, 2.9]), Measured.of([3.0, 3.0, 3.0])],
                               (2, "profile"): [Measured.of([2.0, 2.2, 1.9]), Measured.of([5.0, 4.0, 6.0])]}, measured)
    emulated = deepspeed.model_cuts(layers, [1.0, 1.0, 1.0, 3.0], ["uniform", "profile"], stage_counts=(2,))
    key, verdict, text, figures = deepspeed.contrast_verdict(here, emulated, layers, "H100")
    assert key == "08.profile_here_and_emulated" and verdict == "noisier than modelled"
    assert figures["share_here"] == pytest.approx(3 / 6) and figures["share_modelled"] == pytest.approx(1 / 6)
    assert text.startswith("The Conv2d layers take 50% of the time measured here and 17% on the H100")
    assert figures["spread_here"] == pytest.approx(0.4)  # the profile cut's second stage: 4 to 6 around 5
    row, = deepspeed.contrast_table(here, emulated)
    assert row["profile cut here"] == "[0, 1, 4]" and row["modelled"] == "[0, 3, 4]"
    assert row["fastest cut here"] == "uniform" and row["moved between rounds"] == "40%"
    one_round = deepspeed.CutTimes(here.cuts, {key: [Measured.of(t.values[:1]) for t in per_stage]
                                               for key, per_stage in here.stage_ms.items()}, measured)
    key, verdict, text, figures = deepspeed.contrast_verdict(one_round, emulated, layers, "H100")
    assert verdict == "one round" and "one measured round cannot show how much a measurement moves" in text


def test_the_gpu_profile_counts_its_flops_on_the_meta_device():
    import nbformat

    meta = nbformat.read("notebooks/08_deepspeed_partitioning.ipynb", 4).metadata["pipelab"]
    gpu, need = meta["profiles"]["gpu"], meta["needs"]["gpu"]
    flops = deepspeed.run_flops(gpu)
    assert need["flops"] == pytest.approx(flops, rel=1e-6) and "H100" in need["estimate"]

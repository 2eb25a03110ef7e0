"""Stage boundaries of pipelab.pipeline.partition: the AlexNet table, edge cases, and DeepSpeed itself."""
import random

import pytest
import torch
import torch.nn as nn

from pipelab.models import alexnet_layers
from pipelab.pipeline.p2p import trace
from pipelab.measure import Measured
from pipelab.pipeline.partition import (forward_backward_time, layer_name,
                                        measure_partitions, parameter_counts, partition_balanced,
                                        partition_layers, partition_uniform, profile_layers,
                                        profile_weights, slowest_stage, split_model, stage_sums,
                                        type_weights)

ALEXNET_PARAMS = [23296, 0, 0, 307392, 0, 0, 663936, 0, 884992, 0, 590080, 0, 0, 0, 0, 0,
                  37752832, 0, 0, 16781312, 0, 40970]


def test_alexnet_parameter_counts_and_two_stages():
    layers = alexnet_layers(10)
    assert parameter_counts(layers) == ALEXNET_PARAMS
    assert partition_layers(layers, 2, "parameters") == [0, 19, 22]
    assert partition_balanced(ALEXNET_PARAMS, 4) == [0, 8, 16, 19, 22]


def test_uniform_spreads_the_remainder_over_the_first_stages():
    assert partition_uniform(10, 3) == [0, 4, 7, 10]
    assert partition_uniform(22, 4) == [0, 6, 12, 17, 22]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(5, 1) == [0, 5]


def test_more_parts_than_items_leaves_trailing_stages_empty():
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_uniform(0, 2) == [0, 0, 0]
    assert partition_balanced([5.0, 1.0], 4) == [0, 1, 2, 2, 2]
    assert partition_balanced([3, 3], 2) == [0, 1, 2]


def test_balanced_small_cases_and_ties():
    assert partition_balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition_balanced([10, 1, 1, 1], 2) == [0, 1, 4]
    assert partition_balanced([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [0, 5, 7, 9]
    # All-zero weights: every cut ties, and the latest cut wins, as in DeepSpeed.
    assert partition_balanced([0, 0, 0, 0], 2) == [0, 3, 4]
    assert partition_balanced([0, 0, 0, 0, 0], 3) == [0, 3, 4, 5]
    assert partition_balanced([0, 5, 0, 0, 5, 0], 2) == [0, 4, 6]


def test_balanced_beats_or_ties_every_other_two_way_cut():
    rng = random.Random(0)
    for _ in range(50):
        w = [rng.randint(0, 9) for _ in range(rng.randint(3, 9))]
        parts = partition_balanced(w, 2)
        spread = lambda k: abs(sum(w[:k]) - sum(w[k:]))  # noqa: E731
        assert spread(parts[1]) == min(spread(k) for k in range(1, len(w)))


def test_type_regex_is_a_case_insensitive_search_on_class_names():
    layers = alexnet_layers(10)
    w = type_weights(layers, "conv")
    assert w.count(1) == 5 and w[0] == 1 and w[3] == 1
    assert type_weights(layers, "CONV2D|linear").count(1) == 8
    assert partition_layers(layers, 5, "type:CONV2D")[-1] == 22
    assert partition_layers(layers, 2, "type:Linear") == [0, 21, 22]  # ties: latest cut


def test_layer_names_of_modules_specs_and_functions():
    from pipelab.pipeline.module import LayerSpec

    def flatten(x):
        return x.flatten(1)

    assert [layer_name(l) for l in [nn.ReLU(), LayerSpec(nn.Linear, 2, 2), flatten]] == ["ReLU", "Linear", "flatten"]
    assert type_weights([nn.ReLU(), flatten], "flat") == [0, 1]


def test_bad_methods_raise_value_errors_that_name_the_fix():
    layers = alexnet_layers(10)
    with pytest.raises(ValueError, match="'type:transformer' matches no layer.*Conv2d"):
        partition_layers(layers, 2, "type:transformer")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        partition_layers(layers, 2, "type:conv(")
    with pytest.raises(ValueError, match="unknown partition method 'magic'.*profile"):
        partition_layers(layers, 2, "magic")
    with pytest.raises(ValueError, match="profile_input"):
        partition_layers(layers, 2, "profile")
    with pytest.raises(ValueError, match="num_parts must be a whole number >= 1, got 0"):
        partition_uniform(4, 0)


def test_profile_weights_time_each_layer_and_balance_them():
    torch.manual_seed(0)
    small, big = nn.Linear(16, 16), nn.Linear(16, 1024)
    layers = [small, nn.ReLU(inplace=True), big, nn.ReLU(inplace=True), nn.Linear(1024, 4)]
    x = torch.randn(64, 16)
    times = profile_weights(layers, x, repeats=3)
    assert len(times) == 5 and all(t > 0 for t in times)
    assert small.weight.grad is None  # profiling leaves no gradients behind
    parts = partition_layers(layers, 2, "profile", profile=lambda: times)
    assert parts == partition_balanced(times, 2)
    (per_stage,) = measure_partitions(layers, [parts], x, repeats=1)
    assert len(per_stage) == 2 and all(t.median > 0 for t in per_stage)
    assert stage_sums([1, 2, 3, 4], [0, 1, 4]) == [1, 9]
    both = measure_partitions(layers, [[0, 5], [0, 2, 3, 5]], x, repeats=1)
    assert [len(t) for t in both] == [1, 3] and big.weight.grad is None


def test_measure_partitions_keeps_every_round_and_slowest_stage_goes_round_by_round():
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)]
    x = torch.randn(32, 16)
    timed = measure_partitions(layers, [[0, 3], [0, 1, 3]], x, repeats=4)
    assert [len(per_stage) for per_stage in timed] == [1, 2]
    assert all(len(t.values) == 4 and t.low > 0 for per_stage in timed for t in per_stage)
    assert layers[0].weight.grad is None
    per_layer = profile_layers(layers, x, repeats=3, tries=2)  # each round: the faster of 2 runs
    assert len(per_layer) == 3 and all(len(t.values) == 3 for t in per_layer)
    # Round r's slowest stage is the max over the stages' r-th repeats, not the max of medians.
    stages = [Measured.of([1.0, 5.0, 2.0]), Measured.of([3.0, 1.0, 1.0])]
    assert slowest_stage(stages).values == (3.0, 5.0, 2.0)


def test_a_round_keeps_the_fastest_of_its_back_to_back_tries(monkeypatch):
    import pipelab.pipeline.partition as partition

    clock = iter([5.0, 3.0, 4.0, 6.0])  # round 1: tries 5 and 3; round 2: tries 4 and 6
    monkeypatch.setattr(partition, "forward_backward_time", lambda fn, x, repeats, warmup: (next(clock), x))
    [[stage]] = measure_partitions([nn.Identity()], [[0, 1]], torch.zeros(1), repeats=2, warmup=0, tries=2)
    assert stage.values == (3.0, 4.0)


def test_forward_backward_time_returns_the_output():
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    seconds, out = forward_backward_time(layer, x, repeats=2)
    assert seconds > 0 and torch.equal(out, layer(x).detach())
    # Integer inputs (token ids) get no gradient, but the layer still runs its backward.
    seconds, out = forward_backward_time(nn.Embedding(5, 2), torch.tensor([[0, 4]]), repeats=1)
    assert out.shape == (1, 2, 2)


def test_split_model_keeps_each_activation_with_the_layer_before_it():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    stages = split_model(model, 2)
    assert [[type(l).__name__ for l in s] for s in stages] == [["Linear", "ReLU", "Linear", "Tanh"], ["Linear"]]
    assert stages[1][0] is model[4]  # the layers themselves, not copies
    assert [tuple(out.shape) for out in trace(stages, torch.randn(3, 4))] == [(3, 8), (3, 2)]
    with pytest.raises(ValueError, match="num_stages must be a whole number >= 1, got 0"):
        split_model(model, 0)
    with pytest.raises(ValueError, match="cannot cut a model with 3 layers into 4 stages"):
        split_model(model, 4)


def test_matches_deepspeed_on_random_weights():
    ds_utils = pytest.importorskip("deepspeed.runtime.utils")
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(0, 14)
        w = [rng.choice([0, rng.randint(1, 1000), rng.random()]) for _ in range(n)]
        parts = rng.randint(1, 6)
        assert partition_balanced(w, parts) == [int(p) for p in ds_utils.partition_balanced(w, parts)]
        assert partition_uniform(n, parts) == [int(p) for p in ds_utils.partition_uniform(n, parts)]
    assert [int(p) for p in ds_utils.partition_balanced(ALEXNET_PARAMS, 2)] == [0, 19, 22]

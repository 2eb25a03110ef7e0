"""Stage boundaries of pipelab.pipeline.partition: the AlexNet table, edge cases, and DeepSpeed itself."""
import random

import pytest
import torch.nn as nn

from pipelab.models import alexnet_layers
from pipelab.pipeline.partition import (parameter_counts, partition_balanced, partition_layers,
                                        partition_uniform, type_weights)

ALEXNET_PARAMS = [23296, 0, 0, 307392, 0, 0, 663936, 0, 884992, 0, 590080, 0, 0, 0, 0, 0,
                  37752832, 0, 0, 16781312, 0, 40970]


def test_alexnet_parameter_counts_and_two_stages():
    layers = alexnet_layers(10)
    assert parameter_counts(layers) == ALEXNET_PARAMS
    assert partition_layers(layers, 2, "parameters") == [0, 19, 22]


def test_uniform_spreads_the_remainder_over_the_first_stages():
    assert partition_uniform(10, 3) == [0, 4, 7, 10]
    assert partition_uniform(22, 4) == [0, 6, 12, 17, 22]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]


def test_more_parts_than_items_leaves_trailing_stages_empty():
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_balanced([5.0, 1.0], 4) == [0, 1, 2, 2, 2]


def test_balanced_small_cases():
    assert partition_balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition_balanced([10, 1, 1, 1], 2) == [0, 1, 4]
    assert partition_balanced([0, 0, 0, 0], 2) == [0, 3, 4]  # ties go to the latest cut


def test_balanced_beats_or_ties_every_other_two_way_cut():
    rng = random.Random(0)
    for _ in range(50):
        w = [rng.randint(0, 9) for _ in range(rng.randint(3, 9))]
        parts = partition_balanced(w, 2)
        spread = lambda k: abs(sum(w[:k]) - sum(w[k:]))
        assert spread(parts[1]) == min(spread(k) for k in range(1, len(w)))


def test_type_regex_is_a_case_insensitive_search():
    layers = alexnet_layers(10)
    w = type_weights(layers, "conv")
    assert w.count(1) == 5
    assert partition_layers(layers, 5, "type:CONV2D")[-1] == 22


def test_bad_methods_raise_value_errors():
    layers = alexnet_layers(10)
    with pytest.raises(ValueError, match="matches no layer"):
        partition_layers(layers, 2, "type:transformer")
    with pytest.raises(ValueError, match="unknown partition method"):
        partition_layers(layers, 2, "magic")


def test_matches_deepspeed_on_random_weights():
    ds_utils = pytest.importorskip("deepspeed.runtime.utils")
    rng = random.Random(1)
    for _ in range(200):
        w = [rng.choice([0, rng.randint(1, 1000)]) for _ in range(rng.randint(1, 14))]
        parts = rng.randint(1, 6)
        assert partition_balanced(w, parts) == list(ds_utils.partition_balanced(w, parts))
        assert partition_uniform(len(w), parts) == list(ds_utils.partition_uniform(len(w), parts))


def test_pipeline_module_builds_only_owned_layers_and_shares_tied_ones():
    from pipelab.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
    layers = [TiedLayerSpec("embed", nn.Linear, 4, 4), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 4, 64),
              TiedLayerSpec("embed", nn.Linear, 4, 4)]
    pm = PipelineModule(layers, num_stages=2, partition_method="uniform")
    assert pm.parts == [0, 2, 4]
    tied = {}
    first, second = pm.build_stage(0, tied), pm.build_stage(1, tied)
    assert len(first) == len(second) == 2 and first[0] is second[1]
    assert "stage=1 layers=2" in pm.stage_table() and "3: Linear" in pm.stage_table()
    with pytest.raises(ValueError, match="nn.Module subclass"):
        LayerSpec(42)

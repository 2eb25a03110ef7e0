"""LayerSpec, TiedLayerSpec and PipelineModule: lazy building, seeding, the stage table, bad input."""
import pytest
import torch
import torch.nn as nn

from pipelab.models import alexnet_layers
from pipelab.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from pipelab.pipeline.topology import PipeDataParallelTopology, PipeModelDataParallelTopology


class Counting(nn.Linear):
    built = 0

    def __init__(self, *args):
        super().__init__(*args)
        Counting.built += 1


def test_a_stage_builds_only_the_layers_it_owns():
    layers = [LayerSpec(Counting, 4, 4) for _ in range(6)]
    pm = PipelineModule(layers, num_stages=3, partition_method="uniform", verbose=False)
    Counting.built = 0
    stage = pm.build_stage(1)
    assert Counting.built == 2 and stage.layer_ids == [2, 3]
    assert sorted(n for n, _ in stage.named_parameters()) == ["2.bias", "2.weight", "3.bias", "3.weight"]


def test_seeded_layers_have_the_same_weights_on_their_stage_as_in_the_reference():
    layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 4, 4)]
    pm = PipelineModule(layers, num_stages=2, partition_method="uniform", verbose=False)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    ref, last = pm.build_reference(), pm.build_stage(1)
    torch.testing.assert_close(last.state_dict()["2.weight"], ref.state_dict()["2.weight"])
    assert torch.equal(torch.rand(1), before)  # building does not move the caller's random state


def test_tied_layers_share_one_module_per_stage_and_name_their_stages():
    def head(emb, h):
        return h @ emb.weight.T

    layers = [TiedLayerSpec("embed", nn.Embedding, 10, 4), LayerSpec(nn.Linear, 4, 4),
              LayerSpec(nn.Linear, 4, 4), TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=head)]
    pm = PipelineModule(layers, num_stages=2, partition_method="uniform", verbose=False)
    assert pm.tied_stages() == {"embed": [0, 1]}
    ref = pm.build_reference()
    assert len(ref.tied_modules) == 1 and [k for k, _, _ in ref.tied_weights()] == ["embed"]
    out = ref(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 10)
    whole = PipelineModule(layers, num_stages=1, verbose=False)
    assert whole.tied_stages() == {"embed": [0]}


def test_stage_table_reads_like_deepspeeds():
    pm = PipelineModule(alexnet_layers(10), num_stages=2, loss_fn=nn.CrossEntropyLoss(), verbose=False)
    table = pm.stage_table().splitlines()
    assert pm.partitions() == [0, 19, 22]
    assert table[0] == "stage=0 layers=19" and table[1] == "     0: Conv2d"
    assert table[20] == "stage=1 layers=3" and table[-1] == "  loss: CrossEntropyLoss"
    assert pm.stage_owner(18) == 0 and pm.stage_owner(19) == 1


def test_activation_checkpointing_gives_the_same_gradients():
    layers = [LayerSpec(nn.Linear, 4, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 2)]
    plain = PipelineModule(layers, num_stages=1, verbose=False).build_reference()
    ckpt = PipelineModule(layers, num_stages=1, activation_checkpoint_interval=2, verbose=False).build_reference()
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


def test_profile_partition_times_the_layers():
    layers = [LayerSpec(nn.Linear, 32, 32), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 32, 512),
              LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 512, 4)]
    pm = PipelineModule(layers, num_stages=2, partition_method="profile", profile_input=torch.randn(16, 32),
                        verbose=False)
    assert len(pm.layer_times) == 5 and pm.partitions()[0] == 0 and pm.partitions()[-1] == 5


def test_bad_input_raises_value_errors_that_name_the_fix():
    with pytest.raises(ValueError, match="nn.Module subclass, got 42"):
        LayerSpec(42)
    with pytest.raises(ValueError, match="nn.Module subclass.*LayerSpec\\(nn.Linear"):
        LayerSpec(torch.Tensor)
    with pytest.raises(ValueError, match="layer 1 is 'relu'"):
        PipelineModule([nn.Linear(2, 2), "relu"], num_stages=1, verbose=False)
    with pytest.raises(ValueError, match="num_stages=4 exceeds the 3 layers"):
        PipelineModule([nn.Linear(2, 2)] * 3, num_stages=4, verbose=False)
    with pytest.raises(ValueError, match="give num_stages"):
        PipelineModule([nn.Linear(2, 2)], verbose=False)
    with pytest.raises(ValueError, match="unknown partition method 'params'"):
        PipelineModule([nn.Linear(2, 2)] * 2, num_stages=2, partition_method="params", verbose=False)
    with pytest.raises(ValueError, match="'type:attention' matches no layer"):
        PipelineModule([nn.Linear(2, 2)] * 2, num_stages=2, partition_method="type:attention", verbose=False)
    with pytest.raises(ValueError, match="profile_input"):
        PipelineModule([nn.Linear(2, 2)] * 2, num_stages=2, partition_method="profile", verbose=False)
    with pytest.raises(ValueError, match="model=1"):
        PipelineModule([nn.Linear(2, 2)] * 2, topology=PipeModelDataParallelTopology(2, 2, 1), verbose=False)
    pm = PipelineModule([nn.Linear(2, 2)] * 2, topology=PipeDataParallelTopology(2, 3), verbose=False)
    assert pm.num_stages == 2


def test_partition_matches_deepspeeds_stage_table_methods():
    ds_utils = pytest.importorskip("deepspeed.runtime.utils")
    layers = alexnet_layers(10)
    counts = [sum(p.numel() for p in l.parameters()) for l in layers]
    for stages in (2, 3, 4):
        ours = PipelineModule(layers, num_stages=stages, verbose=False).partitions()
        assert ours == [int(p) for p in ds_utils.partition_balanced(counts, stages)]

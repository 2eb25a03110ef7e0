"""The instruction-stream engine on real ranks gives the single-process losses, gradients and weights."""
import pytest
import torch
import torch.nn as nn

from pipelab.pipeline import engine
from pipelab.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec


def mlp_specs():
    return [LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, 16, 16),
            LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 16, 4)]


def lm_head(embedding, h):
    """The output projection reuses the input embedding's weight."""
    return h @ embedding.weight.T


def token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tied_specs():
    return [TiedLayerSpec("embed", nn.Embedding, 11, 8), LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, 16, 8), LayerSpec(nn.ReLU, inplace=True),
            TiedLayerSpec("embed", nn.Embedding, 11, 8, forward_fn=lm_head)]


def test_two_stages_train_like_one_process():
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform",
                            activation_checkpoint_interval=1, verbose=False)
    run = engine.train(module, x, y, micro_batches=4, steps=3, lr=0.1)
    ref = engine.reference_train(module, x, y, steps=3, lr=0.1)
    engine.assert_matches_reference(run, ref)
    assert run.losses[-1] < run.losses[0]
    assert sorted(run.grads[0]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    tl = run.timeline
    assert {s.kind for s in tl.filter(rank=0)} >= {"F", "B", "send", "recv", "optimizer"}
    assert sorted(s.mb for s in tl.filter(rank=1, kind="F")) == [0, 1, 2, 3]


def test_tied_embedding_across_three_stages_sums_its_gradient():
    torch.manual_seed(0)
    x, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (6, 5))
    module = PipelineModule(tied_specs(), num_stages=3, loss_fn=token_loss, partition_method="uniform",
                            verbose=False)
    assert module.tied_stages() == {"embed": [0, 2]}
    run = engine.train(module, x, y, micro_batches=3, steps=2, lr=0.5)
    ref = engine.reference_train(module, x, y, steps=2, lr=0.5)
    engine.assert_matches_reference(run, ref)
    # Both copies got the summed gradient, so they are still one weight after the steps.
    torch.testing.assert_close(run.params[0]["tied_modules.embed.weight"], run.params[2]["tied_modules.embed.weight"])
    assert run.timeline.filter(kind="tied-allreduce").spans


def test_pipe_by_data_grid_with_tied_weights():
    torch.manual_seed(0)
    x, y = torch.randint(0, 11, (8, 5)), torch.randint(0, 11, (8, 5))
    module = PipelineModule(tied_specs(), num_stages=2, loss_fn=token_loss, verbose=False)
    run = engine.train(module, x, y, micro_batches=2, steps=2, lr=0.5, world_size=4)
    assert run.topology.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    engine.assert_matches_reference(run, engine.reference_train(module, x, y, steps=2, lr=0.5))
    assert {s.rank for s in run.timeline.filter(kind="allreduce")} == {0, 1, 2, 3}


def test_bad_runs_are_refused_before_any_worker_starts():
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(), verbose=False)
    with pytest.raises(ValueError, match="num_stages=2 does not divide world_size=3"):
        engine.train(module, x, y, micro_batches=2, world_size=3)
    with pytest.raises(ValueError, match="num_stages=2 does not divide world_size=1"):
        engine.train(module, x, y, micro_batches=2, world_size=1)
    with pytest.raises(ValueError, match="multiple of 3"):
        engine.train(module, x, y, micro_batches=3)
    with pytest.raises(ValueError, match="2 data-parallel replica\\(s\\) x micro_batches=3.*multiple of 6"):
        engine.train(module, x, y, micro_batches=3, world_size=4)
    with pytest.raises(ValueError, match="loss_fn="):
        engine.train(PipelineModule(mlp_specs(), num_stages=2, verbose=False), x, y, micro_batches=2)
    with pytest.raises(ValueError, match="one target per input"):
        engine.train(module, x, y[:4], micro_batches=2)
    with pytest.raises(ValueError, match="needs a PipelineModule"):
        engine.train(nn.Sequential(nn.Linear(8, 4)), x, y, micro_batches=2)


def test_deepspeed_trains_the_same_layers_to_the_same_losses_and_weights():
    pytest.importorskip("deepspeed")
    torch.manual_seed(0)
    x, y = torch.randint(0, 11, (8, 5)), torch.randint(0, 11, (8, 5))
    module = PipelineModule(tied_specs(), num_stages=2, loss_fn=token_loss, verbose=False)
    ds = engine.train_deepspeed(module, x, y, micro_batches=4, steps=2, lr=0.5)
    ref = engine.reference_train(module, x, y, steps=2, lr=0.5)
    assert ds["parts"] == module.partitions()
    torch.testing.assert_close(torch.tensor(ds["losses"]), torch.tensor(ref.losses))
    for params in ds["params"].values():
        for name, p in params.items():
            torch.testing.assert_close(p, ref.params[name], msg=name)

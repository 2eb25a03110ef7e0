"""Lesson 10's model: causal, cut into stages; global-norm clipping across a pipeline; the grid's
first steps equal one process's."""

import copy

import pytest
import torch

from pipelab.data import load_corpus
from pipelab.experiments.capstone import LMConfig, perplexity, single_process_losses, train_lm, tutorial_perplexity
from pipelab.launch import spawn
from pipelab.lm import TransformerLM, clip_grad_norm_, generate, lm_loss, stages_of
from pipelab.pipeline.partition import partition_layers


def test_a_token_sees_only_the_tokens_before_it():
    torch.manual_seed(0)
    model = TransformerLM(50, emsize=16, nhead=2, nhid=32, nlayers=2)
    x = torch.randint(0, 50, (2, 6))
    changed = x.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % 50
    torch.testing.assert_close(model(x)[:, :4], model(changed)[:, :4])
    assert not torch.allclose(model(x)[:, 4:], model(changed)[:, 4:])


def test_stages_keep_the_layer_names_and_compute_the_model():
    model = TransformerLM(50, emsize=16, nhead=2, nhid=32, nlayers=4)
    parts = partition_layers(list(model), 2, "type:EncoderLayer")
    stages = stages_of(model, parts)
    x = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(stages[1](stages[0](x)), model(x))
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def _clip_worker(ctx, model, parts, x, max_norm):
    import torch.distributed as dist
    loss = lm_loss(model(x), x)
    loss.backward()  # every rank computes the whole gradient, then keeps its stage's
    stage = stages_of(model, parts)[ctx.rank]
    norm = clip_grad_norm_(stage.parameters(), max_norm, dist.group.WORLD)
    return norm, {n: p.grad for n, p in stage.named_parameters()}


def test_clipping_across_stages_equals_clipping_the_whole_model():
    torch.manual_seed(0)
    model = TransformerLM(40, emsize=16, nhead=2, nhid=32, nlayers=2)
    x = torch.randint(0, 40, (3, 7))
    parts = partition_layers(list(model), 2, "parameters")
    ref = copy.deepcopy(model)
    lm_loss(ref(x), x).backward()
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
    assert want_norm > 0.1  # the clip is active
    results = spawn(_clip_worker, 2, model, parts, x, 0.1)
    want = dict(ref.named_parameters())
    for norm, grads in results:
        assert norm == pytest.approx(want_norm, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name].grad, atol=1e-7, rtol=1e-5)
    # Clipping each stage by its own norm would give another gradient:
    own = copy.deepcopy(ref)
    lm_loss(own(x), x).backward()
    for stage in stages_of(own, parts):
        torch.nn.utils.clip_grad_norm_(stage.parameters(), 0.1)
    assert not all(torch.allclose(p.grad, want[n].grad) for n, p in own.named_parameters())


def test_grid_first_steps_equal_one_process():
    corpus = load_corpus(max_lines=600)
    cfg = LMConfig(emsize=16, nhead=2, nhid=32, nlayers=2, batch_size=8, microbatches=2, max_batches=3,
                   log_interval=3)
    run = train_lm(corpus, cfg)
    torch.testing.assert_close(run.losses, single_process_losses(corpus, cfg, 3), atol=1e-5, rtol=1e-5)
    assert run.curve[-1][2] < len(corpus.vocab)  # valid perplexity below guessing
    model = run.load_into(cfg.model(len(corpus.vocab)))
    assert len(generate(model, corpus.vocab, "the", words=5).split()) == 6


def test_tutorial_normalisation_is_too_small_on_a_long_set():
    losses = [(5.0, 35)] * 100
    assert perplexity(losses) == pytest.approx(torch.tensor(5.0).exp().item())
    assert tutorial_perplexity(losses, rows=3501, bptt=35) == pytest.approx(torch.tensor(2.5).exp().item())


def test_bad_recipe_is_refused_before_starting():
    with pytest.raises(ValueError, match="multiple of 8"):
        train_lm(load_corpus(max_lines=100), LMConfig(batch_size=20, microbatches=4))


def test_a_recipe_that_does_not_fit_is_refused():
    from pipelab.experiments.capstone import check_fits, expected_memory
    cfg = LMConfig(emsize=32, nhid=64)
    model = cfg.model(100)
    rows = expected_memory(model, partition_layers(list(model), 2), cfg, 100)
    assert all(r["total"] > 2 * r["parameters"] > 0 for r in rows)
    check_fits(rows, 2**30)
    with pytest.raises(ValueError, match="GiB"):
        check_fits(rows, 1000)

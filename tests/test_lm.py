"""Lesson 10's model: causal, cut into stages; global-norm clipping across a pipeline; the grid's
first steps (and each micro-batch's loss) equal one process's; a bad recipe refused when its Config
is built; the progress bar leaves one output in a notebook."""

import copy
from dataclasses import replace

import pytest
import torch

from pipelab.data import batchify, get_batch, load_corpus
from pipelab.experiments.capstone import Config, memory_plan, perplexity, single_process_losses, train, tutorial_perplexity
from pipelab.launch import spawn
from pipelab.lm import TransformerLM, check_fits, clip_grad_norm_, generate, lm_loss, stage_memory, stages_of
from pipelab.pipeline.partition import partition_layers
from pipelab.pipeline.schedules import make_schedule
from pipelab.progress import ProgressFile, progress_bar
from pipelab.worker import RankContext


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


def _clip_worker(ctx: RankContext, model, parts, x, max_norm):
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


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_grid_first_steps_equal_one_process(schedule, capsys):
    corpus = load_corpus(max_lines=600)
    cfg = Config(emsize=16, nhead=2, nhid=32, nlayers=2, batch_size=8, num_microbatches=2, max_batches=3,
                 log_interval=3, schedule=schedule)
    run = train(cfg, corpus)
    torch.testing.assert_close(run.losses, single_process_losses(corpus, cfg, 3), atol=1e-5, rtol=1e-5)
    # each micro-batch's loss, replica by replica: the first step's as one process computes it
    model = cfg.model(len(corpus.vocab))
    x, y = get_batch(batchify(corpus.train, cfg.batch_size), 0, cfg.bptt)
    want = [lm_loss(model(xm), ym).item() for xm, ym in zip(x.chunk(4), y.chunk(4))]
    assert len(run.mb_losses) == 3 and run.mb_losses[0] == pytest.approx(want, rel=1e-5)
    assert run.curve[-1][2] < len(corpus.vocab)  # valid perplexity below guessing
    model = run.load_into(cfg.model(len(corpus.vocab)))
    assert len(generate(model, corpus.vocab, "the", words=5).split()) == 6
    out = capsys.readouterr()
    assert "3/3" in out.err  # the progress bar followed the batches
    assert "| epoch   1 |     3/    3 batches" in out.out  # the log line, above the bar
    assert len(run.step_time.values) == 2 and len(run.tokens_per_second.values) == 1
    # The estimate before the run: the schedule's peak stash, and the bytes the stash meters counted.
    plan = memory_plan(cfg, len(corpus.vocab))
    assert [count for count, _ in run.stash] == [row["peak stash"] for row in plan]
    assert [nbytes for _, nbytes in run.stash] == pytest.approx([row["activations"] for row in plan], rel=1e-3)


def test_tutorial_normalisation_is_too_small_on_a_long_set():
    losses = [(5.0, 35)] * 100
    assert perplexity(losses) == pytest.approx(torch.tensor(5.0).exp().item())
    assert tutorial_perplexity(losses, rows=3501, bptt=35) == pytest.approx(torch.tensor(2.5).exp().item())


def test_bad_recipe_is_refused_when_its_config_is_built():
    with pytest.raises(ValueError, match="multiple of 8"):
        Config(batch_size=20, num_microbatches=4)
    with pytest.raises(ValueError, match="'gpipe'"):
        Config(schedule="interleaved")
    with pytest.raises(ValueError, match="emsize=64 must be a multiple of nhead=3"):
        Config(nhead=3)
    with pytest.raises(ValueError, match="partition"):
        Config(partition="by size")
    with pytest.raises(ValueError, match="pipe=8 stages cut by .parameters. leave a stage without layers"):
        Config(pipe=8, data=1, batch_size=8, nlayers=1)  # 4 layers cannot make 8 stages
    with pytest.raises(ValueError, match="pipe must be a whole number"):
        Config(pipe=0)
    with pytest.raises(ValueError, match="dropout must be a number in"):
        Config(dropout=1.5)
    with pytest.raises(ValueError, match="max_batches must be a whole number"):
        Config(max_batches=0)
    with pytest.raises(ValueError, match="lr must be a number"):
        Config(lr=-1.0)
    cfg = Config(pipe=2, data=1, batch_size=4)
    assert cfg.world_size == 2 and replace(cfg, pipe=1).world_size == 1


def test_memory_per_stage_takes_the_peak_stash_from_the_schedule():
    model = TransformerLM(100, emsize=32, nhead=2, nhid=64, nlayers=2)
    parts = partition_layers(list(model), 2)
    gpipe, one_f_one_b = (stage_memory(model, parts, make_schedule(name, 2, 4), tokens=70) for name in ("gpipe", "1f1b"))
    assert [r["peak stash"] for r in gpipe] == [4, 4] and [r["peak stash"] for r in one_f_one_b] == [2, 1]
    for r in gpipe:
        assert r["activations"] == 4 * r["activations/mb"] > 0
        assert r["parameters"] == 4 * sum(p.numel() for p in stages_of(model, parts)[r["stage"]].parameters())
        assert r["total"] == 2 * r["parameters"] + r["activations"]
    check_fits(gpipe, 2**30)
    with pytest.raises(ValueError, match="stage 1 needs about .* GiB"):
        check_fits(gpipe, 1000)


def test_a_recipe_that_does_not_fit_is_refused_before_starting():
    huge = Config(emsize=8192, nhid=8192, nhead=16, nlayers=64)  # about 26B parameters: 100 GiB per stage
    with pytest.raises(ValueError, match="needs about"):
        train(huge, load_corpus(max_lines=100))


def test_progress_bar_counts_the_lines_appended(capsys):
    with progress_bar(4, "work") as path:
        with open(path, "a") as f:
            f.write("1.5\n2.5\n3.")  # the last line is not finished yet
            f.flush()
            f.write("5\n0.5\n")
        ProgressFile(path).say("a log line")
    out = capsys.readouterr()
    assert "4/4" in out.err and "loss=0.5" in out.err and "a log line" in out.out


def test_progress_bar_in_a_notebook_is_one_output_updated_in_place(monkeypatch):
    """In a Jupyter kernel the bar and the lines said above it are one display, updated in place:
    the executed notebook keeps one output, whatever the number of batches."""
    import pipelab.progress as progress

    shown = []

    class Handle:
        def update(self, data, raw):
            shown.append(("update", data["text/plain"]))

    def display(data, raw, display_id):
        shown.append(("display", data["text/plain"]))
        return Handle()

    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    monkeypatch.setattr("IPython.display.display", display)
    with progress_bar(30, "grid") as path:
        worker = ProgressFile(path)
        for i in range(30):
            worker.advance(f"{i / 10:.1f}")
            if i == 19:
                worker.say("| epoch   1 |    20/   30 batches")
    assert [kind for kind, _ in shown].count("display") == 1  # one output
    final = shown[-1][1].splitlines()
    assert final[0] == "| epoch   1 |    20/   30 batches" and "30/30" in final[1] and "loss=2.9" in final[1]


def test_verdicts_are_read_off_the_figures(capsys):
    from pipelab.experiments import capstone

    # ln(3000) = 8.006: the loss of guessing evenly among 3,000 words
    assert capstone.loss_at_step_0_verdict(8.1, 0.4, 3000) == "near ln(vocab)"
    assert capstone.loss_at_step_0_verdict(14.0, 3.7, 3000) == "far from ln(vocab)"
    late_high, late_low = [20.0, 9.0, 9.5, 9.1], [8.5, 7.0, 6.9, 7.2]  # the verdict reads the last half
    assert capstone.lr_verdict({5.0: late_high, 1.0: late_low}, 3000, 64) == "tutorial's rate above, ours below"
    assert capstone.lr_verdict({5.0: late_low, 1.0: late_low}, 3000, 64) == "tutorial's rate below, ours below"
    assert capstone.evaluate_verdict(right=110.0, wrong=3.9, windows_summed=165, bptt=35, rows=5747) == "tutorial's too low"
    assert "On this run:" in capsys.readouterr().out

"""Lesson 10's model: causal, cut into stages; global-norm clipping across a pipeline; the grid's
first steps (and each micro-batch's loss) equal one process's, on this machine's clock and on an
emulated node (modelled time: deterministic tokens/s against one emulated device); the tutorial's
`evaluate` reproduced exactly; a bad recipe refused when its Config is built; TF32 off around the
equality checks; the progress bar leaves one output in a notebook."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from pipelab.data import batchify, get_batch, load_corpus
from pipelab.emulate import Emulated
from pipelab.experiments.capstone import Config, memory_plan, train
from pipelab.launch import spawn
from pipelab.lm import (TransformerLM, check_fits, clip_grad_norm_, generate, lm_loss, perplexity, stage_memory, stages_of,
                        tutorial_evaluate_figures, tutorial_perplexity)
from pipelab.lm_training import single_process_losses
from pipelab.measure import Measured
from pipelab.pipeline.partition import partition_layers
from pipelab.pipeline.schedules import make_schedule
from pipelab.progress import ProgressFile, progress_bar
from pipelab.reference import exact_fp32
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


def test_on_an_emulated_node_the_grid_trains_the_same_and_its_clock_is_modelled(capsys, monkeypatch):
    from pipelab.emulate.cost import collective_seconds
    from pipelab.emulate.specs import parse_node
    from pipelab.experiments import capstone, capstone_verdicts

    corpus = load_corpus(max_lines=600)
    cfg = Config(emsize=16, nhead=2, nhid=32, nlayers=2, batch_size=8, num_microbatches=2, max_batches=4,
                 log_interval=1, emulate="4xH100-nvlink")
    run = train(cfg, corpus, progress=False)
    torch.testing.assert_close(run.losses, single_process_losses(corpus, cfg, 4), atol=1e-5, rtol=1e-5)
    rate = run.tokens_per_second  # the log intervals after the first: the same modelled step each time
    assert run.modelled and len(rate.values) == 3 and rate.high - rate.low < 1e-6 * rate.median
    model = capstone.modelled_step(cfg, len(corpus.vocab))
    step = cfg.step_tokens(modelled=True) / rate.median
    all_reduce = collective_seconds("all_reduce", model["gradient_bytes"], cfg.data, parse_node(cfg.emulate).link)
    assert model["schedule_s"] + model["update_s"] + all_reduce < step < model["schedule_s"] + model["update_s"] + 2 * all_reduce
    assert run.step_time.median == pytest.approx(step, rel=0.01)  # the Gantt's steps: the same modelled step, timed alone
    one = capstone_verdicts.baseline_tokens_per_second(corpus, cfg)  # ONE emulated device: its modelled step, no timing
    assert list(one.values) == [capstone.one_device_tokens_per_second(cfg, len(corpus.vocab))]
    assert capstone_verdicts.speed_verdict(run, one)[1] == "faster"
    rows = capstone_verdicts.speed_table(run, one, len(corpus.vocab))
    assert any("one NVIDIA H100 SXM alone" in row[""] for row in rows)
    assert "modelled ms/batch" in capsys.readouterr().out  # the log line says its step time is modelled
    # baseline_device="cuda" on a one-GPU machine: one process timed on the GPU, in a column of its own
    assert capstone_verdicts.gpu_baseline(corpus, cfg, None) is None  # the default times nothing more
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Tesla T4")
    with_gpu = capstone_verdicts.speed_table(run, one, len(corpus.vocab), on_gpu=Measured.of([1000.0, 1100.0, 1200.0]))
    assert with_gpu[:-1] == [{**r, "measured on Tesla T4": "-"} for r in rows]  # the grid's rows: modelled only
    assert with_gpu[-1] == {"": "tokens/s, one process at the real math's size (emsize 16, 2 layers)", "modelled": "-",
                            "measured on Tesla T4": "1,100 (1,000-1,200)"}


def test_baseline_device_is_refused_before_anything_runs(monkeypatch):
    from pipelab.experiments import capstone_verdicts

    with pytest.raises(ValueError, match=r"baseline_device='gpu': use None .*'cuda'"):
        capstone_verdicts.check_baseline_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="baseline_device='cuda': this machine has no CUDA GPU; use baseline_device=None"):
        capstone_verdicts.check_baseline_device("cuda")
    for fine in (None, "cpu"):
        capstone_verdicts.check_baseline_device(fine)


def test_one_emulated_device_does_every_stages_work_on_the_whole_batch():
    from pipelab.emulate.specs import parse_node
    from pipelab.emulate.training import one_device_seconds
    from pipelab.experiments import capstone

    cfg = Config(emulate="4xH100-nvlink")
    node = parse_node(cfg.emulate)
    h100 = node.device
    stages = capstone.big_stages(cfg, 3000)
    assert [r["stage"] for r in stages] == [0, 1] and stages[0]["I"] == 0  # token ids need no gradient
    microbatches = cfg.data * cfg.num_microbatches
    by_stage = sum(microbatches * (r["F"] + r["B"]) + r["clip"] + r["optimizer"] for r in stages)
    # the same work in one pass over the whole batch: no more than micro-batch by micro-batch with each
    # stage's backward priced as I + W (as the simulator prices it), and not much less
    ids = torch.zeros(microbatches * cfg.size.columns, cfg.bptt, dtype=torch.long, device="meta")
    assert 0.8 * by_stage < one_device_seconds(capstone.big_model(cfg, 3000), ids, lm_loss, node, "bfloat16") <= by_stage
    # clipping and SGD over n bfloat16 parameters read and write 3 x 2n bytes each, at the streaming
    # bandwidth the calibrated model measures (a fraction of the data sheet's)
    from pipelab.emulate import calibrated

    n = stages[1]["parameters"]
    streaming = calibrated.efficiency_of(h100).memory_fraction * h100.memory_bandwidth
    assert stages[1]["optimizer"] == pytest.approx(3 * 2 * n / streaming, rel=0.01)
    from pipelab.display import human_bytes

    table = capstone.big_stage_table(cfg, 3000)  # what the notebook prints: 2 bytes per bfloat16 gradient
    assert [row["gradients"] for row in table] == [human_bytes(2 * r["parameters"]) for r in stages]
    with pytest.raises(ValueError, match="emsize=4096 must be a multiple of nhead=3"):
        Config(emulate=Emulated("4xH100-nvlink", nhead=3))
    with pytest.raises(ValueError, match="more nlayers at the modelled size"):
        Config(emulate=Emulated("8xH100-nvlink", nlayers=1), pipe=8, data=1, batch_size=8, nlayers=8)  # 4 layers, 8 stages
    with pytest.raises(ValueError, match="columns must be a whole number >= 1, got 0"):
        Config(emulate=Emulated("4xH100-nvlink", columns=0))


def test_equality_checks_run_without_tf32_and_the_reference_is_on_the_grids_device():
    from pipelab.experiments import capstone_verdicts
    from pipelab.lm_training import reference_device

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        with exact_fp32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert reference_device().type == want
    cfg = Config(emsize=16, nhead=2, nhid=32, nlayers=1, batch_size=4, pipe=1, data=1, num_microbatches=1)
    corpus = load_corpus(max_lines=300)
    assert capstone_verdicts.one_process_rates(corpus, cfg, 2, 1, device="cpu")[0] > 0
    if torch.cuda.is_available():  # the GPU's reference equals the CPU's within the stated tolerance
        torch.testing.assert_close(single_process_losses(corpus, cfg, 3, device="cuda:0"),
                                   single_process_losses(corpus, cfg, 3, device="cpu"), atol=capstone_verdicts.LOSS_TOLERANCE, rtol=0)


def test_tutorial_evaluate_is_its_formula_exactly():
    losses = [(4.0, 35)] * 68
    # 50 windows (min(50 x 35, 2399) = 1750 rows), each weighed by its 10 columns, over 2400 - 1 rows
    assert tutorial_perplexity(losses, 2400, 35, columns=10) == pytest.approx(math.exp(50 * 10 * 4.0 / 2399))
    assert round(tutorial_perplexity(losses, 2400, 35, columns=10), 2) == 2.30  # weighing by 35 tokens gave 18.50
    # a short set: every window scored, the short last one weighed like the others
    short = [(2.0, 35), (3.0, 35), (6.0, 29)]  # 100 rows: windows at 0, 35, 70
    assert tutorial_perplexity(short, 100, 35, columns=4) == pytest.approx(math.exp(4 * (2.0 + 3.0 + 6.0) / 99))
    with pytest.raises(ValueError, match="scores 3 windows"):
        tutorial_perplexity(short[:2], 100, 35, columns=4)
    f = tutorial_evaluate_figures(short, 100, 35, 4)
    assert (f["weight per window"], f["tokens per window"], f["divisor"], f["tokens scored"]) == (4, 140, 99, 4 * 99)
    assert f["right"] == pytest.approx(perplexity(short)) == pytest.approx(math.exp((70 + 105 + 6 * 29) / 99))
    assert perplexity(losses) == pytest.approx(math.exp(4.0))


def test_tutorial_perplexity_equals_the_tutorials_evaluate_run_on_a_model():
    """The tutorial's code, transcribed (its get_batch returns data.t(), batch first), against
    `tutorial_perplexity` of the same model's window losses: equal."""
    corpus = load_corpus()
    model, bptt, columns = Config(emsize=16, nhead=2, nhid=32, nlayers=1).model(len(corpus.vocab)), 7, 10
    data_source = batchify(corpus.valid, columns)  # (rows, columns), as the tutorial's batchify
    assert data_source.shape[0] - 1 > 50 * bptt  # long enough that the 50-window cap matters

    def tutorial_get_batch(source, i):
        seq_len = min(bptt, len(source) - 1 - i)
        data = source[i:i + seq_len]
        target = source[i + 1:i + 1 + seq_len]
        return data.t(), target.t()  # the targets batch first too, so that each loss is the window's own

    total_loss = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, min(50 * bptt, data_source.size(0) - 1), bptt):
            data, targets = tutorial_get_batch(data_source, i)
            total_loss += len(data) * lm_loss(model(data), targets).item()
    tutorial = math.exp(total_loss / (len(data_source) - 1))
    from pipelab.lm import window_losses

    mine = tutorial_perplexity(window_losses(model, data_source, bptt), len(data_source), bptt, columns)
    assert mine == pytest.approx(tutorial, rel=1e-6)


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


def test_verdicts_are_read_off_the_figures():
    from pipelab.experiments import capstone_verdicts as verdicts

    # ln(3000) = 8.006: the loss of guessing evenly among 3,000 words
    assert verdicts.loss_at_step_0_verdict(8.1, 0.4, 3000)[1] == "near ln(vocab)"
    assert verdicts.loss_at_step_0_verdict(14.0, 3.7, 3000)[1] == "far from ln(vocab)"
    late_high, late_low = [20.0, 9.0, 9.5, 9.1], [8.5, 7.0, 6.9, 7.2]  # the verdict reads the last half
    key, verdict, text, _ = verdicts.lr_verdict({5.0: late_high, 1.0: late_low}, 3000, 64)
    assert verdict == "tutorial's rate above, ours below" and "lr 5.0 stayed above ln(vocab), at lr 1.0 below" in text
    assert verdicts.lr_verdict({5.0: late_low, 1.0: late_low}, 3000, 64)[1] == "tutorial's rate below, ours below"
    figures = tutorial_evaluate_figures([(4.7, 35)] * 16 + [(4.9, 13)], 574, 35, 10)
    key, verdict, text, _ = verdicts.evaluate_verdict(figures)
    assert verdict == "tutorial's too low" and "divides by rows, not tokens" in text
    assert figures["divisor"] == 573 and figures["tokens scored"] == 5730  # 16 x 35 + 13 = 573 rows scored, 10 tokens each

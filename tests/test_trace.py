"""pipelab's tracer (pipeline/trace.py): cut points, values that skip a stage, tied weights,
equality with the unsplit model and with torch's pipeline(), and the errors it gives."""

import copy

import pytest
import torch
from torch import nn

from pipelab import experiments
from pipelab.experiments import splitting
from pipelab.pipeline.trace import check_stages, split
from pipelab.reference import assert_same, reference_run
from pipelab.transformer import ModelArgs, Transformer, token_loss

ARGS = ModelArgs(dim=16, n_layers=4, n_heads=2, vocab_size=50)


class Skip(nn.Module):
    """a -> b -> c, plus a residual from a's output to the end: it skips stage 1."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.c(self.b(h)) + h


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: cannot be traced
            return self.a(x)
        return x


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x)


def run_chain(stages, *inputs):
    """The stages in a row, each a separate copy (as on separate processes)."""
    values = inputs
    for stage in stages:
        out = stage(*values)
        values = out if isinstance(out, tuple) else (out,)
    return values[0]


def transformer(tied=False):
    torch.manual_seed(0)
    return Transformer(ARGS, tie_weights=tied)


def test_cut_points_and_a_value_that_skips_a_stage_is_forwarded():
    torch.manual_seed(0)
    model = Skip()
    parts = split(model, ["b", "c"])
    assert len(parts) == 3
    assert parts.receives == [["x"], ["a"], ["a", "b"]]
    assert parts.sends == [["a"], ["a", "b"], ["output"]]
    assert [sorted(n for n, _ in s.named_parameters()) for s in parts.stages] == \
        [["a.bias", "a.weight"], ["b.bias", "b.weight"], ["c.bias", "c.weight"]]
    x = torch.randn(3, 4)
    stages = [copy.deepcopy(s) for s in parts.stages]
    run_chain(stages, x).sum().backward()
    ref = reference_run(model, x, torch.zeros(3, 4), lambda out, _: out.sum(), lr=None)
    grads = [{n: p.grad for n, p in s.named_parameters()} for s in stages]
    assert torch.allclose(run_chain(parts.stages, x), model(x))
    for g in grads:
        for name, grad in g.items():  # a's gradient includes the residual's, through stage 1
            torch.testing.assert_close(grad, ref.grads[name])


def test_transformer_split_equals_the_unsplit_model():
    model = transformer()
    x, y = splitting.make_batch(ARGS, 4, 8)
    parts = split(model, ["layers.1", "layers.3"])
    assert parts.receives[1:] == [["layers_0"], ["layers_2"]]
    assert "tok_embeddings.weight" in dict(parts.stages[0].named_parameters())
    assert "output.weight" in dict(parts.stages[2].named_parameters())
    stages = [copy.deepcopy(s) for s in parts.stages]
    loss = token_loss(run_chain(stages, x), y)
    loss.backward()
    ref = reference_run(model, x, y, token_loss, lr=None)
    assert loss.item() == pytest.approx(ref.loss, abs=1e-6)
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, ref.grads[name], atol=1e-6, rtol=1e-5)


def test_tied_weight_is_held_by_both_stages_and_its_gradients_add_up():
    model = transformer(tied=True)
    x, y = splitting.make_batch(ARGS, 4, 8)
    parts = split(model, ["layers.2"])
    stages = [copy.deepcopy(s) for s in parts.stages]  # separate copies, as on two processes
    assert stages[0].tok_embeddings.weight is not stages[1].output.weight
    token_loss(run_chain(stages, x), y).backward()
    grads = [{n: p.grad for n, p in s.named_parameters()} for s in stages]
    ref = reference_run(model, x, y, token_loss, lr=None)
    either = splitting.tied_gradient(grads, ["tok_embeddings.weight", "output.weight"])
    torch.testing.assert_close(either, ref.grads["tok_embeddings.weight"], atol=1e-6, rtol=1e-5)
    with pytest.raises(AssertionError):  # one stage's share alone is not the gradient
        torch.testing.assert_close(grads[0]["tok_embeddings.weight"], ref.grads["tok_embeddings.weight"])


def test_same_stages_as_torch_pipeline():
    model = transformer()
    x, _ = splitting.make_batch(ARGS, 4, 8)
    parts = split(model, ["layers.2"])
    pipe = splitting.torch_pipe(model, x[:2], ["layers.2"])
    assert splitting.compare_with_torch(parts, pipe, x[:2]) < 1e-5
    assert splitting.pipe_crossings(pipe)[1] == ["submod_pp_0"]


def test_errors_name_the_module_or_the_line():
    model = transformer()
    with pytest.raises(ValueError, match="'layers.9' names no submodule"):
        split(model, ["layers.9"])
    with pytest.raises(ValueError, match="out of order: 'layers.1' runs before 'layers.3'"):
        split(model, ["layers.3", "layers.1"])
    with pytest.raises(ValueError, match="leave stage 0 with nothing to compute"):
        split(model, ["tok_embeddings"])
    with pytest.raises(ValueError, match="never called"):
        split(Unused(), ["b"])
    with pytest.raises(ValueError, match=r"cannot trace Branchy.*test_trace.py:\d+: if x.sum\(\) > 0"):
        split(Branchy(), ["a"])
    with pytest.raises(ValueError, match="3 stages but 2 processes"):
        check_stages(3, 2)
    with pytest.raises(ValueError, match="1 stage\\(s\\) but 2 processes.*give 1 split points"):
        check_stages(1, 2)
    x, y = splitting.make_batch(ARGS, 4, 8)
    with pytest.raises(ValueError, match="3 stages but 2 processes"):
        splitting.TracedConfig(model=model, split_points=["layers.1", "layers.2"], x=x, y=y, num_microbatches=2)
    with pytest.raises(ValueError, match="reduction='sum'"):
        splitting.TracedConfig(model=model, split_points=["layers.2"], x=x, y=y,
                               loss_fn=nn.CrossEntropyLoss(reduction="sum"))
    with pytest.raises(ValueError, match="reduction='sum'"):
        splitting.Config(model=model, x=x, y=y, loss_fn=nn.CrossEntropyLoss(reduction="sum"))
    with pytest.raises(ValueError, match="world_size=3 stages but the model has 2 layers"):
        splitting.Config(model=Transformer(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=50)), x=x, y=y,
                         world_size=3)
    with pytest.raises(ValueError, match="y must be a tensor of token ids.*got list"):
        splitting.Config(model=model, x=x, y=y.tolist())
    with pytest.raises(ValueError, match="batch=4 does not divide evenly by num_microbatches=3"):
        splitting.Config(model=model, x=x, y=y, num_microbatches=3)


def test_traced_stages_run_under_pipelab_runtime():
    model = transformer(tied=True)
    x, y = splitting.make_batch(ARGS, 4, 8)
    cfg = splitting.TracedConfig(model=model, split_points=["layers.2"], x=x, y=y, schedules=["1f1b"],
                                 num_microbatches=2, loss_fn=token_loss)
    (run,) = experiments.run(splitting.traced_worker, cfg, splitting.gather_traced)
    # Each micro-batch's loss, as the last stage computed it: one process's on that micro-batch.
    assert run.mb_losses == pytest.approx(splitting.single_process_losses(model, x, y, 2), abs=1e-6)
    ref = reference_run(model, x, y, token_loss, lr=None)
    tied = splitting.tied_gradient(run.grads, ["tok_embeddings.weight", "output.weight"])
    torch.testing.assert_close(tied, ref.grads["tok_embeddings.weight"], atol=1e-6, rtol=1e-5)
    run.grads[1].pop("output.weight")
    run.grads[0].pop("tok_embeddings.weight")
    ref.grads.pop("tok_embeddings.weight")
    assert_same(run, ref, atol=1e-6)


def test_split_by_hand_and_by_torch_tracer_on_real_ranks():
    model = transformer()
    x, y = splitting.make_batch(ARGS, 4, 8)
    cfg = splitting.Config(model=model, x=x, y=y, num_microbatches=2)
    runs = experiments.run(splitting.worker, cfg, splitting.gather)
    ref = reference_run(model, x, y, token_loss, lr=None)
    want = splitting.single_process_losses(model, x, y, 2)
    assert [r.name for r in runs] == ["manual", "torch pipeline()"]
    for run in runs:
        assert run.mb_losses == pytest.approx(want, abs=1e-5)
        assert_same(run, ref, atol=1e-5)


def test_torchrun_is_this_python_running_torch_distributed_run():
    import sys

    command = splitting.torchrun_command("worker.py", 2)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[3:5] == ["--nproc-per-node", "2"] and command[-1] == "worker.py"


class _Stop(Exception):
    """Raised by the fake process group: the script has shown what it does before it starts."""


@pytest.mark.parametrize("gpus, backend", [(2, "nccl"), (0, "gloo")])
def test_standalone_script_sets_its_gpu_before_nccl_and_runs_under_this_python(monkeypatch, tmp_path, gpus, backend):
    """The generated script, read back from disk and run up to its process group with a fake CUDA:
    with a GPU per process it makes cuda:LOCAL_RANK current before NCCL starts; without, it never
    touches CUDA. Its usage line and the command that launches it are `python -m torch.distributed.run`."""
    import sys

    import torch.distributed as dist

    path = splitting.write_script(str(tmp_path / "lesson09_worker.py"), splitting.standalone_script(ARGS, 4, 8, 2))
    text = open(path).read()
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))

    def init_process_group(backend, *args, **kwargs):
        calls.append(("init_process_group", backend))
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    namespace = {"__name__": "lesson09_worker"}
    exec(compile(text, path, "exec"), namespace)
    with pytest.raises(_Stop):
        namespace["main"]()
    want = [("set_device", 1)] if backend == "nccl" else []
    assert calls == want + [("init_process_group", backend)]
    assert "python -m torch.distributed.run --nproc-per-node 2 lesson09_worker.py" in text
    command = splitting.torchrun_command(path, 2)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"] and command[-1] == path
    assert not any(part.endswith("torchrun") for part in command)


def test_the_gpu_profile_counts_its_flops_on_the_meta_device():
    """Nine forward+backward passes and four forwards of the batch: linear in the batch, and the
    notebook's `needs.gpu.flops` is the count at its gpu profile's size."""
    import nbformat

    model = dict(dim=ARGS.dim, n_layers=ARGS.n_layers, n_heads=ARGS.n_heads, vocab_size=ARGS.vocab_size)
    small = splitting.run_flops({**model, "batch": 4, "seq_len": 8})
    assert splitting.run_flops({**model, "batch": 8, "seq_len": 8}) == pytest.approx(2 * small, rel=1e-9)
    meta = nbformat.read("notebooks/09_automatic_splitting.ipynb", 4).metadata["pipelab"]
    gpu = meta["profiles"]["gpu"]
    assert meta["needs"]["gpu"]["flops"] == pytest.approx(splitting.run_flops(gpu), rel=1e-6)

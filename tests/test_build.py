"""Each rank builds only its own stage: a model built on the meta device travels without storage,
each rank gives weights to its own stages only, and they equal the single-process reference's."""

from __future__ import annotations

import copy
import os
import resource

import cloudpickle
import pytest
import torch
from torch import nn

from pipelab import experiments, models
from pipelab.build import is_meta, materialize, on_meta
from pipelab.experiments import pipeline
from pipelab.pipeline.partition import split_model
from pipelab.reference import assert_same, reference_run
from pipelab.worker import RankContext


def mlp_on_meta(width: int, layers: int, seed: int = 0) -> nn.Sequential:
    return on_meta(lambda: models.mlp([width] * (layers + 1)), seed=seed)


def test_weights_depend_on_the_name_and_seed_not_on_where_they_are_made():
    model = mlp_on_meta(8, 4, seed=1)
    whole = materialize(copy.deepcopy(model))
    stage = materialize(copy.deepcopy(split_model(model, 2)[1]), "cpu")  # layers 2.. of the whole
    assert not is_meta(whole) and not is_meta(stage)
    torch.testing.assert_close(stage[0].weight, whole[4].weight, rtol=0, atol=0)
    assert not torch.equal(whole[0].weight, whole[2].weight)  # each module its own generator
    other = materialize(copy.deepcopy(mlp_on_meta(8, 4, seed=2)))
    assert not torch.equal(whole[0].weight, other[0].weight)
    state = torch.random.get_rng_state()
    materialize(copy.deepcopy(model))
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's random stream is untouched


class SmallEmbedding(nn.Module):
    """Its own initialisation overrides its child's (as the tutorial's LM does for its embedding)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 8)
        self.gain = nn.Parameter(torch.ones(8))

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.ones_(self.gain)


def test_a_parent_s_reset_parameters_runs_after_its_children_s():
    model = on_meta(lambda: nn.Sequential(SmallEmbedding(), nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)))
    whole = materialize(copy.deepcopy(model))
    assert whole[0].embedding.weight.abs().max() <= 0.1 and torch.equal(whole[0].gain, torch.ones(8))
    assert not is_meta(whole)
    assert torch.equal(whole[1].self_attn.out_proj.bias, torch.zeros(8))  # as torch's attention initialises it
    stage = materialize(copy.deepcopy(model[1]), "cpu")
    torch.testing.assert_close(stage.self_attn.in_proj_weight, whole[1].self_attn.in_proj_weight, rtol=0, atol=0)


def test_a_real_module_is_left_as_it_is():
    torch.manual_seed(0)
    real = nn.Linear(4, 4)
    before = real.weight.detach().clone()
    assert materialize(real, "cpu") is real and torch.equal(real.weight, before)


def test_a_meta_pipeline_trains_like_one_process():
    """4 stages built on meta, on 2 ranks (two each, interleaved): the cfg the ranks receive holds
    no weights, and the run gives the reference's losses and gradients (same seed)."""
    model = mlp_on_meta(16, 8, seed=3)
    stages = split_model(model, 4)
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    cfg = pipeline.Config(world_size=2, stages=stages, schedules=["interleaved"], num_microbatches=4, x=x, y=y,
                          steps=1)
    assert len(cloudpickle.dumps(cfg)) < 64 * 1024  # shapes only: no stage's weights travel
    [run] = pipeline.run(cfg)
    assert_same(run, reference_run(nn.Sequential(*stages), x, y, nn.MSELoss(), lr=None))  # the run's names


def test_meta_stages_without_on_meta_are_named_by_their_place():
    """Stages built under `torch.device("meta")` by hand: stage s is named "s" as in nn.Sequential(*stages)."""
    with torch.device("meta"):
        stages = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2)]
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    [run] = pipeline.run(pipeline.Config(world_size=2, stages=stages, num_microbatches=2, x=x, y=y, steps=1))
    assert_same(run, reference_run(nn.Sequential(*stages), x, y, nn.MSELoss(), lr=None))


class Scale(nn.Module):
    """A module holding its own parameter and no reset_parameters(): it cannot be made on a rank."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.gain


def test_a_meta_module_without_reset_parameters_is_refused_before_any_rank():
    model = on_meta(lambda: nn.Sequential(nn.Linear(4, 4), Scale(4), nn.Linear(4, 4)))
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"stages\[0\]: module '1' \(Scale\).*\['gain'\].*reset_parameters"):
        pipeline.Config(world_size=2, stages=split_model(model, 2), num_microbatches=2, x=x, y=x)
    with pytest.raises(ValueError, match=r"give Scale a reset_parameters\(\)"):
        materialize(model)
    real = nn.Sequential(nn.Linear(4, 4), Scale(4), nn.Linear(4, 4))  # real weights: nothing to make
    pipeline.Config(world_size=2, stages=split_model(real, 2), num_microbatches=2, x=x, y=x)


# --- memory: each rank holds its stage, not the whole model -------------------------------------

def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_resident_bytes() -> int:
    """This process's own high-water mark of resident memory (VmHWM). Not getrusage's ru_maxrss: on
    Linux that carries over from the parent across fork and exec, so a rank started by a large test
    process would report the parent's peak."""
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    return int(kib) * 1024


def memory_worker(ctx: RankContext, cfg: pipeline.Config) -> dict[str, int]:
    """Resident memory when the worker starts (the cfg unpickled), then before and after this rank
    makes its stages as the pipeline's worker does, and the peak: bytes."""
    start = resident_bytes()
    materialize(mlp_on_meta(4, 2))  # the first initialisation loads its kernels: not the stage's memory
    before = resident_bytes()
    modules = pipeline.rank_modules(ctx, cfg, cfg.jobs[0].schedule)
    held = {"start": start, "stages": resident_bytes() - before,
            "peak": peak_resident_bytes()}
    del modules  # measured while held
    return held


def rank_memory(stages: list[nn.Module], width: int) -> list[dict[str, int]]:
    x = torch.randn(2, width)
    return experiments.run(memory_worker, pipeline.Config(world_size=2, stages=stages, num_microbatches=2,
                                                          x=x, y=x, steps=1))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc (Linux)")
def test_each_rank_holds_its_stage_not_the_whole_model():
    """8 x Linear(2048) (134 MB) on 2 ranks. Built on meta, each rank makes its half only; sent
    real, each rank reads its half only from its stages' files (`pipeline.stage_source`), where a
    pickled list of stages cost it the whole model and a copy of its half. The run built on meta
    is the baseline of what arrives: its cfg holds shapes only. (8 x Linear(4096), 537 MB, gives
    the same ratios; smaller here to stay fast. tests/test_pipeline_stage_memory.py measures peaks.)"""
    meta = mlp_on_meta(2048, 8)
    whole = sum(p.numel() * p.element_size() for p in meta.parameters())
    on_meta_ = rank_memory(split_model(meta, 2), 2048)
    real = rank_memory(split_model(materialize(copy.deepcopy(meta)), 2), 2048)
    for rank, (n, r) in enumerate(zip(on_meta_, real)):
        grew_meta = n["stages"]
        grew_real = r["start"] - n["start"] + r["stages"]
        assert 0.35 * whole < grew_meta < 0.75 * whole, (rank, grew_meta / whole)  # its half, give or take pages
        assert 0.35 * whole < grew_real < 0.75 * whole, (rank, grew_real / whole)  # its half, read from its files


def test_a_meta_grid_trains_like_one_process():
    """Lesson 05's pipe x data grid with SGD steps, its model built on meta: each process makes its
    own stage; the weights after the steps are the reference's."""
    from pipelab.experiments import grid

    model = mlp_on_meta(8, 4, seed=5)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    cfg = grid.Config(model=model, x=x, y=y, layouts=(grid.Layout(2, 1, 2),), steps=1, rounds=1)
    [run] = experiments.run(grid.worker, cfg, grid.gather)
    assert_same(run, grid.reference(cfg))


# --- lesson 10: each process of the grid makes its own stage of the Transformer LM ---------------

def lm_stage_worker(ctx: RankContext, cfg) -> dict:
    """This process's trainer, as lesson 10's worker builds it: what it holds real, by name."""
    from pipelab.experiments.capstone import GridTrainer

    trainer = GridTrainer(ctx, cfg, cfg.corpus)
    real = {n: p for n, p in trainer.stage.named_parameters()}
    return {"stage": trainer.place.rank, "whole_is_meta": all(p.is_meta for p in trainer.model.parameters()),
            "names": sorted(real), "bytes": sum(p.numel() * p.element_size() for p in real.values()),
            "sums": {n: float(p.detach().double().sum()) for n, p in real.items()}}


def test_lesson_10_sends_no_weights_and_each_process_holds_its_stage_only():
    """At emsize 1024, 4 layers (about 140 MB of weights): the config the processes receive
    pickles to a few kB besides the corpus, each process's model stays on meta, and its stage holds
    exactly that stage's parameters, with the weights of the whole model built in one process."""
    from dataclasses import replace

    from pipelab.data import load_corpus
    from pipelab.experiments.capstone import Config
    from pipelab.lm import stages_of
    from pipelab.pipeline.partition import partition_layers

    corpus = load_corpus(max_lines=200)
    cfg = replace(Config(emsize=1024, nhead=8, nhid=1024, nlayers=4, pipe=2, data=1, batch_size=4,
                         num_microbatches=2), corpus=corpus)
    assert len(cloudpickle.dumps(cfg)) - len(cloudpickle.dumps(corpus)) < 8 * 1024  # the recipe, no weights
    whole = cfg.model(len(corpus.vocab))
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    stages = stages_of(whole, partition_layers(list(whole), cfg.pipe, cfg.partition))
    ranks = sorted(experiments.run(lm_stage_worker, cfg), key=lambda r: r["stage"])
    for got, stage in zip(ranks, stages):
        want = dict(stage.named_parameters())
        assert got["whole_is_meta"] and got["names"] == sorted(want)
        assert got["bytes"] == sum(p.numel() * p.element_size() for p in want.values()) < 0.75 * total
        for name, p in want.items():  # the same weights as the whole model built in one process
            assert got["sums"][name] == pytest.approx(float(p.detach().double().sum()), rel=1e-9, abs=1e-9)

"""Each pipeline rank receives and builds only its own stages: real stages travel one file per
stage, a StageBuilder is called by each rank for its own indexes, and either way a rank's peak
memory grows by its stage, not by the whole model; the runs equal one process."""

from __future__ import annotations

import os
import resource
import tempfile

import cloudpickle
import pytest
import torch
from torch import nn

from pipelab import experiments
from pipelab.build import on_meta
from pipelab.experiments import pipeline
from pipelab.launch import WorkerError
from pipelab.pipeline.partition import split_model
from pipelab.pipeline.stage_source import StageBuilder, StageFiles, stage_for_rank
from pipelab.reference import assert_same, reference_run
from pipelab.worker import RankContext

WIDTH, LAYERS = 2048, 8  # 8 x Linear(2048): 134 MB of float32 weights, 67 MB a stage on 2 ranks
MIB = 2**20

BUILT: list[int] = []  # on a rank: the stage indexes its builder was called with


def linear_stage(s: int, width: int = WIDTH, per_stage: int = LAYERS // 2) -> nn.Module:
    """Stage s of LAYERS Linear layers (a builder: the same function for every stage index)."""
    BUILT.append(s)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(per_stage)])


def nbytes(modules) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


def peak_resident_bytes() -> int:
    """This process's high-water mark of resident memory (VmHWM: since its exec, unlike ru_maxrss)."""
    with open("/proc/self/status") as f:
        return 1024 * int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))


def peak_worker(ctx: RankContext, cfg: pipeline.Config) -> dict:
    """The rank's peak when its worker starts (the cfg already unpickled), then after it built its
    stages as the pipeline's worker does; the bytes of those stages; the builder's calls here."""
    at_start = peak_resident_bytes()
    modules = pipeline.rank_modules(ctx, cfg, cfg.jobs[0].schedule)
    return {"at_start": at_start, "peak": peak_resident_bytes(), "stage": nbytes(modules.values()),
            "stages": sorted(modules), "built": list(BUILT)}


def config(stages, schedules=("gpipe",), rows: int = 4, width: int = WIDTH) -> pipeline.Config:
    torch.manual_seed(1)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    return pipeline.Config(world_size=2, stages=stages, schedules=list(schedules), num_microbatches=2, x=x, y=y,
                           steps=1)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc (Linux)")
def test_a_rank_s_peak_grows_by_its_stage_not_by_the_whole_model():
    """Baseline: the same run with its stages on meta, the rank reading its peak before building
    anything (nothing real travelled). Real stages and a builder: the peak after building grows by
    the rank's stage plus a margin of 25 % of it and 24 MiB (allocator and file pages), far
    below the whole model."""
    meta = on_meta(lambda: nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]))
    whole = nbytes([meta])
    base = experiments.run(peak_worker, config(split_model(meta, 2)))
    torch.manual_seed(0)
    real = experiments.run(peak_worker, config(split_model(nn.Sequential(*[nn.Linear(WIDTH, WIDTH)
                                                                            for _ in range(LAYERS)]), 2)))
    built = experiments.run(peak_worker, config(StageBuilder(linear_stage, num_stages=2)))
    for rank in range(2):
        floor = base[rank]["at_start"]
        for how, got in (("real stages", real[rank]), ("builder", built[rank])):
            grew, stage = got["peak"] - floor, got["stage"]
            print(f"rank {rank}, {how}: peak grew {grew / MIB:.0f} MiB for a {stage / MIB:.0f} MiB stage "
                  f"(whole model {whole / MIB:.0f} MiB)")
            assert stage == whole // 2
            assert grew < 1.25 * stage + 24 * MIB, (rank, how, grew / MIB, stage / MIB)
        assert built[rank]["built"] == [rank]  # the builder ran for this rank's stage only


def test_real_stages_travel_one_file_each_and_the_files_are_removed_after_the_run():
    torch.manual_seed(0)
    stages = split_model(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), 2)
    cfg = config(stages, width=64)
    assert len(cloudpickle.dumps(cfg)) < 16 * 1024  # the folder's name travels, not the weights
    files = cfg.sent_stages
    assert isinstance(files, StageFiles) and sorted(os.listdir(files.folder)) == ["stage0.pt", "stage1.pt"]
    [run] = pipeline.run(cfg)
    assert not os.path.exists(files.folder) and cfg.stages is stages
    assert_same(run, reference_run(nn.Sequential(*stages), cfg.x, cfg.y, nn.MSELoss(), lr=None))


class Gain(nn.Module):
    """A stage with a parameter that does not train, a non-persistent buffer and a tied layer:
    loaded from its file as it was saved."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.again = self.linear
        self.gain = nn.Parameter(torch.full((width,), 0.5), requires_grad=False)
        self.register_buffer("shift", torch.arange(width, dtype=torch.float32) / width, persistent=False)

    def forward(self, x):
        return torch.tanh(self.again(self.linear(x)) * self.gain + self.shift)


def test_a_stage_file_loads_the_module_as_it_was():
    torch.manual_seed(0)
    stage = Gain(8)
    files = StageFiles.save([stage])
    try:
        loaded = stage_for_rank(files, 0, rank=0, device="cpu")
        assert loaded.again is loaded.linear and not loaded.gain.requires_grad
        x = torch.randn(3, 8)
        torch.testing.assert_close(loaded(x), stage(x), rtol=0, atol=0)
    finally:
        files.remove()
    assert not os.path.exists(files.folder)


@pytest.mark.parametrize("kind", ["real", "builder"])
def test_gpipe_and_1f1b_equal_one_process(kind):
    """A user's real stages (a class of its own included) and a builder's, GPipe and 1F1B: losses
    and gradients equal one process's on the same stages."""
    def build_stage(s: int) -> nn.Module:
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), Gain(16)) if s == 0 else nn.Sequential(nn.Linear(16, 16))

    torch.manual_seed(0)
    stages = [build_stage(0), build_stage(1)] if kind == "real" else StageBuilder(build_stage, num_stages=2, seed=3)
    cfg = config(stages, schedules=("gpipe", "1f1b"), rows=8, width=16)
    runs = pipeline.run(cfg)
    reference = reference_run(nn.Sequential(*stages), cfg.x, cfg.y, nn.MSELoss(), lr=None)  # a builder builds all here
    for run in runs:
        assert_same(run, reference)


def test_interleaved_ranks_build_exactly_their_own_stages():
    """4 stages on 2 ranks, two each (interleaved): each rank calls the builder for its own two."""
    builder = StageBuilder(lambda s: linear_stage(s, width=16, per_stage=1), num_stages=4)
    results = experiments.run(peak_worker, pipeline.Config(world_size=2, stages=builder, schedules=["interleaved"],
                                                          num_microbatches=2, x=torch.randn(4, 16),
                                                          y=torch.randn(4, 16), steps=1))
    assert [r["built"] for r in results] == [r["stages"] for r in results] == [[0, 2], [1, 3]]


def test_a_builder_s_stage_is_the_same_alone_as_among_all():
    builder = StageBuilder(lambda s: nn.Linear(4, 4), num_stages=3, seed=7)
    state = torch.random.get_rng_state()
    alone, every = builder[2], list(builder)
    assert torch.equal(alone.weight, every[2].weight) and not torch.equal(every[0].weight, every[1].weight)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's random stream is untouched


def test_a_bad_builder_is_refused_before_any_rank_starts():
    def raises(s: int) -> nn.Module:
        raise RuntimeError("no such layer")

    with pytest.raises(ValueError, match=r"build_stage\(0\) raised RuntimeError: no such layer"):
        config(StageBuilder(raises, num_stages=2))
    with pytest.raises(ValueError, match=r"build_stage\(1\) returned int 7 .*not an nn.Module"):
        config(StageBuilder(lambda s: nn.Linear(WIDTH, WIDTH) if s == 0 else 7, num_stages=2))
    with pytest.raises(ValueError, match=r"is a function: wrap it as stages=StageBuilder"):
        config(linear_stage)
    with pytest.raises(ValueError, match=r"num_stages must be a whole number >= 1, got 0"):
        StageBuilder(linear_stage, num_stages=0)


def test_a_builder_failing_on_a_rank_names_the_rank():
    """A builder that works on meta (where the parent checks it) and fails on the rank with real
    tensors: the error names the rank and the stage."""
    def real_fails(s: int) -> nn.Module:
        if s == 1 and not torch.empty(0).is_meta:
            return "stage one"
        return nn.Linear(8, 8)

    cfg = config(StageBuilder(real_fails, num_stages=2), width=8)
    with pytest.raises(WorkerError, match=r"rank 1") as err:
        pipeline.run(cfg)
    assert "build_stage(1) returned str 'stage one' (on rank 1), not an nn.Module" in str(err.value)


def test_stage_files_left_by_a_killed_caller_go_at_the_next_save(tmp_path, monkeypatch):
    """A caller killed by a signal cannot remove its stage folder; the next save removes folders
    whose saving process is gone, and leaves a living process's folder alone."""
    import subprocess
    import sys

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed = subprocess.run([sys.executable, "-c", "import os, tempfile\n"
                             f"tempfile.tempdir = {str(tmp_path)!r}\n"
                             "from torch import nn\n"
                             "from pipelab.pipeline.stage_source import StageFiles\n"
                             "files = StageFiles.save([nn.Linear(2, 2)])\n"
                             "print(files.folder, flush=True)\n"
                             "os.kill(os.getpid(), 9)"], capture_output=True, text=True, timeout=120)
    orphan = killed.stdout.strip()
    assert killed.returncode == -9 and os.path.isdir(orphan)
    mine = StageFiles.save([nn.Linear(2, 2)])
    try:
        assert not os.path.exists(orphan) and os.path.isdir(mine.folder)
        other = StageFiles.save([nn.Linear(2, 2)])  # this process lives: its folders stay
        assert os.path.isdir(mine.folder) and os.path.isdir(other.folder)
        other.remove()
    finally:
        mine.remove()

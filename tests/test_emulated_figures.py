"""Every figure a lesson prints from an emulated node, pinned to the digit.

Modelled time repeats exactly, so the step times, bubbles, overlaps and timelines each lesson's
experiments give on an emulated node (at small, fast sizes of the lessons' own calls) are compared
with `tests/data/emulated_figures.json`, each written to six significant digits: more than any
lesson prints. A change to who computes the modelled time must leave every one of them alone; a
change to the model itself (its formulas, its calibrated figures) changes them on purpose: then
rerun with `PIPELAB_REPIN=1` to write the new figures, and review the difference.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from pipelab import experiments
from pipelab.emulate import Emulated
from pipelab.measure import Measured
from pipelab.timeline import Timeline

PINNED = Path(__file__).parent / "data" / "emulated_figures.json"
REPIN = os.environ.get("PIPELAB_REPIN") == "1"


def fig(value) -> str | list | dict:
    """A figure as pinned: six significant digits (a Measured: each of its repeats)."""
    if isinstance(value, Measured):
        return [fig(v) for v in value.values]
    if isinstance(value, dict):
        return {str(k): fig(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [fig(v) for v in value]
    return f"{float(value):.6g}"


def timeline(tl: Timeline) -> dict:
    """A timeline as pinned: its makespan, bubble, compute/comm overlap, and each rank's busy time
    per lane and kind, and every compute span (rank, kind, stage or layer, micro-batch, start, end)."""
    tl = tl.shifted()
    busy: dict[str, float] = {}
    for s in tl:
        key = f"{s.rank}/{s.lane}/{s.kind}"
        busy[key] = busy.get(key, 0.0) + s.duration
    compute = sorted(f"{s.rank} {s.kind} {s.meta.get('stage', s.meta.get('layer', ''))} {s.mb} "
                     f"{s.start:.6g} {s.end:.6g}" for s in tl if s.lane == "compute")
    return {"makespan": fig(tl.makespan), "bubble": fig(tl.bubble_fraction()),
            "overlap": fig(tl.overlap("compute", "comm")), "busy": fig(dict(sorted(busy.items()))),
            "compute spans": compute}


def check(lesson: str, figures: dict) -> None:
    """Compare `figures` with the pinned ones of `lesson` (or, with PIPELAB_REPIN=1, pin them)."""
    figures = json.loads(json.dumps(figures))
    pinned = json.loads(PINNED.read_text()) if PINNED.exists() else {}
    if REPIN:
        pinned[lesson] = figures
        PINNED.parent.mkdir(exist_ok=True)
        PINNED.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
        return
    assert lesson in pinned, f"no pinned figures for {lesson}: run with PIPELAB_REPIN=1 once"
    want = pinned[lesson]
    for key in sorted(set(want) | set(figures)):
        assert figures.get(key) == want.get(key), f"{lesson}: {key} moved (PIPELAB_REPIN=1 pins new figures)"


def mlp_problem(width: int, rows: int, layers: int = 4):
    torch.manual_seed(0)
    from pipelab import models

    return models.mlp([width] * (layers + 1)), torch.randn(rows, width), torch.randn(rows, width)


def test_lesson_00_ping_pong_all_reduce_and_step():
    from pipelab.experiments import collectives as lesson

    cfg = lesson.Config(sizes_bytes=[8, 2048, 2**20], rounds=1, trips=1, allreduce_sizes=[8, 2**20],
                        allreduce_rounds=1, matrix_size=16, steps=2, emulate=Emulated("2xH100-nvlink", matrix=1024))
    pp = experiments.run(lesson.ping_pong_worker, cfg, lesson.gather_ping_pong)
    sweep = lesson.all_reduce_run(cfg, pp)
    step = experiments.run(lesson.step_worker, cfg, lesson.gather_timeline)
    check("00", {"one-way": [fig(r.one_way) for r in pp.rows], "latency": fig(pp.latency), "bandwidth": fig(pp.bandwidth),
                 "all-reduce torch": [fig(r.torch) for r in sweep.rows], "all-reduce ring": [fig(r.ring) for r in sweep.rows],
                 "predicted": fig(sweep.predicted), "step": timeline(step)})


def test_lesson_01_ddp_buckets_and_sweep():
    from pipelab.experiments import bucket_sweep, ddp

    model, x, y = mlp_problem(16, 8, layers=3)
    size = dict(emulate=Emulated("2xH100-ib-ndr", width=256, batch=512))
    cfg = ddp.Config(model=model, x=x, y=y, world_size=2, bucket_cap_mb=16 * 17 * 4 / 2**20, steps=3,
                     variants=("naive", "bucketed"), **size)
    runs = experiments.run(ddp.worker, cfg, ddp.gather)
    sweep = experiments.run(bucket_sweep.worker, bucket_sweep.Config(
        model=model, x=x, y=y, world_size=2, caps_mb=[0.001, 1.0], with_torch=False, rounds=1, steps=2, **size),
        bucket_sweep.gather)
    check("01", {**{f"{name} step": fig(run.step_time) for name, run in runs.items()},
                 **{f"{name} overlap": fig(run.overlap) for name, run in runs.items()},
                 "bucket all-reduces": [fig(m) for m in runs["bucketed"].bucket_all_reduce_times()],
                 "bucketed timeline": timeline(runs["bucketed"].timeline),
                 "sweep": [[fig(p.step_time), fig(p.overlap)] for p in sweep]})


def test_lessons_02_to_04_resnet_halves_on_paced_devices():
    from pipelab.experiments import model_parallel as ex, split_pipelining
    from pipelab.experiments.model_parallel import Config
    from pipelab.streams import devices

    out = {}
    for lesson, kind, batch, blocks in (("02-03", "H100-nvlink", 12, 1), ("04", "H100-pcie4", 12, (1, 2))):
        pace = ex.ResNet50Pace(f"2x{kind}", batch)
        ds = devices(2, pace=pace)
        try:
            torch.manual_seed(0)
            extra = dict(expansion=8) if lesson == "04" else {}
            cfg = Config.resnet(ds, channels=4, blocks=blocks, batch=batch, size=8, repeats=1, **extra)
            naive = ex.naive_run(cfg)
            variants = ("pipelined", "dual_stream") if lesson == "04" else ("split_by_split", "pipelined")
            sweep = split_pipelining.split_sweep(cfg, [1, 3, 6, 12], variants)
            out[lesson] = {"one device": fig(naive.one_device.step_time), "naive": fig(naive.naive.step_time),
                           **{f"{v} {s}": fig(t.step_time) for v in variants for s, t in sweep[v].timed.items()},
                           **{f"{v} timeline": timeline(sweep[v].timed[sweep[v].best_split].timeline) for v in variants}}
        finally:
            ds.close()
    check("02-04", out)


def test_lesson_05_grid_layouts():
    from pipelab.emulate import Emulated
    from pipelab.experiments import grid, layouts

    model, x, y = mlp_problem(8, 16)
    cfg = grid.Config(model=model, x=x, y=y, layouts=grid.layouts_of(2, 2, 2), steps=1, rounds=1,
                      emulate=Emulated("4xH100-nvlink", scale=32))
    runs = experiments.run(grid.worker, cfg, grid.gather)
    prediction = layouts.predict(cfg)
    check("05", {**{f"{r.name} step": fig(r.step_time) for r in runs},
                 **{f"{r.name} timeline": timeline(r.timeline) for r in runs},
                 "one device": fig(prediction.one_device)})


def pipeline_runs(schedules, ms, checkpoint=False):
    from pipelab.experiments import pipeline
    from pipelab.pipeline.partition import split_model

    model, x, y = mlp_problem(16, 16)
    stages = split_model(model, 4 if "interleaved" in schedules else 2)
    size = pipeline.emulated_mlp("2xH100-nvlink", layers=4, num_stages=len(stages), width=1024, rows=512)
    cfg = pipeline.Config(world_size=2, stages=stages, x=x, y=y, schedules=schedules, num_microbatches=ms,
                          checkpoint=checkpoint, steps=2, emulate=size)
    return cfg, pipeline.run(cfg)


def test_lessons_06_and_07_pipeline_schedules():
    from pipelab.experiments import gpipe  # noqa: F401 - lesson 06's verdicts read these runs
    from pipelab.pipeline.simulate import simulate

    out = {}
    cfg, runs = pipeline_runs(["gpipe", "gpipe", "1f1b", "zb-h1"], [2, 4, 4, 4], [False, True, False, False])
    for i, r in enumerate(runs):
        out[f"{i} {r.name}"] = {"step": fig(r.step_time), "bubble": fig(r.bubble_fraction),
                                "simulated bubble": fig(r.simulated_bubble), "timeline": timeline(r.timeline),
                                "peak bytes": fig(r.peak_bytes)}
    out["simulated 1f1b"] = fig(simulate(runs[2].schedule, cfg.simulated_costs(messages=True)).makespan_ms)
    _, inter = pipeline_runs(["interleaved"], 4)
    out["interleaved"] = {"step": fig(inter[0].step_time), "timeline": timeline(inter[0].timeline)}
    check("06-07", out)


def test_lesson_06_runs_torchgpipes_anchor_again_on_the_published_p40s():
    """Lesson 06's m = 4 over m = 1 on torchgpipe's hardware: the same stages and batches on 2 Tesla
    P40s in float32, as the simulator plays that node's costs; each column names its hardware."""
    import dataclasses

    from pipelab.experiments import gpipe
    from pipelab.pipeline.schedules import make_schedule
    from pipelab.pipeline.simulate import simulate

    cfg, runs = pipeline_runs(["gpipe", "gpipe"], [1, 4])
    again = gpipe.on_published_hardware(cfg)
    assert sorted(again) == [1, 4] and {r.node for r in again.values()} == {"2xP40-pcie"}
    assert all(again[r.schedule.num_microbatches].step_time.median > r.step_time.median for r in runs)
    p40 = dataclasses.replace(cfg, emulate=Emulated("2xP40-pcie", **{**cfg.emulate.size, "dtype": "float32"}))
    simulated = {m: simulate(make_schedule("gpipe", 2, m), p40.simulated_costs(messages=True)).makespan_ms
                 for m in (1, 4)}
    ratio = gpipe.throughput_ratio(again[4], again[1])
    assert ratio == pytest.approx(4 * simulated[1] / simulated[4], rel=0.02)
    rows = gpipe.published_beside(runs, again)
    there = "on the published hardware (modelled, 2 x NVIDIA Tesla P40 over PCIe 3 x16)"
    assert [r["published on"] for r in rows] == ["NVIDIA Tesla P40s", "GPipe's accelerators, not modelled"]
    assert rows[0][there] == round(ratio, 3) and rows[1][there] == "-"
    assert gpipe.on_published_hardware(dataclasses.replace(cfg, emulate=None)) == {}  # nothing emulated here


def test_lesson_08_deepspeed_engine():
    from pipelab.emulate import Emulated
    from pipelab.experiments import deepspeed
    from pipelab.pipeline.module import LayerSpec, PipelineModule

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    specs = [LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, 16, 16),
             LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 16, 4)]
    module = PipelineModule(specs, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform", verbose=False)
    wide = [LayerSpec(nn.Linear, 1024, 2048), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, 2048, 2048),
            LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 2048, 4)]
    cfg = deepspeed.Config(module=module, inputs=x, targets=y, num_microbatches=4, steps=2, lr=0.1,
                           emulate=Emulated("2xH100-nvlink", layers=wide, microbatch=torch.empty(512, 1024, device="meta"),
                                            dtype="bfloat16"))
    run = experiments.run(deepspeed.worker, cfg, deepspeed.gather)
    check("08", {"timeline": timeline(run.timeline)})


def test_lesson_10_capstone_grid():
    from pipelab.data import load_corpus
    from pipelab.experiments.capstone import Config, train

    corpus = load_corpus(max_lines=600)
    cfg = Config(emsize=16, nhead=2, nhid=32, nlayers=2, batch_size=8, num_microbatches=2, max_batches=4,
                 log_interval=1, emulate="4xH100-nvlink")
    run = train(cfg, corpus, progress=False)
    check("10", {"tokens/s": fig(run.tokens_per_second), "step": fig(run.step_time),
                 "timeline": timeline(run.steps.timelines[0])})


def test_lesson_11_zero3_prefetch():
    from pipelab.experiments import sharding

    from pipelab import models

    torch.manual_seed(0)
    model = models.mlp([6, 5, 3])
    torch.manual_seed(1)
    cfg = sharding.Config(model=model, x=torch.randn(8, 6), y=torch.randn(8, 3), world_size=4, lr=1e-2, steps=3,
                          variants=("zero3", "zero3_no_prefetch"), emulate=Emulated("4xH100-nvlink4", batch=512))
    run = experiments.run(sharding.worker, cfg, sharding.gather)
    check("11", {**{f"{v} makespan": fig(run[v].makespan) for v in ("zero3", "zero3_no_prefetch")},
                 **{f"{v} exposed": fig(run[v].exposed_comm) for v in ("zero3", "zero3_no_prefetch")}})


def test_lesson_12_3d_grid():
    from pipelab.experiments import grid3d

    run = grid3d.run(grid3d.Config(steps=2, emulate="8xH100-nvlink"))
    check("12", {"timeline": timeline(run.timeline), "axis costs": fig(grid3d.axis_costs(run)[3])})


def test_lesson_13_v_schedules():
    from pipelab.experiments import v_schedules as vx

    run = vx.run(vx.Config(world_size=2, num_microbatches=4, layers=4, batch=8, width=16, steps=1,
                           emulate="2xH100-nvlink"))
    check("13", {name: {"step": fig(r.step_time), "bubble": fig(r.bubble_fraction), "timeline": timeline(r.timeline)}
                 for name, r in run.schedules.items()})


def row(r: dict) -> dict:
    """A printed table row as pinned: its figures to six digits, its words as they are."""
    return {k: v if isinstance(v, str) and not v.replace(".", "").replace("e+", "").isdigit() else fig(v)
            for k, v in r.items()}


def test_lesson_14_ring_step_at_128k_tokens():
    from pipelab.experiments import context_parallel as lesson

    check("14", {"ring overlap": [row(r) for r in lesson.ring_overlap(128 * 1024)]})


def test_lesson_15_modelled_steps_capacity_and_hiding():
    from pipelab.experiments import expert_load as lesson_parts, expert_parallel as lesson

    cfg = lesson.Config(world_size=2)  # the notebook's defaults
    counts, _ = lesson_parts.routed_counts(cfg)  # what each rank routes: the run's counts, in one process
    out = {}
    for name, load in (("routed", counts), ("even", lesson_parts.evenly(counts))):
        step = lesson_parts.modelled_step(cfg, load)
        out[name] = {"step": fig(step.step), "all-to-all": fig(step.all_to_all), "experts": fig(step.experts),
                     "assignments": step.assignments, "timeline": timeline(step.timeline)}
    links = ("H100-nvlink", "H100-ib", "H100-100gbe")
    for link in links:
        step = lesson_parts.modelled_step(cfg, counts, link)
        out[f"{link} compute / all-to-all"] = fig(max(step.experts) / step.communication)
    out["capacity sweep"] = [row(r) for r in lesson_parts.capacity_sweep(cfg, (0.5, 0.75, 1.0, 1.25, 1.5, 2.0))]
    out["hiding"] = [row(r) for r in lesson_parts.hiding_table(cfg, counts, links)]
    check("15", out)


def test_lesson_16_recomputation_and_fp8_modelled():
    from pipelab.experiments import precision_parts as lesson_parts

    big, node = lesson_parts.BlockSize(2048, 4, 4096, 32), "1xH100-nvlink4"  # the notebook's defaults
    check("16", {"recomputation": [row(r) for r in lesson_parts.recompute_times(big, node)],
                 "fp8": fig(lesson_parts.fp8_rates((big.seq_len * big.batch, big.dim, 4 * big.dim), node))})


@pytest.mark.skipif(REPIN, reason="pinning")
def test_every_lesson_is_pinned():
    pinned = json.loads(PINNED.read_text())
    assert set(pinned) == {"00", "01", "02-04", "05", "06-07", "08", "10", "11", "12", "13", "14", "15", "16"}

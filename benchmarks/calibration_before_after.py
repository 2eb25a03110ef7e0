"""The lessons' headline modelled figures and published anchors, before and after calibration.

Each figure is computed twice with the same code at the lesson's emulated size: once with the
data-sheet model the emulator had before it was calibrated (PIPELAB_EMULATE_MODEL=datasheet: every
kernel at a flat 50 % of the sheet's peak plus 5 us, every message latency + bytes / the sheet's
bandwidth, collectives as ring formulas over it) and once with the calibrated model the lessons use
(`pipelab.emulate.calibrated`). Lesson 06's stage also stands beside the same stage timed on a
real H100 (`pipelab.emulate.gpu_timing.MEASURED_STAGES`). Anchors are emulated on the published
hardware where it is known and modelled (torchgpipe's Tesla P40s); where it is not (the tutorial's
unnamed GPUs), on the lesson's node and on two other cards. Pipeline figures come from lesson 07's simulator, which plays
the emulated ranks' costs (`benchmarks/emulation.py` holds the two within 1.4 %), not from runs.
Lessons 05, 08, 11-14 and 16 give their headline modelled figures through their own functions
(`LESSONS`); lesson 13's bubbles are DeepSeek-V3's and the DualPipe README's published formulas
(`emulate.anchors.FORMULAS`) evaluated with its stage's modelled F, B and W.

    python benchmarks/calibration_before_after.py            # a markdown table, then one JSON line

Nothing here is timed on this machine: every figure is modelled. Last line: one JSON object.
"""

import json
import os

import torch
from torch import nn

from pipelab.emulate import anchors, cost, moe, resnet50, seconds
from pipelab.emulate.gpu_timing import measured_stage, measured_stages
from pipelab.pipeline.schedules import make_schedule
from pipelab.pipeline.simulate import Costs, simulate

TUTORIAL_SPLITS = (1, 3, 5, 8, 10, 12, 20, 40, 60)
# Lesson 06's stage timed on a real H100 with CUDA events (the calibration's companion file).
GPU_RUN = measured_stages()


def tutorial(node: str) -> dict:
    """Lessons 02-04 at the tutorial's size: one device over naive model parallel (the tutorial's
    3.75/4.02 s), the pipelined speedups at split sizes 20 and 12 and the best split."""
    halves = resnet50.ResNet50Halves(node, resnet50.EMULATED_BATCH)
    a, c, b = halves.split_seconds(resnet50.EMULATED_BATCH)
    speedups = resnet50.modelled_speedups(node, "layer2", TUTORIAL_SPLITS)
    best = max(speedups, key=speedups.get)
    return {"one over naive": (a + b) / (a + c + b), "split 20": speedups[20], "split 12": speedups[12],
            "best split": best, "best": speedups[best]}


def pipeline(node: str, schedule: str, m: int, width: int = 8192, rows: int = 4096, layers: int = 8,
             dtype: str = "bfloat16") -> dict:
    """Lessons 06-07's MLP (`layers` Linear layers of `width`, `rows` per micro-batch) in two stages
    on `node` (`emulated_mlp`, as lesson 06 builds it), played by the simulator with the emulated
    stage and message costs."""
    from pipelab.emulate import node_of, size_of
    from pipelab.emulate.pipe import EmulatedPipe
    from pipelab.experiments.pipeline import Config, emulated_mlp

    size = size_of(Config.SIZE, emulated_mlp(node, layers, 2, width, rows, dtype))
    pipe = EmulatedPipe.of(size, nn.MSELoss(), node_of(node), 2, node)
    run = simulate(make_schedule(schedule, 2, m, 1), Costs(transfer=pipe.message_ms(), per_stage=pipe.stage_ms()))
    return {"step_ms": run.makespan_ms, "bubble": run.bubble_fraction, "samples_per_s": m * rows / run.makespan_ms * 1e3}


def stage_on_h100(row: dict) -> tuple[str, float, float]:
    """A measured row of lesson 06's stage: its name, and the modelled forward and step (ms) on an H100."""
    from pipelab.emulate.specs import DEVICES

    t = cost.stage_seconds(*measured_stage(row), DEVICES["h100"], row["dtype"])
    name = (f"06 stage {row['layers']} x Linear({row['width']}){'' if row['last_stage_relu_dropped'] else ' + ReLU'}, "
            f"{row['rows']} rows {row['dtype']}, 1 x H100")
    return name, 1e3 * t["F"], 1e3 * (t["F"] + t["B"])


MEASURED_ON_H100 = {}
for _row in GPU_RUN["rows"]:
    if _row["width"] >= 4096:
        _name = stage_on_h100(_row)[0]
        MEASURED_ON_H100[f"{_name}: forward (ms)"] = 1e3 * _row["F_s"]
        MEASURED_ON_H100[f"{_name}: forward + backward (ms)"] = 1e3 * _row["FB_s"]


# Lessons 05, 08, 11-14 and 16: each lesson's headline modelled figures at its notebook's defaults, by
# its own functions (no process is started: what a run would time, the lesson's cost functions give).


def lesson_05() -> dict[str, float]:
    """05: the grid MLP's whole step on one H100 at the emulated size, and each layout's compute-only
    step on 4 x H100 (`layouts.predict`, the prediction the lesson plots beside its runs)."""
    from pipelab.emulate import Emulated
    from pipelab.experiments import layouts
    from pipelab.models import mlp

    torch.manual_seed(0)
    cfg = layouts.Config(model=mlp([128] * 9), x=torch.randn(64, 128), y=torch.randn(64, 128),
                         layouts=layouts.layouts_of(2, 2, 4), schedule="1f1b", lr=0.1, steps=1, rounds=2,
                         emulate=Emulated("4xH100-nvlink", scale=64))
    prediction = layouts.predict(cfg)
    out = {"05 grid MLP (8 x Linear(8192), 4096 rows): one step on one H100 (ms)": 1e3 * prediction.one_device}
    for layout in cfg.layouts:
        out[f"05 {layout.name}: compute-only step on 4 x H100 (ms)"] = 1e3 * prediction.seconds(layout, 4)
    return out


def lesson_08(node: str = "2xH100-nvlink") -> dict[str, float]:
    """08: AlexNet's layers modelled at 256 images in bf16 (`layer_profile`), cut in 2 stages by
    parameters and by that profile (`model_cuts`): the headline, slowest stage by parameters / by profile."""
    from pipelab.emulate import node_of
    from pipelab.experiments import deepspeed
    from pipelab.models import alexnet_layers
    from pipelab.pipeline.cuts import model_cuts

    layers = alexnet_layers(num_classes=10)
    sample = torch.empty(256, 3, 224, 224, device="meta")
    layer_ms = [t.median for t in deepspeed.layer_profile(layers, sample, node_of(node).device, "bfloat16")]
    cuts = model_cuts(layers, layer_ms, ["parameters", "profile"], stage_counts=(2,))
    return {"08 AlexNet forward+backward, 256 images bf16, 1 x H100 (ms)": sum(layer_ms),
            "08 AlexNet 2 stages: slowest stage by parameters / by profile": cuts.speedup(2).median}


def lesson_11(node: str = "4xH100-nvlink4", rows: int = 512, width: int = 256) -> dict[str, float]:
    """11: the MLP each rank computes, its layers timed at `rows` rows (`sized.sharded_layers`, the
    table a rank's clock uses), and ZeRO-3's all-gather of the largest layer's fp32 parameters."""
    from pipelab.emulate import node_of, sized
    from pipelab.models import mlp

    torch.manual_seed(0)
    model = mlp([width, width + 1, width + 1, width])
    layers = [(name, m) for name, m in model.named_children() if isinstance(m, nn.Linear)]
    table = sized.sharded_layers(layers, model, torch.randn(16, width), rows)
    device = node_of(node).device
    step = sum(cost.compute_seconds(table.costs[kind, "layer", name], device, "float32")
               for name, _ in layers for kind in ("F", "B"))
    largest = max(sum(p.numel() for p in m.parameters()) for _, m in layers) * 4
    return {f"11 MLP forward+backward at {rows} rows fp32, 1 x H100 (us)": 1e6 * step,
            "11 ZeRO-3 all-gather of the largest layer's fp32 parameters, 4 x H100 NVLink (us)":
                1e6 * seconds("all_gather", nbytes=largest, node=node)}


def lesson_12() -> dict[str, float]:
    """12: the 3-D grid's stage 0 at lesson 10's size (`grid3d.big_stage`), F + B per tensor rank as
    `tensor_stage` times it, and a tensor-parallel all-reduce of one micro-batch's bf16 activation."""
    from pipelab.emulate import node_of
    from pipelab.experiments import grid3d

    cfg = grid3d.Config(emulate="8xH100-nvlink")
    ntoken, _ = cfg.batches()
    module, example = grid3d.big_stage(cfg, ntoken, 0)
    t = cost.stage_seconds(module, example, node_of("8xH100-nvlink").device, "bfloat16")
    activation = cfg.size.columns * cfg.size.seq_len * cfg.size.emsize * 2
    return {"12 3-D grid stage 0 (emsize 4096, 2 x 2048 tokens) F+B per tensor rank, H100 (ms)":
                1e3 * (t["F"] + t["B"]) / cfg.tensor,
            "12 tensor-parallel all-reduce of one micro-batch's activation, 2 x H100 NVLink (us)":
                1e6 * seconds("all_reduce", nbytes=activation, node="2xH100-nvlink")}


def lesson_13(p: int = 2, layers: int = 8) -> dict[str, float]:
    """13: one 1F1B stage's F, B and W at the emulated size (`sized.tanh_stages`, what a rank's clock
    uses), and the published bubbles (`dualpipe_formulas`) of 1F1B and DualPipeV with them."""
    from pipelab.emulate import node_of, sized
    from pipelab.experiments.v_schedules import Config
    from pipelab.pipeline.v_shape import dualpipe_formulas

    size = Config.SIZE
    device = node_of(f"{p}xH100-nvlink").device
    table = sized.tanh_stages([0], layers // p, size["width"], size["rows"], device, size["dtype"])
    f, i, w = (1e3 * table.costs[kind, "stage", 0] for kind in ("F", "I", "W"))
    formulas = dualpipe_formulas(p, f, i + w, w)
    return {f"13 one 1F1B stage ({layers // p} x Linear+Tanh 8192, 4096 rows bf16) F+B, H100 (ms)": f + i + w,
            f"13 DualPipeV bubble, published formula, p={p} (ms)": formulas["DualPipeV"]["bubble"],
            f"13 DualPipeV bubble / 1F1B bubble, published formulas, p={p}":
                formulas["DualPipeV"]["bubble"] / formulas["1F1B"]["bubble"]}


def lesson_14(tokens: int = 128 * 1024) -> dict[str, float]:
    """14: a causal zig-zag ring step of Llama 2 7B's attention at 128K tokens (`ring_overlap`): its
    attention and its K/V passing, inside a node (8 ranks) and over InfiniBand (16)."""
    from pipelab.experiments.context_parallel import ring_overlap

    out = {}
    for row in ring_overlap(tokens, (8, 16)):
        over = f"{row['ranks']} x H100 {row['link']}"
        out[f"14 ring step attention fwd+bwd, {over} (ms)"] = row["attention fwd+bwd (ms)"]
        out[f"14 ring step K/V passing fwd+bwd, {over} (ms)"] = row["K/V passing fwd+bwd (ms)"]
    return out


def lesson_16(size: tuple[int, int, int, int] = (2048, 4, 4096, 32), node: str = "1xH100-nvlink4") -> dict[str, float]:
    """16: the modelled step of one bf16 Transformer block per recomputation mode (`recompute_times`)
    and its MLP product in bf16 and FP8 with FP8's extra passes (`fp8_rates`), at the lesson's size."""
    from pipelab.experiments.precision_parts import BlockSize, fp8_rates, recompute_times

    big = BlockSize(*size)
    block = f"s={big.seq_len}, b={big.batch}, h={big.dim}, a={big.n_heads}"
    out = {f"16 block ({block}) step, recomputation {row['recomputation']}, 1 x H100 (ms)": row["modelled step (ms)"]
           for row in recompute_times(big, node)}
    shape = (big.seq_len * big.batch, big.dim, 4 * big.dim)
    for name, value in fp8_rates(shape, node).items():
        out[f"16 {shape[0]} x {shape[1]} by {shape[1]} x {shape[2]}: {name.replace(', modelled', '')}"] = value
    return out


LESSONS = {"05": lesson_05, "08": lesson_08, "11": lesson_11, "12": lesson_12, "13": lesson_13, "14": lesson_14, "16": lesson_16}


def figures() -> dict[str, float]:
    """Every figure of the table under the model the environment selects."""
    out = {}
    for row in GPU_RUN["rows"]:
        if row["width"] >= 4096:
            name, forward, step = stage_on_h100(row)
            out[f"{name}: forward (ms)"], out[f"{name}: forward + backward (ms)"] = forward, step
    out["00 all-reduce 1 MiB, 2 x H100 NVLink (us)"] = 1e6 * seconds("all_reduce", nbytes=2**20, node="2xH100-nvlink")
    out["00 one-way 1 MiB message, 2 x H100 NVLink (us)"] = 1e6 * seconds("send", nbytes=2**20, node="2xH100-nvlink")
    out["00 all-reduce 58 MB, 8 x H100 NVLink (us)"] = 1e6 * seconds("all_reduce", nbytes=58e6, node="8xH100-nvlink")
    out["01 all-reduce of a 25 MB bucket, 2 x H100 over IB NDR (us)"] = 1e6 * seconds(
        "all_reduce", nbytes=25 * 2**20, node="2xH100-ib-ndr")
    out["01 all-reduce 1 GB, 2 x 8 H100 over IB NDR (ms)"] = 1e3 * seconds("all_reduce", nbytes=1e9, node="2x8xH100")
    for node in ("2xH100-nvlink", "2xH100-pcie4", "2xA100-nvlink", "2xT4"):
        for key, value in tutorial(node).items():
            out[f"02-04 tutorial ResNet-50 {key}, {node}"] = value
    for node, dtype in (("2xH100-nvlink", "bfloat16"), ("2xP40-pcie3", "float32")):
        for schedule, m in (("gpipe", 1), ("gpipe", 4), ("gpipe", 8), ("1f1b", 8)):
            run = pipeline(node, schedule, m, dtype=dtype)
            out[f"06-07 {schedule} m={m} step (ms), {node} {dtype}"] = run["step_ms"]
            out[f"06-07 {schedule} m={m} bubble, {node} {dtype}"] = run["bubble"]
            out[f"_{node} {schedule} {m} samples"] = run["samples_per_s"]
        out[f"06 throughput m=4 over m=1, {node} {dtype}"] = (out.pop(f"_{node} gpipe 4 samples")
                                                            / out.pop(f"_{node} gpipe 1 samples"))
        out.pop(f"_{node} gpipe 8 samples"), out.pop(f"_{node} 1f1b 8 samples")
    from pipelab.experiments.capstone import Config, one_device_tokens_per_second

    out["10 tokens/s of one H100, the tutorial's LM at 4096 wide, 8 layers, 33,278 words, bf16"] = (
        one_device_tokens_per_second(Config(emulate="4xH100-nvlink"), 33278))
    for lesson in LESSONS.values():
        out.update(lesson())
    out["15 expert forward, 8192 tokens, Mixtral size, 1 x H100 (us)"] = 1e6 * moe.expert_seconds("forward", 8192, 4096, 14336, "2xH100-nvlink")
    out["15 all-to-all of 8192 x 4096 bf16 tokens, 2 x H100 NVLink (us)"] = 1e6 * moe.all_to_all_seconds(8192 * 4096 * 2, "2xH100-nvlink")
    return out


def both() -> tuple[dict, dict]:
    """The figures with the data-sheet model, then with the calibrated one."""
    runs = {}
    for model in ("datasheet", "calibrated"):
        os.environ[cost.MODEL_ENV] = model
        runs[model] = figures()
    os.environ.pop(cost.MODEL_ENV)
    return runs["datasheet"], runs["calibrated"]


PUBLISHED = {
    "02-04 tutorial ResNet-50 one over naive": anchors.anchor("tutorial_single_gpu_s").value / anchors.anchor("tutorial_naive_mp_s").value,
    "02-04 tutorial ResNet-50 split 20": anchors.anchor("tutorial_pipeline_split20_speedup").value,
    "02-04 tutorial ResNet-50 split 12": anchors.anchor("tutorial_pipeline_split12_speedup").value,
    "02-04 tutorial ResNet-50 best split": 12,
    "06 throughput m=4 over m=1": anchors.anchor("torchgpipe_amoebanet_n2_m4").value,
    "06-07 gpipe m=8 bubble": anchors.gpipe_bubble(2, 8),
}


def published(key: str) -> str:
    """The published figure a row stands beside, or the one measured on an H100 (marked), if any."""
    if key in MEASURED_ON_H100:
        return f"{MEASURED_ON_H100[key]:.4g} (measured, H100 {GPU_RUN['date']})"
    for prefix, value in PUBLISHED.items():
        if key.startswith(prefix):
            return f"{value:.3g}"
    return ""


def main() -> None:
    before, after = both()
    print("| figure (modelled) | published (or measured on a GPU) | data-sheet model (before) | calibrated (after) | after / before |")
    print("| --- | --- | --- | --- | --- |")
    for key in before:
        ratio = after[key] / before[key] if before[key] else float("nan")
        print(f"| {key} | {published(key)} | {before[key]:.4g} | {after[key]:.4g} | {ratio:.2f} |")
    print(json.dumps({"figures": len(before), "before": {k: round(v, 6) for k, v in before.items()},
                      "after": {k: round(v, 6) for k, v in after.items()}}))


if __name__ == "__main__":
    main()

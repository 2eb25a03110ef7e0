"""Published figures an emulated run can be held against, each with where it was published.

A lesson prints its emulated figure beside the published one (`beside`), and where they differ
says why: the published runs used other hardware (the tutorial does not name its GPUs; torchgpipe
used Tesla P40s, GPipe TPUs and P100s), other batch sizes and their own software's overheads.
Each anchor names the published hardware as an `emulate=` node (`hardware`) where the emulator
models it (torchgpipe's P40s), and "" where it does not (unnamed GPUs, TPUs): a lesson emulates
the published hardware where there is one and says which (`hardware_text`).

Only figures stated in the sources are here; a speedup the source prints as a percentage is kept
with the two times it comes from. Schedules' bubbles published as formulas in their own F, B, W
(DeepSeek-V3's Table 2, the DualPipe README) are `FORMULAS`: no hardware, a lesson evaluates them
with its own run's costs.
"""

from __future__ import annotations

from dataclasses import dataclass

TUTORIAL = ("PyTorch tutorial \"Single-Machine Model Parallel Best Practices\", "
            "https://pytorch.org/tutorials/intermediate/model_parallel_tutorial.html "
            "(source: github.com/pytorch/tutorials, intermediate_source/model_parallel_tutorial.py)")
TUTORIAL_SETUP = ("ResNet-50 (1000 classes) split after layer2 over 2 GPUs; 3 batches of 120 random "
                  "128x128 images, MSELoss, SGD lr 0.001; mean of 10 timeit runs; the GPUs are not named")
GPIPE = ("Huang et al., \"GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism\", "
         "NeurIPS 2019, https://arxiv.org/abs/1811.06965")
TORCHGPIPE = ("torchgpipe documentation, Benchmarks, https://torchgpipe.readthedocs.io/en/stable/benchmarks.html "
              "(source: github.com/kakaobrain/torchgpipe, docs/benchmarks.rst); Kim et al., \"torchgpipe: "
              "On-the-fly Pipeline Parallelism for Training Giant Models\", https://arxiv.org/abs/2004.09910")
DEEPSEEK_V3 = ("DeepSeek-AI, \"DeepSeek-V3 Technical Report\", https://arxiv.org/abs/2412.19437 (v2), section "
               "3.2.1 \"DualPipe and Computation-Communication Overlap\", Table 2 \"Comparison of pipeline bubbles "
               "and memory usage across different pipeline parallel methods\"")
DUALPIPE = ("deepseek-ai/DualPipe, README.md, \"Pipeline Bubbles and Memory Usage Comparison (based on the same number "
            "of PP stages)\", https://github.com/deepseek-ai/DualPipe (commit 3da1bbe, lines 24-36)")

# torchgpipe's benchmarks ran on Tesla P40s (PCIe 3, no NVLink), up to 8 of them.
P40_NODE = "8xP40-pcie"


@dataclass(frozen=True)
class Anchor:
    """One published figure: `value` in `unit`, with its `source`, where in it (`where`, quoted
    as printed there) and the setup it was measured on."""
    key: str
    what: str
    value: float
    unit: str
    source: str
    where: str
    setup: str
    hardware: str = ""  # the published hardware as an emulate= node; "" where it is unknown or not modelled


def _speedups(prefix: str, what: str, rows: dict[str, float], unit: str, where: str, setup: str,
              source: str = TORCHGPIPE, hardware: str = "") -> dict[str, Anchor]:
    return {f"{prefix}_{name}": Anchor(f"{prefix}_{name}", f"{what}, {name}", value, unit, source, where, setup,
                                       hardware) for name, value in rows.items()}


ANCHORS: dict[str, Anchor] = {
    # PyTorch's model-parallel tutorial: times of one training run (3 batches), in seconds.
    "tutorial_single_gpu_s": Anchor(
        "tutorial_single_gpu_s", "ResNet-50 on one GPU, seconds for 3 batches", 3.75, "s", TUTORIAL,
        "section \"Apply Model Parallel to Existing Modules\": \"4.02/3.75-1=7%\"", TUTORIAL_SETUP),
    "tutorial_naive_mp_s": Anchor(
        "tutorial_naive_mp_s", "ResNet-50 split over 2 GPUs, no pipelining, seconds", 4.02, "s", TUTORIAL,
        "same section: \"the execution time of model parallel implementation is 4.02/3.75-1=7% longer\"",
        TUTORIAL_SETUP),
    "tutorial_naive_mp_slowdown": Anchor(
        "tutorial_naive_mp_slowdown", "naive model parallel time over one GPU's", 4.02 / 3.75, "x", TUTORIAL,
        "\"4.02/3.75-1=7% longer than the existing single-GPU implementation\"", TUTORIAL_SETUP),
    "tutorial_pipeline_split20_s": Anchor(
        "tutorial_pipeline_split20_s", "pipelined over 2 GPUs, split size 20, seconds", 2.51, "s", TUTORIAL,
        "section \"Speed Up by Pipelining Inputs\": \"3.75/2.51-1=49%\"", TUTORIAL_SETUP),
    "tutorial_pipeline_split20_speedup": Anchor(
        "tutorial_pipeline_split20_speedup", "one GPU's time over pipelined (split size 20)", 3.75 / 2.51, "x",
        TUTORIAL, "\"pipelining inputs to model parallel ResNet50 speeds up the training process by roughly "
        "3.75/2.51-1=49%\"", TUTORIAL_SETUP),
    "tutorial_pipeline_split12_s": Anchor(
        "tutorial_pipeline_split12_s", "pipelined over 2 GPUs, split size 12 (the best), seconds", 2.43, "s",
        TUTORIAL, "\"setting split_size to 12 achieves the fastest training speed, which leads to "
        "3.75/2.43-1=54% speedup\"", TUTORIAL_SETUP + "; split sizes tried: 1, 3, 5, 8, 10, 12, 20, 40, 60"),
    "tutorial_pipeline_split12_speedup": Anchor(
        "tutorial_pipeline_split12_speedup", "one GPU's time over pipelined (split size 12)", 3.75 / 2.43, "x",
        TUTORIAL, "\"3.75/2.43-1=54% speedup\"", TUTORIAL_SETUP),
    # GPipe's own statement of the bubble.
    "gpipe_negligible_bubble_m_over_p": Anchor(
        "gpipe_negligible_bubble_m_over_p", "micro-batches per stage above which GPipe found the bubble "
        "negligible", 4.0, "m/p", GPIPE, "section 2.3: \"This bubble time is O((K-1)/(M+K-1)) amortized over "
        "the number of micro-steps M. In our experiments, we found the bubble overhead to be negligible "
        "when M >= 4 x K.\" (K partitions, M micro-batches)", "GPipe on TPUs and GPUs, with re-materialisation"),
    # torchgpipe, ResNet-101 speed, throughput relative to one GPU without pipelining.
    **_speedups("torchgpipe_resnet101", "ResNet-101 throughput over the baseline (one GPU, no pipeline)",
                {"pipeline1": 0.853, "pipeline2": 1.414, "pipeline4": 2.774, "pipeline8": 4.294}, "x",
                "Speed, \"ResNet-101 Speed Benchmark\" table, torchgpipe column (baseline 95.862 samples/s)",
                "Tesla P40 GPUs; pipeline-k: k partitions", hardware=P40_NODE),
    **_speedups("gpipe_resnet101", "ResNet-101 speedup reported by GPipe",
                {"pipeline1": 0.80, "pipeline2": 1.42, "pipeline4": 2.18, "pipeline8": 2.89}, "x",
                "torchgpipe's \"ResNet-101 Speed Benchmark\" table, column \"Huang et al.\", from Figure 3(b) of "
                "GPipe v4 (https://arxiv.org/abs/1811.06965v4)", "GPipe's GPUs; pipeline-k: k partitions",
                source=TORCHGPIPE + "; " + GPIPE),
    # torchgpipe, AmoebaNet-D (18, 256): n partitions, m micro-batches, relative to n=2, m=1.
    **_speedups("torchgpipe_amoebanet", "AmoebaNet-D (18, 256) throughput over n=2, m=1",
                {"n2_m1": 1.0, "n2_m4": 1.539, "n2_m32": 1.773, "n4_m1": 1.004, "n4_m4": 1.666,
                 "n4_m32": 2.709, "n8_m1": 0.932, "n8_m4": 2.621, "n8_m32": 4.953}, "x",
                "Speed, \"AmoebaNet-D (18, 256) Speed Benchmark\" table, torchgpipe column",
                "Tesla P40 GPUs; n partitions, m micro-batches", hardware=P40_NODE),
    **_speedups("gpipe_amoebanet", "AmoebaNet-D (18, 256) speedup over n=2, m=1 reported by GPipe",
                {"n2_m1": 1.0, "n2_m4": 1.07, "n2_m32": 1.21, "n4_m1": 1.13, "n4_m4": 1.26, "n4_m32": 1.84,
                 "n8_m1": 1.38, "n8_m4": 1.72, "n8_m32": 3.48}, "x",
                "torchgpipe's \"AmoebaNet-D (18, 256) Speed Benchmark\" table, column \"Huang et al.\", "
                "from Table 2 of GPipe", "GPipe's accelerators; n partitions, m micro-batches",
                source=TORCHGPIPE + "; " + GPIPE),
    # torchgpipe, U-Net (5, 64) speed: long skip connections across partitions.
    **_speedups("torchgpipe_unet", "U-Net (5, 64) throughput over the baseline",
                {"pipeline1": 0.858, "pipeline2": 1.246, "pipeline4": 2.352, "pipeline8": 3.105}, "x",
                "Speed, \"U-Net (5, 64) Speed Benchmark\" table (baseline 28.500/s)",
                "Tesla P40 GPUs; pipeline-k: k partitions", hardware=P40_NODE),
}


@dataclass(frozen=True)
class ScheduleFormula:
    """One schedule's published bubble and memory per device, as the source prints them: F, B (a full
    backward), W and F&B (an overlapped forward and backward) are one chunk's times; PP the pipeline
    stages. `key` is the lesson's name of the schedule, `published_name` the source's."""
    key: str
    published_name: str
    bubble: str
    parameters: str
    activations: str
    devices: str
    source: str
    where: str


def _formula(key: str, name: str, bubble: str, parameters: str, activations: str, devices: str,
             in_report: bool = True) -> ScheduleFormula:
    where = (f"Table 2, row \"{name}{' (Ours)' if name == 'DualPipe' else ''}\"; " if in_report else "") + \
        f"README table, row \"{name}\""
    return ScheduleFormula(key, name, bubble, parameters, activations, devices,
                           f"{DEEPSEEK_V3}; {DUALPIPE}" if in_report else DUALPIPE, where)


FORMULAS: dict[str, ScheduleFormula] = {f.key: f for f in (
    _formula("1F1B", "1F1B", "(PP-1)(F+B)", "1x", "PP", "PP"),
    _formula("ZB-H1", "ZB1P", "(PP-1)(F+B-2W)", "1x", "PP", "PP"),
    _formula("DualPipe", "DualPipe", "(PP/2-1)(F&B+B-3W)", "2x", "PP+1", "PP"),
    # The README's row only: DualPipeV, DualPipe cut in half, puts the PP stages on PP/2 devices.
    _formula("DualPipeV", "DualPipeV", "(PP/2-1)(F&B+B-3W)", "2x", "PP+1", "PP/2", in_report=False))}
FORMULA_HARDWARE = ("a formula in the schedule's own F, B and W: no hardware; evaluated with this run's costs, "
                    "on the lesson's node")


def formula(key: str) -> ScheduleFormula:
    """The published formula of schedule `key`; a ValueError listing the known ones otherwise."""
    if key not in FORMULAS:
        raise ValueError(f"no published formula for {key!r}; known: {', '.join(FORMULAS)}")
    return FORMULAS[key]


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """GPipe's bubble, (p-1)/(m+p-1): the idle fraction of each stage's time in a pipeline of p
    equal stages and m micro-batches (GPipe, section 2.3, writes it O((K-1)/(M+K-1)))."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need stages >= 1 and microbatches >= 1, got {stages}, {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def anchor(key: str) -> Anchor:
    """The anchor named `key`; a ValueError listing the known keys otherwise."""
    if key not in ANCHORS:
        raise ValueError(f"unknown anchor {key!r}; known: {', '.join(sorted(ANCHORS))}")
    return ANCHORS[key]


def hardware_text(key: str) -> str:
    """Which hardware a lesson should emulate for anchor `key`, in words: the published hardware
    where the emulator models it, else why it emulates its own node."""
    if key in FORMULAS:
        return FORMULA_HARDWARE
    published = anchor(key)
    if published.hardware:
        from pipelab.emulate.specs import parse_node

        return f"emulated on the published hardware: {parse_node(published.hardware)}"
    return "the published hardware is not named or not modelled (TPUs): emulated on the lesson's node"


def published_hardware(key: str) -> str:
    """The hardware anchor `key` was measured on, in a few words for a column's name."""
    published = anchor(key)
    if published.hardware:
        from pipelab.emulate.specs import parse_node

        return parse_node(published.hardware).device.name + "s"
    return "GPUs not named" if published.source == TUTORIAL else f"{published.setup.split(';')[0]}, not modelled"


def published_node(key: str, count: int) -> str | None:
    """The published hardware of anchor `key` as an emulate= node of `count` devices (the published
    runs' own number may differ), or None where it is not named or not modelled."""
    node = anchor(key).hardware
    if not node:
        return None
    if count < 1:
        raise ValueError(f"need count >= 1 devices, got {count}")
    return f"{count}x{node.split('x', 1)[1]}"


def beside(key: str, emulated: float) -> dict:
    """A row for a table: the published figure, the emulated one, their ratio, the source and the
    published hardware as an emulate= node ("" where it is unknown or not modelled)."""
    published = anchor(key)
    return {"what": published.what, "published": published.value, "emulated": emulated,
            "emulated / published": emulated / published.value if published.value else float("nan"),
            "unit": published.unit, "setup": published.setup, "source": f"{published.source}; {published.where}",
            "published hardware": published.hardware}

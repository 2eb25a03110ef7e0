"""The emulator's hardware model held against published measurements of real GPUs and links: the
rows the repository holds, the model within 25 % of them, its constants refitted from the rows that
calibrated it, the public `seconds` call, nodes of several machines and the calibration-spec hooks."""

import json
import math

import pytest
import torch

from pipelab.emulate import calibrated, cost, fitting, measured, seconds, specs, validation
from pipelab.emulate.cost import Counts

# ---------------------------------------------------------------------------------------------
# The published rows
# ---------------------------------------------------------------------------------------------


def test_published_tables_are_many_sourced_and_span_sizes():
    tables = measured.tables()
    assert len(tables) >= 6
    for table in tables.values():
        assert "https://" in table.source and table.hardware and table.measured and table.use
    hardware = validation.summary(validation.compare())["hardware"]
    assert len(hardware) >= 4
    sizes = [row.nbytes for row in measured.collectives()]
    assert math.log10(max(sizes) / min(sizes)) >= 3  # message sizes over 3 decades
    curves = {row.device for row in measured.kernels() if row.kind == "matmul" and row.shape[0] == row.shape[2]}
    assert len(curves) >= 2  # matrix-product curves against size for at least two devices
    for rows in (measured.collectives(), measured.kernels()):
        assert {row.use for row in rows} == {"calibrate", "check"}


def test_measured_time_undoes_the_bus_factor():
    row = next(r for r in measured.collectives() if r.table == "a100_allreduce_nccl_tests" and r.nbytes == 2 ** 33)
    assert row.seconds() == pytest.approx(64074e-6, rel=1e-3)  # the row's printed time: 64074 us


# ---------------------------------------------------------------------------------------------
# The model against them
# ---------------------------------------------------------------------------------------------


def test_emulator_within_25_percent_of_published_measurements():
    result = validation.summary(validation.compare())
    for rows in ("all", "check"):  # the held-out rows on their own as well
        assert result[rows]["within_25pct"] >= 0.9, result
        assert result[rows]["median_error"] < 0.10, result


def test_the_sheet_model_was_further_off():
    calibrated_rows = validation.summary(validation.compare())["all"]
    sheet_rows = validation.summary(validation.compare("sheet"))["all"]
    assert sheet_rows["median_error"] > 2 * calibrated_rows["median_error"]
    assert sheet_rows["within_25pct"] < calibrated_rows["within_25pct"]


def _calibrate(rows):
    return [r for r in rows if r.use == "calibrate"]


@pytest.mark.parametrize("key, efficiency", [("h100", calibrated.H100), ("a100-pcie", calibrated.A100_PCIE),
                                              ("l4", calibrated.L4)])
def test_matmul_constants_refit_from_their_calibrate_rows(key, efficiency):
    rows = {}
    for row in _calibrate(measured.kernels()):
        if row.device == key and row.kind == "matmul" and row.table.endswith("zzc0721"):
            rows.setdefault(row.dtype, []).append((row.flops, row.seconds()))
    launch, fits = fitting.fit_device(rows, specs.DEVICES[key].flops)
    assert launch == pytest.approx(efficiency.launch_s, rel=0.02)
    for dtype, (e_max, half) in fits.items():
        assert e_max == pytest.approx(efficiency.matmul[dtype][0], rel=0.02)
        # the half-work matters only against the launch floor: compare the time it adds
        fill = abs(half - efficiency.matmul[dtype][1]) / (specs.DEVICES[key].rate(dtype) * e_max)
        assert fill < 0.05 * launch


def test_memory_and_fabric_constants_refit_from_their_calibrate_rows():
    memory = [(r.nbytes, r.seconds()) for r in _calibrate(measured.kernels()) if r.kind == "memory"]
    launch, fraction = fitting.fit_memory(memory, specs.DEVICES["a100-pcie"].memory_bandwidth)
    assert (launch, fraction) == pytest.approx((calibrated.MEMORY_LAUNCH_S, calibrated.MEMORY_FRACTION), rel=0.01)

    def model(p, row):
        fabric = calibrated.Fabric(p["ll_step_s"], p["ll_busbw"], p["simple_step_s"], p["simple_busbw"],
                                   p.get("nvls_s", 0.0), p.get("nvls_algbw", 0.0))
        return calibrated.ring_seconds(row.kind, row.nbytes, row.ranks, fabric, row.algo)
    a100 = [r for r in _calibrate(measured.collectives()) if r.node.startswith("8xA100")]
    nvlink3 = fitting.fit_fabric(a100, model, {"ll_step_s": 3e-6, "ll_busbw": 20e9, "simple_step_s": 6e-6,
                                               "simple_busbw": 200e9})
    for name, value in nvlink3.items():
        assert value == pytest.approx(getattr(calibrated.NVLINK3, name), rel=0.02), name
    h200 = [r for r in _calibrate(measured.collectives()) if "H200" in r.node]
    nvlink4 = fitting.fit_fabric(h200, model, {"ll_step_s": 3e-6, "ll_busbw": 40e9, "simple_busbw": 360e9,
                                               "nvls_s": 40e-6, "nvls_algbw": 270e9},
                                 {"simple_step_s": calibrated.NVLINK3.simple_step_s})
    for name, value in nvlink4.items():
        assert value == pytest.approx(getattr(calibrated.NVLINK4, name), rel=0.02), name


def test_infiniband_constants_refit_from_their_calibrate_rows():
    rows = [r for r in _calibrate(measured.collectives()) if r.node == "4x8xH100-ib-ndr"]
    assert {r.kind for r in rows} == {"all_reduce", "all_gather"}

    def machines(p, row):
        return calibrated.hierarchical_seconds(row.kind, row.nbytes, row.ranks, 8, calibrated.NVLINK4,
                                               calibrated.Fabric(**p))
    ib = fitting.fit_fabric(rows, machines, {"ll_step_s": 2e-6, "ll_busbw": 5e9, "simple_step_s": 3e-6,
                                             "simple_busbw": 40e9})
    for name, value in ib.items():
        assert value == pytest.approx(getattr(calibrated.IB_NDR, name), rel=0.02), name


def test_several_machines_ring_uses_every_card_and_all_reduce_the_tree():
    """A ring through 32 GPUs crosses the network on all 8 cards of a machine at once, so a large
    all-gather runs at 8 cards' bandwidth, not one's; a small all-reduce takes the tree's few steps."""
    big, ranks = 8 * 2 ** 30, 32
    gather = seconds("all_gather", nbytes=big, node="4x8xH100")
    assert (ranks - 1) / ranks * big / gather == pytest.approx(8 * calibrated.IB_NDR.simple_busbw, rel=0.01)
    tree_steps = 2 * (8 - 1 + 2)  # the chain of 8 inside each machine, a tree of depth 2 across 4
    assert seconds("all_reduce", nbytes=8, node="4x8xH100") == pytest.approx(
        tree_steps * calibrated.IB_NDR.ll_step_s, rel=0.01)
    assert seconds("send", nbytes=1e9, node="4x8xH100") == pytest.approx(
        calibrated.ring_seconds("send", 1e9, 2, calibrated.IB_NDR))  # one message: one card


# ---------------------------------------------------------------------------------------------
# seconds(): one call for a product, a message, a collective
# ---------------------------------------------------------------------------------------------


def test_seconds_matmul_efficiency_grows_with_size_under_the_peak():
    rates = [2 * n ** 3 / seconds("matmul", shape=(n, n, n), node="1xH100", dtype="bf16")
             for n in (256, 1024, 4096, 16384)]
    assert rates == sorted(rates)
    assert rates[-1] <= specs.DEVICES["h100"].rate("bf16")  # the data sheet's peak stays the limit
    assert seconds("matmul", shape=(64, 64, 64), node="1xH100") == pytest.approx(calibrated.H100.launch_s)


def test_seconds_collectives_and_messages():
    big = seconds("all_reduce", nbytes=16 * 2 ** 30, node="8xH200-nvlink")
    assert 2 * 7 / 8 * 16 * 2 ** 30 / big > 1.1 * calibrated.NVLINK4.simple_busbw  # NVLS beats the ring
    ring = seconds("all_gather", nbytes=16 * 2 ** 30, node="8xH200-nvlink")
    assert 7 / 8 * 16 * 2 ** 30 / ring == pytest.approx(calibrated.NVLINK4.simple_busbw, rel=0.01)
    assert seconds("all_reduce", nbytes=1e6, node="8xH100", ranks=1) == 0.0
    assert seconds("barrier", node="8xH100") > 0
    small, large = (seconds("send", nbytes=b, node="2xH100-nvlink") for b in (1e3, 1e9))
    assert small < 2e-5 and large == pytest.approx(1e9 / calibrated.NVLINK4.simple_busbw, rel=0.01)
    assert seconds("send", nbytes=1e8, node="2xL4") > 5 * seconds("send", nbytes=1e8, node="2xH100")


@pytest.mark.parametrize("call, message", [
    (dict(kind="allreduce", nbytes=1), "unknown kind"),
    (dict(kind="all_reduce"), "needs nbytes"),
    (dict(kind="send", nbytes=-1), ">= 0"),
    (dict(kind="matmul", shape=(1, 2)), "shape=\\(m, n, k\\)"),
    (dict(kind="matmul", shape=(8, 8, 8), node="1xT4", dtype="bf16"), "no bfloat16"),
    (dict(kind="all_reduce", nbytes=1, node="2xH100", ranks=4), "ranks"),
])
def test_seconds_refuses_bad_input(call, message):
    kind = call.pop("kind")
    with pytest.raises(ValueError, match=message):
        seconds(kind, **call)


def test_compute_seconds_is_a_stream_of_calibrated_kernels():
    h100 = specs.DEVICES["h100"]
    relu = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU())
    layer = cost.count(relu, torch.empty(4096, 4096))
    assert layer.kernels == 2 and layer.flop_kernels == 1  # addmm (product and bias), the ReLU
    assert cost.compute_seconds(layer, h100, "bf16") == pytest.approx(
        calibrated.matmul_seconds(4096, 4096, 4096, h100, "bfloat16"), rel=0.01)  # the product dominates
    tiny = Counts(1e3, 1e3, 10)
    assert cost.compute_seconds(tiny, h100, "bf16") == pytest.approx(10 * calibrated.H100.launch_s)
    assert cost.compute_seconds(Counts(0.0, 0.0, 0), h100) == 0.0
    flat = cost.compute_seconds(Counts(1e12, 0.0, 1), h100, "bf16", efficiency=0.5, launch_overhead_s=0)
    assert flat == pytest.approx(2e12 / h100.rate("bf16"))  # an explicit efficiency: the flat roofline


# ---------------------------------------------------------------------------------------------
# Nodes of several machines; calibration specs
# ---------------------------------------------------------------------------------------------


def test_nodes_of_several_machines():
    node = specs.parse_node("2x8xH100")
    assert node.count == 16 and node.link.per_node == 8 and node.link.inner == "nvlink4"
    assert node.link.kind == "ib-ndr" and "between machines" in str(node)
    assert specs.Node.from_json(node.to_json()) == node  # what a spawned rank rebuilds
    one_machine = seconds("all_reduce", nbytes=1e9, node="8xH100-nvlink")
    assert seconds("all_reduce", nbytes=1e9, node=node, ranks=8) == pytest.approx(one_machine)
    both = seconds("all_reduce", nbytes=1e9, node=node)
    flat_ring_over_the_network = 2 * 15 / 16 * 1e9 / calibrated.FABRICS["ib-ndr"].simple_busbw
    assert one_machine < both < flat_ring_over_the_network  # reduced inside each machine first
    assert specs.parse_node("2x8xH100-100gbe").link.kind == "100gbe"
    with pytest.raises(ValueError, match="joined by a network"):
        specs.parse_node("2x8xH100-nvlink")


def test_new_devices_and_their_sources():
    for key in ("h200", "a100-40gb", "a100-pcie", "l40s"):
        device = specs.DEVICES[key]
        assert "https://" in device.source and calibrated.efficiency_of(device).matmul
    assert specs.parse_node("2xL40S").link.kind == "pcie4"
    assert specs.DEVICES["h200"].rate("bf16") == specs.DEVICES["h100"].rate("bf16")


def test_calibration_specs_make_devices_and_links():
    before = dict(specs.DEVICES)
    try:
        _check_devices_and_links_from_specs()
    finally:  # device_from_spec registers the device: leave the tables as other tests find them
        specs.DEVICES.clear()
        specs.DEVICES.update(before)


def _check_devices_and_links_from_specs():
    spec = {"name": "My GPU", "flops": {"bfloat16": 100e12, "float32": 20e12}, "memory_bandwidth": 1e12,
            "memory_bytes": 24e9, "source": "pipelab calibrate on this machine, 2026-01-01",
            "efficiency": {"launch_s": 8e-6, "memory_fraction": 0.9, "matmul": {"bfloat16": [0.5, 0.0]}}}
    device = specs.device_from_spec(json.loads(json.dumps(spec)))
    assert specs.parse_node("2xmy-gpu-pcie").device == device
    assert seconds("matmul", shape=(8192,) * 3, node="1xmy-gpu") == pytest.approx(2 * 8192 ** 3 / 50e12)
    fabric = {"ll_step_s": 2e-6, "ll_busbw": 10e9, "simple_step_s": 5e-6, "simple_busbw": 100e9}
    link = specs.link_from_spec({"name": "my link", "latency_s": 5e-6, "bandwidth_Bps": 120e9,
                                 "source": "measured here", "fabric": fabric})
    assert cost.message_seconds(1e9, link) == pytest.approx(5e-6 + 1e9 / 100e9)
    with pytest.raises(ValueError, match="needs"):
        specs.device_from_spec({"name": "x"})


def test_registered_node_readers_come_first():
    def reader(text):
        return specs.parse_node("2xH100") if text.endswith(":calibration.json") else None
    specs.NODE_READERS.insert(0, reader)  # ahead of pipelab calibrate's own reader of such names
    try:
        assert specs.parse_node("8x:calibration.json").count == 2
    finally:
        specs.NODE_READERS.remove(reader)


def test_anchors_name_the_published_hardware_where_it_is_modelled():
    from pipelab.emulate import anchors

    for item in anchors.ANCHORS.values():
        if item.hardware:
            node = specs.parse_node(item.hardware)
            assert "P40" in item.setup and node.device.name == "NVIDIA Tesla P40"
    assert "Tesla P40" in anchors.hardware_text("torchgpipe_amoebanet_n2_m4")
    assert "not named" in anchors.hardware_text("tutorial_pipeline_split20_speedup")
    assert anchors.beside("torchgpipe_amoebanet_n2_m4", 1.5)["published hardware"] == anchors.P40_NODE
    # a lesson of 2 ranks emulates 2 of the published cards; each column names its hardware in words
    assert specs.parse_node(anchors.published_node("torchgpipe_amoebanet_n2_m4", 2)).count == 2
    assert anchors.published_node("gpipe_amoebanet_n2_m4", 2) is None
    assert anchors.published_hardware("torchgpipe_amoebanet_n2_m4") == "NVIDIA Tesla P40s"
    assert anchors.published_hardware("tutorial_naive_mp_slowdown") == "GPUs not named"
    assert "not modelled" in anchors.published_hardware("gpipe_amoebanet_n2_m4")


def test_the_published_schedule_formulas_are_deepseek_v3s_table_2_and_the_dualpipe_readmes():
    from pipelab.emulate import anchors
    from pipelab.pipeline.v_shape import dualpipe_formulas

    rows = {k: (f.bubble, f.parameters, f.activations, f.devices) for k, f in anchors.FORMULAS.items()}
    assert rows == {"1F1B": ("(PP-1)(F+B)", "1x", "PP", "PP"), "ZB-H1": ("(PP-1)(F+B-2W)", "1x", "PP", "PP"),
                    "DualPipe": ("(PP/2-1)(F&B+B-3W)", "2x", "PP+1", "PP"),
                    "DualPipeV": ("(PP/2-1)(F&B+B-3W)", "2x", "PP+1", "PP/2")}
    assert "Table 2" in anchors.formula("DualPipe").where and "2412.19437" in anchors.formula("DualPipe").source
    assert "Table 2" not in anchors.formula("DualPipeV").where  # the report has no DualPipeV row
    # the lesson's evaluation covers every published schedule it runs, and no hardware is implied
    assert set(dualpipe_formulas(2, 1.0, 2.0, 1.0)) == set(anchors.FORMULAS) - {"DualPipe"}
    assert "no hardware" in anchors.hardware_text("DualPipeV")
    with pytest.raises(ValueError, match="no published formula"):
        anchors.formula("ZB-V")


def test_the_model_table_a_lesson_shows_is_the_calibrated_model_it_runs_on(monkeypatch):
    """Every emulated lesson's first table: the fitted figures the clock uses, each citing the
    published table it was fitted on; the data sheet's peak only as the limit."""
    from pipelab.emulate import calibrated, model_table

    rows = {r["figure"]: r for r in model_table("2xH100-nvlink", "8 layers", "bfloat16")}
    e_max, _ = calibrated.EFFICIENCIES["h100"].matmul["bfloat16"]
    matmul = next(r for f, r in rows.items() if f.startswith("matrix products in bfloat16"))
    assert matmul["value"].startswith(f"{e_max:.0%} of the peak")
    assert "pipelab/emulate/published/h100_matmul_zzc0721.csv" in matmul["source"]
    simple = next(r for f, r in rows.items() if "Simple protocol" in f)
    assert f"{calibrated.NVLINK4.simple_busbw / 1e9:.3g} GB/s" in simple["value"]
    assert "published/h200_allreduce_bench.csv" in simple["source"]
    assert any("NVLS" in f for f in rows) and not any("efficiency (fraction" in f for f in rows)
    borrowed = {r["figure"]: r for r in model_table("2xT4-pcie", None, "float16")}
    assert any("no measured table for this device" in r["source"] for r in borrowed.values())
    monkeypatch.setenv("PIPELAB_EMULATE_MODEL", "datasheet")
    before = {r["figure"]: r["value"] for r in model_table("2xH100-nvlink", None, "bfloat16")}
    assert before["efficiency (fraction of the peak reached)"] == "50%"

"""The links measured on several machines (NVLink 5, EFA between machines) refitted from their
calibrate rows, the data-sheet model the emulator had before calibration, which
PIPELAB_EMULATE_MODEL=datasheet plays for before/after comparisons, and the before/after rows of
lessons 05, 08, 11-14 and 16 in benchmarks/calibration_before_after.py."""

import functools
import importlib.util
import math
from pathlib import Path

import pytest

from pipelab.emulate import calibrated, cost, fitting, measured, seconds, specs, validation
from pipelab.emulate.cost import Counts


def _calibrate(table: str):
    return [r for r in measured.collectives() if r.table == table and r.use == "calibrate"]


def test_nvlink5_and_efa_constants_refit_from_their_calibrate_rows():
    def ring(p, row):
        return calibrated.ring_seconds(row.kind, row.nbytes, row.ranks, calibrated.Fabric(**p), row.algo)
    nvlink5 = fitting.fit_fabric(_calibrate("b200_allreduce_1node"), ring,
                                 {"ll_step_s": 3e-6, "ll_busbw": 60e9, "simple_step_s": 6e-6,
                                  "simple_busbw": 700e9, "nvls_s": 40e-6, "nvls_algbw": 500e9})
    for name, value in nvlink5.items():
        assert value == pytest.approx(getattr(calibrated.NVLINK5, name), rel=0.02), name

    def machines(p, row):
        net = calibrated.Fabric(p["step_s"], p["busbw"], p["step_s"], p["busbw"])
        return calibrated.hierarchical_seconds(row.kind, row.nbytes, row.ranks, 8, calibrated.NVLINK5, net)
    efa = fitting.fit_fabric(_calibrate("b200_allreduce_4node_efa"), machines, {"step_s": 14e-6, "busbw": 40e9})
    assert efa["step_s"] == pytest.approx(calibrated.EFA.simple_step_s, rel=0.02)
    assert efa["busbw"] == pytest.approx(calibrated.EFA.simple_busbw, rel=0.02)


def test_several_machines_over_efa_and_infiniband_each_have_their_own_fit():
    node = specs.parse_node("4x8xB200-efa")
    assert (node.count, node.link.per_node, node.link.inner, node.link.kind) == (32, 8, "nvlink5", "efa")
    assert calibrated.fabric_of(specs.LINKS["ib-ndr"]) is calibrated.IB_NDR != calibrated.EFA
    for fabric, link in ((calibrated.EFA, "efa"), (calibrated.IB_NDR, "ib-ndr")):
        assert fabric.simple_busbw < specs.LINKS[link].bandwidth_Bps  # under the card's 50 GB/s line rate
    big = 16 * 2 ** 30  # NCCL reduces inside each machine first: far faster than one flat ring over the network
    flat = calibrated.ring_seconds("all_reduce", big, 32, calibrated.EFA)
    assert seconds("all_reduce", nbytes=big, node="4x8xB200-efa") < flat / 4


def test_validation_names_each_row_by_its_device():
    assert validation._device("4x8xB200-efa") == "b200"
    assert validation._device("8xA100-nvlink") == "a100"
    assert validation._device("a100-pcie") == "a100-pcie"


def test_datasheet_model_is_the_flat_roofline_and_the_plain_link_formulas(monkeypatch):
    h100, link = specs.DEVICES["h100"], specs.LINKS["nvlink4"]
    work = Counts(4e12, 1e9, 40, 10)
    calibrated_s = cost.compute_seconds(work, h100, "bfloat16")
    calibrated_send = cost.message_seconds(64e6, link)
    monkeypatch.setenv(cost.MODEL_ENV, "datasheet")
    assert cost.compute_seconds(work, h100, "bfloat16") == cost.compute_seconds(work, h100, "bfloat16", efficiency=0.5)
    assert cost.compute_seconds(work, h100, "bfloat16") != calibrated_s
    assert cost.message_seconds(64e6, link) == pytest.approx(link.latency_s + 64e6 / link.bandwidth_Bps)
    assert cost.message_seconds(64e6, link) != calibrated_send
    n, nbytes = 8, 58e6
    assert cost.collective_seconds("all_reduce", nbytes, n, link) == pytest.approx(
        2 * (n - 1) * (link.latency_s + nbytes / n / link.bandwidth_Bps))
    monkeypatch.setenv(cost.MODEL_ENV, "calibrated")
    assert cost.compute_seconds(work, h100, "bfloat16") == calibrated_s


def test_datasheet_model_refuses_an_unknown_name(monkeypatch):
    monkeypatch.setenv(cost.MODEL_ENV, "sheet")
    with pytest.raises(ValueError, match="'calibrated' .* or 'datasheet'"):
        cost.message_seconds(1e6, specs.LINKS["nvlink4"])


@functools.cache
def _before_after():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "calibration_before_after.py"
    spec = importlib.util.spec_from_file_location("calibration_before_after", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("lesson", ["05", "08", "11", "12", "13", "14", "16"])
def test_each_lessons_headline_figures_have_a_row_under_both_models(lesson, monkeypatch):
    bench = _before_after()
    assert set(bench.LESSONS) == {"05", "08", "11", "12", "13", "14", "16"}
    rows = {}
    for model in ("datasheet", "calibrated"):
        monkeypatch.setenv(cost.MODEL_ENV, model)
        rows[model] = bench.LESSONS[lesson]()
    before, after = rows["datasheet"], rows["calibrated"]
    assert before and before.keys() == after.keys() and all(name.startswith(f"{lesson} ") for name in before)
    assert all(math.isfinite(v) and v > 0 for v in [*before.values(), *after.values()])
    # Every time here rests on a constant the calibration changed (matrix-product efficiency by size,
    # launch cost, each link's bus bandwidth and step latency): none may come out as the sheet's.
    timed = [name for name in before if name.endswith(("(ms)", "(us)"))]
    assert timed and all(after[name] != pytest.approx(before[name], rel=1e-3) for name in timed), \
        {name: (before[name], after[name]) for name in timed}

"""`pipelab calibrate`'s fitting, on synthetic measurements made from known figures (no GPU here):
the fit recovers them, the JSON file round-trips into a Node that `spawn(emulate=...)` runs on, and
the command stops with a clear message where there is no GPU."""

import json
import random

import pytest
import torch

from pipelab import cli
from pipelab.emulate import calibrate as cal
from pipelab.emulate import gpu_timing
from pipelab.emulate import specs
from pipelab.emulate.cost import Counts, compute_seconds
from pipelab.launch import spawn

# The synthetic GPU: per dtype a fixed overhead per product and a sustained rate.
TRUTH = {"float32": (8e-6, 50e12), "tf32": (9e-6, 380e12), "bfloat16": (10e-6, 790e12), "float16": (10e-6, 800e12)}
MEMORY = (3e-6, 2.9e12)  # overhead, bytes/s (read + write)
LINK = (12e-6, 150e9)  # latency, bus bytes/s


def noisy(seconds: float, rng: random.Random, noise: float) -> float:
    return seconds * (1 + rng.uniform(-noise, noise))


def synthetic(noise: float = 0.0, links: bool = False, seed: int = 0) -> dict:
    """What gpu_timing would measure on the synthetic GPU, with relative noise up to `noise`."""
    rng = random.Random(seed)
    measured = {
        "matmul": [{"dtype": d, "n": n, "seconds": noisy(o + cal.matmul_flops(n) / r, rng, noise)}
                   for d, (o, r) in TRUTH.items() for n in cal.MATMUL_SIZES],
        "copy": [{"bytes": 2 * b, "seconds": noisy(MEMORY[0] + 2 * b / MEMORY[1], rng, noise)} for b in cal.COPY_BYTES],
        "launch_s": [noisy(4e-6, rng, noise) for _ in range(7)]}
    if links:
        ranks = 8
        measured["links"] = {"ranks": ranks, "copy": [
            {"bytes": b, "seconds": noisy(LINK[0] + b / LINK[1], rng, noise)} for b in gpu_timing.MESSAGE_BYTES],
            "collectives": {name: [{"bytes": b, "seconds": noisy(LINK[0] + b * f(ranks) / LINK[1], rng, noise)}
                                   for b in gpu_timing.MESSAGE_BYTES] for name, f in cal.BUS_FACTOR.items()}}
    return measured


def record(measured: dict, gpu: str = "NVIDIA H100 80GB HBM3", count: int = 1) -> dict:
    info = {"gpu": gpu, "memory_bytes": 85520809984, "capability": "9.0", "gpu_count": count,
            "driver": "570.00", "cuda": "12.8", "torch": "2.11.0+cu128", "python": "3.12.0",
            "date": "2026-01-01T00:00:00Z"}
    return cal.spec(info, measured)


def test_fit_line_recovers_overhead_and_rate_exactly_and_refuses_what_cannot_be_fitted():
    work = [1e3, 1e5, 1e7, 1e9]
    overhead, rate = cal.fit_line(work, [5e-6 + w / 2e9 for w in work])
    assert overhead == pytest.approx(5e-6, rel=1e-9) and rate == pytest.approx(2e9, rel=1e-9)
    # a negative overhead (noise) is clamped to zero, the rate refitted alone
    assert cal.fit_line([1.0, 2.0], [0.9, 2.0])[0] == 0.0
    with pytest.raises(ValueError, match="at least two"):
        cal.fit_line([1.0], [1.0])
    with pytest.raises(ValueError, match="do not grow"):
        cal.fit_line([1.0, 2.0, 4.0], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="must all be > 0"):
        cal.fit_line([1.0, 2.0], [0.0, 1.0])


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_fit_recovers_the_synthetic_gpu_within_its_noise(noise):
    fit = record(synthetic(noise, links=True))["fit"]
    tolerance = 1e-9 if noise == 0 else 0.1
    for dtype, (overhead, rate) in TRUTH.items():
        m = fit["matmul"][dtype]
        assert m["flops_per_s"] == pytest.approx(rate, rel=tolerance)
        if noise == 0:
            assert m["overhead_s"] == pytest.approx(overhead, rel=1e-6)
        # the efficiency-versus-size curve is over the H100's data-sheet peak, and rises with size
        assert m["sheet_flops_per_s"] == specs.DEVICES["h100"].flops[dtype]
        fitted = [p["fitted"] for p in m["curve"]]
        assert fitted == sorted(fitted) and 0 < fitted[0] < fitted[-1] < 1
        assert [p["n"] for p in m["curve"]] == list(cal.MATMUL_SIZES)
    assert fit["memory"]["bytes_per_s"] == pytest.approx(MEMORY[1], rel=tolerance)
    assert fit["launch_s"] == pytest.approx(4e-6, rel=max(noise, 1e-9))
    assert fit["link"]["bytes_per_s"] == pytest.approx(LINK[1], rel=tolerance)
    assert fit["link"]["latency_s"] == pytest.approx(LINK[0], rel=1e-6 if noise == 0 else 0.5)
    for name in cal.BUS_FACTOR:
        assert fit["link"]["collectives"][name]["bus_bytes_per_s"] == pytest.approx(LINK[1], rel=tolerance)


def test_a_dtype_whose_times_do_not_grow_is_reported_and_left_out_of_the_node(tmp_path):
    measured = synthetic()
    for row in measured["matmul"]:
        if row["dtype"] == "float16":
            row["seconds"] = 1.0 / row["n"]  # shrinking with size: nothing to fit
    rec = record(measured)
    assert "do not grow" in rec["fit"]["matmul"]["float16"]["error"]
    assert "float16: not fitted" in cal.summary(rec)
    node = cal.load_node(cal.write(rec, str(tmp_path / "c.json")), 2)
    assert sorted(node.device.flops) == ["bfloat16", "float32", "tf32"]


def test_an_unknown_gpu_is_fitted_over_its_own_sustained_rate():
    fit = record(synthetic(), gpu="Some Future GPU")["fit"]
    m = fit["matmul"]["bfloat16"]
    assert m["sheet_flops_per_s"] is None and m["efficiency_of"] == "the fitted sustained rate"
    assert m["curve"][-1]["fitted"] < 1 and m["curve"][-1]["measured"] == pytest.approx(m["curve"][-1]["fitted"])
    assert cal.known_device("NVIDIA A100-SXM4-80GB")[0] == "a100"
    assert cal.known_device("Tesla T4")[0] == "t4" and cal.known_device("Some Future GPU") is None


def test_json_round_trip_makes_a_node_of_eight_with_the_measured_figures(tmp_path):
    path = cal.write(record(synthetic()), str(tmp_path / "calibration.json"))
    json.loads((tmp_path / "calibration.json").read_text())  # strict JSON: allow_nan=False wrote it
    node = specs.parse_node(f"8x:{path}")
    assert node.count == 8 and node.device.name == "NVIDIA H100 80GB HBM3 (calibrated)"
    # the data sheet's peak stays the limit; the measured rate is its fraction e_max, the overhead
    # the work `half` a product needs to reach half of it
    assert node.device.flops["bfloat16"] == specs.DEVICES["h100"].rate("bfloat16")
    e_max, half = node.device.efficiency["matmul"]["bfloat16"]
    assert e_max * node.device.flops["bfloat16"] == pytest.approx(TRUTH["bfloat16"][1], rel=0.02)
    assert half / TRUTH["bfloat16"][1] == pytest.approx(TRUTH["bfloat16"][0], rel=0.2)
    assert node.device.memory_bandwidth * node.device.efficiency["memory_fraction"] == pytest.approx(MEMORY[1], rel=0.02)
    assert node.device.memory_bytes == 85520809984 and "2026-01-01" in node.device.source
    assert node.link == specs.LINKS["nvlink4"]  # one GPU measured no link: the H100's data-sheet link
    assert specs.parse_node(f"2x:{path}@pcie5").link == specs.LINKS["pcie5"]
    assert specs.Node.from_json(node.to_json()) == node
    from pipelab import hardware  # a lesson's first line says where the modelled times come from
    assert "modelled from the GPU as `pipelab calibrate` measured it" in hardware.describe(2, emulate=f"8x:{path}")
    # a compute cost on it takes the measured rate's time
    assert compute_seconds(Counts(1e12, 0.0, 1), node.device, "bfloat16") == pytest.approx(
        TRUTH["bfloat16"][0] + 1e12 / TRUTH["bfloat16"][1], rel=0.02)
    # with a measured link, the node's link is the measured one
    with_link = cal.write(record(synthetic(links=True), count=8), str(tmp_path / "eight.json"))
    link = specs.parse_node(f"8x:{with_link}").link
    assert link.bandwidth_Bps == pytest.approx(LINK[1]) and link.latency_s == pytest.approx(LINK[0])


def test_bad_calibrated_nodes_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="cannot read calibration file .*missing.json.*pipelab calibrate"):
        specs.parse_node(f"8x:{tmp_path}/missing.json")
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a calibration file"):
        specs.parse_node(f"2x:{tmp_path}/other.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        specs.parse_node(f"2x:{tmp_path}/broken.json")
    good = cal.write(record(synthetic()), str(tmp_path / "c.json"))
    with pytest.raises(ValueError, match="cannot read calibrated node"):
        specs.parse_node(f"0x:{good}")
    with pytest.raises(ValueError, match="link 'warp' for calibrated node"):
        specs.parse_node(f"2x:{good}@warp")


def emulated_rank(ctx):
    """What a rank on the calibrated node sees: its device, link and one modelled matrix product."""
    import torch.distributed as dist

    from pipelab.emulate.cost import Counts

    with ctx.rec.span("F", cost=Counts(1e12, 0.0, 1)):
        pass
    t = torch.ones(4)
    dist.all_reduce(t)
    return ctx.emulator.node.device.name, ctx.emulator.node.link.name, t.tolist()


def test_spawn_runs_ranks_on_the_calibrated_node(tmp_path):
    path = cal.write(record(synthetic()), str(tmp_path / "calibration.json"))
    results = spawn(emulated_rank, 2, emulate=f"8x:{path}")
    assert results == [("NVIDIA H100 80GB HBM3 (calibrated)", "NVLink 4", [2.0] * 4)] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the command would measure it")
def test_calibrate_without_a_gpu_says_so_and_stops(tmp_path, capsys):
    out = tmp_path / "calibration.json"
    assert cli.main(["calibrate", "--out", str(out)]) == cli.NO_GPU
    err = capsys.readouterr().err
    assert "no CUDA GPU visible" in err and "8x:calibration.json" in err
    assert not out.exists()
    with pytest.raises(cal.NoGPU):
        cal.calibrate(str(out))


def test_calibrate_help_documents_what_it_measures(capsys):
    with pytest.raises(SystemExit):
        cli.main(["calibrate", "--help"])
    text = capsys.readouterr().out
    for words in ("matrix products", "memory bandwidth", "launch", "all-reduce", "CUDA events",
                  "8x:calibration.json", "Exit code", "--out"):
        assert words in text


def test_doctor_says_which_spec_is_in_use(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(cal.ENV_PATH, str(tmp_path / "none.json"))
    assert cli.main(["doctor"]) == 0
    assert "emulated-node spec: data sheets" in capsys.readouterr().out
    cal.write(record(synthetic()), str(tmp_path / "none.json"))
    assert cli.main(["doctor"]) == 0
    assert "emulated-node spec: calibration file" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_calibrate_on_this_gpu_writes_a_record_that_emulate_takes(tmp_path):
    said = []
    rec = cal.calibrate(str(tmp_path / "gpu.json"), log=said.append, sizes=(256, 512, 1024))
    assert rec["gpu"] == torch.cuda.get_device_name(0) and rec["torch"] == torch.__version__
    assert {r["n"] for r in rec["measured"]["matmul"]} == {256, 512, 1024}
    assert rec["fit"]["memory"]["bytes_per_s"] > 1e10 and 0 < rec["fit"]["launch_s"] < 1e-3
    node = specs.parse_node(f"8x:{tmp_path / 'gpu.json'}")
    assert node.count == 8 and node.device.flops["float32"] > 1e11
    assert any("launch" in line for line in said)

"""`pipelab run`'s plan per machine (a one-GPU machine described to the planner runs every lesson;
a machine without GPUs skips the gpu profile), its `skipped` status and exit code, progress in
the notebook's own cell numbers, no lock file left, and parameter errors naming the parameter."""

import json
import os
import re

import nbformat
import pytest

from pipelab import cli
from pipelab.emulate import calibrate as cal
from pipelab.emulate import specs
from pipelab.planning import Machine, plan_one

from test_calibrate import record, synthetic

LESSONS = cli.course_notebooks("notebooks")
ONE_H100 = Machine(("NVIDIA H100 80GB HBM3",), (79.2,))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    return cal.write(record(synthetic()), str(tmp_path_factory.mktemp("cal") / "calibration.json"))


def test_a_one_gpu_machine_plans_every_lesson_on_its_calibrated_node(calibration):
    assert len(LESSONS) == 18
    plans = cli.plan_runs(LESSONS, {}, "gpu", machine=ONE_H100, calibration=calibration)
    assert [p.path for p in plans] == LESSONS
    for plan in plans:
        assert plan.skip == "", plan.path
        if "no profile 'gpu'" in plan.note:  # lessons 16 and 17 run on CPU cores: their defaults, as they are
            assert plan.parameters == {} and "running with its defaults" in plan.note
            continue
        assert plan.note.startswith("one GPU (NVIDIA H100 80GB HBM3) where the profile asks for"), plan.path
        emulated = {k: v for k, v in plan.parameters.items() if k in ("emulate", "grid_emulate")}
        for value in emulated.values():
            node = specs.parse_node(value)  # the node the lesson will run on, made of this GPU
            assert node.count == 8 and node.device.name == "NVIDIA H100 80GB HBM3 (calibrated)"
        assert plan.calibration == (calibration if emulated else "")
        # each part labelled: modelled on the calibrated node, or measured on this GPU
        assert ("modelled time" in plan.note) == bool(emulated)
        assert "measured on this GPU: " in plan.note
    by_lesson = {os.path.basename(p.path)[:2]: p for p in plans}
    assert by_lesson["08"].real == {"profile_device": "cuda"}  # AlexNet's layers measured on the GPU
    assert by_lesson["12"].parameters == {"grid_emulate": f"8x:{calibration}"}
    assert by_lesson["09"].parameters == {} and "no emulated node" in by_lesson["09"].note
    (given,) = cli.plan_runs(LESSONS[6:7], {"emulate": "2xA100"}, "gpu", machine=ONE_H100, calibration=calibration)
    assert given.parameters == {"emulate": "2xA100"} and given.note.endswith("-p emulate '2xA100' replaces the calibrated node")
    assert given.calibration == ""  # nothing left to calibrate for


def test_on_one_t4_every_lesson_is_planned_each_part_named_measured_on_the_gpu_or_modelled(calibration):
    t4 = Machine(("Tesla T4",), (15.0,))
    plans = cli.plan_runs(LESSONS, {}, "gpu", machine=t4, calibration=calibration)
    by_lesson = {os.path.basename(p.path)[:2]: p for p in plans}
    assert sorted(by_lesson) == [f"{i:02d}" for i in range(18)] and all(p.skip == "" for p in plans)
    for n in ("02", "03", "04"):  # the two devices as streams of the T4: measured, nothing emulated
        plan = by_lesson[n]
        assert plan.real == plan.parameters == {"device": "cuda"} and plan.calibration == ""
        assert ("measured on this GPU: the lesson's two devices as two sets of CUDA streams of this GPU, sharing "
                "its SMs (device='cuda')") in plan.note
        assert "no emulated node: its devices are this GPU's streams (-p device auto" in plan.note
    assert by_lesson["08"].real == {"profile_device": "cuda"}
    assert "measured on this GPU: AlexNet's layer profile (profile_device='cuda')" in by_lesson["08"].note
    ten = by_lesson["10"]  # the grid modelled on the calibrated node, the one-process baseline measured
    assert ten.real == {"baseline_device": "cuda"} and ten.calibration == calibration
    assert ten.parameters == {"emulate": f"8x:{calibration}", "baseline_device": "cuda"}
    assert f"modelled: its emulated node, 8 x this GPU as calibrated in {calibration} (modelled time)" in ten.note
    assert "measured on this GPU: the one-process baseline's tokens/s (baseline_device='cuda')" in ten.note
    assert ten.note.endswith("run on this GPU, not timed: the one-process checks of the first losses, the "
                             "evaluation and section 4's lr runs")
    assert "measured on this GPU: nothing" in by_lesson["00"].note and "modelled time" in by_lesson["00"].note
    assert [n for n, p in by_lesson.items() if p.real] == ["02", "03", "04", "08", "10"]


@pytest.fixture(scope="module")
def lessons():
    """Each lesson's declared parameters, profiles and needs, read once."""
    return [(path, *cli._read_parameters(path), cli._read_needs(path)) for path in LESSONS]


@pytest.fixture(scope="module")
def gpu_lessons(lessons):
    """The lessons with a gpu profile (16 and 17 run on CPU cores only)."""
    return [lesson for lesson in lessons if "gpu" in lesson[2]]


def test_a_machine_with_the_gpus_runs_the_profile_as_it_is_and_one_without_skips_it(gpu_lessons, calibration):
    lessons = gpu_lessons

    def plans(machine):
        return [plan_one(path, declared, profiles, needs, {}, "gpu", machine, calibration)
                for path, declared, profiles, needs in lessons]

    four = Machine(("NVIDIA H100 80GB HBM3",) * 4, (79.6,) * 4)  # what CUDA reports of an 80 GB card
    assert all(not p.skip and not p.note and p.parameters for p in plans(four))
    assert [p.parameters for p in plans(four)] == [profiles["gpu"] for _, _, profiles, _ in lessons]
    for plan in plans(Machine()):
        assert plan.skip.startswith("the gpu profile needs ") and "this machine has 0" in plan.skip
        assert len(plan.skip) < 120  # one short line, said once
    small = plans(Machine(("NVIDIA L4",) * 4, (22.0,) * 4))
    assert small[12].skip == "the gpu profile needs 40 GiB per GPU; this machine's smallest has 22 GiB"


def notebook(path, cells, profiles=None, needs=None) -> str:
    """Cells: text starting with '#md ' is a markdown cell; the first cell is the parameters cell."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["pipelab"] = {"profiles": profiles or {}, "needs": needs or {}}
    nb.cells = [nbformat.v4.new_markdown_cell(c[4:]) if c.startswith("#md ") else nbformat.v4.new_code_cell(c)
                for c in cells]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nbformat.write(nb, str(path))
    return str(path)


def test_progress_and_errors_count_the_notebooks_own_cells(tmp_path, capsys):
    path = notebook(tmp_path / "01_cells.ipynb", ["x = 1", "#md words", "y = x + 1", "#md more", "raise ValueError(y)"])
    code = cli.main(["run", path, "-p", "x", "5", "--out", str(tmp_path / "build")])
    printed = capsys.readouterr().out
    assert code == 1
    lines = [l.strip() for l in printed.splitlines() if ": cell " in l and l.strip().startswith("01_cells")]
    assert [l.split(",")[0] for l in lines] == ["01_cells.ipynb: cell 1/5", "01_cells.ipynb: cell 3/5",
                                                "01_cells.ipynb: cell 5/5"]
    summary = json.loads((tmp_path / "build" / "summary.json").read_text())
    assert summary["notebooks"][0]["error"] == "cell 5/5: ValueError: 6"
    assert not (tmp_path / "build" / "summary.json.lock").exists()


def test_skipped_status_is_in_table_and_summary_said_once_and_exit_code_3_when_nothing_ran(tmp_path, capsys):
    needs = {"gpu": {"gpus": 64, "estimate": "a long text " * 40}}
    a = notebook(tmp_path / "01_a.ipynb", ["x = 1"], {"gpu": {"x": 2}}, needs)
    b = notebook(tmp_path / "02_b.ipynb", ["x = 1", "#md m", "x + 1"], {"gpu": {"x": 3}}, {})
    out = tmp_path / "build"
    assert cli.main(["run", a, "--profile", "gpu", "--out", str(out)]) == cli.NOTHING_RAN == 3
    captured = capsys.readouterr()
    assert "no notebook ran" in captured.err
    reason = "the gpu profile needs 64 GPUs"
    assert captured.out.count(reason) == 1 and "a long text" not in captured.out
    assert "01_a.ipynb  skipped" in captured.out
    row = json.loads((out / "summary.json").read_text())["notebooks"][0]
    assert row["status"] == "skipped" and row["note"].startswith(reason) and row["error"] == ""
    assert not (out / "summary.json.lock").exists()
    # one ran, one skipped: 0, and both rows in the summary
    assert cli.main(["run", a, b, "--profile", "gpu", "--out", str(out)]) == 0
    statuses = {r["notebook"]: r["status"] for r in json.loads((out / "summary.json").read_text())["notebooks"]}
    assert statuses == {"01_a.ipynb": "skipped", "02_b.ipynb": "ok"}
    assert not any(name.endswith(".lock") for name in os.listdir(out))


def test_the_gpu_profile_without_a_gpu_skips_every_lesson_and_exits_3(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Machine, "detect", staticmethod(lambda: Machine()))  # this machine, or one without GPUs
    assert cli.main(["run", "--profile", "gpu", "--out", str(tmp_path)]) == cli.NOTHING_RAN
    rows = json.loads((tmp_path / "summary.json").read_text())["notebooks"]
    assert len(rows) == len(LESSONS) and {r["status"] for r in rows} == {"skipped"}
    out = capsys.readouterr().out
    for row in rows:  # each notebook's reason once (the table says `skipped`, not the reason again)
        assert out.count(f"{row['notebook']}: {row['note']}") == 1
        assert out.count(row["note"]) == sum(r["note"] == row["note"] for r in rows)


@pytest.mark.parametrize("value, words", [("2.5", "-p ranks 2.5: .* declares ranks = 2, a whole number"),
                                          ("two", "-p ranks 'two': .* declares ranks = 2, a whole number"),
                                          ("True", "-p ranks True: .*a whole number")])
def test_a_parameter_error_names_the_parameter_and_value_given(tmp_path, capsys, value, words):
    path = notebook(tmp_path / "08_p.ipynb", ["ranks = 2  # stages\nlr = 0.5\nname = 'x'\nflag = False", "ranks"])
    assert cli.main(["run", path, "-p", "ranks", value, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert re.search(words, err), err
    assert not (tmp_path / "b" / "summary.json").exists()  # refused before anything ran
    assert cli.main(["run", path, "-p", "lr", "fast", "--out", str(tmp_path / "b")]) == 2
    assert "-p lr 'fast'" in capsys.readouterr().err
    # values of the declared kind (an int for a float, None for anything) are taken
    plans = cli.plan_runs([path], {"lr": 1, "name": None, "flag": True, "ranks": 3}, None)
    assert plans[0].parameters == {"lr": 1, "name": None, "flag": True, "ranks": 3}


def _write_rows(path: str, worker: int) -> None:
    from pipelab.batch import NotebookRun, write_summary

    for i in range(5):
        write_summary([NotebookRun(f"{worker}_{i}.ipynb", "ok", 0.1, None)], path)


def test_concurrent_summaries_keep_every_row_and_leave_no_lock(tmp_path):
    import multiprocessing

    path = str(tmp_path / "summary.json")
    workers = [multiprocessing.get_context("fork").Process(target=_write_rows, args=(path, w)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["notebooks"]
    assert sorted(r["notebook"] for r in rows) == sorted(f"{w}_{i}.ipynb" for w in range(4) for i in range(5))
    assert os.listdir(tmp_path) == ["summary.json"]

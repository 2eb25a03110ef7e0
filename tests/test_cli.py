"""The `pipelab` command: `run` (selection, parameters, profiles, progress, timeouts, summary table,
summary.json, HTML), `profiles`, `doctor`, `--version`. Notebooks are written in tmp_path."""

import json
import math
import os
import time

import nbformat
import pytest

import pipelab
from pipelab import cli, hardware
from pipelab.batch import NotebookRun


def write_notebook(path, cells: list[str], profiles: dict | None = None) -> str:
    """A notebook whose first cell is its `parameters` cell; `profiles` go to its metadata."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if profiles is not None:
        nb.metadata["pipelab"] = {"profiles": profiles}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.cells[0].metadata["tags"] = ["parameters"]
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    nbformat.write(nb, str(path))
    return str(path)


def headline_of(name: str) -> str:
    return f"import pipelab\npipelab.headline('{name}', {name})"


def strict_json(path):
    """The file's JSON, refusing NaN/Infinity (which strict JSON readers reject)."""
    def refuse(token):
        raise ValueError(f"{token} in {path}")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def test_run_reports_status_seconds_headline_summary_and_html(tmp_path, capsys):
    good = write_notebook(tmp_path / "01_good.ipynb", ["x = 21", "import pipelab\npipelab.headline('answer', x * 2, 'units')"])
    bad = write_notebook(tmp_path / "02_bad.ipynb", ["x = 1", "y = 2", "raise RuntimeError('lesson broke')"])
    out = tmp_path / "build"
    code = cli.main(["run", good, bad, "--out", str(out), "--html"])
    printed = capsys.readouterr().out
    assert code == 1  # one notebook failed
    table = printed[printed.index("notebook  "):]
    assert "01_good.ipynb  ok" in table and "answer = 42 units" in table
    assert "02_bad.ipynb   failed" in table and "cell 3/3: RuntimeError: lesson broke" in table
    # progress, one plain line per code cell (readable in a batch job's log file)
    assert "01_good.ipynb: cell 1/2, " in printed and "02_bad.ipynb: cell 3/3, " in printed
    assert "\r" not in printed
    summary = strict_json(out / "summary.json")
    rows = {r["notebook"]: r for r in summary["notebooks"]}
    assert rows["01_good.ipynb"]["status"] == "ok" and rows["01_good.ipynb"]["headline"]["value"] == 42
    assert rows["01_good.ipynb"]["seconds"] > 0 and rows["01_good.ipynb"]["parameters"] == {}
    failed = rows["02_bad.ipynb"]
    assert failed["status"] == "failed" and failed["headline"] is None
    assert failed["error"] == "cell 3/3: RuntimeError: lesson broke"
    assert "raise RuntimeError('lesson broke')" in failed["traceback"] and "\x1b[" not in failed["traceback"]
    for name in ("01_good", "02_bad"):
        assert (out / f"{name}.ipynb").exists() and rows[f"{name}.ipynb"]["html"] == f"{name}.html"
    assert "answer = 42 units" in (out / "01_good.html").read_text()
    assert "lesson broke" in (out / "02_bad.html").read_text()


def test_closing_message_names_the_html_copies_only_when_asked(tmp_path, capsys):
    a = write_notebook(tmp_path / "a" / "01_one.ipynb", ["x = 1"])
    b = write_notebook(tmp_path / "b" / "02_two.ipynb", ["x = 2"])
    out = tmp_path / "build"
    assert cli.main(["run", a, b, "--out", str(out), "--html"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (f"executed notebooks, their HTML copies ({os.path.join('a', '01_one.html')}, "
                     f"{os.path.join('b', '02_two.html')}) and summary.json are in {out}/")
    assert (out / "a" / "01_one.html").exists() and (out / "b" / "02_two.html").exists()
    assert cli.main(["run", a, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"executed notebooks and summary.json are in {out}/"


def test_parameters_reach_the_notebook(tmp_path):
    nb = write_notebook(tmp_path / "03_params.ipynb", ["x = 1", headline_of("x")])
    run = cli.run_notebook(nb, str(tmp_path / "build"), parameters={"x": 7})
    assert run.status == "ok" and run.headline == {"name": "x", "value": 7.0, "unit": ""}
    assert run.parameters == {"x": 7} and isinstance(run, NotebookRun)


def test_every_row_prints_whatever_the_headline_holds():
    odd = [None, {"name": "n", "value": "nan", "unit": ""}, {"name": "s", "value": "fast"},
           {"name": "none", "value": None}, {"value": float("inf")}, {"name": "t", "value": True}, {}]
    runs = [NotebookRun(f"{i:02d}_nb.ipynb", "ok", 1.0, h) for i, h in enumerate(odd)]
    runs.append(NotebookRun("99_ok.ipynb", "ok", 2.0, {"name": "speedup", "value": 1.23456, "unit": "x"}))
    table = cli.summary_table(runs)
    assert len(table.splitlines()) == 2 + len(runs)
    for text in ("n = nan", "s = fast", "none = None", "headline = inf", "t = True", "speedup = 1.235 x"):
        assert text in table


def test_a_nan_headline_gets_a_row_and_strict_json(tmp_path, capsys):
    nb = write_notebook(tmp_path / "01_nan.ipynb", ["ratio = float('nan')", headline_of("ratio")])
    assert cli.main(["run", nb, "--out", str(tmp_path / "build")]) == 0
    assert "01_nan.ipynb  ok      " in capsys.readouterr().out
    (row,) = strict_json(tmp_path / "build" / "summary.json")["notebooks"]
    assert row["headline"]["value"] == "nan"


def test_a_failed_rerun_never_shows_the_old_figure(tmp_path, capsys):
    path = tmp_path / "01_lesson.ipynb"
    out = tmp_path / "build"
    write_notebook(path, ["x = 42", headline_of("x")])
    assert cli.main(["run", str(path), "--out", str(out), "--html"]) == 0
    assert "x = 42" in capsys.readouterr().out
    path.write_text("{ this is not a notebook")  # fails before papermill writes anything
    assert cli.main(["run", str(path), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("01_lesson.ipynb  failed"))
    assert "42" not in row
    (summary,) = strict_json(out / "summary.json")["notebooks"]
    assert summary["headline"] is None and summary["error"]
    assert not (out / "01_lesson.ipynb").exists() and not (out / "01_lesson.html").exists()


def test_same_file_names_in_different_folders_do_not_collide(tmp_path, capsys):
    a = write_notebook(tmp_path / "a" / "01_same.ipynb", ["x = 1", headline_of("x")])
    b = write_notebook(tmp_path / "b" / "01_same.ipynb", ["x = 2", headline_of("x")])
    out = tmp_path / "build"
    assert cli.main(["run", a, b, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "a/01_same.ipynb  ok" in table and "b/01_same.ipynb  ok" in table
    for folder, x in (("a", 1), ("b", 2)):
        executed = json.loads((out / folder / "01_same.ipynb").read_text())
        assert pipelab.display.read_headline(executed)["value"] == x
    rows = strict_json(out / "summary.json")["notebooks"]
    assert [(r["notebook"], r["output"]) for r in rows] == [("a/01_same.ipynb", "a/01_same.ipynb"),
                                                            ("b/01_same.ipynb", "b/01_same.ipynb")]


def test_no_kernel_warnings_in_the_output(tmp_path, capfd):
    # capfd, not capsys: the kernel is another process writing to this one's stderr
    nb = write_notebook(tmp_path / "01_quiet.ipynb", ["x = 1", "import warnings"])
    assert cli.main(["run", nb, "--out", str(tmp_path / "build")]) == 0
    out, err = capfd.readouterr()
    assert "without encryption" not in out + err and "[IPKernelApp]" not in out + err


def test_values_are_read_as_papermill_reads_them():
    cases = {"True": True, "False": False, "None": None, "3": 3, "-2": -2, "0.5": 0.5, "1e-3": 0.001,
             "cuda": "cuda", "[1, 2]": "[1, 2]", "true": "true"}
    for text, value in cases.items():
        got = cli.parse_value(text)
        assert got == value and type(got) is type(value), text
    assert math.isnan(cli.parse_value("nan"))


def test_p_sets_a_parameter_in_every_notebook_that_declares_it(tmp_path, capsys):
    one = write_notebook(tmp_path / "01_x.ipynb", ["x = 1", headline_of("x")])
    two = write_notebook(tmp_path / "02_y.ipynb", ["y = 1.0", headline_of("y")])
    three = write_notebook(tmp_path / "03_xy.ipynb", ["x = 1\ny = 1.0", "import pipelab\npipelab.headline('xy', x * y)"])
    out = tmp_path / "build"
    assert cli.main(["run", one, two, three, "-p", "x", "5", "-p", "y", "2.5", "--out", str(out)]) == 0
    rows = {r["notebook"]: r for r in strict_json(out / "summary.json")["notebooks"]}
    assert rows["01_x.ipynb"]["parameters"] == {"x": 5} and rows["01_x.ipynb"]["headline"]["value"] == 5
    assert rows["02_y.ipynb"]["parameters"] == {"y": 2.5} and rows["02_y.ipynb"]["headline"]["value"] == 2.5
    assert rows["03_xy.ipynb"]["parameters"] == {"x": 5, "y": 2.5} and rows["03_xy.ipynb"]["headline"]["value"] == 12.5
    assert "running " + one + " with x=5 ..." in capsys.readouterr().out


def test_p_that_no_notebook_declares_is_refused_before_anything_runs(tmp_path, capsys):
    nb = write_notebook(tmp_path / "01_x.ipynb", ["x = 1", headline_of("x")])
    out = tmp_path / "build"
    assert cli.main(["run", nb, "-p", "batch_size", "8", "--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert "batch_size" in printed.err and "declares" in printed.err
    assert not out.exists() and "running" not in printed.out


def test_profiles_apply_per_notebook_and_p_wins(tmp_path, capsys):
    with_profiles = write_notebook(tmp_path / "01_p.ipynb", ["x = 1\nsteps = 10", headline_of("x")],
                                   profiles={"quick": {"x": 3}, "gpu": {"x": 100, "steps": 50}})
    without = write_notebook(tmp_path / "02_plain.ipynb", ["x = 1", headline_of("x")])
    out = tmp_path / "build"
    assert cli.main(["run", with_profiles, without, "--profile", "quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "02_plain.ipynb: no profile 'quick' (has: none); running with its defaults" in printed
    summary = strict_json(out / "summary.json")
    rows = {r["notebook"]: r for r in summary["notebooks"]}
    assert summary["profile"] == "quick"
    assert rows["01_p.ipynb"]["parameters"] == {"x": 3} and rows["01_p.ipynb"]["headline"]["value"] == 3
    assert rows["02_plain.ipynb"]["parameters"] == {} and rows["02_plain.ipynb"]["headline"]["value"] == 1
    assert "running with its defaults" in rows["02_plain.ipynb"]["note"] and not rows["01_p.ipynb"]["note"]

    assert cli.main(["run", with_profiles, "--profile", "gpu", "-p", "x", "9", "--out", str(out)]) == 0
    rows = {r["notebook"]: r for r in strict_json(out / "summary.json")["notebooks"]}
    row = rows["01_p.ipynb"]  # run again into the same folder: its row is replaced, 02's kept
    assert row["parameters"] == {"x": 9, "steps": 50} and row["headline"]["value"] == 9 and row["profile"] == "gpu"
    assert rows["02_plain.ipynb"]["profile"] == "quick"


def test_profile_mistakes_are_refused(tmp_path, capsys):
    nb = write_notebook(tmp_path / "01_p.ipynb", ["x = 1", "pass"], profiles={"gpu": {"x": 2, "batch": 8}})
    assert cli.main(["run", nb, "--profile", "quick"]) == 2
    assert "no chosen notebook has a profile 'quick'" in capsys.readouterr().err
    assert cli.main(["run", nb, "--profile", "gpu"]) == 2
    assert "profile 'gpu' sets batch, which its parameters cell does not declare (x)" in capsys.readouterr().err


def test_profiles_command_lists_each_notebooks_profiles(tmp_path, capsys):
    write_notebook(tmp_path / "01_p.ipynb", ["x = 1"], profiles={"gpu": {"x": 100, "device": "cuda"}, "quick": {}})
    write_notebook(tmp_path / "02_plain.ipynb", ["x = 1"])
    assert cli.main(["profiles", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [str(tmp_path / "01_p.ipynb"), "  gpu    device='cuda', x=100", "  quick  (defaults)",
                     str(tmp_path / "02_plain.ipynb") + ": no profiles"]


def test_notebooks_are_chosen_by_number_path_or_folder(tmp_path):
    lessons = [write_notebook(tmp_path / name, ["x = 1"]) for name in ("01_a.ipynb", "02_b.ipynb", "10_c.ipynb")]
    notes = write_notebook(tmp_path / "notes.ipynb", ["x = 1"])
    folder = str(tmp_path)
    assert cli.select_notebooks([], folder) == lessons
    assert cli.select_notebooks([folder], "elsewhere") == lessons  # a folder: its lessons, not notes
    assert cli.select_notebooks(["02", "1", "10"], folder) == [lessons[1], lessons[0], lessons[2]]
    assert cli.select_notebooks([notes, "01", lessons[0]], folder) == [notes, lessons[0]]  # each once
    for wrong, message in (("nosuch.ipynb", "no such notebook"), ("7", "no lesson numbered 7"),
                           (str(tmp_path / "empty"), "no such notebook")):
        with pytest.raises(cli.UsageError, match=message):
            cli.select_notebooks([wrong], folder)
    (tmp_path / "empty").mkdir()
    (tmp_path / "readme.txt").write_text("")
    with pytest.raises(cli.UsageError, match="no lesson notebooks"):
        cli.select_notebooks([str(tmp_path / "empty")], folder)
    with pytest.raises(cli.UsageError, match="not a notebook"):
        cli.select_notebooks([str(tmp_path / "readme.txt")], folder)


def test_run_a_folder_runs_its_lessons(tmp_path, capsys):
    write_notebook(tmp_path / "course" / "01_only.ipynb", ["x = 4", headline_of("x")])
    assert cli.main(["run", str(tmp_path / "course"), "--out", str(tmp_path / "build")]) == 0
    assert "01_only.ipynb  ok" in capsys.readouterr().out


def test_a_missing_notebook_fails_clearly(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nosuch.ipynb"), "--out", str(tmp_path / "build")]) == 2
    printed = capsys.readouterr()
    assert "no such notebook" in printed.err and "nosuch.ipynb" in printed.err
    assert "executed notebooks" not in printed.out and not (tmp_path / "build").exists()


def test_timeout_fails_that_notebook_and_the_rest_go_on(tmp_path, capsys):
    slow = write_notebook(tmp_path / "01_slow.ipynb", ["x = 1", "import time\ntime.sleep(300)"])
    good = write_notebook(tmp_path / "02_good.ipynb", ["x = 5", headline_of("x")])
    out = tmp_path / "build"
    t0 = time.perf_counter()
    assert cli.main(["run", slow, good, "--timeout", "4", "--out", str(out)]) == 1  # each cell gets at least 1 s
    assert time.perf_counter() - t0 < 120
    rows = {r["notebook"]: r for r in strict_json(out / "summary.json")["notebooks"]}
    assert rows["01_slow.ipynb"]["status"] == "failed"
    assert rows["01_slow.ipynb"]["error"].startswith("timed out: the notebook ran past its 4 s limit (--timeout) in cell")
    assert rows["01_slow.ipynb"]["seconds"] < 60
    assert rows["02_good.ipynb"]["status"] == "ok" and rows["02_good.ipynb"]["headline"]["value"] == 5
    assert "01_slow.ipynb  failed" in capsys.readouterr().out


def test_bad_timeout_is_refused(capsys):
    for value in ("0", "-1", "soon", "nan"):
        with pytest.raises(SystemExit) as stop:
            cli.main(["run", "--timeout", value])
        assert stop.value.code == 2
        assert "--timeout must be a number > 0" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"pipelab {pipelab.__version__}"


def test_course_notebooks_are_found_in_order():
    names = [p.rsplit("/", 1)[-1] for p in cli.course_notebooks()]
    assert names and names == sorted(names) and names[0].startswith("00_")


def test_doctor_describes_the_machine(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == hardware.describe(2)
    assert f"CPU cores: {hardware.cpu_cores()}" in out


def test_backend_choice():
    gpus = hardware.gpu_count()
    assert hardware.choose_backend(2) == ("nccl" if gpus >= 2 else "gloo")
    assert hardware.choose_backend(1, "gloo") == "gloo"
    desc = hardware.describe(2)
    assert ("GPU path" if gpus >= 2 else "CPU path") in desc and "torch" in desc

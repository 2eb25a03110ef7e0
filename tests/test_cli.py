"""`pipelab run` executes notebooks and tabulates status, seconds and headline; `pipelab doctor`."""

import nbformat

from pipelab import cli, hardware


def write_notebook(path, cells: list[str]) -> str:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    params = nb.cells[0]
    params.metadata["tags"] = ["parameters"]
    nbformat.write(nb, str(path))
    return str(path)


def test_run_reports_status_seconds_and_headline(tmp_path, capsys):
    good = write_notebook(tmp_path / "01_good.ipynb", ["x = 21", "import pipelab\npipelab.headline('answer', x * 2, 'units')"])
    bad = write_notebook(tmp_path / "02_bad.ipynb", ["x = 1", "raise RuntimeError('lesson broke')"])
    out = tmp_path / "build"
    code = cli.main(["run", good, bad, "--out", str(out)])
    table = capsys.readouterr().out
    assert code == 1  # one notebook failed
    assert "01_good.ipynb  ok" in table and "answer = 42 units" in table
    assert "02_bad.ipynb   failed" in table and "lesson broke" in table
    assert (out / "01_good.ipynb").exists()


def test_parameters_reach_the_notebook(tmp_path):
    nb = write_notebook(tmp_path / "03_params.ipynb", ["x = 1", "import pipelab\npipelab.headline('x', x)"])
    run = cli.run_notebook(nb, str(tmp_path / "build"), parameters={"x": 7})
    assert run.status == "ok" and run.headline == {"name": "x", "value": 7.0, "unit": ""}


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

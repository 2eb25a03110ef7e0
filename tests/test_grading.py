"""Grading a class with `pipelab exercises grade`: from any folder (one holding a clone named
`pipelab` with its `build/` output cannot shadow the course), one process per notebook with a time
limit, helpers from other cells, and one broken, empty or hanging notebook does not stop the rest:
every student gets a row per exercise, points from the notebooks' metadata, a total and feedback."""

from __future__ import annotations

import csv

import nbformat

from pipelab.cli import main
from pipelab.exercises import grading

GROUPS_RIGHT = '''def my_grid_groups(pipe, data):
    return {"pipe": pipelines(pipe, data), "data": [[s * data + r for r in range(data)] for s in range(pipe)]}'''
HELPER = '''def pipelines(pipe, data):
    return [[s * data + r for s in range(pipe)] for r in range(data)]'''
PERPLEXITY_RIGHT = '''def my_perplexity(mb_losses, mb_tokens):
    return math.exp(sum(l * n for l, n in zip(mb_losses, mb_tokens)) / sum(mb_tokens))'''
PERPLEXITY_WRONG = '''def my_perplexity(mb_losses, mb_tokens):
    return math.exp(sum(mb_losses) / len(mb_losses))'''
POINTS = {"05_grid_groups": 1, "10_perplexity": 3}


def notebook(path, answers: dict[str, str], helper: str | None = None) -> None:
    """A submitted notebook: an import cell, a helper cell (untagged), each answer and its checker."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import math\nfrom pipelab import exercises\nsolutions = False",
                                          metadata={"tags": ["parameters"]})]
    if helper:
        nb.cells.append(nbformat.v4.new_code_cell(helper + "\n\nslow = sum(range(10))"))
    for name, code in answers.items():
        nb.cells.append(nbformat.v4.new_code_cell(code, metadata={"tags": ["student"], "pipelab": {"exercise": name}}))
        check = {"05_grid_groups": "check_grid_groups(my_grid_groups)", "10_perplexity": "check_perplexity(my_perplexity)"}
        nb.cells.append(nbformat.v4.new_code_cell(f"exercises.{check[name]}",
                                                  metadata={"pipelab": {"exercise": name, "points": POINTS[name]}}))
    nbformat.write(nb, str(path))


def test_a_class_with_a_broken_and_an_empty_notebook(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "submissions"
    folder.mkdir()
    notebook(folder / "ada.ipynb", {"05_grid_groups": GROUPS_RIGHT, "10_perplexity": PERPLEXITY_RIGHT}, helper=HELPER)
    notebook(folder / "bob.ipynb", {"10_perplexity": PERPLEXITY_WRONG})
    (folder / "cyd.ipynb").write_bytes(b"\x00 this is not a notebook")
    nbformat.write(nbformat.v4.new_notebook(), str(folder / "dan.ipynb"))
    # the instructor's folder holds a clone named pipelab with its build/ output: it must not shadow
    shadow = tmp_path / "course"
    (shadow / "pipelab" / "build").mkdir(parents=True)
    (shadow / "build").mkdir()
    monkeypatch.chdir(shadow)
    out_csv, feedback = tmp_path / "grades.csv", tmp_path / "feedback"
    assert main(["exercises", "grade", str(folder), "--csv", str(out_csv), "--feedback", str(feedback)]) == 0
    with open(out_csv) as f:
        rows = {(r["student"], r["exercise"]): r for r in csv.DictReader(f)}
    status = {key: r["status"] for key, r in rows.items() if key[1] != "TOTAL"}
    assert status == {("ada", "05_grid_groups"): "pass", ("ada", "10_perplexity"): "pass",
                      ("bob", "05_grid_groups"): "missing", ("bob", "10_perplexity"): "fail",
                      ("cyd", "05_grid_groups"): "error", ("cyd", "10_perplexity"): "error",
                      ("dan", "05_grid_groups"): "missing", ("dan", "10_perplexity"): "missing"}
    assert "cyd.ipynb could not be read" in rows[("cyd", "10_perplexity")]["message"]
    assert "dan.ipynb has no cell that defines an exercise's function" in rows[("dan", "05_grid_groups")]["message"]
    assert "weight each loss by its tokens" in rows[("bob", "10_perplexity")]["message"]
    totals = {s: (float(rows[(s, "TOTAL")]["points"]), float(rows[(s, "TOTAL")]["max_points"])) for s in "ada bob cyd dan".split()}
    assert totals == {"ada": (4, 4), "bob": (0, 4), "cyd": (0, 4), "dan": (0, 4)}
    text = (feedback / "bob.txt").read_text()
    assert "0 of 4 points" in text and "[fail] 10_perplexity" in text and "[missing] 05_grid_groups" in text


def test_a_hanging_notebook_is_stopped_and_named(tmp_path):
    notebook(tmp_path / "eve.ipynb", {"10_perplexity": "def my_perplexity(mb_losses, mb_tokens):\n    while True:\n        pass"})
    # 5 s: past the grading process's start (torch's import) on a 2-core machine; a limit that is
    # not enforced hangs here until pytest's timeout, one not named fails the message check
    results, problem = grading.grade_notebook(str(tmp_path / "eve.ipynb"), timeout=5)
    assert problem is None
    passed, message = results["10_perplexity"]
    assert not passed and "eve.ipynb did not finish within 5 s" in message


def test_an_answer_uses_a_helper_from_another_cell():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import math"),
                nbformat.v4.new_code_cell("x = expensive()\n" + HELPER + "\nunused = 1"),
                nbformat.v4.new_code_cell(GROUPS_RIGHT, metadata={"tags": ["student"]})]
    code = grading.submitted_code(nb)["05_grid_groups"]
    assert "def pipelines(" in code and "import math" in code
    assert "expensive()" not in code and "unused" not in code  # only what the answer uses

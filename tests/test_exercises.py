"""The graded exercises: every checker passes its solution (solutions/) and fails a typical wrong
answer with the message that names the mistake; `pipelab exercises` lists and grades notebooks."""

from __future__ import annotations

import csv
import os
import sys

import nbformat
import pytest

from pipelab import exercises
from pipelab.cli import main

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exercise_answers as answers  # noqa: E402


@pytest.mark.parametrize("name", list(exercises.EXERCISES))
def test_every_checker_passes_its_solution(name):
    function, check = exercises.EXERCISES[name]
    fn = exercises.solution(name)
    assert fn.__name__ == function
    grade = check(fn, quiet=True)
    assert grade.passed, grade.message


# ---- wrong answers: each fails with the words naming its mistake; right answers pass ---------------
# (tests/exercise_answers.py holds them; benchmarks/exercise_sweep.py runs each of them 5 times)


def test_every_exercise_has_four_wrong_answers_and_another_right_one():
    import importlib

    for name in exercises.EXERCISES:
        if name in answers.ELSEWHERE:
            module = importlib.import_module(answers.ELSEWHERE[name])
            wrong, right = len(module.WRONG_ANSWERS), len(module.RIGHT_ANSWERS)
        else:
            wrong, right = sum(n == name for n, _, _ in answers.WRONG), sum(n == name for n, _ in answers.RIGHT)
        assert wrong >= 4 and right >= 1, (name, wrong, right)


@pytest.mark.parametrize("name, wrong, expected", answers.WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in answers.WRONG])
def test_a_wrong_answer_fails_with_its_message(name, wrong, expected, capsys):
    grade = exercises.EXERCISES[name][1](wrong)
    assert not grade.passed
    for text in expected:
        assert text in grade.message, grade.message
    assert str(grade) in capsys.readouterr().out  # the checker prints its verdict


@pytest.mark.parametrize("name, right", answers.RIGHT, ids=[f"{n}-{r.__name__}" for n, r in answers.RIGHT])
def test_a_right_answer_written_differently_passes(name, right):
    grade = exercises.EXERCISES[name][1](right, quiet=True)
    assert grade.passed, grade.message


def test_an_unwritten_answer_says_so():
    def average_not_written(params, world_size):
        raise NotImplementedError("your code here")

    grade = exercises.check_grid_groups(average_not_written, quiet=True)
    assert not grade.passed and "is not written yet (your code here)" in grade.message


def test_the_partition_cases_are_solved_by_the_lessons_rule():
    """The checker's best spread is what the lesson's partition_balanced reaches on each case."""
    from pipelab.exercises.pipeline import PARTITION_CASES, _stage_sums, best_split
    from pipelab.pipeline.partition import partition_balanced

    for weights, parts in PARTITION_CASES:
        sums = _stage_sums(weights, partition_balanced(weights, parts))
        assert max(sums) - min(sums) == best_split(weights, parts)[0]


def test_a_missing_solution_is_named():
    with pytest.raises(ValueError, match="no solution '99_nothing'"):
        exercises.solution("99_nothing")


# ---- the instructor's view ----------------------------------------------------------------------


def submitted(path, body: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import math\nfrom pipelab import exercises", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(f"def my_perplexity(mb_losses, mb_tokens):\n{body}",
                                          metadata={"tags": ["student"]}),
                nbformat.v4.new_code_cell("exercises.check_perplexity(my_perplexity)")]
    nbformat.write(nb, str(path))


def test_cli_lists_the_exercises_per_lesson(capsys):
    assert main(["exercises"]) == 0
    out = capsys.readouterr().out
    for name, (function, _) in exercises.EXERCISES.items():
        assert f"lesson {name[:2]}  {name}" in out and function in out


def test_cli_grades_a_folder_into_a_table_and_csv(tmp_path, capsys):
    folder = tmp_path / "submissions"
    folder.mkdir()
    submitted(folder / "ada.ipynb", "    return math.exp(sum(l * n for l, n in zip(mb_losses, mb_tokens)) / sum(mb_tokens))")
    submitted(folder / "bob.ipynb", "    return math.exp(sum(mb_losses) / len(mb_losses))")
    assert main(["exercises", "grade", str(folder), "--csv", str(tmp_path / "grades.csv")]) == 0
    out = capsys.readouterr().out
    assert "ada" in out and "bob" in out and "fail" in out
    with open(tmp_path / "grades.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f) if r["exercise"] != "TOTAL"}
    assert rows["ada"]["exercise"] == rows["bob"]["exercise"] == "10_perplexity"
    assert rows["ada"]["status"] == "pass" and rows["bob"]["status"] == "fail"
    assert "weight each loss by its tokens" in rows["bob"]["message"]


def test_cli_grade_needs_a_folder(tmp_path, capsys):
    assert main(["exercises", "grade"]) == 2
    assert main(["exercises", "grade", str(tmp_path / "missing")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_notebook_exercise_cells_are_complete():
    """Each exercise a notebook states has its student cell (with the exercise in its metadata), a
    checker cell with its points that loads the solution when `solutions` is True, and the
    `solutions = False` parameter; a cell tagged `student` is one a student writes (it defines
    something), never a display of the course's code."""
    import glob

    from pipelab.exercises.grading import exercise_points, submitted_code

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seen = set()
    for path in sorted(glob.glob(os.path.join(root, "notebooks", "*.ipynb"))):
        nb = nbformat.read(path, as_version=4)
        found = submitted_code(nb)
        seen |= set(found)
        sources = "\n".join(c.source for c in nb.cells)
        points = exercise_points(nb)
        for name in found:
            check = exercises.EXERCISES[name][1].__name__
            assert f'exercises.solution("{name}")' in sources and f"exercises.{check}(" in sources, (path, name)
            assert points.get(name, 0) > 0, (path, name)
        for cell in nb.cells:
            if "student" in cell.metadata.get("tags", []):
                assert "def " in cell.source or "class " in cell.source, (path, cell.source[:80])
                assert "pipelab.show(" not in cell.source, (path, cell.source[:80])
        if found:
            params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
            assert "solutions = False" in params.source, path
    assert seen == set(exercises.EXERCISES)


def test_every_lesson_makes_an_nbgrader_source_notebook(tmp_path):
    """Each lesson with exercises gives an assignment notebook: a solution region in each answer
    cell (valid Python), a locked autograded checker cell with the exercise's points."""
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lessons = [p for p in sorted(glob.glob(os.path.join(root, "notebooks", "*.ipynb")))
               if __import__("pipelab.exercises.grading", fromlist=["x"]).submitted_code(p)]
    assert main(["exercises", "assignment", str(tmp_path), *lessons]) == 0
    answers_seen = set()
    for path in sorted(tmp_path.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            grader = cell.metadata.get("nbgrader", {})
            if grader.get("solution"):
                assert "### BEGIN SOLUTION" in cell.source and "### END SOLUTION" in cell.source
                compile(cell.source, str(path), "exec")
                answers_seen.add(cell.metadata["pipelab"]["exercise"])
            if grader.get("grade"):
                assert grader["locked"] and grader["points"] > 0
    assert answers_seen == set(exercises.EXERCISES)

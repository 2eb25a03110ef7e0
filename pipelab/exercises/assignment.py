"""A lesson's exercises as an nbgrader assignment: the source notebook an instructor keeps (with
the worked solutions inside nbgrader's solution regions), from which `nbgrader generate_assignment`
makes the student version without them and `nbgrader autograde` grades what students hand in.

    pipelab exercises assignment OUT_FOLDER NOTEBOOK [NOTEBOOK ...]

Each lesson gives one notebook, OUT_FOLDER/<lesson>.ipynb: a locked setup cell, then per exercise
the task and hints (locked), the student's cell whose body is the solution between
`### BEGIN SOLUTION` and `### END SOLUTION` (nbgrader replaces it), and the checker cell, locked,
autograded with the exercise's points (from the lesson's metadata). The checker cell is the same
call `pipelab exercises grade` makes, so both give the same scores.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def _nbgrader(grade_id: str, *, solution: bool = False, grade: bool = False, locked: bool = False,
              points: float | None = None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3, "solution": solution,
            "task": False}
    if points is not None:
        meta["points"] = points
    return meta


def _solution_parts(name: str) -> tuple[list[str], list[str]]:
    """(the solution file's import lines, its function's body without the docstring), dedented."""
    from pipelab.exercises.core import SOLUTIONS

    source = (SOLUTIONS / f"{name}.py").read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    imports = [ast.get_source_segment(source, s) for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    fn = next(s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name.startswith("my_"))
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    text = "\n".join(lines[body[0].lineno - 1:body[-1].end_lineno])
    return imports, textwrap.dedent(text).splitlines()


def solution_cell(student_source: str, name: str) -> str:
    """The student's cell with its gap filled by the worked solution, inside a solution region."""
    imports, body = _solution_parts(name)
    missing = [line for line in imports if line not in student_source]
    lines = student_source.rstrip().splitlines()
    gap = next((i for i, line in enumerate(lines) if "NotImplementedError" in line or "your code here" in line), None)
    if gap is None:  # a cell to rewrite (lesson 07's loop): its whole body is the region
        fn = next(s for s in ast.parse(student_source).body if isinstance(s, ast.FunctionDef))
        first = fn.body[1] if len(fn.body) > 1 and isinstance(fn.body[0], ast.Expr) else fn.body[0]
        indent = re.match(r"\s*", lines[first.lineno - 1]).group(0)
        filled = [indent + BEGIN, *(indent + line if line else "" for line in missing + body), indent + END]
        return "\n".join(lines[:first.lineno - 1] + filled + lines[fn.end_lineno:])
    indent = re.match(r"\s*", lines[gap]).group(0)
    if "NotImplementedError" in lines[gap]:
        region = missing + body
    else:  # a cell to complete: the solution's lines the cell lacks go where it says
        have = {line.strip() for line in lines}
        region = textwrap.dedent("\n".join(line for line in body if line.strip() not in have)).splitlines()
    filled = [indent + BEGIN, *(indent + line if line else "" for line in region), indent + END]
    return "\n".join(lines[:gap] + filled + lines[gap + 1:])


def lesson_assignment(path: str):
    """The nbgrader source notebook of the lesson notebook at `path` (None if it has no exercise)."""
    import nbformat

    from pipelab.exercises import EXERCISES
    from pipelab.exercises.grading import exercise_points, submitted_code

    lesson = nbformat.read(path, as_version=4)
    found = submitted_code(lesson)
    if not found:
        return None
    points = exercise_points(lesson)
    stem = os.path.splitext(os.path.basename(path))[0]
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": lesson.metadata.get("kernelspec", {
        "name": "python3", "display_name": "Python 3", "language": "python"})})
    nb.cells.append(nbformat.v4.new_markdown_cell(
        f"# Exercises of lesson {stem}\n\nWrite each function in its cell; the cell after it checks it.",
        metadata={"nbgrader": _nbgrader("title", locked=True)}))
    nb.cells.append(nbformat.v4.new_code_cell("from pipelab import exercises",
                                              metadata={"nbgrader": _nbgrader("setup", locked=True)}))
    cells = lesson.cells
    for name in found:
        function, check = EXERCISES[name]
        at = next(i for i, c in enumerate(cells) if c.cell_type == "code" and "student" in c.metadata.get("tags", [])
                  and re.search(rf"^def {function}\(", c.source, re.M))
        task = next((c for c in reversed(cells[:at]) if c.cell_type == "markdown" and "Exercise" in c.source), None)
        hints = [c for c in cells[at + 1:at + 3] if c.cell_type == "markdown" and "<summary>" in c.source]
        for i, md in enumerate(([task] if task else []) + hints):
            nb.cells.append(nbformat.v4.new_markdown_cell(md.source, metadata={"nbgrader": _nbgrader(
                f"task_{name}_{i}", locked=True)}))
        nb.cells.append(nbformat.v4.new_code_cell(solution_cell(cells[at].source, name), metadata={
            "nbgrader": _nbgrader(f"answer_{name}", solution=True), "pipelab": {"exercise": name}}))
        nb.cells.append(nbformat.v4.new_code_cell(
            f"grade = exercises.{check.__name__}({function})\nassert grade.passed, grade.message",
            metadata={"nbgrader": _nbgrader(f"check_{name}", grade=True, locked=True, points=points.get(name, 1.0)),
                      "pipelab": {"exercise": name, "points": points.get(name, 1.0)}}))
    return nb


def write_assignment(out: str, notebooks: list[str]) -> list[str]:
    """Write each lesson's assignment notebook into `out`; return their paths."""
    import nbformat

    os.makedirs(out, exist_ok=True)
    written = []
    for path in notebooks:
        nb = lesson_assignment(path)
        if nb is None:
            raise ValueError(f"{path} has no exercise (no cell tagged 'student' defines an exercise's function)")
        target = os.path.join(out, os.path.basename(path))
        nbformat.write(nb, target)
        written.append(target)
    return written

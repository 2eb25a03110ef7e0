"""An instructor's view: grade a folder of submitted notebooks.

For each notebook, every cell tagged `student` that defines an exercise's function (`def
my_average(`) is run in a fresh Python process, after the notebook's own import lines, and the
exercise's checker is called on the function it defines. One row per notebook and exercise:
student (the notebook's file name), exercise, passed, message.

    python -m pipelab.exercises.grading EXERCISE < code   # what each fresh process runs
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

MARK = "PIPELAB-GRADE "


@dataclass(frozen=True)
class Row:
    student: str
    exercise: str
    passed: bool
    message: str


def submitted_code(path: str) -> dict[str, str]:
    """Exercise name -> the code to run for it: the notebook's import lines, then the student cell
    that defines the exercise's function."""
    import nbformat

    from pipelab.exercises import EXERCISES

    nb = nbformat.read(path, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    imports = "\n".join(line for c in code_cells if "student" not in c.metadata.get("tags", [])
                        for line in c.source.splitlines() if re.match(r"(import|from) \S+", line))
    found = {}
    for cell in code_cells:
        if "student" not in cell.metadata.get("tags", []):
            continue
        for exercise, (function, _) in EXERCISES.items():
            if re.search(rf"^def {function}\(", cell.source, re.M):
                found[exercise] = imports + "\n\n" + cell.source
    return found


def grade_code(exercise: str, code: str, timeout: float = 300.0) -> tuple[bool, str]:
    """Run `code` in a fresh process and grade the function it defines; (passed, message)."""
    try:
        done = subprocess.run([sys.executable, "-m", "pipelab.exercises.grading", exercise], input=code,
                              capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return False, f"did not finish within {timeout:g} s"
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK):
            result = json.loads(line[len(MARK):])
            return result["passed"], result["message"]
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return False, f"the submitted cell could not run: {tail}"


def grade_folder(folder: str, timeout: float = 300.0) -> list[Row]:
    """One row per notebook in `folder` and exercise its student cells define."""
    if not os.path.isdir(folder):
        raise ValueError(f"{folder!r} is not a folder of notebooks; pass the folder the submissions are in")
    rows = []
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".ipynb")):
        student = name[:-len(".ipynb")]
        for exercise, code in submitted_code(os.path.join(folder, name)).items():
            rows.append(Row(student, exercise, *grade_code(exercise, code, timeout)))
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a text table."""
    head = ("student", "exercise", "result", "message")
    body = [(r.student, r.exercise, "pass" if r.passed else "FAIL", r.message) for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(3)]
    return "\n".join("  ".join(str(x[i]).ljust(widths[i]) for i in range(3)) + "  " + x[3] for x in [head, *body])


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "exercise", "passed", "message"])
        for r in rows:
            writer.writerow([r.student, r.exercise, "pass" if r.passed else "fail", r.message])


def _grade_stdin(exercise: str) -> None:
    """In the fresh process: define the student's code in __main__ (so it travels to the ranks by
    value, as from a notebook), call the checker, print the grade after MARK."""
    import __main__

    from pipelab.exercises import EXERCISES

    function, check = EXERCISES[exercise]
    code = sys.stdin.read()
    try:
        exec(compile(code, f"<{exercise} student cell>", "exec"), __main__.__dict__)  # noqa: S102
        grade = check(__main__.__dict__[function], quiet=True)
        passed, message = grade.passed, grade.message
    except Exception as e:  # noqa: BLE001 - a cell that does not even define the function
        passed, message = False, f"the submitted cell raised {type(e).__name__}: {e}"
    print(MARK + json.dumps({"passed": passed, "message": message}), flush=True)


if __name__ == "__main__":
    _grade_stdin(sys.argv[1])

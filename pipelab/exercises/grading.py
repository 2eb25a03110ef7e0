"""An instructor's view: grade a folder of submitted notebooks, a class at a time.

    pipelab exercises grade FOLDER [--csv OUT] [--feedback DIR] [--timeout SECONDS]

FOLDER holds one notebook per student (`ada.ipynb`) or one folder per student (`ada/08.ipynb`,
as nbgrader's `submitted/` does). Each notebook is graded in its own Python process, started in
an empty folder (so nothing in the instructor's current folder, e.g. a clone named `pipelab` or
its `build/` output, can shadow the course's modules), stopped after `timeout` seconds with
everything it started. For each exercise, the process runs the notebook's import lines, the
statements of earlier cells that the answer uses (a helper defined in another cell), then the
student's cell, and calls the checker. One broken, empty or hanging notebook gives its rows a
message naming the file and why; the others are graded.

Points per exercise come from the notebook's metadata (the checker cell's `nbgrader.points`, or
`pipelab.points`); a student gets them when the checker passes. Every student has a row for every
exercise the class was given (`missing` where no cell defines its function) and a total.

    python -m pipelab.exercises.grading < {"exercise": "code", ...}   # what each process runs
"""

from __future__ import annotations

import ast
import builtins
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

MARK = "PIPELAB-GRADE "
DEFAULT_POINTS = 1.0


@dataclass(frozen=True)
class Row:
    student: str
    exercise: str
    status: str  # pass, fail, missing, error
    points: float
    max_points: float
    message: str


# ---- what a notebook holds ----------------------------------------------------------------------


def _tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def _python(source: str) -> str:
    """A cell's source without IPython's magics and shell lines, which plain Python cannot run."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(_python(source))
    except SyntaxError:
        return None


def _defined(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - set(dir(builtins))


def exercise_points(nb) -> dict[str, float]:
    """Exercise -> points, from the cells' metadata (nbgrader's on the checker cell, or pipelab's)."""
    from pipelab.exercises import EXERCISES

    points = {}
    for cell in nb.cells:
        meta = cell.get("metadata", {})
        mine = meta.get("pipelab", {})
        if "exercise" in mine and "points" in mine:
            points[mine["exercise"]] = float(mine["points"])
        grader = meta.get("nbgrader", {})
        if grader.get("grade") and "points" in grader:
            for name, (_, check) in EXERCISES.items():
                if f"{check.__name__}(" in cell.source:
                    points.setdefault(name, float(grader["points"]))
    return points


def submitted_code(nb_or_path) -> dict[str, str]:
    """Exercise name -> the code to run for it: every import line of the notebook, the statements
    of earlier cells that define names the answer uses (and what those use), then the cell that
    defines the exercise's function (tagged `student`, or marked as nbgrader's solution)."""
    import nbformat

    from pipelab.exercises import EXERCISES

    nb = nbformat.read(nb_or_path, as_version=4) if isinstance(nb_or_path, str) else nb_or_path
    cells = [c for c in nb.cells if c.cell_type == "code"]
    trees = [_parse(c.source) for c in cells]
    imports = [ast.unparse(s) for t in trees if t for s in t.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    found = {}
    for i, cell in enumerate(cells):
        answer = "student" in _tags(cell) or cell.get("metadata", {}).get("nbgrader", {}).get("solution")
        if not answer:
            continue
        for exercise, (function, _) in EXERCISES.items():
            if exercise in found:
                continue
            if trees[i] is None and f"def {function}(" in cell.source:  # not valid Python: its run says where
                found[exercise] = _python(cell.source)
                continue
            if not any(isinstance(s, ast.FunctionDef) and s.name == function for s in (trees[i].body if trees[i] else [])):
                continue
            found[exercise] = "\n".join([*imports, *_helpers(trees[:i], trees[i]), "", _python(cell.source)])
    return found


def _helpers(earlier: list, tree: ast.Module) -> list[str]:
    """The statements of earlier cells that define what `tree` uses, with what they use, in order."""
    statements = [s for t in earlier if t for s in t.body if _defined(s)]
    need, chosen = set(_used(tree)) - {n for s in tree.body for n in _defined(s)}, set()
    for index in range(len(statements) - 1, -1, -1):
        if _defined(statements[index]) & need:
            chosen.add(index)
            need |= _used(statements[index])
    return [ast.unparse(statements[i]) for i in sorted(chosen)]


# ---- grading one notebook in its own process ----------------------------------------------------


def grade_notebook(path: str, timeout: float = 600.0) -> tuple[dict[str, tuple[bool, str]], str | None]:
    """({exercise: (passed, message)}, None) for the notebook at `path`; or what was graded and
    why the rest could not be (an unreadable file, a crash, the time limit)."""
    import nbformat

    name = os.path.basename(path)
    try:
        nb = nbformat.read(path, as_version=4)
        code = submitted_code(nb)
    except Exception as e:  # noqa: BLE001 - any unreadable notebook is one row's message
        return {}, f"{name} could not be read ({type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''})"
    if not code:
        return {}, None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    with tempfile.TemporaryDirectory(prefix="pipelab-grade-") as empty:
        proc = subprocess.Popen([sys.executable, "-m", "pipelab.exercises.grading"], cwd=empty, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(json.dumps(code), timeout=timeout)
            problem = None
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            problem = f"{name} did not finish within {timeout:g} s"
        finally:
            _kill_group(proc)
    results = {}
    for line in out.splitlines():
        if line.startswith(MARK):
            r = json.loads(line[len(MARK):])
            results[r["exercise"]] = (r["passed"], r["message"])
    if problem is None and len(results) < len(code):
        tail = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        problem = f"{name} stopped before every exercise was graded: {tail[:200]}"
    if problem:
        for exercise in code:
            results.setdefault(exercise, (False, problem))
    return results, None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- a class --------------------------------------------------------------------------------------


def submissions(folder: str) -> list[tuple[str, str]]:
    """(student, notebook path) for FOLDER/student.ipynb and FOLDER/student/**/*.ipynb."""
    found = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry.endswith(".ipynb") and os.path.isfile(path):
            found.append((entry[:-len(".ipynb")], path))
        elif os.path.isdir(path) and not entry.startswith("."):
            for here, dirs, files in sorted(os.walk(path)):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [(entry, os.path.join(here, f)) for f in sorted(files) if f.endswith(".ipynb")]
    return found


def grade_folder(folder: str, timeout: float = 600.0, progress=None) -> list[Row]:
    """A row for every student and exercise the class was given, and each student's total."""
    import nbformat

    if not os.path.isdir(folder):
        raise ValueError(f"{folder!r} is not a folder of notebooks; pass the folder the submissions are in")
    graded: dict[str, dict[str, tuple[str, str]]] = {}
    points: dict[str, float] = {}
    for student, path in submissions(folder):
        if progress:
            progress(f"grading {os.path.relpath(path, folder)}")
        try:
            points = {**exercise_points(nbformat.read(path, as_version=4)), **points}
        except Exception:  # noqa: BLE001 - graded below, where the row says why
            pass
        results, problem = grade_notebook(path, timeout)
        mine = graded.setdefault(student, {})
        for exercise, (passed, message) in results.items():
            mine[exercise] = ("pass" if passed else "fail", message)
        if problem:
            mine.setdefault(f"file:{os.path.relpath(path, folder)}", ("error", problem))
        elif not results:  # an empty or unanswered notebook: its missing rows name it
            mine.setdefault(f"none:{os.path.relpath(path, folder)}", ("missing", f"{os.path.relpath(path, folder)} "
                                                                       "has no cell that defines an exercise's function"))
    exercises = sorted({e for mine in graded.values() for e in mine if ":" not in e} | set(points))
    rows = []
    for student, mine in graded.items():
        errors = [message for key, (_, message) in mine.items() if key.startswith("file:")]
        empty = [message for key, (_, message) in mine.items() if key.startswith("none:")]
        for exercise in exercises:
            top = points.get(exercise, DEFAULT_POINTS)
            status, message = mine.get(exercise, ("error" if errors else "missing", "; ".join(errors or empty)
                                                  or "no cell defines this exercise's function"))
            rows.append(Row(student, exercise, status, top if status == "pass" else 0.0, top, message))
    return rows


def totals(rows: list[Row]) -> dict[str, tuple[float, float]]:
    """Student -> (points, out of)."""
    out: dict[str, tuple[float, float]] = {}
    for r in rows:
        got, top = out.get(r.student, (0.0, 0.0))
        out[r.student] = (got + r.points, top + r.max_points)
    return out


def table(rows: list[Row]) -> str:
    """The rows and totals as a text table."""
    head = ("student", "exercise", "result", "points", "message")
    body = [(r.student, r.exercise, r.status, f"{r.points:g}/{r.max_points:g}", r.message) for r in rows]
    body += [(s, "TOTAL", "", f"{got:g}/{top:g}", "") for s, (got, top) in totals(rows).items()]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
    return "\n".join("  ".join(x[i].ljust(widths[i]) for i in range(4)) + "  " + x[4] for x in [head, *body])


def write_csv(rows: list[Row], path: str) -> None:
    """One line per student and exercise, then one TOTAL line per student."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "exercise", "status", "points", "max_points", "message"])
        for r in rows:
            writer.writerow([r.student, r.exercise, r.status, f"{r.points:g}", f"{r.max_points:g}", r.message])
        for student, (got, top) in totals(rows).items():
            writer.writerow([student, "TOTAL", "", f"{got:g}", f"{top:g}", ""])


def write_feedback(rows: list[Row], folder: str) -> list[str]:
    """One text file per student, FOLDER/<student>.txt, with their exercises' messages and total."""
    os.makedirs(folder, exist_ok=True)
    written = []
    for student, (got, top) in totals(rows).items():
        lines = [f"Feedback for {student}: {got:g} of {top:g} points", ""]
        for r in (r for r in rows if r.student == student):
            lines += [f"[{r.status}] {r.exercise} ({r.points:g}/{r.max_points:g})", f"    {r.message}", ""]
        path = os.path.join(folder, f"{student}.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines))
        written.append(path)
    return written


# ---- inside the grading process -------------------------------------------------------------------


def _grade_stdin() -> None:
    """Each exercise's code run in a namespace of its own named __main__ (so its functions travel
    to the ranks by value, as from a notebook), the checker called, the grade printed after MARK."""
    from pipelab.exercises import EXERCISES

    for exercise, code in json.loads(sys.stdin.read()).items():
        function, check = EXERCISES[exercise]
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        try:
            exec(compile(code, f"<{exercise} student cell>", "exec"), namespace)  # noqa: S102
            grade = check(namespace[function], quiet=True)
            passed, message = grade.passed, grade.message
        except BaseException as e:  # noqa: BLE001 - a cell that does not even define the function
            where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
            passed, message = False, f"the submitted cells raised {type(e).__name__}{where}: {str(e)[:200]}"
        print(MARK + json.dumps({"exercise": exercise, "passed": passed, "message": message}), flush=True)


if __name__ == "__main__":
    _grade_stdin()

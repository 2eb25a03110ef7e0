"""The `pipelab` command.

    pipelab doctor                 what this machine has, and the path the lessons take
    pipelab profiles [NOTEBOOK...] each notebook's named parameter sets
    pipelab run [NOTEBOOK...]      execute notebooks with papermill into build/, then a summary table

Notebooks are chosen by path (`notebooks/06_gpipe.ipynb`), by folder (`notebooks`: its lessons,
the files named like `06_*.ipynb`) or by lesson number (`06`, looked up in --folder); none means
every lesson. `pipelab run` options:

    -p NAME VALUE     set a parameter (papermill's spelling; VALUE read as papermill reads it:
                      True/False/None, int, float, else text) in every chosen notebook whose
                      `parameters` cell declares NAME; an error if none does
    --profile NAME    use each notebook's profile NAME; -p wins over it; a notebook without that
                      profile runs with its defaults and says so
    --timeout SECONDS fail a notebook that runs longer (the others go on)
    --html            also write each executed notebook as HTML beside it

Profiles live in the notebook's metadata, a name -> parameters mapping:

    "metadata": {"pipelab": {"profiles": {"gpu": {"batch": 256, "steps": 20},
                                          "quick": {"steps": 2}}}}

`gpu` is for a single GPU node, `quick` the fastest meaningful run. Each executed notebook goes to
--out (default build/) under its path below the chosen notebooks' common folder, so two notebooks
with the same file name do not collide; --out/summary.json has, per notebook, its status, seconds,
parameters, headline figure and the failing cell's error. Exit code: 0 when every notebook ran,
1 when one failed, 2 for a mistake on the command line (nothing runs).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
from dataclasses import dataclass

from pipelab.batch import NotebookRun, render_html, run_notebook, write_summary

__all__ = ["NotebookRun", "course_notebooks", "main", "run_notebook", "select_notebooks"]


class UsageError(Exception):
    """A mistake on the command line, reported (exit code 2) before any notebook runs."""


def course_notebooks(folder: str = "notebooks") -> list[str]:
    """The lesson notebooks, in teaching order (their names start with the lesson number)."""
    return sorted(glob.glob(os.path.join(folder, "[0-9]*.ipynb")))


def select_notebooks(selectors: list[str], folder: str = "notebooks") -> list[str]:
    """The notebooks named by paths, folders (their lessons) or lesson numbers, in the order given,
    each once; every lesson in `folder` when none is given."""
    if not selectors:
        if not os.path.isdir(folder):
            raise UsageError(f"no folder {folder!r}: run this from the course checkout, or pass --folder")
        selectors = [folder]
    chosen: list[str] = []
    for sel in selectors:
        for path in _select(sel, folder):
            if os.path.abspath(path) not in map(os.path.abspath, chosen):
                chosen.append(path)
    return chosen


def _select(sel: str, folder: str) -> list[str]:
    if os.path.isdir(sel):
        found = course_notebooks(sel)
        if not found:
            raise UsageError(f"no lesson notebooks (named like 06_*.ipynb) in folder {sel!r}")
        return found
    if os.path.isfile(sel):
        if not sel.endswith(".ipynb"):
            raise UsageError(f"{sel!r} is not a notebook (.ipynb)")
        return [sel]
    if re.fullmatch(r"\d+", sel):
        lessons = course_notebooks(folder)
        found = [p for p in lessons if int(re.match(r"\d+", os.path.basename(p))[0]) == int(sel)]
        if not found:
            numbers = ", ".join(re.match(r"\d+", os.path.basename(p))[0] for p in lessons)
            raise UsageError(f"no lesson numbered {sel} in {folder!r} (lessons: {numbers or 'none'})")
        return found
    raise UsageError(f"no such notebook: {sel!r} (give a path, a folder or a lesson number like 06)")


def parse_value(text: str):
    """A command-line parameter value, read as papermill's `-p` reads it."""
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def declared_parameters(path: str) -> dict:
    """The names the notebook's `parameters` cell assigns, with their default values (as text)."""
    import papermill as pm

    return {name: p["default"] for name, p in pm.inspect_notebook(path).items()}


def notebook_profiles(path: str) -> dict[str, dict]:
    """The notebook's profiles: metadata["pipelab"]["profiles"], name -> parameters."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    profiles = nb.metadata.get("pipelab", {}).get("profiles", {})
    return {name: dict(params) for name, params in profiles.items()}


@dataclass
class Planned:
    """One notebook of a batch, with the parameters it will get."""

    path: str
    parameters: dict
    note: str = ""  # said when it starts, e.g. that it has no such profile
    skip: str = ""  # why it does not run at all, e.g. its profile needs GPUs this machine lacks


@dataclass(frozen=True)
class Needs:
    """What a profile needs from the machine (metadata["pipelab"]["needs"][profile]), and what it
    costs there: `estimate` says how long on which node, from the FLOP count in `flops`."""

    gpus: int = 0
    gpu_memory_gib: float = 0.0
    flops: float = 0.0  # the profile's whole run, counted (see the notebook's comment on it)
    estimate: str = ""

    def __str__(self) -> str:
        parts = [f"{self.gpus} GPU(s)" + (f" with {self.gpu_memory_gib:g} GiB each" if self.gpu_memory_gib else "")]
        if self.flops:
            parts.append(f"{self.flops / 1e12:,.1f} TFLOP")
        if self.estimate:
            parts.append(self.estimate)
        return "needs " + "; ".join(parts)


def profile_needs(path: str) -> dict[str, Needs]:
    """Each profile's needs, from the notebook's metadata["pipelab"]["needs"]."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    needs = nb.metadata.get("pipelab", {}).get("needs", {})
    return {name: Needs(**dict(n)) for name, n in needs.items()}


def unmet(needs: Needs, gpus: tuple[str, ...], gpu_memory_gib: list[float]) -> str:
    """Why this machine cannot run a profile with `needs` ('' if it can)."""
    if len(gpus) < needs.gpus:
        return f"profile {needs} but this machine has {len(gpus)} GPU(s): skipped (GPU sizes never run on CPU)"
    if needs.gpu_memory_gib and gpus and min(gpu_memory_gib) < needs.gpu_memory_gib:
        return (f"profile {needs} but this machine's smallest GPU has {min(gpu_memory_gib):.0f} GiB: "
                "skipped")
    return ""


def _gpu_memory_gib() -> list[float]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(torch.cuda.device_count())]


def plan_runs(notebooks: list[str], given: dict, profile: str | None) -> list[Planned]:
    """Each notebook's parameters: its profile (if asked for), then each `-p` it declares.

    Raises UsageError for a `-p` that no notebook declares, a profile that no notebook has, or a
    profile setting a parameter its notebook does not declare."""
    plans, used, profiled = [], set(), False
    for path in notebooks:
        params, note = {}, ""
        if not given and profile is None:
            plans.append(Planned(path, params))
            continue
        declared, profiles = _read_parameters(path)
        if profile is not None:
            if profile in profiles:
                params, profiled = dict(profiles[profile]), True
                unknown = sorted(set(params) - set(declared))
                if unknown:
                    raise UsageError(f"{path}: profile {profile!r} sets {', '.join(unknown)}, which its "
                                     f"parameters cell does not declare ({', '.join(declared) or 'none'})")
            else:
                has = ", ".join(profiles) or "none"
                note = f"no profile {profile!r} (has: {has}); running with its defaults"
        for name, value in given.items():
            if name in declared:
                params[name] = value
                used.add(name)
        skip = ""
        if profile is not None and profile in profiles:
            needs = _read_needs(path).get(profile)
            if needs is not None:
                from pipelab import hardware

                skip = unmet(needs, hardware.detect().gpus, _gpu_memory_gib())
        plans.append(Planned(path, params, note, skip))
    unused = [name for name in given if name not in used]
    if unused:
        raise UsageError(f"no chosen notebook declares parameter {', '.join(unused)} in its parameters cell "
                         "(see `pipelab profiles` and the notebooks' parameters cells)")
    if profile is not None and not profiled:
        raise UsageError(f"no chosen notebook has a profile {profile!r} (see `pipelab profiles`)")
    return plans


def _read_needs(path: str) -> dict[str, Needs]:
    try:
        return profile_needs(path)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{path}: its metadata's pipelab.needs is not understood: {e}") from e


def _read_parameters(path: str) -> tuple[dict, dict]:
    try:
        return declared_parameters(path), notebook_profiles(path)
    except Exception as e:  # noqa: BLE001 - any unreadable notebook is a usage error here
        raise UsageError(f"cannot read the parameters of {path}: {e}") from e


def format_parameters(params: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items())


def format_headline(h: dict | None) -> str:
    """'name = value unit' for any headline: a value that is not a number (NaN arrives as 'nan',
    a hand-made headline may hold anything) is printed as it is."""
    if not h:
        return "-"
    value = h.get("value")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    shown = f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
    text = f"{h.get('name', 'headline')} = {shown} {h.get('unit') or ''}".rstrip()
    if isinstance(h.get("low"), (int, float)) and isinstance(h.get("high"), (int, float)):
        text += f" ({h['low']:.3g}-{h['high']:.3g})"
    return text


def summary_table(runs: list[NotebookRun]) -> str:
    """A plain-text table: notebook, status, seconds, headline figure (or the error of a failed run)."""
    rows = [("notebook", "status", "seconds", "headline")]
    for r in runs:
        figure = (r.error or "-") if r.status != "ok" else format_headline(r.headline)
        rows.append((str(r.notebook), str(r.status), f"{r.seconds:.1f}", figure))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 8)
    return "\n".join(lines)


def _printer(name: str):
    def progress(cell: int, cells: int, seconds: float) -> None:
        print(f"  {name}: cell {cell}/{cells}, {seconds:.1f} s", flush=True)
    return progress


def check_out_folder(out: str) -> None:
    """Refuse an --out folder we cannot write into (a file, /proc, a path under a file, no
    permission), before any notebook runs."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".pipelab-write-test-"):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        raise UsageError(f"--out {out!r} is not a folder we can write into ({reason}); "
                         "pass a writable folder, e.g. --out build") from None


def cmd_run(ns: argparse.Namespace) -> int:
    given = {name: parse_value(value) for name, value in ns.parameters or []}
    plans = plan_runs(select_notebooks(ns.notebooks, ns.folder), given, ns.profile)
    check_out_folder(ns.out)
    # Mirror the folders below the notebooks' common folder, so equal file names never collide.
    base = os.path.commonpath([os.path.dirname(os.path.abspath(p.path)) for p in plans])
    runs = []
    for plan in plans:
        rel = os.path.relpath(os.path.abspath(plan.path), base)
        with_params = f" with {format_parameters(plan.parameters)}" if plan.parameters else ""
        if plan.skip:
            print(f"skipping {plan.path}: {plan.skip}", flush=True)
            runs.append(NotebookRun(rel, "skipped", 0.0, None, error=plan.skip, parameters=plan.parameters))
            write_summary(runs, os.path.join(ns.out, "summary.json"), profile=ns.profile)
            continue
        print(f"running {plan.path}{with_params} ...", flush=True)
        if plan.note:
            print(f"  {rel}: {plan.note}", flush=True)
        run = run_notebook(plan.path, os.path.join(ns.out, os.path.dirname(rel)), plan.parameters,
                           timeout=ns.timeout, progress=_printer(rel), name=rel)
        run.note = plan.note
        if ns.html and os.path.exists(run.output):
            run.html = render_html(run.output)
        runs.append(run)
        print(f"  {run.status} in {run.seconds:.1f} s" + (f": {run.error}" if run.error else ""), flush=True)
        write_summary(runs, os.path.join(ns.out, "summary.json"), profile=ns.profile)
    print()
    print(summary_table(runs))
    html = [os.path.relpath(r.html, ns.out) for r in runs if r.html]
    copies = f", their HTML copies ({', '.join(html)})" if html else ""
    print(f"\nexecuted notebooks{copies} and summary.json are in {os.path.abspath(ns.out)}/")
    return 0 if all(r.status in ("ok", "skipped") for r in runs) else 1


def cmd_profiles(ns: argparse.Namespace) -> int:
    for path in select_notebooks(ns.notebooks, ns.folder):
        profiles, needs = _read_parameters(path)[1], _read_needs(path)
        print(path + ("" if profiles else ": no profiles"))
        width = max(map(len, profiles), default=0)
        for name, params in profiles.items():
            print(f"  {name.ljust(width)}  {format_parameters(params) or '(defaults)'}")
            if name in needs:
                print(f"  {' ' * width}  {needs[name]}")
    return 0


def cmd_doctor(ns: argparse.Namespace) -> int:
    from pipelab import hardware

    problem = hardware.platform_problem()
    if problem:
        print(f"pipelab doctor: {problem}", file=sys.stderr)
        return 2
    hw = hardware.detect()
    print(hardware.describe(ns.world_size))
    print(f"CPU cores: {hw.cpu_cores}")
    print(f"GPUs: {', '.join(hw.gpus) if hw.gpus else 'none'}")
    print(f"torch {hw.torch_version}, CUDA {hw.cuda_version or '-'}")
    return 0


def cmd_exercises(ns: argparse.Namespace) -> int:
    """`pipelab exercises`: the exercises per lesson; `grade FOLDER`: every student's exercises,
    each notebook graded in its own process, with points and totals (a CSV with --csv, a file per
    student with --feedback); `assignment OUT NOTEBOOK...`: the lessons' exercises as nbgrader
    source notebooks (pipelab.exercises.grading, pipelab.exercises.assignment)."""
    from pipelab.exercises import EXERCISES, assignment, grading

    if ns.action == "list":
        for name, (function, check) in EXERCISES.items():
            summary = " ".join((check.__doc__ or "").split())
            print(f"lesson {name[:2]}  {name:<20} {function}: {summary}")
        return 0
    if ns.action == "assignment":
        if not ns.folder or not ns.notebooks:
            raise UsageError("give a folder and the lessons: pipelab exercises assignment OUT NOTEBOOK [NOTEBOOK ...]")
        missing = [p for p in ns.notebooks if not os.path.isfile(p)]
        if missing:
            raise UsageError(f"no notebook {missing[0]!r}; pass lesson notebooks, e.g. notebooks/05_*.ipynb")
        try:
            for path in assignment.write_assignment(ns.folder, ns.notebooks):
                print(f"wrote {path}")
        except ValueError as e:
            raise UsageError(str(e)) from None
        return 0
    if not ns.folder:
        raise UsageError("give the folder of submitted notebooks: pipelab exercises grade FOLDER [--csv OUT]")
    try:
        rows = grading.grade_folder(ns.folder, ns.timeout, progress=lambda line: print(line, file=sys.stderr))
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(grading.table(rows) if rows else f"no student cells defining an exercise in {ns.folder}")
    if ns.csv:
        grading.write_csv(rows, ns.csv)
        print(f"wrote {ns.csv}")
    if ns.feedback:
        print(f"wrote {len(grading.write_feedback(rows, ns.feedback))} feedback files in {ns.feedback}")
    return 0


def _seconds(text: str) -> float:
    """--timeout's value: seconds > 0 (argparse reports the ValueError's message)."""
    from pipelab.checks import positive_number

    try:
        value = float(text)
    except ValueError:
        value = text
    try:
        return positive_number("--timeout", value, example="--timeout 600")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    from pipelab import __version__

    top = argparse.ArgumentParser(prog="pipelab", description="pipelab course tools")
    top.add_argument("--version", action="version", version=f"pipelab {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    chosen = dict(nargs="*", help="notebook paths, folders or lesson numbers (default: every lesson)")
    folder = dict(default="notebooks", help="where lessons given by number are (default: notebooks/)")

    run = sub.add_parser("run", help="execute notebooks with papermill and print a summary")
    run.add_argument("notebooks", **chosen)
    run.add_argument("--folder", **folder)
    run.add_argument("--out", default="build", help="where executed copies go (default: build/)")
    run.add_argument("-p", "--parameters", nargs=2, action="append", metavar=("NAME", "VALUE"),
                     help="set a parameter in every notebook that declares it")
    run.add_argument("--profile", help="use each notebook's named profile (e.g. gpu, quick)")
    run.add_argument("--timeout", type=_seconds, metavar="SECONDS", help="time limit per notebook")
    run.add_argument("--html", action="store_true", help="also render each executed notebook to HTML")
    run.set_defaults(func=cmd_run)

    profiles = sub.add_parser("profiles", help="list each notebook's profiles and their parameters")
    profiles.add_argument("notebooks", **chosen)
    profiles.add_argument("--folder", **folder)
    profiles.set_defaults(func=cmd_profiles)

    doctor = sub.add_parser("doctor", help="what this machine has and which path the lessons take")
    doctor.add_argument("--world-size", type=int, default=2)
    doctor.set_defaults(func=cmd_doctor)

    exercises = sub.add_parser("exercises", help="list the graded exercises, grade a folder of submitted notebooks, "
                                                 "or write the lessons' exercises as nbgrader assignments")
    exercises.add_argument("action", nargs="?", choices=["list", "grade", "assignment"], default="list")
    exercises.add_argument("folder", nargs="?", help="grade: the folder of submitted notebooks; assignment: the output folder")
    exercises.add_argument("notebooks", nargs="*", help="with assignment: the lesson notebooks")
    exercises.add_argument("--csv", metavar="OUT", help="with grade: also write the rows and totals as CSV")
    exercises.add_argument("--feedback", metavar="DIR", help="with grade: write each student's messages to DIR/<student>.txt")
    exercises.add_argument("--timeout", type=_seconds, default=600.0, metavar="SECONDS", help="per notebook")
    exercises.set_defaults(func=cmd_exercises)
    return top


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        return ns.func(ns)
    except UsageError as e:
        print(f"pipelab {ns.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`pipelab profiles | head`): stop quietly, as other commands do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `pipelab` command.

    pipelab doctor                 what this machine has, and the path the lessons take
    pipelab profiles [NOTEBOOK...] each notebook's named parameter sets
    pipelab run [NOTEBOOK...]      execute notebooks with papermill into build/, then a summary table
    pipelab calibrate [--out FILE] measure this GPU and write an emulated device's spec (JSON)

Notebooks are chosen by path (`notebooks/06_gpipe.ipynb`), by folder (`notebooks`: its lessons,
the files named like `06_*.ipynb`) or by lesson number (`06`, looked up in --folder); none means
every lesson. `pipelab run` options:

    -p NAME VALUE     set a parameter (papermill's spelling; VALUE read as papermill reads it:
                      True/False/None, int, float, else text) in every chosen notebook whose
                      `parameters` cell declares NAME; an error if none does, or if VALUE is not
                      of the default's kind (a whole number for `ranks = 2`; None always goes)
    --profile NAME    use each notebook's profile NAME; -p wins over it; a notebook without that
                      profile runs with its defaults and says so
    --timeout SECONDS fail a notebook that runs longer (the others go on)
    --html            also write each executed notebook as HTML beside it
    --calibration FILE  on a one-GPU machine, the calibration file the emulated nodes are made of

Profiles live in the notebook's metadata, a name -> parameters mapping:

    "metadata": {"pipelab": {"profiles": {"gpu": {"batch": 256, "steps": 20},
                                          "quick": {"steps": 2}}}}

`gpu` is for a single GPU node, `quick` the fastest meaningful run. A profile's needs
(metadata["pipelab"]["needs"]) decide where it runs: with the GPUs it asks for, as it is; on a
machine with one GPU, with the lesson's defaults, the parts its profile sets to "cuda" measured on
this GPU and the rest on an emulated node of eight of this GPU calibrated by `pipelab calibrate`
(pipelab/planning.py); without GPUs it is skipped. Each executed
notebook goes to --out (default build/) under its path below the chosen notebooks' common folder,
so two notebooks with the same file name do not collide; --out/summary.json has, per notebook, its
status (ok, failed or skipped), seconds, parameters, headline figure, note and the failing cell's
error. Exit code: 0 when every notebook that was to run ran ok (some may be skipped), 1 when one
failed, 2 for a mistake on the command line (nothing runs), 3 when no notebook ran (all skipped).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

from pipelab.batch import NotebookRun, render_html, run_notebook, write_summary
from pipelab.planning import (Machine, Needs, PlanError, Planned, _read_needs, _read_parameters, declared_parameters,
                              notebook_profiles, parse_value, plan_runs, profile_needs, unmet)


__all__ = ["Machine", "Needs", "NotebookRun", "Planned", "course_notebooks", "main", "parse_value", "plan_runs",
           "run_notebook", "select_notebooks", "unmet"]


NO_GPU = 3  # `pipelab calibrate`'s exit code on a machine without a GPU
NOTHING_RAN = 3  # `pipelab run`'s exit code when every chosen notebook was skipped

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
    """A plain-text table: notebook, status (ok, failed, skipped), seconds, headline figure (or the
    error of a failed run; a skipped one's reason was said once, when it was skipped)."""
    rows = [("notebook", "status", "seconds", "headline")]
    for r in runs:
        figure = {"ok": format_headline(r.headline), "skipped": "-"}.get(r.status, r.error or "-")
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


def ensure_calibration(plans: list[Planned]) -> None:
    """Calibrate this GPU first when a one-GPU plan's calibration file does not exist yet."""
    missing = sorted({p.calibration for p in plans if p.calibration and not os.path.exists(p.calibration)})
    for path in missing:
        from pipelab.emulate import calibrate as cal

        print(f"no calibration file at {path}: calibrating this GPU first (pipelab calibrate, about a minute)",
              flush=True)
        try:
            print(cal.summary(cal.calibrate(path)), flush=True)
        except (cal.NoGPU, ValueError) as e:
            raise UsageError(f"cannot calibrate this GPU for the one-GPU runs: {e}") from None


def cmd_run(ns: argparse.Namespace) -> int:
    given = {name: parse_value(value) for name, value in ns.parameters or []}
    plans = plan_runs(select_notebooks(ns.notebooks, ns.folder), given, ns.profile,
                      calibration=os.path.abspath(os.path.expanduser(ns.calibration)) if ns.calibration else None)
    check_out_folder(ns.out)
    ensure_calibration(plans)
    # Mirror the folders below the notebooks' common folder, so equal file names never collide.
    base = os.path.commonpath([os.path.dirname(os.path.abspath(p.path)) for p in plans])
    runs, summary = [], os.path.join(ns.out, "summary.json")
    for plan in plans:
        rel = os.path.relpath(os.path.abspath(plan.path), base)
        with_params = f" with {format_parameters(plan.parameters)}" if plan.parameters else ""
        if plan.skip:
            print(f"skipping {plan.path}: {plan.skip}", flush=True)
            runs.append(NotebookRun(rel, "skipped", 0.0, None, parameters=plan.parameters, note=plan.skip))
            write_summary(runs, summary, profile=ns.profile)
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
        write_summary(runs, summary, profile=ns.profile)
    print()
    print(summary_table(runs))
    html = [os.path.relpath(r.html, ns.out) for r in runs if r.html]
    copies = f", their HTML copies ({', '.join(html)})" if html else ""
    ran = any(r.status != "skipped" for r in runs)
    print(f"\n{f'executed notebooks{copies} and summary.json are' if ran else 'summary.json is'} in "
          f"{os.path.abspath(ns.out)}/")
    return exit_code(runs)


def exit_code(runs: list[NotebookRun]) -> int:
    """0 when every notebook that was to run ran ok (some may be skipped), 1 when one failed,
    NOTHING_RAN (3) when every notebook was skipped."""
    if any(r.status == "failed" for r in runs):
        return 1
    if runs and all(r.status == "skipped" for r in runs):
        print(f"pipelab run: no notebook ran (every one skipped): exit code {NOTHING_RAN}", file=sys.stderr)
        return NOTHING_RAN
    return 0


def cmd_profiles(ns: argparse.Namespace) -> int:
    for path in select_notebooks(ns.notebooks, ns.folder):
        profiles, needs = _read_profiles(path), _read_needs(path)
        print(path + ("" if profiles else ": no profiles"))
        width = max(map(len, profiles), default=0)
        for name, params in profiles.items():
            print(f"  {name.ljust(width)}  {format_parameters(params) or '(defaults)'}")
            if name in needs:
                print(f"  {' ' * width}  {needs[name]}")
    return 0


def _read_profiles(path: str) -> dict[str, dict]:
    """The notebook's profiles, read from its metadata alone (no papermill: listing them is quick)."""
    try:
        return notebook_profiles(path)
    except Exception as e:  # noqa: BLE001 - any unreadable notebook is a usage error here
        raise PlanError(f"cannot read the profiles of {path}: {e}") from e


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
    from pipelab.emulate.calibrate import in_use

    print(f"emulated-node spec: {in_use()}")
    return 0


def cmd_calibrate(ns: argparse.Namespace) -> int:
    from pipelab.emulate import calibrate as cal

    path = ns.out or cal.default_path()
    problem = cal.gpu_problem()
    if problem:
        print(f"pipelab calibrate: {problem}", file=sys.stderr)
        return NO_GPU
    try:
        record = cal.calibrate(path)
    except ValueError as e:
        print(f"pipelab calibrate: {e}", file=sys.stderr)
        return 1
    print(cal.summary(record))
    print(f"wrote {path}; emulate a node of eight of this GPU with emulate=\"8x:{path}\"")
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


def calibrate_help() -> str:
    from pipelab.emulate.calibrate import HELP

    return HELP


class _CalibrateParser(argparse.ArgumentParser):
    """`pipelab calibrate`'s parser: its long help comes from pipelab.emulate, which imports torch,
    so it is read only when shown; every other command (`--version`, `profiles`, `run`) starts
    without torch."""

    def format_help(self) -> str:
        self.description = calibrate_help()
        return super().format_help()


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
    run.add_argument("--calibration", metavar="FILE", help="on a one-GPU machine, the `pipelab calibrate` file "
                     "the lessons' emulated nodes are made from (default: $PIPELAB_CALIBRATION, else "
                     "~/.cache/pipelab/calibration.json; written first when missing)")
    run.set_defaults(func=cmd_run)

    profiles = sub.add_parser("profiles", help="list each notebook's profiles and their parameters")
    profiles.add_argument("notebooks", **chosen)
    profiles.add_argument("--folder", **folder)
    profiles.set_defaults(func=cmd_profiles)

    doctor = sub.add_parser("doctor", help="what this machine has and which path the lessons take")
    doctor.add_argument("--world-size", type=int, default=2)
    doctor.set_defaults(func=cmd_doctor)

    sub._parser_class = _CalibrateParser  # argparse has no per-subcommand class argument
    calibrate = sub.add_parser(
        "calibrate", help="measure this GPU and write the emulated device's spec as JSON",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub._parser_class = argparse.ArgumentParser
    calibrate.add_argument("--out", metavar="FILE", help="where the JSON goes (default: $PIPELAB_CALIBRATION, "
                           "else ~/.cache/pipelab/calibration.json)")
    calibrate.set_defaults(func=cmd_calibrate)

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
    except (UsageError, PlanError) as e:
        print(f"pipelab {ns.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`pipelab profiles | head`): stop quietly, as other commands do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

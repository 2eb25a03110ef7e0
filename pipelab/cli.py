"""The `pipelab` command.

    pipelab doctor             what this machine has, and the path the lessons take
    pipelab run [NOTEBOOK...]  execute the notebooks with papermill into build/, then a summary table
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from dataclasses import dataclass


@dataclass
class NotebookRun:
    notebook: str
    status: str  # "ok" or "failed"
    seconds: float
    headline: dict | None
    error: str = ""


def course_notebooks(folder: str = "notebooks") -> list[str]:
    """The lesson notebooks, in teaching order (their names start with the lesson number)."""
    return sorted(glob.glob(os.path.join(folder, "[0-9]*.ipynb")))


def run_notebook(path: str, out_dir: str = "build", parameters: dict | None = None,
                 kernel_name: str = "python3") -> NotebookRun:
    """Execute one notebook with papermill into `out_dir`; report status, seconds and headline."""
    import papermill as pm

    from pipelab.display import read_headline

    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, os.path.basename(path))
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        pm.execute_notebook(path, out_path, parameters=parameters or {}, kernel_name=kernel_name,
                            cwd=os.path.dirname(os.path.abspath(path)), progress_bar=False)
    except Exception as e:  # noqa: BLE001 - a failed lesson is reported in the table, not fatal
        status, error = "failed", _last_line(str(e))
    seconds = time.perf_counter() - t0
    headline = None
    if os.path.exists(out_path):
        with open(out_path) as f:
            headline = read_headline(json.load(f))
    return NotebookRun(os.path.basename(path), status, seconds, headline, error)


def _last_line(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1][:200] if lines else ""


def summary_table(runs: list[NotebookRun]) -> str:
    """A plain-text table: notebook, status, seconds, headline figure."""
    rows = [("notebook", "status", "seconds", "headline")]
    for r in runs:
        if r.headline:
            h = r.headline
            figure = f"{h['name']} = {h['value']:.4g} {h.get('unit', '')}".rstrip()
        else:
            figure = r.error or "-"
        rows.append((r.notebook, r.status, f"{r.seconds:.1f}", figure))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 8)
    return "\n".join(lines)


def cmd_run(ns: argparse.Namespace) -> int:
    notebooks = ns.notebooks or course_notebooks(ns.folder)
    if not notebooks:
        print(f"no notebooks found in {ns.folder!r}; run this from the course checkout", file=sys.stderr)
        return 2
    runs = []
    for path in notebooks:
        print(f"running {path} ...", flush=True)
        runs.append(run_notebook(path, ns.out))
        print(f"  {runs[-1].status} in {runs[-1].seconds:.1f} s", flush=True)
    print()
    print(summary_table(runs))
    print(f"\nexecuted notebooks are in {os.path.abspath(ns.out)}/")
    return 0 if all(r.status == "ok" for r in runs) else 1


def cmd_doctor(ns: argparse.Namespace) -> int:
    from pipelab import hardware

    hw = hardware.detect()
    print(hardware.describe(ns.world_size))
    print(f"CPU cores: {hw.cpu_cores}")
    print(f"GPUs: {', '.join(hw.gpus) if hw.gpus else 'none'}")
    print(f"torch {hw.torch_version}, CUDA {hw.cuda_version or '-'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipelab", description="pipelab course tools")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute the lesson notebooks with papermill and print a summary")
    run.add_argument("notebooks", nargs="*", help="notebooks to run (default: notebooks/[0-9]*.ipynb)")
    run.add_argument("--folder", default="notebooks", help="where the lesson notebooks are")
    run.add_argument("--out", default="build", help="where executed copies go (default: build/)")
    run.set_defaults(func=cmd_run)
    doctor = sub.add_parser("doctor", help="what this machine has and which path the lessons take")
    doctor.add_argument("--world-size", type=int, default=2)
    doctor.set_defaults(func=cmd_doctor)
    ns = parser.parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())

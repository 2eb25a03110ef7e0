"""Executing lesson notebooks as a batch job: one notebook at a time with papermill, with progress
lines, a time limit, the failing cell's error, the headline figure, and an optional HTML copy.

`pipelab run` (pipelab/cli.py) and tests/test_notebooks.py use `run_notebook`."""

from __future__ import annotations

import json
import math
import os
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable

from pipelab.checks import positive_number

# The kernel's own log goes to its stderr, the terminal of `pipelab run`: a start-up WARNING
# ("Kernel is running over TCP without encryption ...") every time. It is about the kernel's
# plumbing; what a notebook does reaches its cells, and a kernel that dies is reported by nbclient.
# So only CRITICAL lines get through.
KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=CRITICAL"]



def _kernel_manager_class():
    """nbclient's kernel manager, minus the interrupt it sends a kernel it is shutting down.

    jupyter_client interrupts (SIGINT) before asking a kernel to shut down; one that lands just
    after the kernel answered papermill's last request logs "KeyboardInterrupt caught in kernel."
    Interrupts for a cell that runs past --timeout still go through."""
    from jupyter_client import AsyncKernelManager

    class QuietShutdownKernelManager(AsyncKernelManager):
        async def _async_interrupt_kernel(self) -> None:
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

    return QuietShutdownKernelManager


Progress = Callable[[int, int, float], None]  # (the cell's number in the notebook, its cells, seconds elapsed)


@dataclass
class NotebookRun:
    """What one notebook run gave: a row of the summary table and of build/summary.json."""

    notebook: str  # the notebook's name in tables: its file name, or its path below the batch's folder
    status: str  # "ok", "failed" or "skipped" (never started: `note` says why)
    seconds: float
    headline: dict | None  # reported by this run (pipelab.headline), never read from an older file
    error: str = ""  # failed runs: "cell 3/9: RuntimeError: ..." (one line; the notebook's cell numbers)
    parameters: dict = field(default_factory=dict)  # the values papermill injected
    output: str = ""  # the executed copy
    traceback: str = ""  # the failing cell's traceback, colours removed
    html: str = ""  # the HTML copy, when one was rendered
    note: str = ""  # e.g. that it had no such profile, how it ran on one GPU, or why it was skipped
    conclusions: list = field(default_factory=list)  # what the run stated (pipelab.conclude), in order

    def summary(self) -> dict:
        """This run as JSON-safe data (NaN and infinities written as text)."""
        return _json_safe({**asdict(self), "seconds": round(self.seconds, 3)})


class _Watch:
    """Follows a notebook's execution through nbclient's hooks: reports progress as each code cell
    starts, numbered as in the notebook itself (every cell counts, markdown too; the cell papermill
    injects with the parameters does not), and gives each cell the time left before the deadline."""

    def __init__(self, progress: Progress | None, timeout: float | None):
        self.progress, self.timeout = progress, timeout
        self.start = time.perf_counter()
        self.cells, self.cell = 0, 0
        self.injected: int | None = None  # where papermill's injected cell is

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def notebook_start(self, notebook, **_) -> None:
        found = [i for i, c in enumerate(notebook.cells) if _injected(c)]
        self.injected = found[0] if found else None
        self.cells = len(notebook.cells) - len(found)

    def cell_start(self, cell, cell_index: int = 0, **_) -> None:
        if _runs(cell) and not _injected(cell):
            injected_before = self.injected is not None and self.injected < cell_index
            self.cell = cell_index + 1 - injected_before
            if self.progress:
                self.progress(self.cell, self.cells, self.elapsed())

    def cell_timeout(self, cell) -> int:
        """Seconds this cell may take: what is left of the notebook's limit (at least 1)."""
        return max(1, math.ceil(self.timeout - self.elapsed()))

    def where(self) -> str:
        return f"cell {self.cell}/{self.cells}" if self.cell else "before the first cell"


def _injected(cell) -> bool:
    return "injected-parameters" in cell.get("metadata", {}).get("tags", [])


def _runs(cell) -> bool:
    return cell.cell_type == "code" and bool(cell.source.strip())


def run_notebook(path: str, out_dir: str = "build", parameters: dict | None = None,
                 kernel_name: str = "python3", timeout: float | None = None,
                 progress: Progress | None = None, name: str | None = None) -> NotebookRun:
    """Execute one notebook with papermill into `out_dir`; report status, seconds and headline.

    The previous executed copy (and its HTML) is removed first, so a run that fails early can never
    show an old figure. `timeout` limits the whole notebook, in seconds; `progress` is called as each
    code cell starts, with its number among the notebook's cells; `name` is the run's name in tables
    (default: the file name)."""
    import papermill as pm

    if timeout is not None:
        positive_number("timeout", timeout, example="600 (seconds)")
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, os.path.basename(path))
    for old in (out_path, _html_path(out_path)):
        if os.path.exists(old):
            os.remove(old)
    watch = _Watch(progress, timeout)
    hooks = {"on_notebook_start": watch.notebook_start, "on_cell_start": watch.cell_start}
    if timeout is not None:
        hooks["timeout_func"] = watch.cell_timeout
    status, error, tb = "ok", "", ""
    try:
        pm.execute_notebook(path, out_path, parameters=parameters or {}, kernel_name=kernel_name,
                            cwd=os.path.dirname(os.path.abspath(path)), progress_bar=False,
                            extra_arguments=KERNEL_ARGUMENTS, kernel_manager_class=_kernel_manager_class(),
                            **hooks)
    except Exception as e:  # noqa: BLE001 - a failed lesson is reported in the table, not fatal
        status = "failed"
        error, tb = describe_failure(e, watch)
    seconds = watch.elapsed()
    headline, conclusions = None, []
    if os.path.exists(out_path):
        from pipelab.display import read_conclusions, read_headline

        with open(out_path) as f:
            executed = json.load(f)
        headline, conclusions = read_headline(executed), read_conclusions(executed)
    return NotebookRun(name or os.path.basename(path), status, seconds, headline, error,
                       dict(parameters or {}), out_path, tb, conclusions=conclusions)


def describe_failure(e: Exception, watch: _Watch) -> tuple[str, str]:
    """(one line saying where and why the notebook failed, the cell's traceback or '')."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    if isinstance(e, PapermillExecutionError):
        first = (str(e.evalue).strip().splitlines() or [""])[0]
        line = f"{watch.where()}: {e.ename}" + (f": {first}" if first else "")
        return line[:300], _strip_colours("\n".join(e.traceback))
    if isinstance(e, CellTimeoutError):
        return (f"timed out: the notebook ran past its {watch.timeout:g} s limit "
                f"(--timeout) in {watch.where()}"), ""
    if isinstance(e, DeadKernelError):
        return f"the kernel died in {watch.where()}", ""
    lines = [l for l in str(e).strip().splitlines() if l.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300], ""


def _strip_colours(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _html_path(notebook_path: str) -> str:
    return os.path.splitext(notebook_path)[0] + ".html"


def render_html(notebook_path: str) -> str:
    """Write the executed notebook as HTML beside it (nbconvert), for reading results copied from a
    cluster without Jupyter; returns the HTML file's path."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(notebook_path)
    html_path = _html_path(notebook_path)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(body)
    return html_path


def write_summary(runs: list[NotebookRun], path: str, **about) -> None:
    """build/summary.json: `about` (e.g. the profile) and one entry per notebook run, its files
    named relative to the summary, so the folder can be copied elsewhere whole.

    Two `pipelab run` into the same folder both keep their rows: under a lock, the file's rows of
    other notebooks are kept and only this run's notebooks are replaced; each row says its profile."""
    from pipelab import __version__

    rows = [{**r.summary(), **_json_safe(about)} for r in runs]
    for row in rows:
        for key in ("output", "html"):
            if row[key]:
                row[key] = os.path.relpath(row[key], os.path.dirname(os.path.abspath(path)))
    with _locked(path + ".lock"):
        ours = {row["notebook"] for row in rows}
        kept = [row for row in _summary_rows(path) if row.get("notebook") not in ours]
        data = {"pipelab": __version__, **_json_safe(about), "notebooks": kept + rows}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)  # a reader never sees half a file


def _summary_rows(path: str) -> list[dict]:
    """The notebook rows already in a summary.json, or none (no file, or not one of ours)."""
    try:
        with open(path) as f:
            rows = json.load(f).get("notebooks", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


@contextmanager
def _locked(lock_path: str):
    """Hold an exclusive lock on `lock_path` (POSIX flock; where there is none, no lock), and remove
    the lock file when done, so none is left behind. A process that locked a file another has since
    removed sees that its path names another file (or none) and locks again."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    while True:
        f = open(lock_path, "a")  # noqa: SIM115 - closed below
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            same = os.path.samestat(os.fstat(f.fileno()), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    try:
        yield
    finally:
        os.remove(lock_path)  # still holding the lock: whoever waits on this file locks again
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _json_safe(value):
    """`value` with NaN and infinities as the strings 'nan', 'inf', '-inf' (strict JSON has none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def conclusion_changes(runs: list[list[dict]]) -> list[dict]:
    """Conclusions whose verdict differed between repeated runs of the same notebooks.

    `runs`: per run, the notebook rows of its summary.json (each with "notebook" and "conclusions").
    Returns one entry per (notebook, key) whose verdicts were not all equal, or that some run did not
    state: the verdicts, sentences and figures of every run, so a reader sees what moved and why."""
    seen: dict[tuple[str, str], list] = {}
    for i, rows in enumerate(runs):
        for row in rows:
            for c in row.get("conclusions") or []:
                seen.setdefault((row["notebook"], c["key"]), [None] * len(runs))[i] = c
    changes = []
    for (notebook, key), stated in seen.items():
        verdicts = [c["verdict"] if c else None for c in stated]
        if len(set(verdicts)) > 1:
            changes.append({"notebook": notebook, "key": key, "verdicts": verdicts,
                            "texts": [c["text"] if c else None for c in stated],
                            "figures": [c.get("figures") if c else None for c in stated]})
    return changes


def headline_spread(runs: list[list[dict]]) -> dict[str, dict]:
    """Per notebook: its headline's name, unit and value in each run, with median, min and max."""
    import statistics

    out: dict[str, dict] = {}
    for rows in runs:
        for row in rows:
            h = row.get("headline") or {}
            value = h.get("value")
            if isinstance(value, (int, float)):
                entry = out.setdefault(row["notebook"], {"name": h.get("name"), "unit": h.get("unit"), "values": []})
                entry["values"].append(value)
    for entry in out.values():
        v = entry["values"]
        entry.update(median=statistics.median(v), low=min(v), high=max(v))
    return out

"""What spawn says when a rank fails: which rank caused it, how it died, what its peers hit.

The ranks leave their errors as files in the call's temp dir (`pipelab.worker`); a rank that died
without a Python error left only its exit code (and, for a crash in native code, the Python stack
faulthandler wrote). This module turns those into one `WorkerError` that names the cause.
"""

from __future__ import annotations

import os
import shutil
import signal

from pipelab.worker import EXIT_DISK_FULL, load_pickle, rank_path


class WorkerError(RuntimeError):
    """A worker rank failed: it raised, died without a Python error, or did not finish in time.
    Carries the rank, its traceback, and the errors its peers hit because of it."""

    def __init__(self, rank: int, message: str, traceback_text: str = ""):
        super().__init__(f"rank {rank} {message}")
        self.rank = rank
        self.traceback = traceback_text
        self.consequences: list[WorkerError] = []  # the other ranks' errors, caused by this one
        self.during_rendezvous = False  # failed while forming the process group, before fn ran

    def __str__(self) -> str:
        text = self.args[0]
        if self.traceback:
            text += f"\n\n--- traceback from rank {self.rank} ---\n{self.traceback.rstrip()}"
        if self.consequences:
            text += "\n\n--- then, because of it ---\n" + "\n".join(e.args[0] for e in self.consequences)
        return text


def failed(rank: int, code: int | None, workdir: str) -> bool:
    """Whether the rank failed: it wrote an error, or exited without a result."""
    if os.path.exists(rank_path(workdir, "error", rank)):
        return True
    return code is not None and not (code == 0 and os.path.exists(rank_path(workdir, "result", rank)))


def failure_error(codes: list[int | None], workdir: str) -> WorkerError:
    """One error naming the cause, the other ranks' errors listed as its consequences. A rank that
    died without a Python error (a crash in native code, a SIGKILL from the out-of-memory killer,
    os._exit) is the cause: its peers' errors ("Connection closed by peer") are only its echo.
    Otherwise the cause is the rank whose error was written first."""
    failures = [_rank_failure(rank, code, workdir) for rank, code in enumerate(codes)]
    (_, cause), *others = sorted(f for f in failures if f is not None)
    cause.consequences = [error for _, error in others]
    return cause


def _rank_failure(rank: int, code: int | None, workdir: str) -> tuple[tuple, WorkerError] | None:
    """How the rank failed, with a key that sorts the cause first; None if it did not fail."""
    path = rank_path(workdir, "error", rank)
    if os.path.exists(path):
        info = load_pickle(path)
        error = WorkerError(rank, f"raised {info['type']}: {info['message']}", info["traceback"])
        error.during_rendezvous = info.get("phase") == "rendezvous"
        return (1, os.stat(path).st_mtime_ns, rank), error
    if not failed(rank, code, workdir):
        return None
    if code == EXIT_DISK_FULL:
        return (0, 0, rank), WorkerError(rank, _disk_full(workdir))
    return (0, 0, rank), WorkerError(rank, _how_it_died(code), _crash_report(workdir, rank))


def _disk_full(workdir: str) -> str:
    folder = os.path.dirname(workdir)
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    return (f"could not write its result: the disk holding {folder} is full ({free / 2**20:.0f} MiB free). "
            "Results travel through files there: free space, or point TMPDIR at a larger disk "
            "(e.g. TMPDIR=$HOME/tmp) before starting Python")


def _crash_report(workdir: str, rank: int) -> str:
    """The Python stack faulthandler wrote when the rank crashed in native code, if it did."""
    try:
        with open(rank_path(workdir, "crash", rank)) as f:
            return f.read()
    except OSError:
        return ""


def _how_it_died(code: int) -> str:
    if code < 0:
        name = (signal.strsignal(-code) or "unknown signal").lower()
        why = ("the out-of-memory killer sends it, so does `kill -9`" if -code == signal.SIGKILL
               else "a crash in native code (a C/C++ extension, a bad pointer)")
        return f"was killed by signal {-code} ({name}) without a Python error: {why}"
    if code == 0:
        return "exited with code 0 without returning a result (os._exit(0) in the worker?)"
    return f"exited with code {code} without a Python error (os._exit? exit() in native code?)"

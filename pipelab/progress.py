"""A progress bar in the caller's process for work done in worker processes.

A worker's prints reach the caller line by line, tagged with its rank (`pipelab.launch`), so
tqdm's in-place updates (a carriage return, no newline) cannot travel that way. Instead one worker
appends to a small file (`ProgressFile`): a line per finished unit of work, and the lines it has to
say (a log line); a thread in the caller reads the new lines and moves the bar there.

In a notebook the bar and the lines said above it are one output, updated in place, so the
executed notebook keeps one output, not one per update; elsewhere (a terminal, a test) it is a
tqdm bar on stderr with the lines said printed above it.
"""

from __future__ import annotations

import contextvars
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

SAY = "> "  # a line that starts with this is shown above the bar; any other line is one finished unit
REFRESH_SECONDS = 1.0  # how often the bar is redrawn while the work goes on


class ProgressFile:
    """The worker's end: append one line per finished unit (`advance`, with a short note such as
    the batch's loss, shown beside the bar) or a line to show above the bar (`say`)."""

    def __init__(self, path: str):
        self.file = open(path, "a")  # noqa: SIM115 - open while the worker runs

    def advance(self, note: str = "") -> None:
        self._write(note)

    def say(self, line: str) -> None:
        self._write(SAY + line)

    def _write(self, line: str) -> None:
        self.file.write(line.replace("\n", " ") + "\n")
        self.file.flush()


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (whose outputs can be updated in place)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class _NotebookBar:
    """The lines said and tqdm's bar line, as one display output updated in place."""

    def __init__(self, total: int, desc: str, note_name: str):
        from IPython.display import display

        self.total, self.desc, self.note_name = total, desc, note_name
        self.done, self.note, self.said = 0, "", []
        self.start = time.perf_counter()
        self.handle = display({"text/plain": self.text()}, raw=True, display_id=True)

    def text(self) -> str:
        from tqdm import tqdm

        postfix = f"{self.note_name}={self.note}" if self.note else None
        bar = tqdm.format_meter(self.done, self.total, time.perf_counter() - self.start, prefix=self.desc,
                                unit="batch", postfix=postfix)
        return "\n".join([*self.said, bar])

    def update(self, units: int, note: str | None, said: list[str]) -> None:
        self.done += units
        self.note = note if note is not None else self.note
        self.said += said

    def show(self) -> None:
        self.handle.update({"text/plain": self.text()}, raw=True)

    def close(self) -> None:
        self.show()


class _TerminalBar:
    """A tqdm bar on stderr; the lines said go to stdout above it."""

    def __init__(self, total: int, desc: str, note_name: str):
        from tqdm import tqdm

        self.note_name = note_name
        self.bar = tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, mininterval=REFRESH_SECONDS)

    def update(self, units: int, note: str | None, said: list[str]) -> None:
        for line in said:
            self.bar.write(line, file=sys.stdout)
        if note is not None:
            self.bar.set_postfix({self.note_name: note}, refresh=False)
        self.bar.update(units)

    def show(self) -> None:
        pass  # tqdm redraws by itself, at most every REFRESH_SECONDS

    def close(self) -> None:
        self.bar.close()


@contextmanager
def progress_bar(total: int, desc: str, note_name: str = "loss"):
    """A bar of `total` units in this process, fed through a file: yields the file's path for a
    worker to open with `ProgressFile`. A thread here reads the new lines every 0.2 s and moves
    the bar, once more after the block."""
    folder = tempfile.mkdtemp(prefix="pipelab-progress-")
    path = os.path.join(folder, "progress.txt")
    open(path, "w").close()
    done = threading.Event()
    bar = (_NotebookBar if in_notebook() else _TerminalBar)(total, desc, note_name)

    def follow():
        pending, shown = "", time.perf_counter()
        with open(path) as f:
            while True:
                finished = done.is_set()  # read once more after the run has ended
                *lines, pending = (pending + f.read()).split("\n")
                units = [line for line in lines if not line.startswith(SAY)]
                bar.update(len(units), units[-1] if units else None,
                           [line[len(SAY):] for line in lines if line.startswith(SAY)])
                if finished:
                    bar.close()
                    return
                if time.perf_counter() - shown >= REFRESH_SECONDS:
                    bar.show()
                    shown = time.perf_counter()
                done.wait(0.2)

    # The thread's outputs belong to the cell that started it.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(follow,), daemon=True)
    thread.start()
    try:
        yield path
    finally:
        done.set()
        thread.join()
        shutil.rmtree(folder, ignore_errors=True)

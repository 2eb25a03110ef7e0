"""A progress bar in the caller's process for work done in worker processes.

A worker's prints reach the caller line by line, tagged with its rank (`pipelab.launch`), so
tqdm's in-place updates (a carriage return, no newline) cannot travel that way. Instead one worker
appends a line per finished unit of work to a small file, and a thread in the caller reads the new
lines and advances a tqdm bar there.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager


@contextmanager
def progress_bar(total: int, desc: str):
    """A tqdm bar of `total` units in this process, fed through a file: yields the file's path for a
    worker to append one line per finished unit (e.g. the batch's loss, shown beside the bar); a
    thread here reads the new lines every 0.2 s and advances the bar, once more after the block."""
    from tqdm import tqdm

    folder = tempfile.mkdtemp(prefix="pipelab-progress-")
    path = os.path.join(folder, "batches.txt")
    open(path, "w").close()
    done = threading.Event()

    def follow():
        pending = ""
        with open(path) as f, tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, mininterval=1.0) as bar:
            while True:
                finished = done.is_set()  # read once more after the run has ended
                *lines, pending = (pending + f.read()).split("\n")
                if lines:
                    bar.set_postfix(loss=lines[-1], refresh=False)
                    bar.update(len(lines))
                if finished:
                    return
                done.wait(0.2)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        done.set()
        thread.join()
        shutil.rmtree(folder, ignore_errors=True)

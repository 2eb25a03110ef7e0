"""Running a job that may hang, and saying how it ended: the way lesson 17 plants its bugs.

A planted hang runs under a small process-group timeout (`short_timeout`, per operation): the
waiting rank raises when it expires, spawn stops every rank and leaves no process behind, so a hang
costs seconds. `attempt` reports how the run ended, after how many seconds of wall clock (start-up
of the ranks included).
"""

from __future__ import annotations

import datetime
import os
import time
import warnings
from dataclasses import dataclass

import torch.distributed as dist

from pipelab.launch import WorkerError, spawn


@dataclass(frozen=True)
class Outcome:
    """How one run ended: `ended` ('finished', 'raised', 'timed out'), after `seconds` measured, and
    the first line(s) of what it said."""

    name: str
    ended: str
    seconds: float
    message: str


def short_timeout(seconds: float) -> None:
    """Give this rank's process group a timeout of `seconds` for each operation (as
    `init_process_group(timeout=...)` does for a whole job): a planted hang then ends in seconds
    once the ranks run, however long they took to start."""
    with warnings.catch_warnings():  # torch warns "only supported for either nccl or gloo" on gloo too
        warnings.simplefilter("ignore", UserWarning)
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def attempt(name: str, fn, world_size: int, *args, timeout: float = 120.0, env: dict[str, str] | None = None,
            **spawn_kwargs) -> Outcome:
    """Run `fn` on `world_size` ranks (with the environment variables `env`) and say how it ended,
    after how many seconds. A planted hang ends at the process group's timeout (`short_timeout`);
    spawn's `timeout` is the last resort."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    start = time.perf_counter()
    try:
        spawn(fn, world_size, *args, timeout=timeout, **spawn_kwargs)
        ended, message = "finished", ""
    except WorkerError as e:
        timed_out = any(s in e.args[0] for s in ("did not finish within timeout", "code 3 ", "Timed out"))
        ended, message = "timed out" if timed_out else "raised", first_lines(e)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return Outcome(name, ended, time.perf_counter() - start, message)


def first_lines(e: WorkerError) -> str:
    """The cause's first line, and its first consequence's."""
    lines = [e.args[0].splitlines()[0][:300]]
    lines += [c.args[0].splitlines()[0][:300] for c in e.consequences[:1]]
    return "\n".join(lines)

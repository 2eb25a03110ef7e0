"""What the tests that start ranks share: the processes a test's spawn() calls left alive."""

from __future__ import annotations

import os


def live_processes(parent_pid: int) -> list[int]:
    """PIDs of live processes of the spawn() calls made by `parent_pid`: its workers and the
    processes they started, which inherit the workers' environment (PIPELAB_PARENT_PID)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if not zombie and env.get(b"PIPELAB_PARENT_PID") == str(parent_pid).encode():
            found.append(int(pid))
    return found

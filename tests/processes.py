"""Which processes a test's spawn() calls left running (Linux /proc)."""

import os


def live_processes(parent_pid: int) -> list[int]:
    """PIDs of live processes of the spawn() calls made by `parent_pid`: its workers and the
    processes they started, which inherit the workers' environment. The caller's worker server
    (pipelab.worker_server, its child while the caller lives) is the caller's, not a call's."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                server = b"pipelab.worker_server" in f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if server and int(ppid) == parent_pid:
            continue
        if state != "Z" and env.get(b"PIPELAB_PARENT_PID") == str(parent_pid).encode():
            found.append(int(pid))
    return found

"""A process with torch and pipelab imported once, that forks `spawn`'s ranks from itself.

A rank started as a fresh Python process first pays its imports: torch alone costs about 3 s of
CPU on a small machine, more than most of a lesson's runs, and a course makes thousands of them.
So on Linux without CUDA GPUs, `spawn` starts one server per caller (a notebook kernel, a test
run) the first time it runs ranks; the server imports once and forks each rank in milliseconds.
Forking the caller itself would copy a notebook kernel's threads half-way; the server is a fresh
process that starts no threads, so its forks are clean. (On a CUDA machine every rank stays a
fresh process: a fork must never inherit an initialised CUDA context, and fresh processes are
what the course has run on GPUs.)

A rank forked here behaves as one started with Popen: its own session (process group), its
output on a pipe the caller reads, the environment and working folder the caller gives it, its
exit code kept (unreaped) until the caller has ended its process group. The server ends when its
caller does (its socket closes), and its ranks then end themselves (`worker._watch_caller`).
PIPELAB_FRESH_WORKERS=1 turns it off: every rank a fresh process.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import signal
import socket
import subprocess
import sys
import threading
import time

_BUFSIZE = 1 << 20  # one message: a rank's environment and sys.path fit easily
# What every rank needs, imported once here; the lessons' plots and notebook helpers are not.
_PRELOAD = ("torch", "torch.distributed", "torch.nn.functional", "cloudpickle", "pipelab.launch")
_SKIP = ("pipelab.cli", "pipelab.batch", "pipelab.widgets", "pipelab.display", "pipelab.plots")


# ---------------------------------------------------------------------------------------------
# The server's side
# ---------------------------------------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """Answer the caller's requests until it goes: start a rank, say how one exited, reap one."""
    while True:
        data, fds, _, _ = socket.recv_fds(sock, _BUFSIZE, 1)
        if not data:  # the caller is gone: its ranks see this process go and end themselves
            os._exit(0)
        request = json.loads(data)
        if request["do"] == "start":
            pid = os.fork()
            if pid == 0:
                sock.close()
                _become_rank(request, fds[0])
            os.close(fds[0])
            reply = {"pid": pid}
        elif request["do"] == "status":
            reply = {"code": _exit_status(request["pid"])}
        else:  # "reap": the caller has ended the rank's process group
            _reap(request["pid"])
            reply = {}
        sock.send(json.dumps(reply).encode())


def _become_rank(request: dict, output_fd: int) -> None:
    """In the forked child: take the rank's session, output, folder, environment and path, then
    run it as a fresh spawned process would. Never returns."""
    code = 1
    try:
        os.setsid()  # its own process group, which the caller ends with everything the rank started
        for fd in (1, 2):
            os.dup2(output_fd, fd)
        os.close(output_fd)
        sys.stdout = _unbuffered(1)
        sys.stderr = _unbuffered(2)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["PIPELAB_WATCH_PID"] = str(os.getppid())  # this server: it goes when the caller does
        sys.path[:] = request["path"]
        importlib.invalidate_caches()  # modules the caller wrote since the server started
        from pipelab.worker import run_spawned

        run_spawned(request["workdir"])  # ends the process itself
    except BaseException:  # noqa: BLE001 - a rank that cannot start says why on its output
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _unbuffered(fd: int):
    import io

    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors="backslashreplace", line_buffering=True, write_through=True)


def _exit_status(pid: int) -> int | None:
    """The rank's exit code (negative: its signal), or None while it runs; it stays unreaped."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _preload() -> None:
    for name in _PRELOAD:
        importlib.import_module(name)
    _import_below("pipelab")


def _import_below(package: str) -> None:
    """Import every module of `package` and its subpackages, but those in _SKIP."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
        if module.name.startswith(_SKIP):
            continue
        try:
            importlib.import_module(module.name)
        except Exception:  # noqa: BLE001 - a rank that needs it imports it and meets the error
            continue
        if module.ispkg:
            _import_below(module.name)


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's Ctrl-C is the caller's
    _preload()
    import torch

    ready = not torch.cuda.is_initialized()  # a fork must never inherit a CUDA context
    sock.send(json.dumps({"ready": ready}).encode())
    if ready:
        serve(sock)


# ---------------------------------------------------------------------------------------------
# The caller's side
# ---------------------------------------------------------------------------------------------


class ForkedRank:
    """A rank the server forked, with the part of Popen's interface spawn uses (`pid`, `stdout`,
    `returncode`, `poll`, `wait`, `kill`, `send_signal`), so spawn treats it as any rank it started.
    The rank is the server's child, not ours: the server reports and reaps it."""

    def __init__(self, server: "Server", pid: int, stdout):
        self.server, self.pid, self.stdout = server, pid, stdout
        self.args, self.returncode = ["pipelab rank", pid], None

    def poll(self) -> int | None:
        """How it exited (None while it runs), without reaping it: its pid names its process group
        until the caller has ended the group (`wait` reaps, as Popen's does)."""
        if self.returncode is None:
            return self.server.request({"do": "status", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to exit, then have the server reap it; `subprocess.TimeoutExpired` as Popen's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            code = self.poll()
            if code is not None:
                self.server.request({"do": "reap", "pid": self.pid})
                self.returncode = code
            elif deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            else:
                time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """The caller's handle on its server: start it, ask it for ranks, notice when pipelab's files
    changed (a server holding old code is replaced)."""

    def __init__(self):
        import pipelab

        self.stamp = _source_stamp(pipelab.__path__[0])
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PIPELAB_PARENT_PID": str(os.getpid()),
               "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from pipelab.worker_server import main; main({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.sock, self.lock = ours, threading.Lock()
        self.ready = self._receive().get("ready", False)

    def _receive(self) -> dict:
        data = self.sock.recv(_BUFSIZE)
        if not data:
            raise ConnectionError("pipelab's worker server ended")
        return json.loads(data)

    def request(self, message: dict, fds: tuple[int, ...] = ()) -> dict:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(message).encode()], list(fds))
            return self._receive()

    def start(self, workdir: str, env: dict[str, str]) -> ForkedRank:
        """A rank forked with `env` (as Popen's env=), run on `workdir`'s payload."""
        path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        path += [p for p in sys.path if p and p not in path]
        read_end, write_end = os.pipe()
        try:
            pid = self.request({"do": "start", "workdir": workdir, "env": env, "cwd": os.getcwd(),
                                "path": path}, (write_end,))["pid"]
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return ForkedRank(self, pid, os.fdopen(read_end, "rb", buffering=0))

    def alive(self) -> bool:
        import pipelab

        return self.proc.poll() is None and self.stamp == _source_stamp(pipelab.__path__[0])

    def close(self) -> None:
        self.sock.close()  # the server reads the end of its socket and exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _source_stamp(folder: str) -> float:
    """The newest modification time of pipelab's Python files."""
    newest = 0.0
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".py"):
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
    return newest


_server: Server | None = None
_server_lock = threading.Lock()
_cannot_serve = False  # a server found a CUDA context after its imports: fresh processes from then on


def _close_server() -> None:
    if _server is not None:
        _server.close()


def usable() -> bool:
    """Whether ranks may be forked from a server here: Linux, no CUDA GPU, not turned off."""
    if os.environ.get("PIPELAB_FRESH_WORKERS") == "1" or not sys.platform.startswith("linux"):
        return False
    from pipelab import hardware

    return hardware.gpu_count() == 0


def server() -> Server | None:
    """This caller's server, started (again, after pipelab's files changed) when needed; None
    where it cannot serve (it found a CUDA context after its imports)."""
    global _server, _cannot_serve
    with _server_lock:
        if _cannot_serve:
            return None
        if _server is not None and not _server.alive():
            _server.close()
            _server = None
        if _server is None:
            import atexit

            _server = Server()
            atexit.register(_close_server)
            if not _server.ready:
                _cannot_serve = True
                _server.close()
                _server = None
        return _server


def server_pid() -> int | None:
    """The pid of this caller's server, if one runs (tests tell it apart from ranks)."""
    return _server.proc.pid if _server is not None and _server.proc.poll() is None else None

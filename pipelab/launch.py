"""Start real worker processes, each with a `torch.distributed` process group.

`spawn(fn, world_size)` is what every multi-process lesson calls. It starts `world_size` fresh
Python processes (not forks: a Jupyter kernel has threads and maybe CUDA state, which a fork would
copy half-way), hands each one `fn` and its arguments pickled with cloudpickle (so a function
written in a notebook cell travels by value), and collects what each rank returns. This file is the
caller's side: start, wait, blame the right rank, leave nothing behind. What runs inside each rank
is in `pipelab.worker`.

The same worker runs under torchrun, which is how you go multi-node (`python -m
torch.distributed.run` is torchrun, started by this interpreter):

    python -m torch.distributed.run --nproc-per-node 2 -m pipelab.launch mypackage.mymodule:my_worker

`pipelab.nodes.torchrun_nodes` starts one torchrun per "node" on this machine, as a cluster does on
its nodes (lesson 05, section 6).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Callable

from pipelab import hardware, worker_server
from pipelab.checks import positive_number, whole_number
from pipelab.emulate import environment, finished, install_from_environment
from pipelab.rank_failures import WorkerError, failed, failure_error
from pipelab.worker import RankContext, hello, init_worker  # noqa: F401 - importable from here
from pipelab.worker import ON_FINISH, ON_START, load_pickle, rank_path, run_spawned, run_under_torchrun

# A rank's process: a fresh Python process, or one forked by the worker server.
RankProcess = subprocess.Popen | worker_server.ForkedRank

# Every rank started here installs what its environment asks for (an emulated node, NCCL's rule).
if install_from_environment not in ON_START:  # once, whether imported or run as __main__
    ON_START.append(install_from_environment)
    ON_FINISH.append(finished)

_POLL_SECONDS = 0.01
_GRACE_SECONDS = 2.0  # after a rank fails, the most we wait for its peers to exit with their errors
_RENDEZVOUS_ATTEMPTS = 3  # tries to form the process group, each on a newly picked port


def spawn(fn: Callable, world_size: int, *args, backend: str = "auto", timeout: float = 120.0,
          emulate=None, nccl_rule: bool = False, **kwargs) -> list:
    """Run `fn(ctx, *args, **kwargs)` on `world_size` new processes; return their results by rank.

    `emulate="4xH100-nvlink"` (a node name or `emulate.specs.Node`) runs the ranks on an emulated
    node: real math and real gloo messages, each rank's time a logical clock moved by the device and
    link models, its communication under NCCL's ordering rule (`pipelab.emulate`). `nccl_rule=True`
    puts the communication under NCCL's rule alone, on the machine's own clock: a program that
    would deadlock on GPUs then fails within seconds, naming the ranks and what each waits on.

    If a rank fails, every rank is stopped and one `WorkerError` names the cause (the rank that
    raised first, or one that died without a Python error) and lists its peers' errors as
    consequences. A run longer than `timeout` seconds (a finite number) is stopped the same way.
    Nothing of the call outlives it: not the ranks, not processes they started, not its temp files,
    also when it is interrupted (Ctrl-C / the notebook's stop button) or its caller is killed.
    """
    backend = _check_arguments(world_size, "gloo" if emulate is not None and backend == "auto" else backend, timeout)
    extra_env = _emulation_environment(emulate, nccl_rule, world_size, backend)
    payload = _pickle_payload(fn, args, kwargs)
    with _ctrl_c_held() as ctrl_c:
        for attempt in range(_RENDEZVOUS_ATTEMPTS):
            try:
                return _run_once(payload, world_size, backend, timeout, ctrl_c, extra_env)
            except WorkerError as e:
                # The free port we picked can be taken by another program before rank 0 binds it;
                # nothing of `fn` has run yet, so starting again on a new port is safe.
                if not e.during_rendezvous or attempt == _RENDEZVOUS_ATTEMPTS - 1:
                    raise
                ctrl_c.check()


def _emulation_environment(emulate, nccl_rule: bool, world_size: int, backend: str) -> dict[str, str]:
    """What tells the ranks to emulate a node or obey NCCL's rule, checked before any process starts."""

    if emulate is not None and backend != "gloo":
        raise ValueError(f"emulate={emulate!r} runs the ranks on gloo (real CPU tensors, modelled time), "
                         f"not on backend={backend!r}; leave backend='auto' or pass backend='gloo'")
    if not isinstance(nccl_rule, bool):
        raise ValueError(f"nccl_rule must be True or False, got {nccl_rule!r}")
    return environment(emulate, nccl_rule, world_size)


def _run_once(payload: bytes, world_size: int, backend: str, timeout: float, ctrl_c,
              extra_env: dict[str, str] | None = None) -> list:
    """Start the ranks on a fresh port, wait for them, collect their results. Whatever happens,
    every rank's process group ends and the temp dir goes before this returns or raises."""
    workdir = tempfile.mkdtemp(prefix="pipelab-spawn-")
    procs: list[RankProcess] = []
    pumps: list[_Pump] = []
    try:
        _write_payload(payload, workdir, world_size)
        port = _free_port()
        # One server for the whole call: a server replaced between two ranks (pipelab's files
        # changed) would leave the first rank's handle talking to a closed socket.
        server = worker_server.server() if worker_server.usable() else None
        for rank in range(world_size):
            ctrl_c.check()  # Ctrl-C while starting: stop here, the finally ends those started
            procs.append(_start_worker(rank, world_size, backend, port, timeout, workdir, extra_env, server))
            pumps.append(_pump_output(procs[-1], rank))
        _wait_for_workers(procs, workdir, timeout, ctrl_c)
        return [load_pickle(rank_path(workdir, "result", rank)) for rank in range(world_size)]
    finally:
        _end_all(procs, pumps)
        shutil.rmtree(workdir, ignore_errors=True)


class _CtrlC:
    """Whether Ctrl-C was pressed; `check()` raises KeyboardInterrupt where spawn can handle it."""

    pressed = False

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


@contextmanager
def _ctrl_c_held():
    """Turn Ctrl-C into a flag for the duration of a call. A KeyboardInterrupt raised at any line
    (inside Popen, or a second one inside the cleanup) could leave processes or files behind; one
    raised where `check()` is called cannot. Only the main thread gets SIGINT, and only a handler
    that raises KeyboardInterrupt is replaced (a caller that ignores Ctrl-C keeps ignoring it)."""
    ctrl_c = _CtrlC()
    take_over = (threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if take_over:
        signal.signal(signal.SIGINT, lambda signum, frame: setattr(ctrl_c, "pressed", True))
    try:
        yield ctrl_c
    finally:
        if take_over:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c.check()  # pressed while the results were read: the call still ends as interrupted


def _check_arguments(world_size, backend: str, timeout) -> str:
    """Refuse bad input before any process starts; return the backend to use."""
    problem = hardware.platform_problem()
    if problem:
        raise RuntimeError(problem)
    whole_number("world_size", world_size, example="world_size=2")
    if isinstance(timeout, float) and math.isinf(timeout):
        raise ValueError("timeout must be a finite number of seconds, got inf: spawn has no "
                         "'no timeout' (the process group needs one); pass a large one, e.g. timeout=24*3600")
    positive_number("timeout", timeout, example="timeout=120")
    return hardware.choose_backend(world_size, backend)


def _pickle_payload(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    import cloudpickle

    if not callable(fn):
        raise ValueError(f"fn must be a function taking (ctx, ...), got {fn!r}")
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001 - any pickling failure is the user's to fix
        raise ValueError(
            f"cannot send {getattr(fn, '__name__', fn)!r} or its arguments to the workers: {e}. "
            "Pass only picklable values (tensors, numbers, modules' state dicts), not open files, "
            "locks, generators or live process groups; build those inside the worker."
        ) from e


def _write_payload(payload: bytes, workdir: str, world_size: int) -> None:
    """One name per rank for the same bytes (hard links): each rank deletes its name as soon as it
    has opened it, so the pickled model and data leave the disk once every rank has them."""
    first = rank_path(workdir, "payload", 0)
    with open(first, "wb") as f:
        f.write(payload)
    for rank in range(1, world_size):
        try:
            os.link(first, rank_path(workdir, "payload", rank))
        except OSError:  # a file system without hard links: a copy does the same
            shutil.copyfile(first, rank_path(workdir, "payload", rank))


def _free_port() -> int:
    """A TCP port nobody listens on right now, for the rendezvous of this call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_worker(rank: int, world_size: int, backend: str, port: int, timeout: float,
                  workdir: str, extra_env: dict[str, str] | None = None,
                  server: worker_server.Server | None = None) -> RankProcess:
    # A caller's PIPELAB_NCCL_RULE=1 puts every spawn under NCCL's rule (e.g. a whole test run);
    # a node to emulate comes only from the call, checked there.
    env = {k: v for k, v in os.environ.items() if k != "PIPELAB_EMULATE"}
    env.update(extra_env or {})
    env.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "PIPELAB_BACKEND": backend, "PIPELAB_TIMEOUT": str(timeout),
        "PIPELAB_PARENT_PID": str(os.getpid()),
        # The worker imports what the caller could import (e.g. a test module, a local package).
        "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p),
        "PYTHONUNBUFFERED": "1",
    })
    if backend == "gloo":
        env["OMP_NUM_THREADS"] = "1"  # one intra-op thread per rank, so ranks don't fight over cores
        loopback = hardware.loopback_interface()
        if loopback and "GLOO_SOCKET_IFNAME" not in env:
            env["GLOO_SOCKET_IFNAME"] = loopback  # every rank is on this machine: talk over loopback
    if server is not None:  # forked from a process that has torch imported: no 3 s of imports
        return server.start(workdir, env)
    return subprocess.Popen(
        [sys.executable, "-m", "pipelab.launch", "--spawned-worker", workdir],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, so we can end it and anything it started
    )


_PRINT_LOCK = threading.Lock()  # one rank's line is printed whole, never inside another's


class _Pump:
    """Copies a worker's prints to ours, line by line, tagged with its rank. It stops when told to,
    not when the pipe closes: a helper process that left the rank's process group (setsid) may hold
    the pipe open for ever, and must neither delay spawn's return nor print into the caller later."""

    def __init__(self, proc: RankProcess, rank: int):
        self.proc, self.rank = proc, rank
        self.stop = threading.Event()
        self.partial = b""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import select

        fd = self.proc.stdout.fileno()
        try:
            while True:
                readable, _, _ = select.select([fd], [], [], 0.05)
                if readable:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break  # every writer closed the pipe
                    self._write(chunk)
                elif self.stop.is_set():
                    break  # the rank is gone and nothing is left to read
        finally:
            self._write(b"", end=True)
            self.proc.stdout.close()

    def _write(self, chunk: bytes, end: bool = False) -> None:
        """Print the complete lines; keep an unfinished one until its end comes (or the pump ends)."""
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        if end and self.partial:
            lines, self.partial = [*lines, self.partial], b""
        if lines:
            text = "".join(f"[rank {self.rank}] {line.decode(errors='replace')}\n" for line in lines)
            with _PRINT_LOCK:
                sys.stdout.write(text)
                sys.stdout.flush()


def _pump_output(proc: RankProcess, rank: int) -> _Pump:
    return _Pump(proc, rank)


def _wait_for_workers(procs: list[RankProcess], workdir: str, timeout: float, ctrl_c) -> None:
    """Block until every rank exits cleanly; raise one WorkerError on a failure or a timeout."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [_exit_code(p) for p in procs]
        if any(failed(rank, code, workdir) for rank, code in enumerate(codes)):
            _wait_for_all_exits(procs, _GRACE_SECONDS, ctrl_c)  # the peers' own errors, if any
            raise failure_error([_exit_code(p) for p in procs], workdir)
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, code in enumerate(codes) if code is None]
            # A rank that saved its result only waits for its peers to leave: blame the others.
            pending = [r for r in running if not os.path.exists(rank_path(workdir, "result", r))] or running
            raise WorkerError(
                pending[0],
                f"did not finish within timeout={timeout}s (ranks still running: {pending}); "
                "it may be waiting for a peer that never sends, or the step is slower than the "
                "timeout: check your sends/receives, or pass a larger timeout",
            )
        time.sleep(_POLL_SECONDS)
        ctrl_c.check()


def _wait_for_all_exits(procs: list[RankProcess], seconds: float, ctrl_c) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(_exit_code(p) is None for p in procs):
        time.sleep(_POLL_SECONDS)
        ctrl_c.check()


def _exit_code(proc: RankProcess) -> int | None:
    """The rank's exit code (negative: the signal that killed it), or None while it runs. Where the
    OS allows, the exited rank is not reaped yet: its pid, which names its process group, stays
    ours until `_end_all` has ended the group, so that can never hit a stranger's processes."""
    if proc.returncode is not None or not hasattr(os, "waitid"):
        return proc.poll()
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _end_all(procs: list[RankProcess], pumps: list[_Pump]) -> None:
    """End every rank's whole process group (the rank and any helper process it started), reap the
    ranks, then let the output threads finish: their pipes close once those processes are gone."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # pid = process group id: started in a new session
        except (ProcessLookupError, PermissionError):
            # The group is empty already, or not formed yet: a rank the worker server forked an
            # instant ago may not have called setsid. It is still ours (unreaped): kill it by pid.
            p.kill()
    for p in procs:
        _reap(p)
    for pump in pumps:  # the ranks are gone: print what they left in the pipes, then stop
        pump.stop.set()
    deadline = time.monotonic() + 5
    for pump in pumps:
        pump.thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _reap(proc: RankProcess) -> None:
    """Wait for a rank whose group was killed (a fresh `Popen` or a `worker_server.ForkedRank`)."""
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelab.launch",
                                     description="Run a pipelab worker function under torchrun.")
    parser.add_argument("target", nargs="?", help="MODULE:FUNCTION taking a RankContext")
    parser.add_argument("--spawned-worker", metavar="DIR", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.spawned_worker:
        run_spawned(ns.spawned_worker)
    elif ns.target:
        run_under_torchrun(ns.target)
    else:
        parser.error("give MODULE:FUNCTION, e.g. torchrun --nproc-per-node 2 -m pipelab.launch pipelab.launch:hello")


if __name__ == "__main__":
    main()

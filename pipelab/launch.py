"""Start real worker processes, each with a `torch.distributed` process group.

`spawn(fn, world_size)` is what every multi-process lesson calls. It starts `world_size` fresh
Python processes (not forks: a Jupyter kernel has threads and maybe CUDA state, which a fork would
copy half-way), hands each one `fn` and its arguments pickled with cloudpickle (so a function
written in a notebook cell travels by value), and collects what each rank returns.

The same worker runs under torchrun, which is how you go multi-node:

    torchrun --nproc-per-node 2 -m pipelab.launch mypackage.mymodule:my_worker
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from pipelab import hardware
from pipelab.timeline import Recorder, Timeline

_POLL_SECONDS = 0.01
_GRACE_SECONDS = 0.5  # after a rank fails, how long to wait for its peers' own errors
_RENDEZVOUS_ATTEMPTS = 3  # tries to form the process group, each on a newly picked port


class WorkerError(RuntimeError):
    """A worker rank raised, or did not finish in time. Carries the rank and its traceback."""

    def __init__(self, rank: int, message: str, traceback_text: str = ""):
        self.rank = rank
        self.traceback = traceback_text
        self.during_rendezvous = False  # failed while forming the process group, before fn ran
        text = f"rank {rank} {message}"
        if traceback_text:
            text += f"\n\n--- traceback from rank {rank} ---\n{traceback_text.rstrip()}"
        super().__init__(text)


@dataclass
class WorkerContext:
    """What a worker function gets as its first argument."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: Any  # torch.device
    rec: Recorder = field(repr=False)

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        import torch.distributed as dist

        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def timeline(self) -> Timeline:
        """The spans this rank recorded so far."""
        return self.rec.timeline()


# ---------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------

def spawn(fn: Callable, world_size: int, *args, backend: str = "auto", timeout: float = 120.0,
          **kwargs) -> list:
    """Run `fn(ctx, *args, **kwargs)` on `world_size` new processes; return their results by rank.

    If a rank raises, every rank is stopped and one `WorkerError` names the failing rank and
    carries its traceback. A run longer than `timeout` seconds is stopped the same way. No worker
    process outlives this call, also when it is interrupted (Ctrl-C / the notebook's stop button).
    """
    backend = _check_arguments(world_size, backend, timeout)
    payload = _pickle_payload(fn, args, kwargs)
    for attempt in range(_RENDEZVOUS_ATTEMPTS):
        try:
            return _run_once(payload, world_size, backend, timeout)
        except WorkerError as e:
            # The free port we picked can be taken by another program before rank 0 binds it;
            # nothing of `fn` has run yet, so starting again on a new port is safe.
            if not e.during_rendezvous or attempt == _RENDEZVOUS_ATTEMPTS - 1:
                raise


def _run_once(payload: bytes, world_size: int, backend: str, timeout: float) -> list:
    """Start the ranks on a fresh port, wait for them, collect their results; stop them all."""
    workdir = tempfile.mkdtemp(prefix="pipelab-spawn-")
    procs: list[subprocess.Popen] = []
    try:
        with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
            f.write(payload)
        port = _free_port()
        procs = [_start_worker(rank, world_size, backend, port, timeout, workdir) for rank in range(world_size)]
        pumps = [_pump_output(p, rank) for rank, p in enumerate(procs)]
        _wait_for_workers(procs, workdir, timeout)
        for t in pumps:
            t.join(timeout=5)
        return [_load(os.path.join(workdir, f"result-{rank}.pkl")) for rank in range(world_size)]
    finally:
        _stop_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


def _check_arguments(world_size, backend: str, timeout) -> str:
    """Refuse bad input before any process starts; return the backend to use."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}; "
                         "pass e.g. world_size=2")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}; pass e.g. timeout=120")
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


def _free_port() -> int:
    """A TCP port nobody listens on right now, for the rendezvous of this call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_worker(rank: int, world_size: int, backend: str, port: int, timeout: float,
                  workdir: str) -> subprocess.Popen:
    env = dict(os.environ)
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
    return subprocess.Popen(
        [sys.executable, "-m", "pipelab.launch", "--spawned-worker", workdir],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, so we can stop it and anything it started
    )


def _pump_output(proc: subprocess.Popen, rank: int) -> threading.Thread:
    """Copy a worker's prints to ours, line by line, tagged with its rank."""

    def pump():
        for raw in iter(proc.stdout.readline, b""):
            sys.stdout.write(f"[rank {rank}] {raw.decode(errors='replace')}")
            sys.stdout.flush()
        proc.stdout.close()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def _wait_for_workers(procs: list[subprocess.Popen], workdir: str, timeout: float) -> None:
    """Block until every rank exits cleanly; raise WorkerError for the first failure or a timeout."""
    deadline = time.monotonic() + timeout
    while True:
        failed = _first_failure(procs, workdir)
        if failed is not None:
            time.sleep(_GRACE_SECONDS)  # let the others write their errors, to find the earliest
            raise _failure_error(_first_failure(procs, workdir), procs, workdir)
        if all(p.poll() == 0 for p in procs):
            return
        if time.monotonic() > deadline:
            pending = [r for r, p in enumerate(procs) if p.poll() is None]
            raise WorkerError(
                pending[0],
                f"did not finish within timeout={timeout}s (ranks still running: {pending}); "
                "it may be waiting for a peer that never sends, or the step is slower than the "
                "timeout: check your sends/receives, or pass a larger timeout",
            )
        time.sleep(_POLL_SECONDS)


def _first_failure(procs: list[subprocess.Popen], workdir: str) -> int | None:
    """The rank that failed first: the earliest error file, else any rank that died without one."""
    errors = []
    for rank in range(len(procs)):
        path = os.path.join(workdir, f"error-{rank}.pkl")
        if os.path.exists(path):
            errors.append((os.stat(path).st_mtime_ns, rank))
    if errors:
        return min(errors)[1]
    for rank, p in enumerate(procs):
        code = p.poll()
        if code not in (None, 0):
            return rank
    return None


def _failure_error(rank: int, procs: list[subprocess.Popen], workdir: str) -> WorkerError:
    path = os.path.join(workdir, f"error-{rank}.pkl")
    if os.path.exists(path):
        info = _load(path)
        error = WorkerError(rank, f"raised {info['type']}: {info['message']}", info["traceback"])
        error.during_rendezvous = info.get("phase") == "rendezvous"
        return error
    code = procs[rank].poll()
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return WorkerError(rank, f"{how} without a Python error (out of memory? a crash in native code?)")


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """Kill every worker's process group and reap it, so nothing outlives spawn()."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
        if p.stdout and not p.stdout.closed:
            try:
                p.stdout.close()
            except Exception:  # noqa: BLE001 - the pump thread may be closing it too
                pass


def _load(path: str):
    import cloudpickle  # noqa: F401 - registers what cloudpickled objects need

    with open(path, "rb") as f:
        return pickle.load(f)


def _dump_atomic(obj, path: str) -> None:
    """Write a pickle so the parent never reads half a file: write aside, then rename."""
    import cloudpickle

    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# The worker side
# ---------------------------------------------------------------------------------------------

def init_worker(backend: str | None = None, timeout: float = 1800.0) -> WorkerContext:
    """Join the process group described by the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    as set by spawn() or torchrun) and return this rank's context."""
    import torch
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend is None:
        backend = os.environ.get("PIPELAB_BACKEND") or hardware.choose_backend(
            int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), "auto")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)
    return WorkerContext(rank, world_size, local_rank, backend, device, Recorder(rank, device))


def _watch_parent(parent_pid: int) -> None:
    """Exit if the process that spawned us goes away (e.g. the notebook kernel was killed)."""

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def _spawned_worker_main(workdir: str) -> None:
    """Entry point of a process started by spawn()."""
    rank = int(os.environ["RANK"])
    _watch_parent(int(os.environ["PIPELAB_PARENT_PID"]))
    phase = "load"
    try:
        fn, args, kwargs = _load(os.path.join(workdir, "payload.pkl"))
        phase = "rendezvous"
        ctx = init_worker(os.environ["PIPELAB_BACKEND"], float(os.environ["PIPELAB_TIMEOUT"]))
        phase = "run"
        result = fn(ctx, *args, **kwargs)
        _dump_atomic(result, os.path.join(workdir, f"result-{rank}.pkl"))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        _dump_atomic({"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc(),
                      "phase": phase}, os.path.join(workdir, f"error-{rank}.pkl"))
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    # Skip the process group's teardown: peers may already be gone, and the result is saved.
    os._exit(0)


def _torchrun_main(target: str) -> None:
    """Run `module:function` as a worker under torchrun, printing each rank's result."""
    module_name, _, fn_name = target.partition(":")
    if not fn_name:
        raise SystemExit(f"expected MODULE:FUNCTION, got {target!r}, e.g. pipelab.launch:hello")
    fn = getattr(importlib.import_module(module_name), fn_name)
    ctx = init_worker()
    result = fn(ctx)
    print(f"[rank {ctx.rank}] {fn_name} returned {result!r}", flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()


def hello(ctx: WorkerContext) -> str:
    """The smallest worker: all-reduce the ranks' numbers, so every rank knows the sum."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t)
    return f"rank {ctx.rank} of {ctx.world_size} on {ctx.device}: sum of ranks = {t.item():g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelab.launch",
                                     description="Run a pipelab worker function under torchrun.")
    parser.add_argument("target", nargs="?", help="MODULE:FUNCTION taking a WorkerContext")
    parser.add_argument("--spawned-worker", metavar="DIR", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.spawned_worker:
        _spawned_worker_main(ns.spawned_worker)
    elif ns.target:
        _torchrun_main(ns.target)
    else:
        parser.error("give MODULE:FUNCTION, e.g. torchrun --nproc-per-node 2 -m pipelab.launch pipelab.launch:hello")


if __name__ == "__main__":
    main()

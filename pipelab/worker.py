"""The worker side of `pipelab.launch`: what runs inside each rank's process.

A rank started by `spawn` reads its pickled function from the call's temp dir, joins the process
group, runs the function and leaves its result (or its error) there as a file for the parent. The
same `init_worker` joins a process group started by torchrun.

Files of one call, in its temp dir: `payload-R.pkl` (what rank R runs; deleted as soon as R has
opened it), `result-R.pkl` or `error-R.pkl` (what R returned or raised), `crash-R.txt` (the Python
stack if R crashes in native code, written by `faulthandler`).
"""

from __future__ import annotations

import datetime
import errno
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from pipelab import hardware
from pipelab.timeline import Recorder, Timeline

EXIT_DISK_FULL = 28  # a rank's exit code when its result cannot be written: no space left (ENOSPC)
_WATCH_SECONDS = 0.2  # how often a rank checks that its caller still waits for it


# What every rank runs once its process group has formed (with its RankContext), and once its
# function has returned. `pipelab.launch` adds the emulator's: it installs an emulated node's clock
# and communication, or NCCL's ordering rule, when the caller of `spawn` asked for one.
ON_START: list[Callable[["RankContext"], None]] = []
ON_FINISH: list[Callable[[], None]] = []


@dataclass
class RankContext:
    """What a worker function gets as its first argument, `ctx`: who this rank is and what it has.

    `rank` of `world_size` processes (`local_rank` on its node), the process group's `backend`
    ("gloo" or "nccl"), the `device` its tensors live on, `rec` the recorder its spans go to, and
    `groups`: the process groups a lesson made for it by name (e.g. a grid's "pipe" and "data"
    groups; the default group, all ranks, is `None` in `torch.distributed` calls)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: Any  # torch.device
    rec: Recorder = field(repr=False)
    groups: dict[str, Any] = field(default_factory=dict, repr=False)
    emulator: Any = field(default=None, repr=False)  # pipelab.emulate.Emulator on an emulated node

    def now(self) -> float:
        """This rank's time: its logical clock on an emulated node, else the shared clock."""
        return self.rec.now()

    def barrier(self, group: Any = None) -> None:
        """Wait until every rank of `group` (default: all ranks) reaches this point."""
        import torch.distributed as dist

        if self.backend == "nccl":
            dist.barrier(group=group, device_ids=[self.device.index])
        else:
            dist.barrier(group=group)

    def timeline(self) -> Timeline:
        """The spans this rank recorded so far."""
        return self.rec.timeline()


def init_worker(backend: str | None = None, timeout: float = 1800.0) -> RankContext:
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
    ctx = RankContext(rank, world_size, local_rank, backend, device, Recorder(rank, device))
    for hook in ON_START:  # e.g. an emulated node or NCCL's ordering rule, if spawn asked for one
        hook(ctx)
    return ctx


def rank_path(workdir: str, kind: str, rank: int) -> str:
    """Where rank `rank` finds or leaves its `kind` file: payload, result, error or crash."""
    return os.path.join(workdir, f"{kind}-{rank}.{'txt' if kind == 'crash' else 'pkl'}")


def run_spawned(workdir: str) -> None:
    """Entry point of a process started by spawn(): run the function, leave its result or error."""
    rank = int(os.environ["RANK"])
    # A rank forked by pipelab.worker_server watches the server, which goes when the caller does.
    _watch_caller(int(os.environ.get("PIPELAB_WATCH_PID") or os.environ["PIPELAB_PARENT_PID"]), workdir)
    phase = "load"
    try:
        crash_log = open(rank_path(workdir, "crash", rank), "w")  # noqa: SIM115 - open until we exit
        faulthandler.enable(crash_log, all_threads=False)
        fn, args, kwargs = load_pickle(rank_path(workdir, "payload", rank), unlink=True)
        phase = "rendezvous"
        ctx = init_worker(os.environ["PIPELAB_BACKEND"], float(os.environ["PIPELAB_TIMEOUT"]))
        phase = "run"
        result = fn(ctx, *args, **kwargs)
        for done in ON_FINISH:  # e.g. under NCCL's rule: the other ranks learn this one waits for nobody
            done()
        dump_pickle(result, rank_path(workdir, "result", rank))
        phase = "leave"
        leave_together(ctx)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        error = {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc(), "phase": phase}
        try:
            dump_pickle(error, rank_path(workdir, "error", rank))
        except OSError as full:
            # No room even for the error: say so by the exit code, which needs no disk.
            if full.errno == errno.ENOSPC or isinstance(e, OSError) and e.errno == errno.ENOSPC:
                os._exit(EXIT_DISK_FULL)
            raise
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    # Skip the process group's teardown: peers may already be gone, and the result is saved.
    os._exit(0)


def leave_together(ctx: RankContext) -> None:
    """Rank 0 hosts the rendezvous store: it stays until every other rank has finished, so that a
    rank still connecting (its function may be quicker than a peer's start-up) never finds the
    store gone. A rank that fails instead never counts itself done; spawn() then stops them all."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if ctx.rank != 0:
        store.add("pipelab/done", 1)
        return
    while store.add("pipelab/done", 0) < ctx.world_size - 1:
        time.sleep(0.005)


def _watch_caller(parent_pid: int, workdir: str) -> None:
    """End this rank and every process it started (its process group) once spawn() no longer
    waits for it: its caller died (even by SIGKILL, which runs no cleanup, so we remove the call's
    temp dir for it), or the caller gave up on the call and removed the temp dir."""

    def watch():
        while os.getppid() == parent_pid and os.path.isdir(workdir):
            time.sleep(_WATCH_SECONDS)
        shutil.rmtree(workdir, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def run_under_torchrun(target: str) -> None:
    """Run `module:function` as a worker under torchrun, printing each rank's result."""
    import importlib

    module_name, _, fn_name = target.partition(":")
    if not fn_name:
        raise SystemExit(f"expected MODULE:FUNCTION, got {target!r}, e.g. pipelab.launch:hello")
    fn = getattr(importlib.import_module(module_name), fn_name)
    ctx = init_worker()
    result = fn(ctx)
    print(f"[rank {ctx.rank}] {fn_name} returned {result!r}", flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    # Skip the interpreter's teardown, as a spawned rank does: C++ objects of the process group
    # still held from Python (e.g. by a torch DDP module in a reference cycle) can abort the rank
    # as it exits ("terminate called without an active exception"; about 1 run in 7 of lesson 01's
    # step on two torchrun nodes), and torchrun then fails the job after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def hello(ctx: RankContext) -> str:
    """The smallest worker: all-reduce the ranks' numbers, so every rank knows the sum."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t)
    return f"rank {ctx.rank} of {ctx.world_size} on {ctx.device}: sum of ranks = {t.item():g}"


def load_pickle(path: str, unlink: bool = False):
    """Read a (cloud)pickled object; with `unlink`, delete the file's name once it is open."""
    import cloudpickle  # noqa: F401 - registers what cloudpickled objects need

    with open(path, "rb") as f:
        if unlink:
            os.unlink(path)  # the bytes stay readable through `f`
        return pickle.load(f)


def dump_pickle(obj, path: str) -> None:
    """Write a pickle so the parent never reads half a file: write aside, then rename."""
    import cloudpickle

    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

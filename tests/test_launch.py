"""spawn(): real processes, results by rank, errors named by rank, timeouts, no orphans."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pipelab.launch import WorkerError, spawn
from pipelab.timeline import Timeline


def live_workers(parent_pid: int | None = None) -> list[int]:
    """PIDs of spawn() workers still alive (optionally only those started by `parent_pid`)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if b"--spawned-worker" not in cmd:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if zombie:
            continue
        if parent_pid is None or env.get(b"PIPELAB_PARENT_PID") == str(parent_pid).encode():
            found.append(int(pid))
    return found


def rank_payload(ctx, scale):
    """All-reduce the ranks, return a tensor, a timeline and the rank."""
    with ctx.rec.span("allreduce", lane="comm"):
        t = torch.full((256, 256), float(ctx.rank + 1))
        dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": t * scale, "timeline": ctx.timeline(),
            "threads": torch.get_num_threads()}


def test_results_arrive_in_rank_order_and_intact():
    results = spawn(rank_payload, 3, 2.0)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 for r in results)
    expected = torch.full((256, 256), (1 + 2 + 3) * 2.0)
    for r in results:  # the tensor survives the worker's exit right after returning
        torch.testing.assert_close(r["sum"], expected)
        assert isinstance(r["timeline"], Timeline) and r["timeline"].spans[0].kind == "allreduce"
        assert r["threads"] == 1  # one intra-op thread per CPU rank
    assert live_workers(os.getpid()) == []


def fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise KeyError("no such layer: 'fc9'")
    dist.barrier()  # rank 0 waits for a peer that never comes
    return ctx.rank


def test_raising_rank_is_named_with_its_traceback():
    with pytest.raises(WorkerError) as info:
        spawn(fail_on_rank_one, 2, timeout=60)
    err = info.value
    assert err.rank == 1
    assert "rank 1 raised KeyError" in str(err)
    assert "fail_on_rank_one" in err.traceback and "fc9" in err.traceback
    assert live_workers(os.getpid()) == []


def hang_on_rank_one(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    return ctx.rank


def test_hanging_rank_is_killed_at_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(hang_on_rank_one, 2, timeout=8)
    assert info.value.rank == 1
    assert "timeout=8" in str(info.value)
    assert time.monotonic() - t0 < 30
    assert live_workers(os.getpid()) == []


def square_rank(ctx):
    return ctx.rank**2


def test_twenty_calls_in_a_row():
    for _ in range(20):
        assert spawn(square_rank, 2) == [0, 1]
    assert live_workers(os.getpid()) == []


def test_function_defined_in_a_notebook_cell_is_sent_by_value():
    cell = textwrap.dedent("""
        def my_worker(ctx, base):
            import torch, torch.distributed as dist
            t = torch.tensor([base + ctx.rank])
            dist.all_reduce(t)
            return int(t)
    """)
    namespace = {"__name__": "__main__"}  # what a notebook cell's functions look like
    exec(cell, namespace)
    assert spawn(namespace["my_worker"], 2, 10) == [21, 21]


@pytest.mark.parametrize("world_size", [0, -1, 1.5, "2", True])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size"):
        spawn(square_rank, world_size)


@pytest.mark.parametrize("timeout", [0, -5, "60"])
def test_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout"):
        spawn(square_rank, 2, timeout=timeout)


def test_unpicklable_argument_is_refused_before_start():
    with pytest.raises(ValueError, match="cannot send"):
        spawn(square_rank, 2, threading.Lock())
    assert live_workers(os.getpid()) == []


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        spawn(square_rank, 2, backend="mpi-please")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 64, reason="has GPUs")
def test_nccl_without_enough_gpus_is_refused():
    with pytest.raises(ValueError, match="nccl"):
        spawn(square_rank, 64, backend="nccl")


INTERRUPTED_CALLER = """
import time
from pipelab.launch import spawn
def sleeper(ctx):
    time.sleep(600)
spawn(sleeper, 2, timeout=300)
"""


def _wait_for_workers(parent_pid: int, count: int, seconds: float = 60) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pids = live_workers(parent_pid)
        if len(pids) == count:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"expected {count} workers of pid {parent_pid}, saw {live_workers(parent_pid)}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["interrupted", "killed"])
def test_no_worker_outlives_its_caller(sig):
    """Ctrl-C in a notebook (SIGINT), or the kernel killed outright: the workers go too."""
    caller = subprocess.Popen([sys.executable, "-c", INTERRUPTED_CALLER])
    try:
        _wait_for_workers(caller.pid, 2)
        caller.send_signal(sig)
        caller.wait(timeout=30)
        deadline = time.monotonic() + 10  # a killed caller's workers notice within a second
        while live_workers(caller.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_workers(caller.pid) == []
    finally:
        caller.kill()


def test_worker_runs_under_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "-m", "pipelab.launch", "pipelab.launch:hello"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 2 on cpu: sum of ranks = 1" in out.stdout
    assert "rank 1 of 2 on cpu: sum of ranks = 1" in out.stdout


def test_a_port_taken_before_rendezvous_is_retried_on_a_new_port(monkeypatch):
    """Another program may grab the free port between our pick and rank 0's bind: spawn retries."""
    import socket as socket_module

    from pipelab import launch

    taken = socket_module.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real_free_port = launch._free_port
    monkeypatch.setattr(launch, "_free_port", lambda: next(ports, None) or real_free_port())
    try:
        results = launch.spawn(launch.hello, 2, timeout=60)
        assert results == [f"rank {r} of 2 on cpu: sum of ranks = 1" for r in range(2)]
    finally:
        taken.close()

"""spawn(): real processes, results by rank, errors named by rank, timeouts, no orphans."""

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pipelab.launch import WorkerError, spawn
from pipelab.timeline import Timeline
from processes import live_processes


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
    assert live_processes(os.getpid()) == []


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
    assert live_processes(os.getpid()) == []


def hang_on_rank_one(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    return ctx.rank


def test_hanging_rank_is_killed_at_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(hang_on_rank_one, 2, timeout=4)  # counted from the ranks' start: rank 0 has long returned
    assert info.value.rank == 1
    assert "timeout=4" in str(info.value)
    assert time.monotonic() - t0 < 30
    assert live_processes(os.getpid()) == []


def square_rank(ctx):
    return ctx.rank**2


def test_twenty_calls_in_a_row():
    for _ in range(20):
        assert spawn(square_rank, 2) == [0, 1]
    assert live_processes(os.getpid()) == []


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


@pytest.mark.parametrize("timeout", [0, -5, "60", float("nan")])
def test_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout"):
        spawn(square_rank, 2, timeout=timeout)


def test_unpicklable_argument_is_refused_before_start():
    with pytest.raises(ValueError, match="cannot send"):
        spawn(square_rank, 2, threading.Lock())
    assert live_processes(os.getpid()) == []


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        spawn(square_rank, 2, backend="mpi-please")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 64, reason="has GPUs")
def test_nccl_without_enough_gpus_is_refused():
    with pytest.raises(ValueError, match="nccl"):
        spawn(square_rank, 64, backend="nccl")


def test_infinite_timeout_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="finite number of seconds, got inf.*timeout=24\\*3600"):
        spawn(square_rank, 2, timeout=float("inf"))


INTERRUPTED_CALLER = """
import signal, subprocess, sys, time
from pipelab.launch import spawn
# Ctrl-C raises KeyboardInterrupt, as in a notebook kernel, also when whoever started this test
# ignores SIGINT (a job started with `&` from a script does; Python then keeps ignoring it).
signal.signal(signal.SIGINT, signal.default_int_handler)
def sleeper(ctx):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL)
    time.sleep(600)
spawn(sleeper, 2, timeout=300)
"""


def _wait_for_processes(parent_pid: int, count: int, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if len(live_processes(parent_pid)) == count:
            return
        time.sleep(0.1)
    raise AssertionError(f"expected {count} processes of pid {parent_pid}, saw {live_processes(parent_pid)}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL, signal.SIGTERM],
                         ids=["interrupted", "killed", "terminated"])
def test_no_worker_outlives_its_caller(sig, tmp_path):
    """Ctrl-C in a notebook (SIGINT), or the kernel killed outright: the workers go too, with the
    processes they started, and so do the call's temp files (the pickled model and data)."""
    caller = subprocess.Popen([sys.executable, "-c", INTERRUPTED_CALLER],
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        _wait_for_processes(caller.pid, 4)  # two workers, each with a helper process
        caller.send_signal(sig)
        caller.wait(timeout=30)
        if sig != signal.SIGINT:  # a killed caller cleans nothing up: its workers notice it
            deadline = time.monotonic() + 10
            while (live_processes(caller.pid) or os.listdir(tmp_path)) and time.monotonic() < deadline:
                time.sleep(0.1)
        assert live_processes(caller.pid) == []  # an interrupted caller waited for them to end
        assert os.listdir(tmp_path) == []
    finally:
        caller.kill()


def die_while_peer_waits(ctx, how, stamp):
    """Rank 1 dies without a Python error while rank 0 waits for it in an all-reduce."""
    ctx.barrier()
    if ctx.rank == 1:
        time.sleep(0.2)  # rank 0 is in the all-reduce by now
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        if how == "segfault":
            ctypes.string_at(0)  # read address 0: SIGSEGV inside native code
        elif how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
        os._exit(3)
    dist.all_reduce(torch.ones(1))
    return ctx.rank


@pytest.mark.parametrize("how, says", [
    ("segfault", "rank 1 was killed by signal 11 (segmentation fault) without a Python error"),
    ("sigkill", "rank 1 was killed by signal 9 (killed) without a Python error"),
    ("exit", "rank 1 exited with code 3 without a Python error"),
], ids=["segfault", "sigkill", "exit"])
def test_a_rank_that_dies_without_a_python_error_is_the_cause(how, says, tmp_path):
    stamp = tmp_path / "died_at"
    with pytest.raises(WorkerError) as info:
        spawn(die_while_peer_waits, 2, how, str(stamp), timeout=60)
    surfaced = time.time() - float(stamp.read_text())
    err = info.value
    assert err.rank == 1 and str(err).startswith(says), str(err)
    assert [e.rank for e in err.consequences] == [0], str(err)  # rank 0: "Connection closed by peer"
    assert "--- then, because of it ---\nrank 0 raised" in str(err)
    if how == "segfault":  # faulthandler's Python stack of the crash
        assert "in die_while_peer_waits" in err.traceback, err.traceback
    print(f"rank 1 ({how}) surfaced {surfaced:.2f}s after it died")
    assert surfaced < 10
    assert live_processes(os.getpid()) == []


def start_helpers(ctx, fail):
    """Each rank starts a helper process: rank 0's writes to the rank's output pipe, rank 1's
    elsewhere. With `fail`, rank 1 raises once rank 0 has returned and exited."""
    out = None if ctx.rank == 0 else subprocess.DEVNULL
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=out)
    if fail and ctx.rank == 1:
        time.sleep(1)
        raise RuntimeError("the step failed")
    return helper.pid


@pytest.mark.parametrize("fail", [False, True], ids=["ranks_return", "a_rank_fails"])
def test_helper_processes_neither_block_spawn_nor_outlive_it(fail):
    t0 = time.monotonic()
    if fail:
        with pytest.raises(WorkerError, match="rank 1 raised RuntimeError: the step failed"):
            spawn(start_helpers, 2, fail)
    else:
        assert len(spawn(start_helpers, 2, fail)) == 2
    assert time.monotonic() - t0 < 30  # not held until the helpers end (60 s)
    assert live_processes(os.getpid()) == []


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C (SIGINT) raises KeyboardInterrupt in this process, as in a notebook kernel, also when
    pytest was started ignoring SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_ranks_start_stops_those_started(monkeypatch, tmp_path, ctrl_c_raises):
    from pipelab import launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_start = launch._start_worker

    def start_then_ctrl_c(rank, *args):
        proc = real_start(rank, *args)
        if rank == 0:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C once the first rank is running
        return proc

    monkeypatch.setattr(launch, "_start_worker", start_then_ctrl_c)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        spawn(square_rank, 3)
    # at once: a rank killed before it formed its process group is still killed, not waited for
    # until _reap gives up (10 s)
    assert time.monotonic() - t0 < 8
    assert live_processes(os.getpid()) == []
    assert os.listdir(tmp_path) == []


def ctrl_c_the_caller(ctx):
    os.kill(int(os.environ["PIPELAB_PARENT_PID"]), signal.SIGINT)
    time.sleep(60)


def test_a_second_ctrl_c_during_the_cleanup_leaves_nothing_behind(monkeypatch, tmp_path, ctrl_c_raises):
    """The first Ctrl-C stops the call; a second one lands while it ends the ranks."""
    from pipelab import launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_reap = launch._reap
    pressed = []

    def reap_after_ctrl_c(proc):
        if not pressed:
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return real_reap(proc)

    monkeypatch.setattr(launch, "_reap", reap_after_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        spawn(ctrl_c_the_caller, 1)
    assert pressed
    assert live_processes(os.getpid()) == []
    assert os.listdir(tmp_path) == []


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

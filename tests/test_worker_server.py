"""spawn's ranks forked from a server that imported torch once (pipelab.worker_server): they see
what a fresh process would (the caller's environment, folder and modules as they are at the call),
print through spawn, and a server holding old pipelab code is replaced."""

import os
import sys

import pytest

from pipelab import hardware, worker_server
from pipelab.launch import spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or hardware.gpu_count() > 0,
                                reason="the server forks ranks on Linux machines without CUDA GPUs")


def where_am_i(ctx, module_name):
    import importlib

    module = importlib.import_module(module_name)
    print(f"rank {ctx.rank} here")
    return {"ppid": os.getppid(), "cwd": os.getcwd(), "flag": os.environ.get("PIPELAB_TEST_FLAG"),
            "from_module": module.VALUE, "pgid": os.getpgrp(), "pid": os.getpid()}


def test_ranks_are_forked_with_the_callers_state_at_the_call(tmp_path, monkeypatch, capfd):
    if os.environ.get("PIPELAB_FRESH_WORKERS") == "1":
        pytest.skip("PIPELAB_FRESH_WORKERS=1 turns the server off")
    spawn(lambda ctx: ctx.rank, 2)  # the server is up before what follows changes
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELAB_TEST_FLAG", "set after the server started")
    (tmp_path / "written_after_start.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    results = spawn(where_am_i, 2, "written_after_start")
    server = worker_server.server_pid()
    assert server is not None and all(r["ppid"] == server for r in results)
    assert all(r["cwd"] == str(tmp_path) and r["flag"] == "set after the server started" for r in results)
    assert all(r["from_module"] == 42 for r in results)
    assert all(r["pgid"] == r["pid"] for r in results)  # each rank leads its own process group
    out = capfd.readouterr().out
    assert "[rank 0] rank 0 here" in out and "[rank 1] rank 1 here" in out


def test_a_server_with_old_code_is_replaced(monkeypatch):
    if os.environ.get("PIPELAB_FRESH_WORKERS") == "1":
        pytest.skip("PIPELAB_FRESH_WORKERS=1 turns the server off")
    spawn(lambda ctx: ctx.rank, 1)
    old = worker_server.server_pid()
    monkeypatch.setattr(worker_server._server, "stamp", -1.0)  # as if a pipelab file changed since
    assert spawn(lambda ctx: os.getppid(), 1) == [worker_server.server_pid()]
    assert worker_server.server_pid() != old
    assert not os.path.exists(f"/proc/{old}") or open(f"/proc/{old}/stat").read().split()[2] == "Z"


def test_fresh_workers_when_asked(monkeypatch):
    monkeypatch.setenv("PIPELAB_FRESH_WORKERS", "1")
    assert spawn(lambda ctx: os.getppid(), 2) == [os.getpid(), os.getpid()]


def rank_of(ctx):
    return ctx.rank


@pytest.mark.skipif(not worker_server.usable(), reason="ranks are fresh processes here")
def test_one_server_starts_every_rank_of_a_call(monkeypatch):
    """A server replaced between two ranks of one call (pipelab's files changed meanwhile) would
    leave the first rank talking to a closed socket: a call asks for its server once."""
    asked = []
    real = worker_server.server

    def counted():
        asked.append(1)
        return real()

    monkeypatch.setattr(worker_server, "server", counted)
    assert spawn(rank_of, 3) == [0, 1, 2]
    assert len(asked) == 1

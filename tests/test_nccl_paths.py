"""Every multi-rank path of the course under NCCL's ordering rule (GPU nodes deadlock where gloo
does not). With PIPELAB_NCCL_RULE=1 every `spawn` puts its ranks' communication under the rule
(`pipelab.emulate.comm`): a path that would deadlock on NCCL fails within seconds, naming the ranks
and the operations they wait on. Each path is one of the lessons' own tests, which the suite runs
under the rule (tests/conftest.py; the list is tests/nccl_rule_paths.py); lessons 06 and 07's
schedules are in tests/test_nccl_rule.py."""

import ast
import os

import torch
import torch.distributed as dist

from pipelab.emulate.comm import DeadlockError
from pipelab.launch import spawn

from nccl_rule_paths import PATHS, UNDER_RULE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def receive_first(ctx) -> str:
    """Both ranks receive before they send: gloo runs it, NCCL deadlocks."""
    peer = 1 - ctx.rank
    recv = dist.irecv(torch.empty(4), peer)
    send = dist.isend(torch.ones(4), peer)
    try:
        recv.wait()
        send.wait()
    except DeadlockError as e:
        return str(e)
    return "no deadlock"


def test_the_environment_puts_every_spawn_under_the_rule(monkeypatch):
    """The switch the run below relies on: an exchange gloo runs deadlocks once it is set."""
    assert spawn(receive_first, 2, timeout=120) == ["no deadlock"] * 2
    monkeypatch.setenv("PIPELAB_NCCL_RULE", "1")
    for message in spawn(receive_first, 2, timeout=120):
        assert "rank 0 waits for its receive from rank 1" in message


def test_every_listed_path_is_a_test_of_the_suite():
    """A renamed or removed test would silently drop its path from the rule's runs."""
    for test in UNDER_RULE:
        path, name = test.split("::")
        with open(os.path.join(ROOT, path)) as f:
            defined = {n.name for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.FunctionDef)}
        assert name in defined, f"{test} is listed in tests/nccl_rule_paths.py but not defined"
    lessons = {key.split()[0] for key in PATHS}
    assert lessons >= {"00", "01", "05", "08", "09", "10", "11", "12", "13", "14", "15", "16", "17"}


def test_a_listed_path_runs_under_the_rule():
    """This test is listed itself: the suite's fixture put it (and every listed path) under the rule."""
    assert os.environ.get("PIPELAB_NCCL_RULE") == "1"
    assert spawn(receive_first, 2, timeout=120) != ["no deadlock"] * 2

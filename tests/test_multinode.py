"""The multi-node path, proven on one machine: two torchrun processes, one per "node", each
starting one worker with `python -m pipelab.launch MODULE:FUNCTION`, exactly as two hosts would
(`--nnodes 2 --node-rank 0|1 --master-addr ...`). The lesson workers they run (lesson 01's DDP
step, lesson 06's GPipe step) must compute what `spawn` computes on the same inputs; lesson 05's
cell runs its worker through `nodes.torchrun_nodes` (a c10d rendezvous), which must also stop
both nodes at once when one fails.

The targets live in tests/multinode_targets.py; the torchrun processes find it on PYTHONPATH.
torchrun is started as `python -m torch.distributed.run`: a `torchrun` script is not next to
every interpreter.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import multinode_targets as targets
from pipelab import experiments
from pipelab.experiments import ddp as ddp_experiment
from pipelab.experiments.ddp import VARIANTS
from pipelab.experiments import pipeline as pipeline_experiment
from pipelab.reference import assert_same, reference_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
NODES = 2
TIMEOUT_S = 150  # both nodes together; a normal run takes a few seconds

pytestmark = [pytest.mark.timeout(2 * TIMEOUT_S + 60)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_env(out_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([TESTS, ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        targets.OUT_DIR: out_dir,  # also how we find every process of this run (see _processes_of)
        # gloo, as spawn uses here: on a 1-GPU machine two "nodes" would otherwise both take cuda:0.
        "PIPELAB_BACKEND": "gloo",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _start_node(node_rank: int, port: int, target: str, out_dir: str, log) -> subprocess.Popen:
    command = [*TORCHRUN, "--nnodes", str(NODES), "--nproc-per-node", "1", "--node-rank", str(node_rank),
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "pipelab.launch", f"multinode_targets:{target}"]
    return subprocess.Popen(command, cwd=ROOT, env=_node_env(out_dir), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _processes_of(out_dir: str) -> list[int]:
    """Live processes started for this run: their environment names our output folder. torchrun
    puts its workers in sessions of their own, so this also finds a worker its agent left behind."""
    marker = f"{targets.OUT_DIR}={out_dir}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read():
                        pids.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return pids


def _stop(nodes: list[subprocess.Popen], out_dir: str) -> None:
    """Stop both torchruns (SIGTERM: each stops its worker), then kill whatever is left."""
    for p in nodes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in nodes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    for pid in _processes_of(out_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_two_nodes(target: str, tmp_path) -> tuple[list, list[str]]:
    """Run `multinode_targets:<target>` on two torchrun "nodes"; return each rank's saved result
    and each node's log. On any failure or timeout, everything started here is stopped."""
    out_dir = str(tmp_path / "out")
    os.makedirs(out_dir, exist_ok=True)
    for attempt in range(2):  # a second try only if another program took our free port meanwhile
        port = _free_port()
        logs = [tmp_path / f"{target}-node{n}-try{attempt}.log" for n in range(NODES)]
        nodes = []
        try:
            for n in range(NODES):
                with open(logs[n], "wb") as log:
                    nodes.append(_start_node(n, port, target, out_dir, log))
            deadline = time.monotonic() + TIMEOUT_S
            while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in nodes):
                    time.sleep(2)  # let the other node report too, then stop it
                    break
                time.sleep(0.1)
            codes = [p.poll() for p in nodes]
        finally:
            _stop(nodes, out_dir)
        texts = [log.read_text(errors="replace") for log in logs]
        if codes == [0] * NODES:
            assert not _processes_of(out_dir), "a torchrun worker outlived its node"
            results = [torch.load(os.path.join(out_dir, f"{target}-rank{r}.pt"), weights_only=False)
                       for r in range(NODES)]
            return results, texts
        if attempt == 0 and any("address already in use" in t.lower() for t in texts):
            continue
        report = "\n".join(f"--- node {n} (exit code {codes[n]}, None = stopped at the timeout) ---\n{t[-4000:]}"
                           for n, t in enumerate(texts))
        raise AssertionError(f"two-node torchrun of {target} failed:\n{report}")
    raise AssertionError("unreachable")


def _assert_ranks_on_both_nodes(logs: list[str], target: str) -> None:
    """Node n's torchrun ran global rank n (one worker per node)."""
    for n, text in enumerate(logs):
        assert f"{target}: rank {n} of {NODES} saved" in text, f"node {n} did not run rank {n}:\n{text}"


def test_ddp_step_on_two_nodes_equals_spawn(tmp_path):
    """Lesson 01: each DDP variant's loss, gradients, updated weights and replica spread over two
    torchrun nodes equal those of `experiments.run` (spawn) on the same model and batch."""
    per_rank, logs = run_two_nodes("ddp_step", tmp_path)
    _assert_ranks_on_both_nodes(logs, "ddp_step")
    cfg = targets.ddp_config(NODES, backend="gloo")
    spawned = experiments.run(ddp_experiment.worker, cfg, ddp_experiment.gather)
    reference = reference_run(cfg.model, cfg.x, cfg.y, nn.MSELoss(), steps=1, lr=targets.DDP_LR)
    on_two_nodes = ddp_experiment.gather(cfg, per_rank)
    for variant in VARIANTS:
        two_nodes = dataclasses.replace(on_two_nodes[variant], variant=f"{variant} on two nodes")
        run = spawned[variant]
        torch.testing.assert_close(two_nodes.losses, run.losses, msg=lambda m: f"{variant} losses: {m}")
        torch.testing.assert_close(two_nodes.grads, run.grads, msg=lambda m: f"{variant} gradients: {m}")
        torch.testing.assert_close(two_nodes.weights, run.weights, msg=lambda m: f"{variant} weights: {m}")
        assert_same(two_nodes, reference)  # and both equal one process (replicas in step included)
    assert len(on_two_nodes["bucketed"].buckets) > 1  # several buckets: the overlapping path ran


def test_gpipe_step_on_two_nodes_equals_spawn(tmp_path):
    """Lesson 06: GPipe's loss and every stage's gradients over two torchrun nodes (one stage
    each, activations sent between the nodes) equal those of the same Config run by spawn."""
    per_rank, logs = run_two_nodes("gpipe_step", tmp_path)
    _assert_ranks_on_both_nodes(logs, "gpipe_step")
    stages, schedule, x, y = targets.gpipe_inputs()
    cfg = pipeline_experiment.Config(stages=stages, schedules=[schedule], x=x, y=y, loss_fn=nn.MSELoss(), steps=1,
                                     backend="gloo")
    [two_nodes] = pipeline_experiment.gather(cfg, per_rank)
    [spawned] = pipeline_experiment.run(cfg)
    torch.testing.assert_close(two_nodes.mb_losses, spawned.mb_losses, msg=lambda m: f"losses: {m}")
    torch.testing.assert_close(two_nodes.grads, spawned.grads, msg=lambda m: f"gradients: {m}")
    assert [r[0].stages for r in per_rank] == [[0], [1]]
    assert two_nodes.messages_sent == spawned.messages_sent > 0  # activations and gradients crossed
    assert_same(two_nodes, reference_run(nn.Sequential(*stages), x, y, nn.MSELoss(), lr=None))


def test_lesson_05_s_worker_on_two_c10d_nodes_equals_one_process():
    """Lesson 05's cell: part 1's worker on two torchrun nodes meeting at a c10d rendezvous on
    127.0.0.1 (`nodes.torchrun_nodes`): both wrappers compute what one process computes."""
    from pipelab import nodes
    from pipelab.experiments import hybrid

    per_rank = nodes.torchrun_nodes("pipelab.experiments.hybrid:on_nodes", nnodes=NODES, timeout=TIMEOUT_S)
    cfg = hybrid.toy_config(NODES, steps=hybrid.NODE_STEPS)
    runs = hybrid.gather(cfg, per_rank)
    assert set(runs) == {"bucketed", "torch"}
    for run in runs.values():
        assert len(run.losses) == hybrid.NODE_STEPS
        assert_same(run, hybrid.reference(cfg))
    command = nodes.torchrun_command("m:f", 2, 1, "10.0.0.1:29500")
    assert command[:3] == TORCHRUN and command[command.index("--node-rank") + 1] == "1"
    assert command[command.index("--rdzv-endpoint") + 1] == "10.0.0.1:29500" and command[-2:] == ["pipelab.launch", "m:f"]


def test_torchrun_nodes_stops_both_nodes_when_one_fails_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """A target that does not exist fails on both nodes: a RuntimeError with both logs, well before
    the timeout, and no process of the run left (their environment names the run's folder)."""
    from pipelab import nodes

    folders = []
    real = nodes.tempfile.mkdtemp
    monkeypatch.setattr(nodes.tempfile, "mkdtemp", lambda **kw: folders.append(real(dir=tmp_path, **kw)) or folders[-1])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)failed \(exit codes.*--- node 0 ---.*no_such_worker.*--- node 1 ---"):
        nodes.torchrun_nodes("pipelab.experiments.hybrid:no_such_worker", nnodes=NODES, timeout=TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S / 2
    marker = f"{nodes.NODES_OUT}={folders[0]}"
    assert not _processes_of_marker(marker) and not os.path.exists(folders[0])


def _processes_of_marker(marker: str) -> list[int]:
    needle = (marker + "\0").encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_a_node_s_error_stays_in_the_message_when_torchrun_s_tracebacks_follow_it():
    """A node whose worker failed and whose torchrun then lost its peer: the worker's error line is
    shown even when pages of torchrun's own tracebacks push it out of the log's end."""
    from pipelab import nodes

    log = ("Traceback (most recent call last):\nAttributeError: module 'pipelab.experiments.hybrid' has no "
           "attribute 'no_such_worker'\n" + "  File \"torch/distributed/run.py\", line 1, in main\n" * 200
           + "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: the store has failed\n")
    excerpt = nodes._excerpt(log)
    assert "no attribute 'no_such_worker'" in excerpt and excerpt.endswith("the store has failed\n")
    assert nodes._excerpt("short log\nValueError: bad\n") == "short log\nValueError: bad\n"

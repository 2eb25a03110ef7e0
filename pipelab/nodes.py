"""Several nodes on one machine: one torchrun per "node", as a cluster runs a job (lesson 05,
section 6).

`torchrun_nodes("MODULE:FUNCTION", nnodes=2)` starts `nnodes` processes of `python -m
torch.distributed.run --nnodes N --node-rank K --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT -m
pipelab.launch MODULE:FUNCTION`; their workers meet at the rendezvous and form one process group,
exactly as on a cluster where each node runs one such command with the head node's address. The
worker hands its result back with `save_node_result`. On a failure or a timeout every process
started here is stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from pipelab import hardware
from pipelab.checks import positive_number, whole_number
from pipelab.launch import _free_port
from pipelab.worker import RankContext, load_pickle

_GRACE_SECONDS = 2.0  # after a node fails, the most we wait for its peers to exit with their errors


NODES_OUT = "PIPELAB_NODES_OUT"  # the folder where `save_node_result` writes, set by `torchrun_nodes`


def torchrun_command(target: str, nnodes: int, node_rank: int, endpoint: str, nproc_per_node: int = 1) -> list[str]:
    """The command one node runs: torchrun (as `python -m torch.distributed.run`, which needs no
    script on PATH) starting `nproc_per_node` workers of `python -m pipelab.launch target`, which
    meet the other nodes' at the c10d rendezvous on `endpoint` ("HOST:PORT")."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node_rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "-m", "pipelab.launch", target]


def save_node_result(ctx: RankContext, result) -> str:
    """In a worker started by `torchrun_nodes`: hand `result` back to the caller (written aside,
    then renamed: never half a file). Returns a line for the node's log."""
    from pipelab.worker import dump_pickle

    out = os.environ.get(NODES_OUT)
    if not out:
        raise RuntimeError(f"{NODES_OUT} is not set: start this target with pipelab.nodes.torchrun_nodes, which "
                           "sets it to the folder the caller reads the results from")
    dump_pickle(result, os.path.join(out, f"rank{ctx.rank}.pkl"))
    return f"rank {ctx.rank} of {ctx.world_size} saved its result"


def torchrun_nodes(target: str, nnodes: int = 2, timeout: float = 60.0) -> list:
    """Run `MODULE:FUNCTION` (a function of `ctx` that ends with `save_node_result`) as `nnodes`
    torchrun "nodes" on this machine, one worker each, as a cluster runs it: one torchrun per
    node, all meeting at a c10d rendezvous on 127.0.0.1 (on a cluster: the head node's address).
    Returns each global rank's result. On a failure or after `timeout` seconds every process
    started here is stopped, and a RuntimeError carries each node's log."""
    whole_number("nnodes", nnodes, example="nnodes=2")
    positive_number("timeout", timeout, example="timeout=60", unit="seconds")
    out = tempfile.mkdtemp(prefix="pipelab-nodes-")
    env = {k: v for k, v in os.environ.items() if k != "PIPELAB_EMULATE"}
    env.update({NODES_OUT: out, "PIPELAB_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)})
    loopback = hardware.loopback_interface()
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)  # every "node" is on this machine
    endpoint = f"127.0.0.1:{_free_port()}"
    logs = [os.path.join(out, f"node{n}.log") for n in range(nnodes)]
    nodes: list[subprocess.Popen] = []
    try:
        for n in range(nnodes):
            with open(logs[n], "wb") as log:
                nodes.append(subprocess.Popen(torchrun_command(target, nnodes, n, endpoint), env=env, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        codes = _wait_for_nodes(nodes, timeout)
        if codes != [0] * nnodes:
            texts = [_excerpt(open(path, errors="replace").read()) for path in logs]
            stopped = f"; None: stopped after timeout={timeout}s" if None in codes else ""
            raise RuntimeError(f"torchrun of {target} on {nnodes} nodes failed (exit codes {codes}{stopped}):\n"
                               + "\n".join(f"--- node {n} ---\n{t}" for n, t in enumerate(texts)))
        return [load_pickle(os.path.join(out, f"rank{r}.pkl")) for r in range(nnodes)]
    finally:
        _stop_nodes(nodes, out)
        shutil.rmtree(out, ignore_errors=True)


def _excerpt(log: str, tail: int = 3000) -> str:
    """A node's log for the error: its first error lines, which pages of torchrun's own tracebacks
    (a peer gone, the store closed) can push out of its end, then its end."""
    errors = [line for line in log.splitlines() if re.match(r"[\w.]*(Error|Exception)\b", line)][:3]
    end = log[-tail:]
    first = "".join(f"{line}\n" for line in errors if line not in end)
    return f"its first errors:\n{first}...\n{end}" if first else end


def _wait_for_nodes(nodes: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes once every node has exited, or as soon as one fails (its peers then get a
    moment to report), or at the timeout (None for a node still running)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in nodes):
            grace = time.monotonic() + _GRACE_SECONDS
            while time.monotonic() < grace and any(p.poll() is None for p in nodes):
                time.sleep(0.05)
            break
        time.sleep(0.05)
    return [p.poll() for p in nodes]


def _stop_nodes(nodes: list[subprocess.Popen], out: str) -> None:
    """Stop each torchrun still running (SIGTERM: it stops its workers), kill what is left, and
    any worker of this run that outlived its torchrun (its environment names `out`)."""
    for p in nodes:
        if p.poll() is None:
            p.terminate()
    for p in nodes:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill_group(p.pid)
            p.wait(timeout=5)
    marker = f"{NODES_OUT}={out}\0".encode()
    for pid in (int(e) for e in (os.listdir("/proc") if os.path.isdir("/proc") else []) if e.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read():
                    os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):  # gone meanwhile, or not ours to read
            pass


def _kill_group(pid: int) -> None:
    try:
        if hasattr(os, "killpg"):
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass

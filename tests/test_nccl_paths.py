"""Every multi-rank path of the course under NCCL's ordering rule (issue: GPU nodes deadlock where
gloo does not). With PIPELAB_NCCL_RULE=1 every `spawn` puts its ranks' communication under the rule
(`pipelab.emulate.comm`): a path that would deadlock on NCCL fails within seconds, naming the ranks
and the operations they wait on. Each path is one of the lessons' own tests, run again under the
rule; lessons 06 and 07's schedules are in tests/test_nccl_rule.py."""

import os
import subprocess
import sys

import torch
import torch.distributed as dist

from pipelab.emulate.comm import DeadlockError
from pipelab.launch import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PATHS = {
    "00 ring all-reduce, ping-pong, all-reduce sweep, a step": [
        "tests/test_collectives.py::test_ring_all_reduce_equals_torch_all_reduce",
        "tests/test_collectives.py::test_lesson_runs_give_typed_results_and_verdicts_from_them"],
    "01 naive, bucketed and torch DDP": ["tests/test_ddp.py::test_gradients_and_updated_weights_match_one_process"],
    "05 replicas over two devices, the pipe x data grid": [
        "tests/test_hybrid.py::test_ddp_over_two_device_replicas_equals_one_process",
        "tests/test_hybrid.py::test_every_layout_equals_one_process_after_optimizer_steps"],
    "08 the engine, with tied weights and a pipe x data grid": [
        "tests/test_engine.py::test_two_stages_train_like_one_process",
        "tests/test_engine.py::test_pipe_by_data_grid_with_tied_weights"],
    "09 the traced pipeline": ["tests/test_trace.py::test_traced_stages_run_under_pipelab_runtime"],
    "10 the capstone's trainer": ["tests/test_lm.py::test_grid_first_steps_equal_one_process"],
    "11 ZeRO-1/2/3 and fully_shard": ["tests/test_sharding.py::test_every_variant_matches_one_process"],
    "12 tensor and sequence parallelism, the 3-D grid": [
        "tests/test_tensor_parallel.py::test_parallel_block_equals_the_unsplit_block",
        "tests/test_tensor_parallel.py::test_the_3d_grid_has_the_topologys_groups_and_one_process_losses"],
    "13 ZB-V, DualPipeV, looped BFS": ["tests/test_v_shape.py::test_runs_on_real_ranks_like_one_process"],
    "14 ring attention, all-to-all, torch's context_parallel": [
        "tests/test_context_parallel.py::test_every_variant_equals_one_process"],
    "16 ZeRO in mixed precision, the bf16 all-reduce": [
        "tests/test_precision.py::test_mixed_precision_zero_on_real_ranks_matches_one_process_and_the_formula",
        "tests/test_precision.py::test_bf16_all_reduce_halves_the_bytes"],
    "15 expert parallelism, with data parallelism": ["tests/test_expert_parallel.py::test_layer_over_ranks_equals_one_process"],
    "17 the silent bugs and their fixes, the collective check": [
        "tests/test_debug.py::test_each_bug_keeps_the_loss_is_caught_and_its_fix_equals_one_process",
        "tests/test_debug.py::test_matching_collectives_run_as_without_the_check"],
}


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


def test_every_multi_rank_path_runs_under_nccls_ordering_rule():
    tests = [t for group in PATHS.values() for t in group]
    env = {**os.environ, "PIPELAB_NCCL_RULE": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"a path fails under NCCL's rule:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"

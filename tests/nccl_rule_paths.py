"""The lessons' multi-rank paths the suite runs under NCCL's ordering rule: one or two of each
lesson's own tests (tests/conftest.py sets PIPELAB_NCCL_RULE=1 for them)."""

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
    "the rule's own switch": ["tests/test_nccl_paths.py::test_a_listed_path_runs_under_the_rule"],
}

UNDER_RULE = frozenset(t for group in PATHS.values() for t in group)

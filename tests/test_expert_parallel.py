"""Lesson 15: the Mixture-of-Experts layer over ranks equals one process; routing, capacity and the
balancing loss by hand; bad input refused before any rank starts; the modelled step; the exercise."""


import pytest
import torch
import torch.distributed as dist

from pipelab import exercises
from pipelab.emulate import moe
from pipelab.emulate.cost import message_seconds
from pipelab.emulate.specs import parse_node
from pipelab.experiments import expert_load as load
from pipelab.experiments import expert_parallel as epx
from pipelab.expert_parallel import capacity, keep_within_capacity, load_balancing_loss


@pytest.mark.parametrize("world_size, ep", [(2, None), (4, 2)], ids=["ep2", "ep2xdp2"])
def test_layer_over_ranks_equals_one_process(world_size, ep):
    cfg = epx.Config(world_size=world_size, ep=ep, tokens=32, steps=1,
                     syncs=("reduce_gradients", "as_plain_data_parallel"))
    run = epx.run(cfg)
    assert run.same_dropped and run.dropped > 0  # the same assignments dropped, and some were
    assert max(run.difference.values()) < 1e-5, run.difference
    assert epx.same_as_one_process(run)[1] == "same"
    # averaged as data parallelism alone averages, the experts' gradients are ep times too large
    assert epx.doubled_gradient(run)[1] == f"{cfg.ep_size:.2f}x"
    assert epx.doubled_gradient(run, "reduce_gradients")[1] == "right"
    assert run.counts.sum() == world_size * cfg.tokens * cfg.top_k - run.dropped


@pytest.mark.parametrize("fields, words", [
    ({"experts": 6, "world_size": 4}, ["experts=6", "ep=4", "experts=8"]),
    ({"top_k": 5}, ["top_k=5", "experts=4", "top_k <= 4"]),
    ({"capacity_factor": 0}, ["capacity_factor", "got 0", "capacity_factor=1.25"]),
    ({"capacity_factor": -1.0}, ["capacity_factor", "got -1.0"]),
    ({"ep": 3, "world_size": 4}, ["ep=3", "world_size=4", "[1, 2, 4]"]),
    ({"syncs": ("average",)}, ["syncs", "average"]),
])
def test_bad_input_is_refused_before_ranks_start(fields, words):
    with pytest.raises(ValueError) as e:
        epx.Config(**fields)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_capacity_and_who_is_dropped():
    assert capacity(tokens=64, n_experts=4, k=2, capacity_factor=1.25) == 40
    assert capacity(tokens=10, n_experts=4, k=1, capacity_factor=1.0) == 3  # ceil(2.5)
    # tokens 0-3 all choose expert 0 first; capacity 2: tokens 0 and 1 keep it. Second choices queue
    # after every first choice: expert 1 has token 3's first choice, then tokens 0 and 1's second.
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 2]])
    keep = keep_within_capacity(experts, 3, 2)
    assert keep.tolist() == [[True, True], [True, False], [False, True], [True, True]]


def test_balancing_loss_is_one_when_even_and_grows_when_concentrated():
    even = torch.full((8, 4), 0.25)
    assert load_balancing_loss(even, torch.tensor([[0], [1], [2], [3]] * 2), 4).item() == pytest.approx(1.0)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert load_balancing_loss(probs, torch.zeros(8, 1, dtype=torch.long), 4).item() == pytest.approx(4 * 0.7)


def test_modelled_all_to_all_is_one_message_per_peer():
    node = parse_node("4xH100-nvlink")
    got = moe.all_to_all_seconds(3e6, "4xH100-nvlink")
    assert got == pytest.approx(3 * message_seconds(1e6, node.link))
    assert moe.all_to_all_seconds(3e6, "1xH100-nvlink") == 0.0
    forward = moe.expert_seconds("forward", 4096, 4096, 14336, "2xH100-nvlink")
    # 2 matrix products of 2 * 4096 * 4096 * 14336 FLOPs at the H100's measured bf16 efficiency, compute-bound
    from pipelab.emulate import calibrated

    flops = 2 * 2 * 4096 * 4096 * 14336
    e_max = calibrated.efficiency_of(node.device).matmul["bfloat16"][0]
    assert forward == pytest.approx(flops / (e_max * node.device.rate("bfloat16")), rel=0.02)
    with pytest.raises(ValueError, match="kind must be 'forward' or 'backward', got 'gemm'"):
        moe.expert_seconds("gemm", 1, 4, 4, "2xH100-nvlink")


def test_the_busiest_rank_sets_the_modelled_step_and_the_condition_by_hand():
    cfg = epx.Config(world_size=2)
    uneven = torch.tensor([[40, 40, 10, 10], [40, 40, 10, 10]])
    step, even = load.modelled_step(cfg, uneven), load.modelled_step(cfg, load.evenly(uneven))
    assert step.assignments[0] > step.assignments[1] and step.step > even.step
    assert load.pace_verdict(step, even)[1] == "busiest sets the pace"
    row = moe.hiding_condition("2xH100-nvlink", load.SIZE["tokens"], cfg.top_k, cfg.experts, load.SIZE["dim"],
                               load.SIZE["hidden"])
    # (n-1)/n * b * C / (3W), C and W what the calibrated model reaches at the layer's sizes: C below
    # the H100's dense bf16 peak, W below NVLink 4's 450 GB/s line rate, so the threshold moves
    # with both and the modelled step must agree with the formula on which side a layer is
    assert 0 < row["threshold F"] and row["formula: compute / all-to-all"] > 1
    rows = load.capacity_sweep(cfg, (0.5, 2.0))
    assert load.capacity_verdict(rows)[1] == "fewer drops, longer step"


# ---------------------------------------------------------------------------------------------
# The exercise: the solution, another correct answer, and wrong ones named
# ---------------------------------------------------------------------------------------------


def dispatch_gathering_every_count(rows, expert, experts_per_rank):
    """Correct, written differently: a sort, every rank's counts all-gathered (a rank reads its
    column), the rows moved by all_to_all_single."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sorted_expert, order = torch.sort(expert, stable=True)
    dest = torch.div(sorted_expert, experts_per_rank, rounding_mode="floor")
    send = torch.nn.functional.one_hot(dest, world).sum(0)
    everyone = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(everyone, send)
    recv = [int(counts[rank]) for counts in everyone]
    out = rows.new_empty(sum(recv), rows.shape[1])
    dist.all_to_all_single(out, rows[order], recv, send.tolist())
    return out


def dispatch_unsorted(rows, expert, experts_per_rank):
    world = dist.get_world_size()
    send = torch.bincount(expert // experts_per_rank, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    out = rows.new_empty(int(recv.sum()), rows.shape[1])
    dist.all_to_all_single(out, rows, recv.tolist(), send.tolist())
    return out


def dispatch_round_robin(rows, expert, experts_per_rank):
    world = dist.get_world_size()
    dest = expert % world
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    out = rows.new_empty(int(recv.sum()), rows.shape[1])
    dist.all_to_all_single(out, rows[order], recv.tolist(), send.tolist())
    return out


def dispatch_without_counts(rows, expert, experts_per_rank):
    world = dist.get_world_size()
    send = torch.bincount(expert // experts_per_rank, minlength=world).tolist()
    out = rows.new_empty(sum(send), rows.shape[1])  # as if every rank sent what this one sends
    dist.all_to_all_single(out, rows[torch.argsort(expert, stable=True)], send, send)
    return out


def dispatch_even_split(rows, expert, experts_per_rank):
    out = torch.empty_like(rows)
    dist.all_to_all_single(out, rows[torch.argsort(expert, stable=True)])
    return out


def dispatch_split_sizes_swapped(rows, expert, experts_per_rank):
    world = dist.get_world_size()
    order = torch.argsort(expert, stable=True)
    send = torch.bincount(expert // experts_per_rank, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    out = rows.new_empty(int(recv.sum()), rows.shape[1])
    dist.all_to_all_single(out, rows[order], send.tolist(), recv.tolist())
    return out


def dispatch_async_never_waited(rows, expert, experts_per_rank):
    world = dist.get_world_size()
    order = torch.argsort(expert, stable=True)
    send = torch.bincount(expert // experts_per_rank, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    out = rows.new_empty(int(recv.sum()), rows.shape[1])
    dist.all_to_all_single(out, rows[order], recv.tolist(), send.tolist(), async_op=True)
    return out


def dispatch_returns_sorted_rows(rows, expert, experts_per_rank):
    world = dist.get_world_size()
    order = torch.argsort(expert, stable=True)
    send = torch.bincount(expert // experts_per_rank, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    out = rows.new_empty(int(recv.sum()), rows.shape[1])
    dist.all_to_all_single(out, rows[order], recv.tolist(), send.tolist())
    return rows[order]


RIGHT_ANSWERS = [dispatch_gathering_every_count]
WRONG_ANSWERS = [
    (dispatch_unsorted, ["row(s) of other ranks' experts", "sort the rows by expert"]),
    (dispatch_round_robin, ["consecutive blocks", "not e % world_size"]),
    (dispatch_without_counts, ["exchange the counts"]),
    (dispatch_even_split, ["an even split", "[6, 6]", "exchanged first"]),
    (dispatch_split_sizes_swapped, ["input_split_sizes [", "add up to", "(output, input, output_split_sizes, input_split_sizes)"]),
    (dispatch_async_never_waited, ["never waited", "all_to_all_single"]),
    (dispatch_returns_sorted_rows, ["returned its own 12 rows", "the ones it sends"]),
]


def test_another_correct_answer_passes():
    # the solution's own run is in tests/test_exercises.py
    assert exercises.check_dispatch(dispatch_gathering_every_count).passed


@pytest.mark.parametrize("wrong, words", WRONG_ANSWERS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_wrong_dispatch_fails_naming_its_mistake(wrong, words):
    grade = exercises.check_dispatch(wrong)
    assert not grade.passed
    for word in words:
        assert word in grade.message, grade.message

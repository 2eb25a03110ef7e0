"""Tensor and sequence parallelism (lesson 12): our column/row-parallel layers, MLP, attention and
block give the unsplit layer's outputs and gradients on 2 and 4 ranks, send the bytes the ring
formulas say, and refuse sizes that do not divide."""

import copy

import pytest
import torch
from torch import nn

from pipelab.launch import spawn
from pipelab.tensor_parallel import ParallelBlock, TensorParallelGroup
from pipelab.tensor_parallel.comm import ring_bytes
from pipelab.transformer import Block


def make_block(dim=16, heads=4, seed=0):
    torch.manual_seed(seed)
    return Block(dim, heads)


def as_block_of_grads(block: Block) -> Block:
    """A copy of `block` whose parameters hold its gradients: cut like the parallel block, it
    gives each rank's expected gradient shards."""
    grads = copy.deepcopy(block)
    with torch.no_grad():
        for p, g in zip(grads.parameters(), block.parameters()):
            p.copy_(g.grad)
    return grads


def reference(block, x, g):
    block = copy.deepcopy(block)
    x = x.clone().requires_grad_()
    y = block(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, block


def block_worker(ctx, block, x, g, sequence_parallel, regather=False):
    tp = TensorParallelGroup.world()
    pblock = ParallelBlock(block, tp, sequence_parallel, regather)
    if sequence_parallel:  # this rank's slice of the sequence in, its slice out
        x, g = tp.slice(x, 1), tp.slice(g, 1)
    x = x.clone().requires_grad_()
    y = pblock(x)
    (y * g).sum().backward()
    pblock.sync_replicated_grads()
    grads = {n: p.grad.clone() for n, p in pblock.named_parameters()}
    return y.detach(), x.grad, grads, dict(tp.meter.bytes), dict(tp.meter.calls)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("sequence_parallel,regather", [(False, False), (True, False), (True, True)],
                         ids=["tp", "tp+sp", "tp+sp-regather"])
def test_parallel_block_equals_the_unsplit_block(ranks, sequence_parallel, regather):
    block = make_block()
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    y_ref, dx_ref, ref_block = reference(block, x, g)
    results = spawn(block_worker, ranks, block, x, g, sequence_parallel, regather)
    grads_block = as_block_of_grads(ref_block)
    for rank, (y, dx, grads, _, _) in enumerate(results):
        tp = TensorParallelGroup(None, rank, ranks)
        want_y, want_dx = (tp.slice(y_ref, 1), tp.slice(dx_ref, 1)) if sequence_parallel else (y_ref, dx_ref)
        torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dx, want_dx, atol=1e-5, rtol=1e-5)
        expected = dict(ParallelBlock(grads_block, tp, sequence_parallel).named_parameters())
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name].detach(), atol=1e-5, rtol=1e-5, msg=name)


def test_sequence_parallelism_sends_what_tensor_parallelism_sends():
    """Per block: TP all-reduces the (b, s, h) activation twice forward and twice backward; SP
    replaces each all-reduce by an all-gather plus a reduce-scatter, which a ring sends in the same
    bytes. (SP adds the small all-reduce of the replicated parameters' gradients.)"""
    block = make_block()
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    activation = x.numel() * x.element_size()
    per_rank = {}
    for sp in (False, True):
        _, _, _, sent, calls = spawn(block_worker, 2, block, x, g, sp)[0]
        per_rank[sp] = sum(b for (kind, d), b in sent.items() if d in ("forward", "backward"))
        if sp:
            assert calls[("all_gather", "forward")] == 2 and calls[("reduce_scatter", "forward")] == 2
            assert calls[("reduce_scatter", "backward")] == 2 and calls[("all_gather", "backward")] == 2
        else:
            assert calls == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}
    assert per_rank[False] == per_rank[True] == 4 * ring_bytes("all_reduce", activation, 2)


@pytest.mark.parametrize("dim,heads,ranks,bad", [(16, 4, 3, "n_heads=4"), (24, 3, 2, "n_heads=3")])
def test_sizes_that_do_not_divide_are_refused(dim, heads, ranks, bad):
    block = make_block(dim, heads)
    with pytest.raises(ValueError, match=bad):
        ParallelBlock(block, TensorParallelGroup(None, 0, ranks))


def test_every_variant_ours_and_torchs_equals_one_process_and_memory_follows_the_formula():
    from pipelab.experiments import tensor_parallel as tpx

    run = tpx.run(tpx.Config(world_size=2, dim=32, n_heads=4, seq_len=16, steps=1))
    assert tpx.same_as_one_process(run)[1] == "same"
    assert tpx.bytes_verdict(run)[1] == "same bytes"
    assert tpx.memory_verdict(run)[1] == "as the formula divides"
    calls = run["torch tp"].calls  # torch's q, k, v: three column-wise layers, three input-gradient sums
    assert calls[("all_reduce", "forward")] == 2 and calls[("all_reduce", "backward")] == 4


@pytest.mark.parametrize("bad,match", [
    (dict(n_heads=8, world_size=3), "n_heads=8 does not divide by the tensor-parallel size world_size=3"),
    (dict(dim=30, n_heads=4), "dim=30 does not divide evenly by n_heads=4"),
    (dict(seq_len=15), "seq_len=15 does not divide evenly by world_size=2"),
    (dict(variants=("tp", "megatron")), "variants must be some of"),
    (dict(world_size=64), "ranks per core"),
])
def test_the_lessons_config_refuses_what_cannot_run(bad, match):
    from pipelab.experiments import tensor_parallel as tpx

    with pytest.raises(ValueError, match=match):
        tpx.Config(**bad)


def encoder_worker(ctx, model, ids, targets):
    from pipelab import lm
    from pipelab.tensor_parallel.encoder import parallel_stage

    stage = parallel_stage(model, TensorParallelGroup.world())
    loss = lm.lm_loss(stage(ids), targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in stage.named_parameters()}


def test_lesson_10s_encoder_layer_cut_over_2_ranks_equals_the_whole_one():
    from pipelab import lm

    torch.manual_seed(0)
    model = lm.TransformerLM(50, emsize=16, nhead=4, nhid=32, nlayers=2)
    ids, targets = torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12))
    ref = copy.deepcopy(model)
    loss = lm.lm_loss(ref(ids), targets)
    loss.backward()
    for rank, (got, grads) in enumerate(spawn(encoder_worker, 2, model, ids, targets)):
        assert got == pytest.approx(loss.item(), abs=1e-6)
        torch.testing.assert_close(grads["2.fc2.weight"], ref[2].linear2.weight.grad.chunk(2, 1)[rank], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(grads["0.embedding.weight"], ref[0].embedding.weight.grad, atol=1e-6, rtol=1e-5)


def test_the_3d_grid_has_the_topologys_groups_and_one_process_losses():
    from pipelab.experiments import grid3d

    run = grid3d.run(grid3d.Config(steps=2, emulate="8xH100-nvlink"))  # timed on an emulated node
    assert run.groups() == {"pipe": [[0, 4], [1, 5], [2, 6], [3, 7]], "data": [[0, 2], [1, 3], [4, 6], [5, 7]],
                            "model": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert grid3d.same_losses(run)[1] == "same"
    assert {s.lane for s in run.timeline} >= {"compute", "comm", "tensor"}  # each axis on its own lane
    shares = grid3d.axis_costs(run)[3]
    assert shares["compute"] > 0 and shares["tensor"] > 0 and shares["data"] > 0  # modelled, not zero


@pytest.mark.parametrize("bad,match", [(dict(pipe=2, data=2, tensor=1), "holds 4 processes, not world_size=8"),
                                       (dict(nhead=2, tensor=4, data=1), "nhead=2 does not divide evenly by tensor=4")])
def test_the_3d_grid_refuses_what_cannot_run(bad, match):
    from pipelab.experiments import grid3d

    with pytest.raises(ValueError, match=match):
        grid3d.Config(**bad)

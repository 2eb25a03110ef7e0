"""Lesson 14: ring attention (contiguous and zig-zag, causal and not) and all-to-all (Ulysses)
against one process's attention, outputs and dQ, dK, dV; bytes against the formulas; memory per
rank; bad input refused before ranks start; the modelled ring overlap; the exercise's checker."""

import pytest
import torch
import torch.nn.functional as F

from pipelab import exercises
from pipelab.context_parallel import Layout, attend_block, merge
from pipelab.emulate.attention import attention_flops, flash_attention_seconds
from pipelab.experiments import context_parallel as cpx


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_variant_equals_one_process(world_size):
    variants = tuple(cpx.VARIANTS) if world_size == 2 else tuple(v for v in cpx.VARIANTS if v != "torch")
    cfg = cpx.Config(world_size=world_size, heads=4, seq_len=8 * world_size, head_dim=8, timed_seq_len=8 * world_size,
                     steps=2, variants=variants)
    run = cpx.run(cfg)
    key, verdict, text, figures = cpx.same_as_one_process(run)
    assert verdict == "same", text
    assert all(v.difference < cpx.TOLERANCE for v in run.variants.values())
    # the output and each of the three gradients checked on its own (torch's: the output only)
    assert all(list(v.differences) == (["output"] if n == "torch" else ["output", "dQ", "dK", "dV"])
               for n, v in run.variants.items())
    assert cpx.bytes_verdict(run)[1] == "as the formulas count", cpx.bytes_table(run)
    assert cpx.memory_verdict(run)[1] == "1/n of one process", cpx.memory_verdict(run)[2]
    assert set(run.timelines["zigzag"].ranks) == set(range(world_size))
    if "torch" in variants:
        assert cpx.torch_verdict(run)[1] == "same"
        assert any(a.startswith("NotImplementedError") for a in run.torch_refusals.values()), run.torch_refusals


def test_bad_input_is_refused_before_ranks_start():
    with pytest.raises(ValueError, match="heads=3 does not divide evenly by world_size=2"):
        cpx.Config(world_size=2, heads=3)
    with pytest.raises(ValueError, match="seq_len=12 does not split into 2 x world_size = 8"):
        cpx.Config(world_size=4, seq_len=12)
    with pytest.raises(ValueError, match="variants must be some of"):
        cpx.Config(variants=("ring", "rings"))


def test_zigzag_gives_rank_r_chunks_r_and_2n_minus_1_minus_r_and_unshards():
    lay = Layout("zigzag", 4)
    assert [lay.chunks(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = torch.arange(16.0).reshape(1, 1, 16, 1)
    assert lay.shard(x, 1).flatten().tolist() == [2, 3, 12, 13]
    for name in ("contiguous", "zigzag"):
        layout = Layout(name, 4)
        assert torch.equal(layout.unshard([layout.shard(x, r) for r in range(4)]), x)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    assert cpx.blocks_per_rank("contiguous", 4) == {0: 1, 1: 2, 2: 3, 3: 4}
    assert len(set(cpx.blocks_per_rank("zigzag", 4).values())) == 1
    assert set(cpx.blocks_per_rank("contiguous", 4, causal=False).values()) == {4}


def test_merging_two_blocks_is_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    a, b = attend_block(q, k[:, :, :2], v[:, :, :2], 0.5), attend_block(q, k[:, :, 2:], v[:, :, 2:], 0.5)
    out, lse = merge(*a, *b)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, scale=0.5), atol=1e-6)
    assert torch.allclose(lse, torch.logsumexp(q @ k.transpose(-2, -1) * 0.5, -1), atol=1e-6)


def test_the_flash_model_counts_what_torchs_counter_counts_of_our_blocks():
    from pipelab.context_parallel.online_softmax import block_grads
    from pipelab.emulate.cost import count

    q, o = (torch.empty(1, 4, 64, 16, device="meta") for _ in range(2))
    k, v = (torch.empty(1, 4, 32, 16, device="meta") for _ in range(2))
    lse = torch.empty(1, 4, 64, device="meta")
    assert count(attend_block, q, k, v, 0.25).flops == attention_flops("forward", (1, 4, 64, 32, 16))
    assert count(block_grads, q, k, v, o, lse, o, 0.25).flops == attention_flops("backward", (1, 4, 64, 32, 16))


def test_modelled_overlap_comes_from_the_emulator_and_stops_hiding_across_nodes():
    rows = cpx.ring_overlap()
    by_n = {r["ranks"]: r for r in rows}
    assert by_n[8]["hidden"] == "100%" and by_n[64]["hidden"] != "100%"
    # attention per step falls as (s/n)^2, the K/V message as s/n: quartered vs halved from 2 to 4 ranks
    assert by_n[2]["attention fwd+bwd (ms)"] / by_n[4]["attention fwd+bwd (ms)"] == pytest.approx(4, rel=0.05)
    assert by_n[2]["K/V passing fwd+bwd (ms)"] / by_n[4]["K/V passing fwd+bwd (ms)"] == pytest.approx(2, rel=0.05)
    # twice the FLOPs on the same device in the model: twice the time, near enough (launch overhead aside)
    one = flash_attention_seconds("forward", (1, 32, 4096, 4096, 128), "8xH100-nvlink")
    assert flash_attention_seconds("forward", (1, 32, 4096, 8192, 128), "8xH100-nvlink") == pytest.approx(2 * one, rel=0.01)
    assert "exposed from n=16" in cpx.overlap_verdict(rows)[1]


# ---------------------------------------------------------------------------------------------
# The exercise: right answers pass, each wrong one fails naming its mistake
# ---------------------------------------------------------------------------------------------


def merge_with_max(out_a, lse_a, out_b, lse_b):
    """Correct, written differently: subtract the larger log-sum-exp by hand."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b) / (wa + wb).unsqueeze(-1), m + torch.log(wa + wb)


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_unnormalised(out_a, lse_a, out_b, lse_b):
    return (lse_a.exp().unsqueeze(-1) * out_a + lse_b.exp().unsqueeze(-1) * out_b), torch.logaddexp(lse_a, lse_b)


def merge_swapped(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_b - lse).unsqueeze(-1) * out_a + torch.exp(lse_a - lse).unsqueeze(-1) * out_b, lse


def merge_lse_max(out_a, lse_a, out_b, lse_b):
    out, _ = merge(out_a, lse_a, out_b, lse_b)
    return out, torch.maximum(lse_a, lse_b)


def merge_lse_sum(out_a, lse_a, out_b, lse_b):
    out, _ = merge(out_a, lse_a, out_b, lse_b)
    return out, lse_a + lse_b


def merge_overflowing(out_a, lse_a, out_b, lse_b):
    wa, wb = lse_a.exp(), lse_b.exp()
    return (wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b) / (wa + wb).unsqueeze(-1), torch.log(wa + wb)


def merge_not_written(out_a, lse_a, out_b, lse_b):
    raise NotImplementedError("your code here")


RIGHT_ANSWERS = [merge_with_max]
WRONG_ANSWERS = [
    (merge_average, "plain average"), (merge_unnormalised, "not normalised"), (merge_swapped, "swaps the weights"),
    (merge_lse_max, "larger of L_a and L_b"), (merge_lse_sum, "L_a + L_b"),
    (merge_overflowing, "overflows float32"), (merge_not_written, "not written yet")]


@pytest.mark.parametrize("right", [exercises.solution("14_online_softmax_merge"), *RIGHT_ANSWERS])
def test_right_merges_pass(right):
    assert exercises.check_online_softmax_merge(right, quiet=True).passed


@pytest.mark.parametrize("wrong, expected", WRONG_ANSWERS)
def test_wrong_merges_fail_naming_the_mistake(wrong, expected):
    grade = exercises.check_online_softmax_merge(wrong, quiet=True)
    assert not grade.passed and expected in grade.message, grade.message

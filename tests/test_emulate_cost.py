"""The emulated node's cost model: device and link tables, FLOP and byte counts on the meta device
against hand-computed ones, the roofline, the ring collectives, memory accounting and the anchors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipelab.collectives import ring_all_reduce_time
from pipelab.emulate import anchors, cost, memory, specs
from pipelab.emulate.cost import Counts

F32 = 4  # bytes


# ---------------------------------------------------------------------------------------------
# Counting on meta
# ---------------------------------------------------------------------------------------------


def test_linear_forward_and_backward_halves():
    batch, n_in, n_out = 8, 64, 32
    forward, grad_input, grad_weight = cost.forward_backward_counts(nn.Linear(n_in, n_out), torch.randn(batch, n_in))
    products = 2 * batch * n_in * n_out
    assert forward.flops == products  # x @ W.T
    assert grad_input.flops == products  # dy @ W
    assert grad_weight.flops == products  # dy.T @ x (the bias gradient is a sum: no products)
    # forward reads the bias, x and W and writes y
    assert forward.bytes == F32 * (n_out + batch * n_in + n_in * n_out + batch * n_out)
    # I reads dy and W, writes dx
    assert grad_input.bytes == F32 * (batch * n_out + n_out * n_in + batch * n_in)
    # W reads dy and x, writes dW; then sums dy over the batch into db
    assert grad_weight.bytes == F32 * (batch * n_out + batch * n_in + n_out * n_in + batch * n_out + n_out)


def test_two_layers_backward_input_includes_every_activation_gradient():
    batch, width = 4, 16
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    forward, grad_input, grad_weight = cost.forward_backward_counts(model, torch.randn(batch, width))
    one = 2 * batch * width * width
    assert forward.flops == 2 * one
    assert grad_input.flops == 2 * one  # dx through both layers
    assert grad_weight.flops == 2 * one  # both weight gradients, nothing else


def test_counting_leaves_a_real_module_as_it_was():
    layer = nn.Linear(4, 3)
    before = layer.weight.detach().clone()
    cost.forward_backward_counts(layer, torch.randn(2, 4))
    assert layer.weight.device.type == "cpu" and torch.equal(layer.weight, before) and layer.weight.grad is None


def test_conv2d_flops_and_bytes():
    batch, c_in, c_out, k, size = 2, 3, 8, 3, 16
    conv = nn.Conv2d(c_in, c_out, k, padding=1)
    x = torch.randn(batch, c_in, size, size)
    counts = cost.count(conv, x)
    assert counts.flops == 2 * batch * c_out * size * size * c_in * k * k
    assert counts.bytes == F32 * (x.numel() + conv.weight.numel() + c_out + batch * c_out * size * size)
    _, grad_input, grad_weight = cost.forward_backward_counts(conv, x)
    assert grad_input.flops == grad_weight.flops == counts.flops


def test_layer_norm_bytes():
    rows, width = 4, 32
    counts = cost.count(nn.LayerNorm(width), torch.randn(rows, width))
    # reads x, weight, bias; writes y, and the mean and 1/std of each row (kept for backward)
    assert counts.bytes == F32 * (rows * width + 2 * width + rows * width + 2 * rows)
    assert counts.flops == 0  # PyTorch's counter counts products of matrices and convolutions


def test_matmul_and_elementwise():
    m, k, n = 8, 16, 4
    counts = cost.count(torch.matmul, torch.randn(m, k), torch.randn(k, n))
    assert counts.flops == 2 * m * k * n
    assert counts.bytes == F32 * (m * k + k * n + m * n)
    added = cost.count(torch.add, torch.randn(m, k), torch.randn(m, k))
    assert added == Counts(0.0, F32 * 3 * m * k, 1)


def test_attention_two_matmuls():
    batch, heads, tokens, dim = 2, 4, 16, 8
    q = torch.randn(batch, heads, tokens, dim)

    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(dim), dim=-1) @ v

    counts = cost.count(attention, q, q, q)
    scores = 2 * batch * heads * tokens * tokens * dim  # Q K^T
    mixing = 2 * batch * heads * tokens * tokens * dim  # softmax(...) V
    assert counts.flops == scores + mixing


def test_views_move_no_bytes_and_a_large_model_costs_no_memory():
    assert cost.count(lambda x: x.view(-1).unsqueeze(0).t(), torch.empty(3, 4)).bytes == 0
    assert cost.count(lambda x: x.t().reshape(-1), torch.empty(3, 4)).bytes == 2 * F32 * 12  # a copy
    with torch.device("meta"):
        big = nn.Linear(65536, 65536)  # 16 GiB of fp32 weights, never allocated
    forward, _, _ = cost.forward_backward_counts(big, torch.empty(4, 65536, device="meta"))
    assert forward.flops == 2 * 4 * 65536 * 65536


# ---------------------------------------------------------------------------------------------
# The roofline
# ---------------------------------------------------------------------------------------------


def test_roofline_compute_and_memory_bound():
    h100 = specs.DEVICES["h100"]
    big = cost.count(torch.matmul, torch.empty(4096, 4096), torch.empty(4096, 4096))
    added = cost.count(torch.add, torch.empty(4096, 4096), torch.empty(4096, 4096))
    assert cost.bound(big, h100, "bfloat16") == "compute"
    assert cost.bound(added, h100, "bfloat16") == "memory"
    compute = big.flops / h100.rate("bf16")
    seconds = cost.compute_seconds(big, h100, "bfloat16", efficiency=0.5, launch_overhead_s=0)
    assert seconds == pytest.approx(2 * compute)
    moving = added.bytes / h100.memory_bandwidth
    assert cost.compute_seconds(added, h100, efficiency=1.0, launch_overhead_s=1e-6) == pytest.approx(moving + 1e-6)


def test_roofline_refuses_what_the_card_lacks():
    with pytest.raises(ValueError, match="no bfloat16"):
        cost.compute_seconds(Counts(1e9, 1e6), specs.DEVICES["t4"], "bf16")
    with pytest.raises(ValueError, match="efficiency"):
        cost.compute_seconds(Counts(1e9, 1e6), specs.DEVICES["h100"], efficiency=1.5)


# ---------------------------------------------------------------------------------------------
# Messages and collectives
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_collectives(ranks):
    link = specs.Link("test", latency_s=1e-5, bandwidth_Bps=1e9, source="a test")
    nbytes, n = 8e6, ranks
    step = 1e-5 + nbytes / n / 1e9  # one message of a chunk
    assert cost.message_seconds(nbytes, link) == pytest.approx(1e-5 + 8e-3)
    assert cost.collective_seconds("all_reduce", nbytes, n, link) == pytest.approx(2 * (n - 1) * step)
    assert cost.collective_seconds("all_reduce", nbytes, n, link) == ring_all_reduce_time(nbytes, n, 1e9, 1e-5)
    assert cost.collective_seconds("reduce_scatter", nbytes, n, link) == pytest.approx((n - 1) * step)
    assert cost.collective_seconds("all_gather", nbytes, n, link) == pytest.approx((n - 1) * step)
    assert cost.collective_seconds("broadcast", nbytes, n, link) == pytest.approx((n - 1) * 1e-5 + nbytes / 1e9)
    assert cost.collective_seconds("barrier", 0, n, link) == pytest.approx(2 * (n - 1) * 1e-5)


def test_collective_edges():
    link = specs.LINKS["nvlink4"]
    assert cost.collective_seconds("all_reduce", 1e6, 1, link) == 0.0
    with pytest.raises(ValueError, match="all_reduce"):
        cost.collective_seconds("allreduce", 1e6, 2, link)
    with pytest.raises(ValueError, match="ranks"):
        cost.collective_seconds("all_reduce", 1e6, 0, link)


# ---------------------------------------------------------------------------------------------
# Devices, links, nodes
# ---------------------------------------------------------------------------------------------


def test_tables_have_sources_and_dense_rates():
    for device in specs.DEVICES.values():  # a GPU `pipelab calibrate` measured names its file instead
        assert ("http" in device.source or device.source.startswith("measured by pipelab calibrate")) \
            and device.flops["float32"] > 0
    for link in specs.LINKS.values():
        assert "http" in link.source and "estimate" in link.latency_source
    h100 = specs.DEVICES["h100"]
    assert h100.rate(torch.bfloat16) == pytest.approx(989.5e12)  # half the sheet's 1,979 "with sparsity"
    assert specs.LINKS["nvlink4"].bandwidth_Bps == pytest.approx(450e9)  # 900 GB/s is both directions


def test_parse_node():
    node = specs.parse_node("4xH100-nvlink")
    assert (node.count, node.device.name, node.link.name) == (4, "NVIDIA H100 SXM", "NVLink 4")
    assert specs.parse_node("8xa100-nvlink").link.name == "NVLink 3"
    assert specs.parse_node("2xA100-ib-ndr").link.name == "InfiniBand NDR 400G"
    assert specs.parse_node("2xL4").link.name == "PCIe 4 x16"  # no NVLink: its own PCIe
    assert specs.parse_node("2xT4-pcie").link.name == "PCIe 3 x16"
    assert specs.parse_node(node) is node
    assert specs.Node.from_json(node.to_json()) == node


@pytest.mark.parametrize("name, message", [
    ("4xMI300X-nvlink", "known devices: .*h100"),
    ("H100-nvlink", "COUNTxDEVICE-LINK"),
    ("0xH100", "COUNTxDEVICE-LINK"),
    ("2xH100-token-ring", "known links: .*nvlink4"),
    ("2xL4-nvlink", "has no NVLink"),
])
def test_parse_node_refuses(name, message):
    with pytest.raises(ValueError, match=message) as error:
        specs.parse_node(name)
    assert "e.g. '4xH100-nvlink'" in str(error.value)


def test_add_device_and_link():
    mine = specs.Device("My Card", {"fp32": 10e12}, memory_bandwidth=500e9, memory_bytes=32e9,
                        source="my data sheet, https://example.com/sheet.pdf")
    try:
        specs.add_device("mycard", mine)
        specs.add_link("myfabric", specs.Link("My Fabric", 2e-6, 100e9, "https://example.com/fabric"))
        node = specs.parse_node("2xmycard-myfabric")
        assert node.device.flops == {"float32": 10e12} and node.link.bandwidth_Bps == 100e9
        with pytest.raises(ValueError, match="already known"):
            specs.add_device("mycard", mine)
        with pytest.raises(ValueError, match="source"):
            specs.add_device("other", specs.Device("Other", {"fp32": 1e12}, 1e9, 1e9, source=""))
        with pytest.raises(ValueError, match="> 0"):
            specs.add_device("other", specs.Device("Other", {"fp32": 0}, 1e9, 1e9, source="x"))
    finally:
        specs.DEVICES.pop("mycard", None)
        specs.LINKS.pop("myfabric", None)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer, dtype, per_parameter", [
    ("sgd", torch.float32, 4 + 4),
    ("momentum", torch.float32, 4 + 4 + 4),
    ("adam", torch.float32, 4 + 4 + 8),
    ("adam", torch.bfloat16, 2 + 2 + 4 + 8),  # ZeRO's 16 bytes: bf16 weights and grads, fp32 master and moments
])
def test_bytes_per_parameter(optimizer, dtype, per_parameter):
    breakdown = memory.rank_memory(1000, specs.DEVICES["a100"], optimizer=optimizer, param_dtype=dtype)
    assert breakdown.total == 1000 * per_parameter


def test_the_sentence_and_the_refusal():
    h100 = specs.DEVICES["h100"]
    breakdown = memory.rank_memory(5_025_000_000, h100, stage=1, activation_bytes=12.7e9 / 4, microbatches_in_flight=4)
    assert breakdown.sentence() == ("stage 1 would need 93.1 GB of an 80 GB NVIDIA H100 SXM (parameters 20.1, "
                                    "gradients 20.1, Adam 40.2, activations 12.7)")
    assert not breakdown.fits
    with pytest.raises(ValueError, match=r"stage 1 would need 93\.1 GB .* more stages") as error:
        memory.check_fits(breakdown)
    assert "checkpoint" in str(error.value) and "ZeRO" in str(error.value)
    small = memory.rank_memory(1_000_000, h100, stage=0)
    assert memory.check_fits(small) is small and "16.0 MB of an 80 GB" in small.sentence()


def test_stashed_activations_and_checkpointing():
    batch, width, hidden = 8, 1024, 4096
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
    x = torch.empty(batch, width, device="meta")
    # x (first linear), its output (GELU's input), GELU's output (second linear); weights not counted
    per_microbatch = F32 * (batch * width + batch * hidden + batch * hidden)
    assert memory.stashed_bytes(mlp, x) == per_microbatch
    stage = memory.stage_memory(mlp, x, specs.DEVICES["l4"], optimizer="sgd", microbatches_in_flight=4)
    params = sum(p.numel() for p in mlp.parameters())
    assert stage.activations == 4 * per_microbatch and stage.parameters == F32 * params
    saved = memory.stage_memory(mlp, x, specs.DEVICES["l4"], optimizer="sgd", microbatches_in_flight=4, checkpoint=True)
    assert saved.activations == 4 * F32 * batch * width + per_microbatch


def test_microbatches_in_flight():
    assert memory.microbatches_in_flight("gpipe", 0, 4, 8) == 8
    assert [memory.microbatches_in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert memory.microbatches_in_flight("1f1b", 0, 4, 2) == 2
    with pytest.raises(ValueError, match="schedule"):
        memory.microbatches_in_flight("zb", 0, 4, 8)


def test_memory_meter_peak():
    meter = memory.MemoryMeter(specs.DEVICES["t4"], fixed_bytes=10e9)
    meter.stash(4e9)
    meter.stash(4e9)
    meter.release(4e9)
    assert meter.current == 14e9 and meter.peak == 18e9 and not meter.fits


# ---------------------------------------------------------------------------------------------
# Anchors
# ---------------------------------------------------------------------------------------------


def test_anchors_as_published():
    assert round(anchors.anchor("tutorial_pipeline_split20_speedup").value - 1, 2) == 0.49
    assert round(anchors.anchor("tutorial_pipeline_split12_speedup").value - 1, 2) == 0.54
    assert round(anchors.anchor("tutorial_naive_mp_slowdown").value - 1, 2) == 0.07
    assert anchors.gpipe_bubble(4, 8) == pytest.approx(3 / 11)
    assert anchors.gpipe_bubble(1, 8) == 0
    for item in anchors.ANCHORS.values():
        assert "http" in item.source and item.where
    row = anchors.beside("torchgpipe_resnet101_pipeline2", 1.5)
    assert row["published"] == 1.414 and row["emulated / published"] == pytest.approx(1.5 / 1.414)
    with pytest.raises(ValueError, match="tutorial_naive_mp_slowdown"):
        anchors.anchor("nope")


def test_counting_in_another_dtype_and_stage_seconds():
    layer, x = nn.Linear(64, 32), torch.randn(8, 64)
    full = cost.forward_backward_counts(layer, x)
    half = cost.forward_backward_counts(layer, x, torch.bfloat16)
    assert [c.flops for c in half] == [c.flops for c in full]
    assert [2 * c.bytes for c in half] == [c.bytes for c in full]
    h100 = specs.DEVICES["h100"]
    seconds = cost.stage_seconds(layer, x, h100, "bf16", efficiency=0.5, launch_overhead_s=5e-6)
    assert seconds["F"] == pytest.approx(cost.compute_seconds(half[0], h100, "bf16", 0.5, 5e-6))
    assert seconds["B"] == pytest.approx(cost.compute_seconds(half[1] + half[2], h100, "bf16", 0.5, 5e-6))
    assert seconds["I"] + seconds["W"] >= seconds["B"] * (1 - 1e-9)  # split, each pays its own roofline
    stage = memory.stage_memory(layer, x, h100, dtype=torch.bfloat16)
    assert stage.parameters == 2 * (64 * 32 + 32) and stage.master_weights == 4 * (64 * 32 + 32)

"""Every model-parallel variant equals the one-device model: outputs and gradients; bad input."""

import copy

import pytest
import torch

from pipelab import model_parallel as mp
from pipelab.streams import Device


@pytest.fixture
def devs():
    ds = [Device("cpu:0"), Device("cpu:1")]
    yield ds
    for d in ds:
        d.close()


def _reference(model, x, y):
    ref = copy.deepcopy(model)
    loss = torch.nn.functional.cross_entropy(ref(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def _data(kind):
    torch.manual_seed(0)
    if kind == "toy":
        return mp.ToyModel(), torch.randn(12, 10), torch.randint(0, 5, (12,))
    return mp.SplitResNet(channels=8, blocks_per_half=1), torch.randn(12, 3, 8, 8), torch.randint(0, 10, (12,))


@pytest.mark.parametrize("kind", ["toy", "resnet"])
@pytest.mark.parametrize("variant,split", [("one_device", None), ("naive", None), ("pipelined", 5),
                                           ("pipelined", 1), ("dual_stream", 4)])
def test_variant_matches_one_device(devs, kind, variant, split):
    model, x, y = _data(kind)
    ref_loss, ref_grads = _reference(model, x, y)
    loss, tl = mp.train_step(model, x, y, devs, variant=variant, split_size=split)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-5)
    if variant in ("pipelined", "dual_stream"):
        splits = -(-x.shape[0] // split)
        assert len(tl.filter(rank="cpu:0", lane="compute", kind="F")) == splits
    if variant == "dual_stream":
        assert len(tl.filter(rank="cpu:1", lane="copy")) == splits


def test_split_size_out_of_range(devs):
    model, x, _ = _data("toy")
    for bad in (0, -1, 13):
        with pytest.raises(ValueError, match=f"split_size={bad}"):
            mp.forward_pipelined(model, x, devs, bad)


def test_more_devices_than_halves(devs):
    model, x, _ = _data("toy")
    with pytest.raises(ValueError, match="3 devices"):
        mp.forward_naive(model, x, devs + [Device("cpu:2")])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_dual_stream_on_two_gpus():
    from pipelab.streams import devices

    ds = devices(2)
    model, x, y = _data("resnet")
    ref_loss, ref_grads = _reference(model, x, y)
    mp.place(model, ds)
    loss, tl = mp.train_step(model, x, y, ds, variant="dual_stream", split_size=4)
    torch.testing.assert_close(loss.cpu(), ref_loss, atol=1e-4, rtol=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref_grads[n], atol=1e-4, rtol=1e-4)
    assert {"cuda:0", "cuda:1"} <= set(tl.ranks)

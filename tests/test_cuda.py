"""The CUDA paths: CUDA-event spans, NCCL process groups, CUDA streams, events and copies.

Skipped on machines without a GPU (CI). On a one-GPU machine the single-process lessons' two
"devices" are two Device objects on the same GPU, each with its own streams (`devices(2,
device="cuda")`, the lessons' `device="cuda"`): that exercises the same stream, event and copy code
as two GPUs do (it does not show idle devices, which needs two)."""

import threading

import pytest
import torch

from pipelab import launch
from pipelab import model_parallel as mp
from pipelab.experiments.model_parallel import Config, Forward, train_step
from pipelab.experiments.split_pipelining import hazard_report
from pipelab.models import SplitResNet
from pipelab.reference import reference_run
from pipelab.streams import CudaDevice, CudaStream, Event, VirtualDevice, timeline
from pipelab.timeline import Recorder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_recorder_times_kernels_with_cuda_events():
    dev = torch.device("cuda", 0)
    rec = Recorder(rank=0, device=dev)
    a = torch.randn(2048, 2048, device=dev)
    for mb in range(3):
        with rec.span("F", mb=mb):
            a = a @ a
            a = a / a.norm()
    spans = list(rec.timeline())
    assert [s.mb for s in spans] == [0, 1, 2]
    assert all(s.end > s.start for s in spans)
    # kernels on one stream run in order: each span starts after the previous one ends
    assert all(b.start >= a.end - 1e-6 for a, b in zip(spans, spans[1:]))


def _nccl_worker(ctx):
    import torch.distributed as dist

    t = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    with ctx.rec.span("allreduce", lane="comm"):
        dist.all_reduce(t)
    return {"device": str(ctx.device), "backend": ctx.backend, "sum": t.cpu(), "timeline": ctx.timeline()}


def test_spawn_with_nccl_one_rank_per_gpu():
    n = torch.cuda.device_count()
    results = launch.spawn(_nccl_worker, n, backend="nccl", timeout=120)
    expected = torch.full((4,), float(n * (n + 1) // 2))
    for rank, r in enumerate(results):
        assert r["backend"] == "nccl" and r["device"] == f"cuda:{rank}"
        torch.testing.assert_close(r["sum"], expected)
        assert [s.kind for s in r["timeline"]] == ["allreduce"]


@pytest.fixture
def gpu_devs():
    # two Device objects on one GPU: separate streams and recorders, the same code path as two GPUs
    ds = [CudaDevice("cuda:0"), CudaDevice(f"cuda:{min(1, torch.cuda.device_count() - 1)}")]
    yield ds
    for d in ds:
        d.close()


def test_stream_waits_for_event_on_cuda(gpu_devs):
    dev = gpu_devs[0]
    side, main = dev.stream("side"), dev.stream("compute")
    x = dev.own(torch.ones(4096, 4096))
    slow = side.submit(lambda t: (t @ t) @ t, x, kind="F")  # long kernels on the side stream
    done = Event()
    done.record(side)
    main.wait(done)
    y = main.submit(lambda t: t.sum(), slow, kind="F").result()
    dev.synchronize()
    # ones @ ones = 4096 everywhere, @ ones again = 4096**2; summed over 4096**2 entries
    assert y.item() == pytest.approx(4096.0 ** 4, rel=1e-3)
    spans = timeline([dev]).filter(kind="F")
    side_span = spans.filter(lane="side").spans[0]
    main_span = spans.filter(lane="compute").spans[0]
    assert main_span.start >= side_span.end - 1e-6


@pytest.mark.parametrize("variant,split", [("one_device", None), ("naive", None), ("pipelined", 4),
                                           ("dual_stream", 4)])
def test_model_parallel_variants_on_cuda_match_cpu_reference(gpu_devs, variant, split):
    torch.manual_seed(0)
    model = SplitResNet(channels=8, blocks_per_half=1)
    x, y = torch.randn(12, 3, 8, 8), torch.randint(0, 10, (12,))
    ref = reference_run(model, x, y, torch.nn.functional.cross_entropy, lr=None)
    if variant == "one_device":
        model.to(gpu_devs[0].torch_device)
    else:
        mp.place(model, gpu_devs)
    loss, tl = train_step(Config(model=model, x=x, y=y, devs=gpu_devs), Forward(variant, split))
    torch.testing.assert_close(loss.cpu(), torch.tensor(ref.loss), atol=1e-4, rtol=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref.grads[name], atol=1e-4, rtol=1e-4)
    assert len(tl.filter(kind="F")) >= 1
    if variant == "dual_stream":
        assert len(tl.filter(lane="copy")) == 3


def test_cuda_device_gets_cuda_streams_and_refuses_a_virtual_event(gpu_devs):
    s = gpu_devs[0].stream("compute")
    assert isinstance(s, CudaStream)
    cpu = VirtualDevice("cpu:0")
    gate = threading.Event()
    cpu.stream().submit(gate.wait, 5)
    pending = Event()
    pending.record(cpu.stream())  # not reached yet: the virtual stream is held by the gate
    with pytest.raises(ValueError, match="virtual device"):
        s.wait(pending)
    gate.set()
    pending.synchronize()
    s.wait(pending)  # passed already: nothing to wait for
    cpu.close()


def test_race_demo_with_a_late_producer_on_cuda(gpu_devs):
    torch.manual_seed(0)
    model = mp.place(SplitResNet(channels=8, blocks_per_half=1, expansion=4), gpu_devs)
    cfg = Config(model=model, x=torch.randn(12, 3, 8, 8), y=torch.randint(0, 10, (12,)), devs=gpu_devs)
    good = hazard_report(cfg, 4, use_events=True)
    assert good.wrong_splits == [] and good.raw_hazards == []
    late = hazard_report(cfg, 4, use_events=False, late_producer=True)
    assert late.raw_hazards == [0, 1, 2]  # device 0 spun for a second: every read came first
    assert len(late.timeline.filter(kind="held")) == 1


# ---------------------------------------------------------------------------------------------
# One clock per rank: communication timed with CUDA events too (no future callback as a stamp)
# ---------------------------------------------------------------------------------------------

def _compute_then_flat_all_reduce(ctx):
    from pipelab.ddp import FlatAllReduce

    a = torch.randn(4096, 4096, device=ctx.device)
    with ctx.rec.span("F"):
        for _ in range(4):
            a = a @ a
            a = a / a.norm()
    flat = torch.ones(1 << 22, device=ctx.device)
    FlatAllReduce(flat, rec=ctx.rec, bucket=0).wait()
    torch.cuda.synchronize(ctx.device)
    return ctx.timeline(), flat[0].item()


def test_an_all_reduce_span_is_cuda_events_after_the_compute_it_follows():
    """With NCCL an all-reduce's future completes when the collective is enqueued; timed by it, a
    span came out near 0 s and before the kernels it waits for. Timed by events on the stream that
    waits for it, the span lasts the collective and starts once the compute before it is done."""
    n = torch.cuda.device_count()
    for timeline, total in launch.spawn(_compute_then_flat_all_reduce, n, backend="nccl", timeout=120):
        assert total == n
        (f,), (comm,) = timeline.filter(kind="F").spans, timeline.filter(kind="allreduce").spans
        assert comm.duration > 0 and f.duration > 0
        assert comm.start >= f.end - 1e-6  # launched behind the matrix products on the same stream
        assert timeline.overlap("compute", "comm") == 0.0


def test_ddp_on_cuda_times_every_span_with_events_and_naive_overlaps_nothing():
    from pipelab import experiments
    from pipelab.experiments import ddp
    from pipelab.models import mlp
    from pipelab.reference import assert_same

    n = torch.cuda.device_count()
    torch.manual_seed(0)
    model = mlp([1024] * 7)
    x, y = torch.randn(64 * n, 1024), torch.randn(64 * n, 1024)
    cfg = ddp.Config(model=model, x=x, y=y, world_size=n, bucket_cap_mb=4.0, steps=3, variants=("naive", "bucketed"))
    runs = experiments.run(ddp.worker, cfg, ddp.gather)
    reference = reference_run(model, x, y, cfg.loss_fn, steps=1, lr=cfg.lr)
    for run in runs.values():
        assert_same(run, reference)
        comm = [s for tl in run.steps.timelines for s in tl.filter(kind="allreduce")]
        assert comm and all(s.duration > 0 for s in comm)
    assert runs["naive"].overlap.median == 0.0  # lesson 01's assertion, measured on the GPU


def test_exact_fp32_turns_tf32_off_for_the_check_and_back_on_after():
    from pipelab.reference import exact_fp32

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        a = torch.randn(512, 512, device="cuda", dtype=torch.float32)
        exact = a.double() @ a.double()
        with exact_fp32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            full = a @ a
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
        torch.testing.assert_close(full.double(), exact, atol=1e-3, rtol=1e-5)  # float32, not TF32's 10 bits
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_two_devices_as_streams_of_one_gpu_run_lessons_02_and_03_like_one_device(monkeypatch):
    """`devices(2, device="cuda")` on a one-GPU machine (this one made to look like one): two sets of
    streams of cuda:0, each its own CUDA streams, labelled as such; lesson 02's naive and lesson 03's
    pipelined step give the whole model's loss and gradients, and the timeline has both devices' rows."""
    from pipelab import streams
    from pipelab.experiments import model_parallel as lesson

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with streams.devices(2, device="cuda") as devs:
        assert [d.name for d in devs] == ["cuda:0", "cuda:0"]
        assert [d.label for d in devs] == ["cuda:0 stream 0", "cuda:0 stream 1"]
        assert streams.shares_one_gpu(list(devs))
        assert devs[0].stream("compute").cuda != devs[1].stream("compute").cuda  # each owns its streams
        cfg = lesson.Config.resnet(devs, channels=8, blocks=1, batch=12, size=8, repeats=2)
        for f in (Forward("naive"), Forward("pipelined", 4)):
            lesson.check_against_one_device(cfg, f)  # the one-device model's loss and gradients
            _, tl = train_step(cfg, f)
            assert {s.rank for s in tl.filter(kind="F")} == {"cuda:0 stream 0", "cuda:0 stream 1"}
        run = lesson.naive_run(cfg)
        where = lesson.where(devs)
        assert where.startswith("two streams of one ") and where.endswith(" (shared SMs)")
        assert where in lesson.naive_verdict(run)[2] and " x 2 " not in lesson.naive_verdict(run)[2]


def test_lesson_10s_baseline_is_timed_on_the_gpu_beside_a_modelled_grid():
    """baseline_device="cuda" on an emulated node: one process's tokens/s measured on this GPU, shown in
    a column of its own; the grid's rows stay modelled."""
    from pipelab.data import load_corpus
    from pipelab.experiments import capstone_verdicts
    from pipelab.experiments.capstone import Config

    corpus = load_corpus(max_lines=600)
    cfg = Config(emsize=16, nhead=2, nhid=32, nlayers=2, batch_size=8, num_microbatches=2, speed_steps=2,
                 speed_repeats=2, emulate="4xH100-nvlink")
    capstone_verdicts.check_baseline_device("cuda")
    rate = capstone_verdicts.gpu_baseline(corpus, cfg, "cuda")
    assert len(rate.values) == 2 and all(v > 0 for v in rate.values)
    assert capstone_verdicts.gpu_baseline(corpus, cfg, None) is None

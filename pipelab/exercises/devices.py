"""Exercises of the model-parallel lessons (02-04), on the devices of `pipelab.streams`: the naive
two-device forward, its split-by-split pipelining, and the event that orders a copy stream and a
compute stream. Each is checked against the model run whole in one process, and against the
timeline the devices recorded (which device ran what, whether a read came before its copy)."""

from __future__ import annotations

import threading
import time

import torch

from pipelab.exercises.core import Wrong, call, checker, how_far, same

BATCH, WIDTH, SPLIT = 10, 16, 4  # 10 rows in splits of 4: the last split is shorter
HOLD_SECONDS = 1.0
LATE_COPY_SECONDS = 0.1


def _case():
    from pipelab.models import SplitMLP

    torch.manual_seed(2)
    return SplitMLP(WIDTH, 1, 4), torch.randn(BATCH, WIDTH)


def _hold(stream, until, seconds: float = HOLD_SECONDS) -> None:
    """Keep `stream` busy, as if with earlier work, until `until()` is true (or for at most
    `seconds`): an order the answer does not enforce then goes wrong by construction, not by
    chance. A correct answer waits out the hold, so it costs up to `seconds`."""
    release = stream.hold()

    def watch():
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            time.sleep(0.01)
        release()

    threading.Thread(target=watch, daemon=True).start()


def _late_producer(devs) -> None:
    """Device 0 and device 1's copy stream held until device 1 has run a forward, and each copy
    landing late: a read that does not wait for its copy then comes first every time."""
    ran_forward = lambda: bool(devs[1].timeline().filter(kind="F"))  # noqa: E731
    _hold(devs[0].stream("compute"), ran_forward)
    copy_stream = devs[1].stream("copy")
    _hold(copy_stream, ran_forward)
    land = copy_stream._copy_now

    def late_copy(src, out, chunk_bytes):  # every copy lands late, so nothing unordered reads after it by luck
        time.sleep(LATE_COPY_SECONDS)
        return land(src, out, chunk_bytes)

    copy_stream._copy_now = late_copy


def _slow_consumer(devs) -> None:
    """Device 1 held until device 0 has run every split: split i+1 then starts on device 0 before
    split i ends on device 1, unless the answer waited for split i before submitting i+1."""
    splits = -(-BATCH // SPLIT)
    _hold(devs[1].stream("compute"), lambda: len(devs[0].timeline().filter(kind="F")) >= splits)


def _run(fn, *args, no_grad: bool = False, late_producer: bool = False, slow_consumer: bool = False):
    """`fn(model, x, devs, *args)` on two fresh devices: its output (a tensor) and the timeline."""
    from pipelab import streams

    model, x = _case()
    with torch.no_grad():
        want = model(x)
    with streams.devices(2) as devs:
        if late_producer:
            _late_producer(devs)
        if slow_consumer:
            _slow_consumer(devs)
        with torch.no_grad() if no_grad else torch.enable_grad():
            out = call(fn, model, x, devs, *args)
        out = out.result() if hasattr(out, "result") else out
        tl = streams.timeline(devs)
        labels = [d.label for d in devs]
    if not isinstance(out, torch.Tensor):
        raise Wrong(f"{fn.__name__} returned {type(out).__name__}, not the model's output (a tensor)")
    if out.shape == want.shape and torch.isnan(out).any():
        rows = int(torch.isnan(out).any(dim=-1).sum())
        raise Wrong(f"{rows} of the output's {BATCH} rows are NaN: device 1 read a buffer before its copy filled it "
                    "(a read-after-write race)")
    if out.shape == want.shape and not same(out.detach(), want):
        chunks = want.split(SPLIT)
        if len(chunks) > 1 and same(out.detach(), torch.cat(chunks[::-1])):
            raise Wrong(f"your output holds the splits in reverse order: concatenate the results in the order of "
                        f"the splits (an order mistake)")
    if out.dim() == 2 and out.shape[1] != want.shape[1] and out.shape[1] == WIDTH:
        raise Wrong(f"your output has shape {tuple(out.shape)} where the model's has {tuple(want.shape)}: that is "
                    "the activation between the halves; a part of the model (seq2 and fc: second_half) did not run")
    if not same(out.detach(), want):
        rows = f" ({out.shape[0]} rows where the batch has {BATCH}: is the last, shorter split lost?)" \
            if out.dim() and out.shape[0] != BATCH else ""
        raise Wrong(f"your output {how_far(out.detach(), want)}{rows}")
    return tl, labels


def _forwards(tl, label) -> list:
    return [s for s in tl.filter(rank=label, kind="F")]


@checker("02_naive_forward")
def check_naive_forward(my_forward_naive) -> str:
    """`my_forward_naive(model, x, devs)`: seq1 on device 0, the activation copied to device 1,
    seq2 and fc there (`model_parallel.second_half`)."""
    tl, (d0, d1) = _run(my_forward_naive)
    if not _forwards(tl, d0) or not _forwards(tl, d1):
        idle = d0 if not _forwards(tl, d0) else d1
        raise Wrong(f"device {idle} ran no forward: submit seq1 to devs[0]'s stream and second_half to devs[1]'s")
    if not tl.filter(rank=d1, kind="copy"):
        raise Wrong(f"nothing was copied to {d1}: its stream must copy device 0's activation before using it")
    return f"the output equals the whole model's; {d0} ran seq1, {d1} copied its activation and ran the rest"


@checker("03_split_forward")
def check_split_forward(my_forward_pipelined) -> str:
    """`my_forward_pipelined(model, x, devs, split_size)`: the batch cut into splits, each through
    device 0 then device 1, every split submitted before any result is waited for."""
    tl, (d0, d1) = _run(my_forward_pipelined, SPLIT, slow_consumer=True)
    splits = -(-BATCH // SPLIT)
    for label in (d0, d1):
        ran = {s.mb for s in _forwards(tl, label)}
        if len(ran) != splits:
            raise Wrong(f"{label} ran {len(ran)} split(s) ({sorted(ran, key=str)}) where a batch of {BATCH} in splits "
                        f"of {SPLIT} has {splits}: submit each split with its mb=i, cut with x.split(split_size)")
    if not tl.filter(rank=d1, kind="copy"):
        raise Wrong(f"nothing was copied to {d1}: copy each split's activation with devs[1]'s stream before using it")
    first, second = sorted(_forwards(tl, d0), key=lambda s: s.start), sorted(_forwards(tl, d1), key=lambda s: s.start)
    if all(later.start >= done.end for later, done in zip(first[1:], second)):
        raise Wrong(f"{d0} started each split only after {d1} had finished the one before: each split's result was "
                    "waited for before the next was submitted, so the devices never work at once; submit every "
                    "split first, then wait for the results")
    return f"the output equals the whole model's; all {splits} splits of {SPLIT} rows were in flight at once on both devices"


@checker("04_event_wait")
def check_event_wait(my_dual_stream) -> str:
    """`my_dual_stream(model, x, devs, split_size)`: each split's copy goes on device 1's copy
    stream into a buffer; device 1's compute must wait for an event recorded after that copy."""
    from pipelab.model_parallel import raw_hazards

    try:
        tl, (d0, d1) = _run(my_dual_stream, SPLIT, no_grad=True, late_producer=True)
    except Wrong as e:
        if "NaN" in str(e):
            raise Wrong(f"{e}: does device 1's compute stream wait for an Event recorded after each copy?") from None
        raise
    if not tl.filter(rank=d1, kind="copy"):
        raise Wrong(f"nothing was copied to {d1}: copy each split on devs[1].stream('copy') into a buffer")
    early = raw_hazards(tl, d1)
    if early:
        raise Wrong(f"split(s) {early}: {d1}'s compute started before the copy had landed (a read-after-write race): "
                    "make the compute stream wait for an Event recorded on the copy stream after each copy")
    return f"the output equals the whole model's, and {d1} read every split only after its copy landed"

"""Lesson 04: a copy stream and a compute stream. Each split's copy lands in a buffer device 1
owns; the compute stream reads that buffer, so it must wait for an event recorded on the copy
stream after the copy (nothing else orders them)."""

import torch

from pipelab.model_parallel import cut_shape, second_half
from pipelab.streams import Event


def my_dual_stream(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    copy_stream = devs[1].stream("copy")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        buf = copy_stream.empty(cut_shape(model, xs), xs.dtype, fill=float("nan"))
        copy_stream.copy(h, out=buf, mb=i)
        landed = Event()
        landed.record(copy_stream)
        s1.wait(landed)
        outs.append(s1.submit(second_half, model, buf, kind="F", mb=i))
    return torch.cat([o.result() for o in outs])

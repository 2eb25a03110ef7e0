"""Lesson 03: pipelining over splits. Every split is submitted to device 0, copied and submitted to
device 1 before any result is waited for, so device 0 works on split i+1 while device 1 runs split
i; x.split keeps the last, shorter split."""

import torch

from pipelab.model_parallel import second_half


def my_forward_pipelined(model, x, devs, split_size):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    outs = []
    for i, xs in enumerate(x.split(split_size)):
        h = s0.submit(model.seq1, devs[0].own(xs), kind="F", mb=i)
        h1 = s1.copy(h, mb=i)
        outs.append(s1.submit(second_half, model, h1, kind="F", mb=i))
    return torch.cat([o.result() for o in outs])

"""Lesson 02: the naive two-device forward. Device 0 runs seq1; its output is copied onto device 1
(the copy waits for seq1, since it is handed seq1's Future); device 1 runs seq2 and fc."""

from pipelab.model_parallel import second_half


def my_forward_naive(model, x, devs):
    s0, s1 = devs[0].stream("compute"), devs[1].stream("compute")
    h = s0.submit(model.seq1, devs[0].own(x), kind="F", mb=0)
    h1 = s1.copy(h, mb=0)
    return s1.submit(second_half, model, h1, kind="F", mb=0).result()

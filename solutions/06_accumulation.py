"""Lesson 06: one micro-batch's backward on one stage, under gradient accumulation. Only the loss is
divided by the number of micro-batches (each micro-batch's loss is a mean over its samples, and the
batch's loss is their mean); the gradient another stage sends back already carries that factor,
so a middle or first stage passes it on unchanged."""


def my_backward(output, grad_output, num_microbatches):
    if grad_output is None:  # the last stage: output is this micro-batch's loss
        (output / num_microbatches).backward()
    else:
        output.backward(grad_output)

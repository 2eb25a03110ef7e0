"""Lesson 07: sends and receives in an order that cannot deadlock. Rank 1 sends micro-batch mb's
gradient right after its forward and backward, so rank 0 must post the receive of that gradient
before it sends activation mb+1 (under NCCL's rule a send waits for its receive). Rank 0 still
computes forward mb+1 first, while rank 1 works on mb: one forward, one backward (1F1B)."""


def my_pipeline_loop(rank, num_microbatches, stage, send, recv):
    if rank == 0:
        send("activation", 0, stage.forward(0))
        for mb in range(num_microbatches):
            ahead = stage.forward(mb + 1) if mb + 1 < num_microbatches else None
            stage.backward(mb, recv("gradient", mb))
            if ahead is not None:
                send("activation", mb + 1, ahead)
    else:
        for mb in range(num_microbatches):
            stage.forward(mb, recv("activation", mb))
            send("gradient", mb, stage.backward(mb))

"""Lesson 15: dispatch. Sort the rows by expert, so each destination rank's rows are one consecutive
chunk; count the rows per rank; exchange the counts (only the sender knows how many it sends);
then one all_to_all_single with uneven split sizes moves the rows."""

import torch
import torch.distributed as dist


def my_dispatch(rows, expert, experts_per_rank):
    world = dist.get_world_size()
    order = torch.argsort(expert, stable=True)
    send = torch.bincount(expert // experts_per_rank, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    arrived = rows.new_empty(int(recv.sum()), rows.shape[1])
    dist.all_to_all_single(arrived, rows[order], recv.tolist(), send.tolist())
    return arrived

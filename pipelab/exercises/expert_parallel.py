"""Lesson 15's exercise: dispatching tokens to the ranks that hold their experts."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pipelab.exercises.core import Wrong, checker, on_ranks, student_call
from pipelab.worker import RankContext

EP_RANKS = 2
EXPERTS_PER_RANK = 2
# Each rank's rows go to these experts: uneven on purpose (rank 0 sends 3 rows to itself and 9 to
# rank 1, rank 1 sends 7 to rank 0 and keeps 5), so an even split of 6 and 6 is wrong, and so is a
# rank that receives what it sends.
EXPERT_OF_ROW = ([3, 0, 2, 3, 1, 3, 2, 3, 0, 3, 2, 3], [1, 0, 1, 2, 0, 1, 3, 2, 1, 3, 2, 0])


def dispatch_case(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows, each saying where it is from (source rank, expert, index), and experts."""
    expert = torch.tensor(EXPERT_OF_ROW[rank])
    index = torch.arange(len(expert))
    rows = torch.stack([torch.full_like(index, rank), expert, index], dim=1).float()
    return torch.cat([rows, torch.randn(len(expert), 2, generator=torch.Generator().manual_seed(rank))], dim=1), expert


def expected_arrivals(rank: int) -> torch.Tensor:
    """What rank `rank` must receive: from each source rank in turn, its rows for this rank's
    experts, grouped by expert, each expert's rows in their original order."""
    mine = range(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    parts = []
    for source in range(EP_RANKS):
        rows, expert = dispatch_case(source)
        parts += [rows[expert == e] for e in mine]
    return torch.cat(parts)


def _dispatch_rank(ctx: RankContext, fn):
    rows, expert = dispatch_case(ctx.rank)
    with _split_sizes_checked():  # inside the recorder, which fails a request never waited for
        got, _ = student_call(ctx, fn, rows.clone(), expert.clone(), EXPERTS_PER_RANK)
    return got.clone() if isinstance(got, torch.Tensor) else got


@contextmanager
def _split_sizes_checked():
    """`dist.all_to_all_single` that first checks, on every rank, that what each rank expects from
    each other rank is what that rank sends it: gloo aborts the process on a mismatch (NCCL would
    read or write past a buffer), so the mistake is named here instead."""
    import torch.distributed as dist

    real = dist.all_to_all_single

    def checked(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        n = dist.get_world_size(group)
        expects = list(output_split_sizes) if output_split_sizes else [output.shape[0] // n] * n
        sends = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
        if sum(sends) != input.shape[0] or sum(expects) != output.shape[0]:
            raise Wrong(f"rank {dist.get_rank()}'s input_split_sizes {sends} add up to {sum(sends)} for an input of "
                        f"{input.shape[0]} rows, its output_split_sizes {expects} to {sum(expects)} for an output of "
                        f"{output.shape[0]}: the order is (output, input, output_split_sizes, input_split_sizes), "
                        "the counts this rank receives before the counts it sends")
        everyone = [None] * n
        dist.all_gather_object(everyone, (expects, sends), group=group)
        for r, (want, _) in enumerate(everyone):
            for s, (_, sent) in enumerate(everyone):
                if want[s] != sent[r]:
                    raise Wrong(f"rank {r} expects {want[s]} rows from rank {s} (its output_split_sizes), but rank {s} "
                                f"sends it {sent[r]} (its input_split_sizes): a rank cannot know what the others will "
                                "send it; exchange the counts first (an all_to_all_single of the per-rank counts)")
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = checked
    try:
        yield
    finally:
        dist.all_to_all_single = real


@checker("15_dispatch")
def check_dispatch(my_dispatch) -> str:
    """`my_dispatch(rows, expert, experts_per_rank)`: send each row to the rank holding its expert
    (rank = expert // experts_per_rank) with all_to_all_single; return the rows this rank received."""
    for rank, got in enumerate(on_ranks(_dispatch_rank, EP_RANKS, my_dispatch)):
        want = expected_arrivals(rank)
        if not isinstance(got, torch.Tensor):
            raise Wrong(f"rank {rank}: my_dispatch returned {type(got).__name__}, not the received rows")
        if got.shape == want.shape and torch.equal(got, want):
            continue
        _explain(rank, got, want)
    received = [[int((expected_arrivals(r)[:, 0] == s).sum()) for s in range(EP_RANKS)] for r in range(EP_RANKS)]
    return (f"each rank received the rows for its {EXPERTS_PER_RANK} experts, grouped by source rank, then expert "
            f"(uneven: from ranks 0 and 1, rank 0 got {received[0]}, rank 1 {received[1]})")


def _explain(rank: int, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise `Wrong` naming the mistake the received rows show."""
    if got.dim() != 2 or got.shape[1] != want.shape[1]:
        raise Wrong(f"rank {rank} returned shape {tuple(got.shape)}; return the received rows, "
                    f"({want.shape[0]}, {want.shape[1]})")
    experts = got[:, 1].long()
    local = experts // EXPERTS_PER_RANK == rank
    if got.shape[0] == len(EXPERT_OF_ROW[rank]) and bool((got[:, 0] == rank).all()):
        raise Wrong(f"rank {rank} returned its own {got.shape[0]} rows, the ones it sends: return the output "
                    "all_to_all_single filled, the rows the other ranks sent this one")
    per_source = [int((got[:, 0] == s).sum()) for s in range(EP_RANKS)]
    sent = [int((want[:, 0] == s).sum()) for s in range(EP_RANKS)]
    even = len(EXPERT_OF_ROW[0]) // EP_RANKS
    if per_source == [even] * EP_RANKS and per_source != sent:
        raise Wrong(f"rank {rank} received {per_source} rows from ranks {list(range(EP_RANKS))}, an even split, where "
                    f"the senders had {sent} for it: pass input_split_sizes and output_split_sizes (the counts, "
                    "exchanged first)")
    if not bool(local.all()):
        if bool((experts % EP_RANKS == rank).all()):
            raise Wrong(f"rank {rank} received the rows of experts {sorted(set(experts.tolist()))}: experts are placed "
                        f"in consecutive blocks, expert e on rank e // experts_per_rank, not e % world_size")
        wrong = int((~local).sum())
        raise Wrong(f"rank {rank} received {wrong} row(s) of other ranks' experts "
                    f"(e.g. expert {int(experts[~local][0])}): "
                    "all_to_all_single sends consecutive chunks, the first input_split_sizes[0] rows to rank 0 and so "
                    "on, so sort the rows by expert (hence by destination rank) before sending")
    if got.shape[0] != want.shape[0]:
        raise Wrong(f"rank {rank} received {got.shape[0]} rows where {want.shape[0]} were sent to it")
    raise Wrong(f"rank {rank} received the right rows in another order: keep them grouped by source rank, "
                "and within each by expert in their original order (a stable sort by expert)")

"""Lesson 15's exercise: dispatching tokens to the ranks that hold their experts."""

from __future__ import annotations

import torch

from pipelab.exercises.core import Wrong, call, checker, on_ranks
from pipelab.worker import RankContext

EP_RANKS = 2
EXPERTS_PER_RANK = 2
# Each rank's rows go to these experts: uneven on purpose (rank 0 sends 3 rows to itself and 9 to
# rank 1, rank 1 the reverse), so an even split of 6 and 6 is wrong.
EXPERT_OF_ROW = ([3, 0, 2, 3, 1, 3, 2, 3, 0, 3, 2, 3], [1, 0, 1, 2, 0, 1, 3, 0, 1, 1, 2, 0])


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
    try:
        got = call(fn, rows.clone(), expert.clone(), EXPERTS_PER_RANK)
    except Wrong as e:
        if "split" in str(e).lower() or "size" in str(e).lower():
            raise Wrong(f"rank {ctx.rank}: {e}. all_to_all_single checks the split sizes: a rank's output_split_sizes "
                        "must be what each rank sends it, which only the senders know: exchange the counts "
                        "first (an all_to_all_single of the per-rank counts)") from None
        raise
    return got.clone() if isinstance(got, torch.Tensor) else got


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
    return (f"each rank received the rows for its {EXPERTS_PER_RANK} experts (uneven: 3 from itself, 9 from "
            "the other), grouped by source rank, then expert")


def _explain(rank: int, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise `Wrong` naming the mistake the received rows show."""
    if got.dim() != 2 or got.shape[1] != want.shape[1]:
        raise Wrong(f"rank {rank} returned shape {tuple(got.shape)}; return the received rows, ({want.shape[0]}, {want.shape[1]})")
    experts = got[:, 1].long()
    local = experts // EXPERTS_PER_RANK == rank
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
        raise Wrong(f"rank {rank} received {wrong} row(s) of other ranks' experts (e.g. expert {int(experts[~local][0])}): "
                    "all_to_all_single sends consecutive chunks, the first input_split_sizes[0] rows to rank 0 and so "
                    "on, so sort the rows by expert (hence by destination rank) before sending")
    if got.shape[0] != want.shape[0]:
        raise Wrong(f"rank {rank} received {got.shape[0]} rows where {want.shape[0]} were sent to it")
    raise Wrong(f"rank {rank} received the right rows in another order: keep them grouped by source rank, "
                "and within each by expert in their original order (a stable sort by expert)")

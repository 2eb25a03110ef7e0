"""Pipeline schedules: for every rank, the ordered list of actions it runs in one training step.

A schedule says, for each rank, in which order it runs its forwards `F` and backwards `B` (or a
backward's two halves, `I` and `W`): the action vocabulary of `actions.py`. The orders below are
the ones `torch.distributed.pipelining` executes (GPipe, 1F1B, interleaved 1F1B and its zero-bubble
schedule with one stage per rank, i.e. ZB-H1), written out one rule at a time. `validate` (from
`actions.py`, importable from here too) checks any schedule, including one you write by hand.
"""

from __future__ import annotations

from collections import Counter

from pipelab.checks import whole_number
from pipelab.pipeline.actions import (KINDS, Action, B, F, I, ScheduleError, W, dependencies, play,  # noqa: F401
                                      validate)


class Schedule:
    """The action lists of all ranks for `num_microbatches` micro-batches on `num_ranks` ranks.

    Stage `s` lives on rank `s % num_ranks`, so with `stages_per_rank` = v > 1 each rank holds v
    "virtual" stages (rank 0 holds stages 0, p, 2p, ...). Subclasses define `rank_actions`; a
    schedule written by hand (or lowered from another library) is given its `actions` and `name`."""

    name = "custom"

    def __init__(self, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1,
                 actions: list[list[Action]] | None = None, name: str | None = None):
        self.num_ranks = whole_number("num_ranks", num_ranks, example="num_ranks=2")
        self.num_microbatches = whole_number("num_microbatches", num_microbatches,
                                             example="num_microbatches=4")
        self.stages_per_rank = whole_number("stages_per_rank", stages_per_rank, example="stages_per_rank=2")
        if name is not None:
            if not isinstance(name, str):
                raise ValueError(f"a schedule's name must be a string, got {name!r}; e.g. name='my 1F1B'")
            self.name = name
        if actions is None:
            actions = [self.rank_actions(r) for r in range(num_ranks)]
        self.actions: list[list[Action]] = [list(a) for a in actions]

    def rank_actions(self, rank: int) -> list[Action]:
        raise NotImplementedError("a custom Schedule is given its actions directly")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        """The rank that holds `stage`."""
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` holds, first to last."""
        return [rank + k * self.num_ranks for k in range(self.stages_per_rank)]

    def split_backwards(self) -> set[tuple[int, int]]:
        """The (stage, micro-batch) pairs whose backward runs as `I` then `W` instead of one `B`."""
        return {(a.stage, a.mb) for actions in self.actions for a in actions if a.kind == "I"}

    def table(self) -> str:
        """The action lists as text, a row per rank (no timing: see `simulate` for that)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))

    def __repr__(self) -> str:
        v = f", v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return f"{type(self).__name__}(p={self.num_ranks}, m={self.num_microbatches}{v})"


# ---------------------------------------------------------------------------------------------
# The schedules
# ---------------------------------------------------------------------------------------------

class ScheduleGPipe(Schedule):
    """GPipe (fill-drain): every forward, then every backward. Bubble (p-1)/(m+p-1); each rank
    stashes the activations of all m micro-batches."""

    name = "GPipe"

    def rank_actions(self, rank: int) -> list[Action]:
        m = self.num_microbatches
        return [F(rank, i) for i in range(m)] + [B(rank, i) for i in range(m)]


class Schedule1F1B(Schedule):
    """1F1B (PipeDream-flush): p - rank forwards to fill the pipe, then one backward, one forward,
    ... Same bubble as GPipe, but rank r stashes at most p - r micro-batches instead of m."""

    name = "1F1B"

    def rank_actions(self, rank: int) -> list[Action]:
        m, p = self.num_microbatches, self.num_ranks
        warmup = min(m, p - rank)  # the last stage starts backward after its first forward
        actions = [F(rank, i) for i in range(warmup)]
        next_f = warmup
        for next_b in range(m):  # steady state: B, then F while forwards remain; then drain
            actions.append(B(rank, next_b))
            if next_f < m:
                actions.append(F(rank, next_f))
                next_f += 1
        return actions


class ScheduleInterleaved1F1B(Schedule):
    """Interleaved 1F1B (Megatron-LM): each rank holds v stages and cycles through them in rounds of
    micro-batches, so the pipe fills v times faster: bubble (p-1)/(v*m + p-1). The price is
    messages: all v*p - 1 stage boundaries cross ranks, so a step sends 2m(vp-1) of them against
    1F1B's 2m(p-1), (vp-1)/(p-1) times as many (3x for p=2, v=2; close to v for many ranks). As in torch, m need not be a multiple of p: the m micro-batches are
    cut into max(1, m // p) equal rounds, so m must be a multiple of that number of rounds."""

    name = "Interleaved 1F1B"
    warmup_factor = 2  # extra warm-up forwards per hop from the last rank

    def __init__(self, num_ranks: int, num_microbatches: int, stages_per_rank: int = 2):
        whole_number("num_ranks", num_ranks, example="num_ranks=2")
        whole_number("num_microbatches", num_microbatches, example="num_microbatches=4")
        rounds = max(1, num_microbatches // num_ranks)
        if num_microbatches % rounds:
            ok = [k for k in range(max(1, num_microbatches - 4), num_microbatches + 5)
                  if k % max(1, k // num_ranks) == 0]
            raise ValueError(
                f"{type(self).__name__} with num_ranks={num_ranks} cannot take "
                f"num_microbatches={num_microbatches}: it runs micro-batches in "
                f"max(1, m // p) = {rounds} equal rounds, and {num_microbatches} is not a multiple "
                f"of {rounds}; use a multiple of num_ranks, or one of {ok}")
        self.microbatches_per_round = num_microbatches // rounds
        super().__init__(num_ranks, num_microbatches, stages_per_rank)

    def _warmup_ops(self, rank: int) -> int:
        """Forwards before the first backward: a round per extra virtual stage, plus the hops."""
        v, p = self.stages_per_rank, self.num_ranks
        warmup = (v - 1) * self.microbatches_per_round + self.warmup_factor * (p - 1 - rank)
        return min(warmup, self.num_microbatches * v)

    def _forward_stage(self, rank: int, op: int) -> int:
        """Forwards go through the rank's stages first to last, a round of micro-batches each."""
        local = (op // self.microbatches_per_round) % self.stages_per_rank
        return local * self.num_ranks + rank

    def _backward_stage(self, rank: int, op: int) -> int:
        """Backwards go through them last to first, a round each, counted from the first backward."""
        local = self.stages_per_rank - 1 - (op // self.microbatches_per_round) % self.stages_per_rank
        return local * self.num_ranks + rank

    def rank_actions(self, rank: int) -> list[Action]:
        total = self.num_microbatches * self.stages_per_rank  # forwards (and backwards) on this rank
        warmup = self._warmup_ops(rank)
        next_mb: Counter = Counter()  # per (kind, stage): the next micro-batch to run

        def take(kind: str, stage: int) -> Action:
            mb = next_mb[kind, stage]
            next_mb[kind, stage] += 1
            return Action(kind, stage, mb)

        actions = [take("F", self._forward_stage(rank, op)) for op in range(warmup)]
        for op in range(total - warmup):  # steady state: one forward, one backward
            actions.append(take("F", self._forward_stage(rank, warmup + op)))
            actions.append(take("B", self._backward_stage(rank, op)))
        for op in range(total - warmup, total):  # cool-down: the remaining backwards
            actions.append(take("B", self._backward_stage(rank, op)))
        return actions


class ScheduleZeroBubble(Schedule):
    """Zero-bubble ZB-H1 (Qi et al., 2024): 1F1B with the backward split into I (input gradient,
    on the critical path) and W (weight gradient, which nobody waits for). Rank r holds back its
    first r W's and runs them in the cool-down, where 1F1B idles. With equal F, I and W costs each
    rank idles p-1 slots instead of 1F1B's 3(p-1), and stashes as many micro-batches. Same order
    as torch's ScheduleInterleavedZeroBubble with one stage per rank."""

    name = "ZB-H1"

    def rank_actions(self, rank: int) -> list[Action]:
        m, p = self.num_microbatches, self.num_ranks
        warmup = min(m, p - 1 - rank)
        actions = [F(rank, i) for i in range(warmup)]
        next_w = 0
        for k in range(m):  # the k-th input gradient, after a forward while forwards remain
            if warmup + k < m:
                actions.append(F(rank, warmup + k))
            actions.append(I(rank, k))
            if k >= rank:  # rank r holds back its first r weight gradients
                actions.append(W(rank, next_w))
                next_w += 1
        actions += [W(rank, i) for i in range(next_w, m)]  # the held-back W's fill the tail
        return actions


def messages_per_step(schedule: Schedule) -> int:
    """The point-to-point messages one step of `schedule` sends: an activation after each forward
    of every stage but the last, a gradient after each backward (B or I) of every stage but the
    first; stage s and s+1 always live on different ranks (p > 1). That is 2m(S-1) for S stages."""
    if schedule.num_ranks == 1:
        return 0
    last = schedule.num_stages - 1
    return sum((a.kind == "F" and a.stage < last) or (a.kind in ("B", "I") and a.stage > 0)
               for actions in schedule.actions for a in actions)


SCHEDULES: dict[str, type[Schedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleZeroBubble,
}


def make_schedule(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 2,
                  check: bool = True) -> Schedule:
    """Build a schedule by name ("gpipe", "1f1b", "interleaved", "zb-h1") and validate it."""
    key = name.lower() if isinstance(name, str) else None
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    cls = SCHEDULES[key]
    if cls is ScheduleInterleaved1F1B:
        schedule = cls(num_ranks, num_microbatches, stages_per_rank)
    else:
        schedule = cls(num_ranks, num_microbatches)
    if check:
        validate(schedule)
    return schedule

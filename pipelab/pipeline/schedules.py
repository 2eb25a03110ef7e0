"""Pipeline schedules: for every rank, the ordered list of actions it runs in one training step.

A pipeline cuts a model into stages and a batch into micro-batches. A schedule says, for each
rank, in which order it runs

* `F(stage, mb)`: the forward pass of one stage on one micro-batch,
* `B(stage, mb)`: its backward pass (in a zero-bubble schedule only the *input* gradient),
* `W(stage, mb)`: the *weight* gradient, split off from `B` so it can fill idle time.

The orders below are the ones `torch.distributed.pipelining` executes (GPipe, 1F1B, interleaved
1F1B and its zero-bubble schedule with one stage per rank, i.e. ZB-H1), written out one rule at a
time. `validate` checks any schedule, including one you write by hand.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or repeated action, or ranks that would wait forever."""


@dataclass(frozen=True)
class Action:
    """One unit of work of a schedule: `kind` ("F", "B" or "W") of `stage` on micro-batch `mb`."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:  # torch's notation: stage, kind, micro-batch ("1F0")
        return f"{self.stage}{self.kind}{self.mb}"

    __repr__ = __str__


def F(stage: int, mb: int) -> Action:
    """Forward of `stage` on micro-batch `mb`."""
    return Action("F", stage, mb)


def B(stage: int, mb: int) -> Action:
    """Backward (input gradient) of `stage` on micro-batch `mb`."""
    return Action("B", stage, mb)


def W(stage: int, mb: int) -> Action:
    """Weight gradient of `stage` on micro-batch `mb` (zero-bubble schedules only)."""
    return Action("W", stage, mb)


class Schedule:
    """The action lists of all ranks for `num_microbatches` micro-batches on `num_ranks` ranks.

    Stage `s` lives on rank `s % num_ranks`, so with `stages_per_rank` = v > 1 each rank holds v
    "virtual" stages (rank 0 holds stages 0, p, 2p, ...). Subclasses define `rank_actions`."""

    name = "custom"
    split_backward = False  # True when B computes only input gradients and W the weight gradients

    def __init__(self, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1,
                 actions: list[list[Action]] | None = None, split_backward: bool | None = None):
        _check_positive("num_ranks", num_ranks, "e.g. num_ranks=2")
        _check_positive("num_microbatches", num_microbatches, "e.g. num_microbatches=4")
        _check_positive("stages_per_rank", stages_per_rank, "e.g. stages_per_rank=2")
        self.num_ranks = num_ranks
        self.num_microbatches = num_microbatches
        self.stages_per_rank = stages_per_rank
        if split_backward is not None:
            self.split_backward = split_backward
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

    def table(self) -> str:
        """The action lists as text, a row per rank (no timing: see `simulate` for that)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))

    def __repr__(self) -> str:
        v = f", v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return f"{type(self).__name__}(p={self.num_ranks}, m={self.num_microbatches}{v})"


def _check_positive(name: str, value, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}; pass {hint}")


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
    micro-batches, so the pipe fills v times faster: bubble (p-1)/(v*m + p-1), for v times more
    point-to-point messages. As in torch, m need not be a multiple of p: the m micro-batches are
    cut into max(1, m // p) equal rounds, so m must be a multiple of that number of rounds."""

    name = "Interleaved 1F1B"
    warmup_factor = 2  # extra warm-up forwards per hop from the last rank

    def __init__(self, num_ranks: int, num_microbatches: int, stages_per_rank: int = 2):
        _check_positive("num_ranks", num_ranks, "e.g. num_ranks=2")
        _check_positive("num_microbatches", num_microbatches, "e.g. num_microbatches=4")
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
    """Zero-bubble ZB-H1 (Qi et al., 2024): 1F1B with the backward split into B (input gradient,
    on the critical path) and W (weight gradient, which nobody waits for). Rank r holds back its
    first r W's and runs them in the cool-down, where 1F1B idles. With equal F, B and W costs each
    rank idles p-1 slots instead of 1F1B's 3(p-1), and stashes as many micro-batches. Same order as torch's
    ScheduleInterleavedZeroBubble with one stage per rank."""

    name = "ZB-H1"
    split_backward = True

    def rank_actions(self, rank: int) -> list[Action]:
        m, p = self.num_microbatches, self.num_ranks
        warmup = min(m, p - 1 - rank)
        actions = [F(rank, i) for i in range(warmup)]
        next_w = 0
        for k in range(m):  # the k-th backward, after a forward while forwards remain
            if warmup + k < m:
                actions.append(F(rank, warmup + k))
            actions.append(B(rank, k))
            if k >= rank:  # rank r holds back its first r weight gradients
                actions.append(W(rank, next_w))
                next_w += 1
        actions += [W(rank, i) for i in range(next_w, m)]  # the held-back W's fill the tail
        return actions


SCHEDULES: dict[str, type[Schedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleZeroBubble,
}


def make_schedule(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 2,
                  check: bool = True) -> Schedule:
    """Build a schedule by name ("gpipe", "1f1b", "interleaved", "zb-h1") and validate it."""
    key = name.lower()
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


# ---------------------------------------------------------------------------------------------
# The validator
# ---------------------------------------------------------------------------------------------

def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The actions that must finish before `action` can start (wherever they run)."""
    s, mb = action.stage, action.mb
    if action.kind == "F":
        return [F(s - 1, mb)] if s > 0 else []
    if action.kind == "B":  # needs its own forward, and the gradient from the next stage
        return [F(s, mb)] + ([B(s + 1, mb)] if s < num_stages - 1 else [])
    return [B(s, mb)]  # W reuses the output gradient that B received


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless `schedule` can run: each rank runs only its own stages; every
    (stage, mb) has exactly one F and one B (and one W when the backward is split); and executing
    every rank's list in order, with sends that never block, no rank waits forever."""
    S, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule!r} has action lists for {len(schedule.actions)} ranks, expected {p}")
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    counts: Counter = Counter()
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind not in kinds or not (0 <= a.stage < S) or not (0 <= a.mb < m):
                raise ScheduleError(f"rank {rank}: {a} is not an action of {schedule!r} "
                                    f"(kinds {kinds}, stages 0..{S - 1}, micro-batches 0..{m - 1})")
            if schedule.rank_of(a.stage) != rank:
                raise ScheduleError(f"rank {rank} runs {a}, but stage {a.stage} lives on rank "
                                    f"{schedule.rank_of(a.stage)}")
            counts[a] += 1
    for kind in kinds:
        for s in range(S):
            for mb in range(m):
                n = counts[Action(kind, s, mb)]
                if n != 1:
                    raise ScheduleError(f"{Action(kind, s, mb)} appears {n} times in {schedule!r}; "
                                        "every (stage, micro-batch) needs exactly one")
    _check_progress(schedule)


def _check_progress(schedule: Schedule) -> None:
    """Run every rank's list in order (a rank blocks until its next action's inputs exist)."""
    done: set[Action] = set()
    position = [0] * schedule.num_ranks
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            while position[rank] < len(actions):
                a = actions[position[rank]]
                if not all(d in done for d in dependencies(a, schedule.num_stages)):
                    break
                done.add(a)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[position[r]]) for r, acts in enumerate(schedule.actions)
                     if position[r] < len(acts)}
            raise ScheduleError(f"{schedule!r} deadlocks: every rank waits for an input that never "
                                f"comes; the ranks are stuck at {stuck}")

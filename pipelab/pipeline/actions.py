"""The vocabulary of pipeline schedules: actions, and the rules that say whether a list of them
can run.

A pipeline cuts a model into stages and a batch into micro-batches. One unit of work is an action:

* `F(stage, mb)`: the forward pass of one stage on one micro-batch,
* `B(stage, mb)`: its full backward pass (the gradients of the input and of the weights), or
  split in two, so that the part nobody waits for can fill idle time:
* `I(stage, mb)`: the gradient of the stage's *input* only (the previous stage waits for it),
* `W(stage, mb)`: the gradient of its *weights* only (after its `I`).

These are torch's names too: `torch.distributed.pipelining` calls them FORWARD "F", FULL_BACKWARD
"B", BACKWARD_INPUT "I" and BACKWARD_WEIGHT "W" (`_ComputationType`), and writes an action as
stage, kind, micro-batch ("1F0"). A schedule (`schedules.py`) orders them for every rank;
`dependencies` says what each action waits for, `play` runs the ranks' lists on paper and
`validate` checks any schedule, including one written by hand.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Protocol


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or repeated action, or ranks that would wait forever."""


@dataclass(frozen=True)
class Action:
    """One unit of work of a schedule: `kind` ("F", "B", "I" or "W") of `stage` on micro-batch `mb`."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:  # torch's notation: stage, kind, micro-batch ("1F0")
        return f"{self.stage}{self.kind}{self.mb}"

    __repr__ = __str__


KINDS = ("F", "B", "I", "W")


class Plan(Protocol):
    """What `play` and `validate` read of a schedule (`schedules.Schedule` is one): every rank's
    action list, the sizes, where each stage lives, and which backwards are split in I and W."""

    actions: list[list[Action]]

    @property
    def num_ranks(self) -> int: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def num_microbatches(self) -> int: ...

    def rank_of(self, stage: int) -> int: ...

    def split_backwards(self) -> set[tuple[int, int]]: ...


def F(stage: int, mb: int) -> Action:
    """Forward of `stage` on micro-batch `mb`."""
    return Action("F", stage, mb)


def B(stage: int, mb: int) -> Action:
    """Full backward of `stage` on micro-batch `mb`: input and weight gradients at once."""
    return Action("B", stage, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E743 - torch's name for it
    """Input gradient only of `stage` on micro-batch `mb`: what the previous stage waits for."""
    return Action("I", stage, mb)


def W(stage: int, mb: int) -> Action:
    """Weight gradient only of `stage` on micro-batch `mb`, after its `I`."""
    return Action("W", stage, mb)


def dependencies(action: Action, num_stages: int, split: Container[tuple[int, int]] = ()) -> list[Action]:
    """The actions that must finish before `action` can start (wherever they run). `split` holds
    the (stage, mb) pairs whose backward is an `I` and a `W` (see `Schedule.split_backwards`)."""
    s, mb = action.stage, action.mb
    if action.kind == "F":  # the previous stage's activation
        return [F(s - 1, mb)] if s > 0 else []
    if action.kind == "W":  # reuses the output gradient that its I received
        return [I(s, mb)]
    # B or I: its own forward, and the gradient of the next stage's input (made by its B or its I)
    if s == num_stages - 1:
        return [F(s, mb)]
    next_grad = I if (s + 1, mb) in split else B
    return [F(s, mb), next_grad(s + 1, mb)]


def play(schedule: Plan) -> Iterator[tuple[int, Action, list[Action]]]:
    """Run every rank's list in order, on paper: a rank blocks until its next action's inputs exist;
    sends never block. Yields (rank, action, its dependencies) in an order where each comes after
    its dependencies and after the rank's earlier actions. Raises ScheduleError on a deadlock.

    `validate` plays a schedule to prove it finishes; `simulate` to time it."""
    split = schedule.split_backwards()
    done: set[Action] = set()
    position = [0] * schedule.num_ranks
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            while position[rank] < len(actions):  # advance this rank as far as its inputs allow
                a = actions[position[rank]]
                deps = dependencies(a, schedule.num_stages, split)
                if not all(d in done for d in deps):
                    break
                yield rank, a, deps
                done.add(a)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[position[r]]) for r, acts in enumerate(schedule.actions)
                     if position[r] < len(acts)}
            raise ScheduleError(f"{schedule!r} deadlocks: every rank waits for an input that never "
                                f"comes; the ranks are stuck at {stuck}")


def validate(schedule: Plan) -> None:
    """Raise ScheduleError unless `schedule` can run: each rank runs only its own stages; every
    (stage, mb) has exactly one F and either exactly one B or exactly one I and one W; and playing
    every rank's list in order (`play`), no rank waits forever."""
    S, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule!r} has action lists for {len(schedule.actions)} ranks, expected {p}")
    counts: Counter = Counter()
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind not in KINDS or not (0 <= a.stage < S) or not (0 <= a.mb < m):
                raise ScheduleError(f"rank {rank}: {a} is not an action of {schedule!r} "
                                    f"(kinds {KINDS}, stages 0..{S - 1}, micro-batches 0..{m - 1})")
            if schedule.rank_of(a.stage) != rank:
                raise ScheduleError(f"rank {rank} runs {a}, but stage {a.stage} lives on rank "
                                    f"{schedule.rank_of(a.stage)}")
            counts[a] += 1
    for s in range(S):
        for mb in range(m):
            _check_counts(schedule, counts, s, mb)
    for _ in play(schedule):
        pass


def _check_counts(schedule: Plan, counts: Counter, s: int, mb: int) -> None:
    """One F, and either one B or one I and one W, for (stage s, micro-batch mb)."""
    n = {kind: counts[Action(kind, s, mb)] for kind in KINDS}
    if n["B"] and (n["I"] or n["W"]):
        raise ScheduleError(f"{B(s, mb)} and {I(s, mb) if n['I'] else W(s, mb)} both appear in "
                            f"{schedule!r}; a backward is either one B or one I and one W")
    wanted = ("F", "I", "W") if n["I"] or n["W"] else ("F", "B")
    for kind in wanted:
        if n[kind] != 1:
            raise ScheduleError(f"{Action(kind, s, mb)} appears {n[kind]} times in {schedule!r}; every "
                                "(stage, micro-batch) needs exactly one F, and one B or one I and one W")

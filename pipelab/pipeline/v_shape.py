"""The newest schedules (lesson 13): two stages per rank on a V, and looped breadth-first.

On a **V** (`VSchedule`), rank r holds stage r and stage 2p-1-r: the stages run down the ranks and
back up, so the turn of the V (stages p-1 and p) sits on the last rank, which hands its activation
and gradient across in memory, and the first and the last stage share rank 0. Two schedules use it:

* **ZB-V** (Qi et al., "Zero Bubble Pipeline Parallelism", 2023, section 6): 1F1B on the V, with
  each backward split into I and W so that the weight gradients fill what would be bubbles;
* **DualPipeV** (DeepSeek-V3, 2024; the V-shaped half of DualPipe): in its steady state a rank runs
  the forward of one micro-batch together with the backward of another (`Overlap`): on a GPU one's
  compute hides the other's communication.

**Looped BFS** (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2022) keeps interleaved 1F1B's
loop placement (stage s on rank s % p) but runs every micro-batch through a rank's earlier stage
before its later one: all forwards stage by stage, then all backwards in reverse.

The per-rank orders are the ones torch 2.13 plans (`ScheduleZBVZeroBubble`, `ScheduleDualPipeV`,
`ScheduleLoopedBFS`), written out one phase at a time. `dualpipe_formulas` gives the DualPipe
README's bubbles and activations to set beside them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

from pipelab.pipeline.actions import Action, B, F, I, W
from pipelab.pipeline.schedules import Schedule


@dataclass(frozen=True)
class Overlap:
    """DualPipe's overlapped pair: `forward` of one micro-batch and `backward` (a full B) of another,
    issued as one action; written as torch writes OVERLAP_F_B."""

    forward: Action
    backward: Action
    kind: ClassVar[str] = "F&B"

    @property
    def parts(self) -> tuple[Action, Action]:
        return self.forward, self.backward

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})OVERLAP_F_B"

    __repr__ = __str__


def expand(actions: list) -> list[Action]:
    """A rank's list with every overlapped pair written as its two actions, forward first."""
    return [part for a in actions for part in (a.parts if isinstance(a, Overlap) else (a,))]


class VSchedule(Schedule):
    """Two stages per rank on a V: rank r holds stage r and stage 2p-1-r."""

    def __init__(self, num_ranks: int, num_microbatches: int, stages_per_rank: int = 2,
                 actions: list | None = None, name: str | None = None):
        if stages_per_rank != 2:
            raise ValueError(f"a V placement holds exactly 2 stages per rank (one going down the ranks, one "
                             f"coming back), got stages_per_rank={stages_per_rank}; use stages_per_rank=2, or "
                             "a loop placement (interleaved 1F1B, looped BFS) for other counts")
        super().__init__(num_ranks, num_microbatches, 2, actions, name)

    def rank_of(self, stage: int) -> int:
        p = self.num_ranks
        return stage if stage < p else 2 * p - 1 - stage

    def stages_of(self, rank: int) -> list[int]:
        return [rank, 2 * self.num_ranks - 1 - rank]

    def expanded(self) -> list[list[Action]]:
        """Every rank's actions with overlapped pairs written out (what `validate` and `play` read)."""
        return [expand(a) for a in self.actions]


class ScheduleZBV(VSchedule):
    """ZB-V: warm up with forwards down and back up the V, then in the steady state one forward, one
    I and one W of each of the rank's two stages; cool down with the I's first and the W's last.
    torch plans it for at least 2p-1 micro-batches and drops those past m."""

    name = "ZB-V"

    def rank_actions(self, rank: int) -> list[Action]:
        p, m = self.num_ranks, self.num_microbatches
        n = max(2 * p - 1, m)  # torch's plan fills the V with at least 2p-1 micro-batches
        down, up = self.stages_of(rank)
        count: dict[tuple[int, str], int] = defaultdict(int)
        ops: list[Action] = []

        def add(kind, stage: int, counter: str | None = None) -> None:
            key = (stage, counter or kind.__name__)
            ops.append(kind(stage, count[key]))
            count[key] += 1

        for _ in range(2 * (p - rank) - 1):  # warm-up: down the V
            add(F, down)
        for _ in range(rank):  # the turn reaches this rank: alternate up and down
            add(F, up)
            add(F, down)
        for _ in range(p - rank):  # the first backwards of the upper stage, each I with its W
            add(F, up), add(I, up), add(W, up)
        while count[up, "F"] < count[down, "F"] or count[down, "F"] < n:  # steady state
            if count[down, "F"] < n:
                add(F, down)
            add(I, down), add(W, down)
            add(F, up), add(I, up), add(W, up)
        for _ in range(rank):  # cool-down: input gradients first, for the ranks that wait on them
            add(I, down), add(I, up)
        for _ in range(p - rank):
            add(I, down), add(W, down)
        for stage in (up, down):  # the weight gradients nobody waits for
            while count[stage, "W"] < count[stage, "I"]:
                add(W, stage)
        return [a for a in ops if a.mb < m]


class ScheduleDualPipeV(VSchedule):
    """DualPipeV, in torch's eight steps: forwards of the lower stage; both stages' forwards; zero
    bubble on the upper stage; the steady state of overlapped pairs (the forward of one stage with
    the backward of the other, both ways); the drain, with I/W split for the second half of the
    backwards; the last weight gradients."""

    name = "DualPipeV"

    def __init__(self, num_ranks: int, num_microbatches: int, stages_per_rank: int = 2,
                 actions: list | None = None, name: str | None = None):
        if actions is None and num_microbatches < 2 * num_ranks:
            raise ValueError(f"DualPipeV needs at least as many micro-batches as stages (2 x {num_ranks} "
                             f"ranks = {2 * num_ranks}), got num_microbatches={num_microbatches}; use "
                             f"num_microbatches >= {2 * num_ranks}")
        super().__init__(num_ranks, num_microbatches, stages_per_rank, actions, name)

    def rank_actions(self, rank: int) -> list:
        p, m = self.num_ranks, self.num_microbatches
        down, up = self.stages_of(rank)
        nxt: dict[tuple[int, str], int] = defaultdict(int)  # next micro-batch per (stage, F or backward)
        pending_w: list[Action] = []  # W's owed by the I's issued so far, oldest first
        ops: list = []

        def forward(stage: int) -> Action:
            nxt[stage, "F"] += 1
            return F(stage, nxt[stage, "F"] - 1)

        def backward(stage: int, split: bool = False) -> Action:
            nxt[stage, "B"] += 1
            mb = nxt[stage, "B"] - 1
            if split:
                pending_w.append(W(stage, mb))
                return I(stage, mb)
            return B(stage, mb)

        def pay_w() -> None:
            if pending_w:
                ops.append(pending_w.pop(0))

        ops += [forward(down) for _ in range(2 * (p - rank - 1))]  # 1: F0
        for _ in range(rank + 1):  # 2: F0 F1
            ops += [forward(down), forward(up)]
        for _ in range(p - rank - 1):  # 3: I1 W1 F1 (zero bubble on the upper stage)
            ops.append(backward(up, split=True))
            pay_w()
            ops.append(forward(up))
        for i in range(m - 2 * p + rank + 1):  # 4: the steady state, F0&B1 then F1&B0
            if i == 0 and rank == p - 1:  # the turn of the V: not overlapped, a smaller bubble
                ops += [forward(down), backward(up)]
            else:
                ops.append(Overlap(forward(down), backward(up)))
            ops.append(Overlap(forward(up), backward(down)))
        for _ in range(p - rank - 1):  # 5: B1, F1&B0
            ops.append(backward(up))
            ops.append(Overlap(forward(up), backward(down)))
        split = False  # 6: B1 B0, the second half of them split into I and W
        for i in range(rank + 1):
            split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
            ops.append(backward(up, split))
            split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
            ops.append(backward(down, split))
        for _ in range(p - rank - 1):  # 7: W0 B0
            pay_w()
            ops.append(backward(down, split))
        for _ in range(rank + 1):  # 8: the last W's
            pay_w()
        return ops


class ScheduleLoopedBFS(Schedule):
    """Looped BFS on the loop placement (stage s on rank s % p): every micro-batch's forward
    through the rank's first stage, then its next stage, ...; then every backward, last stage
    first, micro-batches in reverse."""

    name = "Looped BFS"

    def rank_actions(self, rank: int) -> list[Action]:
        stages, mbs = self.stages_of(rank), range(self.num_microbatches)
        return [F(s, mb) for s in stages for mb in mbs] + [B(s, mb) for s in reversed(stages) for mb in reversed(mbs)]


def dualpipe_formulas(p: int, forward: float, backward: float, weight: float,
                      overlapped: float | None = None) -> dict[str, dict]:
    """The DualPipe README's comparison (deepseek-ai/DualPipe, "Pipeline Bubbles and Memory Usage
    Comparison") for one model on p devices. The README counts in chunks: F, B (full backward), W
    and F&B (an overlapped forward and backward) of one chunk; 1F1B and ZB1P put PP = p chunks on p
    devices, DualPipeV PP = 2p half-size chunks on PP/2 = p. Here `forward`, `backward` and `weight`
    are one *1F1B stage's* F, B and W, so a DualPipeV chunk takes half of each; F&B (`overlapped`)
    defaults to F + B (nothing overlaps). Activations are in micro-batches of one 1F1B stage: the
    README's PP + 1 chunks are p + 1/2 stages."""
    f, b, w = forward / 2, backward / 2, weight / 2
    fb = f + b if overlapped is None else overlapped / 2
    return {"1F1B": {"bubble": (p - 1) * (forward + backward), "activations": p},
            "ZB-H1": {"bubble": (p - 1) * (forward + backward - 2 * weight), "activations": p},
            "DualPipeV": {"bubble": (p - 1) * (fb + b - 3 * w), "activations": p + 0.5}}

"""Point-to-point messages between pipeline stages: activations forward, gradients backward.

A stage's output goes to the next stage (an activation); the gradient of a stage's input goes to
the previous stage (a gradient). Two stages on the same rank hand their tensors over in memory,
without a message.

**Safe on NCCL by construction.** NCCL runs the operations between two ranks one after another, in
the order each rank issued them, and a (large) send does not finish until its receiver has reached
the matching receive. Matching sends to receives in the order the peer sends is not enough: a
receive posted early sits in front of the sends its rank issues after it, so two ranks that each
post a receive before the send the other waits for hang for ever (gloo, which never blocks a send
behind a receive, runs the same program). So every rank issues its operations in one order that
both ends of every pair agree on: the order in which the schedule *makes* the messages. Every rank
knows every action list, so every rank plays the whole schedule on paper (`schedules.play`, which
runs each action after its inputs) and lists, in that order, the messages it sends and receives
(`plan`). A rank then walks its list: each send is issued together with the receives that follow
it, before the next send, in one `batch_isend_irecv` (NCCL's group call), and the receives before
its first send at the start. On each pair of ranks both ends then hold the pair's messages in the
same order, a receive is always posted before the rank needs its message, and a send never waits
behind a receive whose message is made only after it: no cycle, so no deadlock. The tests run
every schedule under NCCL's ordering rule on gloo (`spawn(..., nccl_rule=True)`) to prove it.

On gloo, `batch_isend_irecv` is the same `isend`/`irecv` posted one after the other (gloo has no
group call; PyTorch 2 loops over the operations), so it behaves as the plain calls: no hang, checked
on every schedule at 2 and 4 ranks. On NCCL, a communicator created lazily requires the first
batch of a group to include every rank of it; `worker.init_worker` creates it eagerly (`device_id`).

Every message has its own shape and dtype (a `TensorSpec`): token ids stay integers on their way
into stage 0, an activation is whatever its stage outputs (float32, bf16, ...), and a gradient has
the spec of the activation it belongs to. Only a floating-point activation has a gradient to send
back. The specs of a step are traced once before it (`message_specs`: the stages run on every
micro-batch), so each receive can be posted ahead into a buffer of the right shape and dtype, even
where a stage's output shape differs from one micro-batch to the next. A sender checks its tensor
against the trace: a mismatch fails there, naming the stage and both shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from pipelab.pipeline.schedules import Action, Schedule, play

if TYPE_CHECKING:
    from pipelab.worker import RankContext


@dataclass(frozen=True)
class Message:
    """An activation (`kind`="act", from stage `stage` to stage+1) or a gradient ("grad", from
    stage `stage` to stage-1) of micro-batch `mb`."""

    kind: str
    stage: int
    mb: int


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of a message: what its receiver allocates."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        return cls(tuple(tensor.shape), tensor.dtype)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


def trace(stages: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """Each stage's output on `x`, the stages run in a row without gradients. The stages' buffers
    (BatchNorm's running statistics) and the random state are left as they were. Stages built on
    the meta device (`pipelab.build`) run on a meta copy of `x`: shapes and dtypes, no math."""
    buffers = [b for stage in stages for b in stage.buffers()]
    saved = [b.clone() for b in buffers]
    on_meta = any(p.is_meta for stage in stages for p in stage.parameters())
    outputs, h = [], x.to("meta") if on_meta else x
    with torch.no_grad(), torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
        for stage in stages:
            h = stage(h)
            outputs.append(h)
        for b, old in zip(buffers, saved):
            b.copy_(old)
    return outputs


def message_specs(stages: Sequence[nn.Module], x: torch.Tensor, num_microbatches: int) -> list[list[TensorSpec]]:
    """`specs[mb][s]`: the shape and dtype of stage s's output on micro-batch mb of the batch `x`."""
    return [[TensorSpec.of(out) for out in trace(stages, chunk)] for chunk in x.chunk(num_microbatches)]


def message_sent_by(action: Action, schedule: Schedule) -> Message | None:
    """The message an action sends when it finishes, if any: F sends its output on (except on the
    last stage), B or I send the input gradient back (except on the first), W sends nothing."""
    if action.kind == "F" and action.stage < schedule.num_stages - 1:
        return Message("act", action.stage, action.mb)
    if action.kind in ("B", "I") and action.stage > 0:
        return Message("grad", action.stage, action.mb)
    return None


def destination(msg: Message, schedule: Schedule) -> int:
    """The rank that receives `msg`."""
    return schedule.rank_of(msg.stage + 1 if msg.kind == "act" else msg.stage - 1)


def plan(schedule: Schedule, rank: int, carried=lambda msg: True) -> list[tuple[str, Message]]:
    """The messages `rank` sends ("send") and receives ("recv") over the step, in the order the
    schedule makes them (`schedules.play`): the order both ends of every pair issue them in.
    Messages between two stages on the same rank and those not `carried` do not travel."""
    ops = []
    for src, action, _ in play(schedule):
        msg = message_sent_by(action, schedule)
        if msg is None or not carried(msg) or destination(msg, schedule) == src:
            continue
        if src == rank:
            ops.append(("send", msg))
        elif destination(msg, schedule) == rank:
            ops.append(("recv", msg))
    return ops


class P2P:
    """This rank's sends and receives for one step of `schedule`, NCCL-safe (see the module's
    docstring): each send goes out in one batch with the receives that follow it in the `plan`.

    `specs[mb][s]` is the spec of stage s's output on micro-batch mb (`message_specs`): an activation
    from stage s has it, a gradient from stage s has stage s-1's. `ranks[r]` is the process that runs
    the schedule's rank r (by default process r; in a pipe x data grid, the processes of one pipeline)."""

    def __init__(self, ctx: RankContext, schedule: Schedule, specs: list[list[TensorSpec]],
                 ranks: Sequence[int] | None = None):
        self.ctx, self.schedule, self.specs = ctx, schedule, specs
        self.ranks = list(ranks) if ranks is not None else list(range(schedule.num_ranks))
        self.plan = plan(schedule, ctx.rank, self.carried)
        self.next = 0  # the plan's next operation to issue
        self.posted: dict[Message, tuple] = {}  # message -> (buffer, work) of a posted receive
        self.local: dict[Message, torch.Tensor] = {}  # messages between two stages on this rank
        self.sends: list = []  # (work, tensor) of the sends still in flight
        self.bytes_sent = 0
        self.messages_sent = 0
        self.issue()  # the receives that come before this rank's first send

    def spec(self, msg: Message) -> TensorSpec:
        """The shape and dtype `msg` carries: its activation's (a gradient's is its activation's)."""
        return self.specs[msg.mb][msg.stage if msg.kind == "act" else msg.stage - 1]

    def carried(self, msg: Message) -> bool:
        """Whether `msg` travels at all: every activation does, a gradient only for a
        floating-point activation (token ids have none)."""
        return msg.kind == "act" or self.spec(msg).dtype.is_floating_point

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        """Start sending `tensor` as `msg`, with the receives that follow it; return at once."""
        if not self.carried(msg):
            return
        self.check(msg, tensor)
        dst = destination(msg, self.schedule)
        tensor = tensor.detach()  # the receiver starts a graph of its own, as after a real transfer
        if dst == self.ctx.rank:
            self.local[msg] = tensor
            return
        if self.next >= len(self.plan) or self.plan[self.next] != ("send", msg):
            expected = self.plan[self.next] if self.next < len(self.plan) else "nothing more"
            raise RuntimeError(f"rank {self.ctx.rank} sends {msg}, but its plan's next operation is "
                               f"{expected}: the rank ran its actions out of the schedule's order")
        tensor = tensor.contiguous()
        start, about = self.ctx.rec.now(), dict(lane="comm", mb=msg.mb, to=dst, bytes=tensor.nbytes)
        work = self.issue(tensor)
        self.sends.append((work, tensor, start, about))  # the tensor kept alive until sent
        if not hasattr(work, "end"):  # torch's Work: the span is the call (the send leaves later)
            self.ctx.rec.add("send", start, self.ctx.rec.now(), **about)
        self.bytes_sent += tensor.nbytes
        self.messages_sent += 1

    def issue(self, tensor: torch.Tensor | None = None):
        """Issue, as one batch, the plan's next send (its `tensor`, if given) and every receive
        after it up to the following send, each into a buffer of its message's spec; return the
        send's work."""
        import torch.distributed as dist

        ops = []
        if tensor is not None:
            _, msg = self.plan[self.next]
            ops.append(dist.P2POp(dist.isend, tensor, self.ranks[destination(msg, self.schedule)]))
            self.next += 1
        receives = []
        while self.next < len(self.plan) and self.plan[self.next][0] == "recv":
            _, msg = self.plan[self.next]
            spec = self.spec(msg)
            buffer = torch.empty(spec.shape, dtype=spec.dtype, device=self.ctx.device)
            ops.append(dist.P2POp(dist.irecv, buffer, self.ranks[self.schedule.rank_of(msg.stage)]))
            receives.append((msg, buffer))
            self.next += 1
        if not ops:
            return None
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # one handle for the whole group (NCCL's coalesced work)
            works = [works[-1]] * len(ops)
        for (msg, buffer), work in zip(receives, works[len(ops) - len(receives):]):
            self.posted[msg] = (buffer, work)
        return works[0] if tensor is not None else None

    def check(self, msg: Message, tensor: torch.Tensor) -> None:
        """Refuse to send a tensor other than the one the receiver allocated for `msg`."""
        got, want = TensorSpec.of(tensor), self.spec(msg)
        if got != want:
            what = "output" if msg.kind == "act" else "input gradient"
            raise ValueError(f"stage {msg.stage} made an {what} of {got} on micro-batch {msg.mb}, but the "
                             f"trace before the run (message_specs) gave {want}, and stage "
                             f"{msg.stage + (1 if msg.kind == 'act' else -1)} allocated that. A stage's "
                             "output may change shape from one micro-batch to the next, but must be the "
                             "same each time it runs on the same micro-batch (no random shapes)")

    def recv(self, msg: Message) -> torch.Tensor | None:
        """Wait for `msg` and return its tensor (None for a gradient that does not travel)."""
        if not self.carried(msg):
            return None
        if msg in self.local:
            return self.local.pop(msg)
        if msg not in self.posted:
            raise RuntimeError(f"rank {self.ctx.rank} needs {msg} before its plan posted its receive: "
                               "the rank ran its actions out of the schedule's order")
        src = self.schedule.rank_of(msg.stage)
        with self.ctx.rec.span("recv", lane="comm", mb=msg.mb, frm=src):
            buffer, work = self.posted.pop(msg)
            work.wait()
        return buffer

    def finish(self) -> None:
        """Wait until every send of the step has left. Under NCCL's rule (`pipelab.emulate`) a
        send's work knows when it ended: its span runs from its issue to then, as on a GPU's stream."""
        for work, _, start, about in self.sends:
            work.wait()
            if hasattr(work, "end"):
                self.ctx.rec.add("send", start, work.end, **about)
        self.sends.clear()

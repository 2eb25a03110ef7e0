"""Point-to-point messages between pipeline stages: activations forward, gradients backward.

A stage's output goes to the next stage (an activation); the gradient of a stage's input goes to
the previous stage (a gradient). Both are plain `isend`/`irecv` (gloo has a history of hangs with
`batch_isend_irecv`). Sends never block the sender. A receiver posts its receives in the order its
peer sends (every rank knows every action list), so messages match on NCCL, which pairs sends and
receives between two ranks in the order they are issued, as well as on gloo. Two stages on the same
rank hand their tensors over in memory, without a message.

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
from typing import Sequence

import torch
from torch import nn

from pipelab.pipeline.schedules import Action, Schedule


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
    (BatchNorm's running statistics) and the random state are left as they were."""
    buffers = [b for stage in stages for b in stage.buffers()]
    saved = [b.clone() for b in buffers]
    outputs, h = [], x
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


class P2P:
    """This rank's sends and receives for one step of `schedule`.

    `specs[mb][s]` is the spec of stage s's output on micro-batch mb (`message_specs`): an activation
    from stage s has it, a gradient from stage s has stage s-1's. `lookahead` receives per peer are
    posted before they are asked for, so a message can land while this rank computes. `ranks[r]` is
    the process that runs the schedule's rank r (by default process r; in a pipe x data grid, the
    processes of one pipeline)."""

    def __init__(self, ctx, schedule: Schedule, specs: list[list[TensorSpec]], lookahead: int = 1,
                 ranks: Sequence[int] | None = None):
        self.ctx, self.schedule, self.specs, self.lookahead = ctx, schedule, specs, lookahead
        self.ranks = list(ranks) if ranks is not None else list(range(schedule.num_ranks))
        # For each peer, the messages it sends us, in the order it sends them.
        self.expected: dict[int, list[Message]] = {}
        for src, actions in enumerate(schedule.actions):
            msgs = [m for a in actions if (m := message_sent_by(a, schedule)) and self.carried(m)
                    and src != ctx.rank and destination(m, schedule) == ctx.rank]
            if msgs:
                self.expected[src] = msgs
        self.posted: dict[Message, tuple] = {}  # message -> (buffer, work)
        self.local: dict[Message, torch.Tensor] = {}  # messages between two stages on this rank
        self.sends: list = []  # (work, tensor) of the sends still in flight
        self.bytes_sent = 0
        self.messages_sent = 0
        for src in self.expected:
            self.post_ahead(src)

    def spec(self, msg: Message) -> TensorSpec:
        """The shape and dtype `msg` carries: its activation's (a gradient's is its activation's)."""
        return self.specs[msg.mb][msg.stage if msg.kind == "act" else msg.stage - 1]

    def carried(self, msg: Message) -> bool:
        """Whether `msg` travels at all: every activation does, a gradient only for a
        floating-point activation (token ids have none)."""
        return msg.kind == "act" or self.spec(msg).dtype.is_floating_point

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        """Start sending `tensor` as `msg`; return at once."""
        import torch.distributed as dist

        if not self.carried(msg):
            return
        self.check(msg, tensor)
        dst = destination(msg, self.schedule)
        tensor = tensor.detach()  # the receiver starts a graph of its own, as after a real transfer
        if dst == self.ctx.rank:
            self.local[msg] = tensor
            return
        tensor = tensor.contiguous()
        with self.ctx.rec.span("send", lane="comm", mb=msg.mb, to=dst, bytes=tensor.nbytes):
            self.sends.append((dist.isend(tensor, self.ranks[dst]), tensor))  # kept alive until sent
        self.bytes_sent += tensor.nbytes
        self.messages_sent += 1

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
        src = self.schedule.rank_of(msg.stage)
        with self.ctx.rec.span("recv", lane="comm", mb=msg.mb, frm=src):
            while msg not in self.posted:  # post src's receives in its send order, up to msg
                self.post_next(src)
            buffer, work = self.posted.pop(msg)
            work.wait()
        self.post_ahead(src)
        return buffer

    def post_next(self, src: int) -> None:
        """Post the receive of the next message `src` sends us, into a buffer of its spec."""
        import torch.distributed as dist

        msg = self.expected[src].pop(0)
        spec = self.spec(msg)
        buffer = torch.empty(spec.shape, dtype=spec.dtype, device=self.ctx.device)
        self.posted[msg] = (buffer, dist.irecv(buffer, self.ranks[src]))

    def post_ahead(self, src: int) -> None:
        """Keep `lookahead` receives from `src` posted (one buffer per posted receive)."""
        in_flight = sum(1 for m in self.posted if self.schedule.rank_of(m.stage) == src)
        for _ in range(min(self.lookahead - in_flight, len(self.expected.get(src, [])))):
            self.post_next(src)

    def finish(self) -> None:
        """Wait until every send of the step has left."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()

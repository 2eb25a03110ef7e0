"""Lesson 07's exercise on the order of sends and receives: the student's loop for two pipeline
stages is first played in this process, both ranks on threads, under NCCL's rule (a send waits
until its receive is posted; messages between two ranks pair up in the order they are posted), so a
deadlock is found at once and described by what each rank waits on. An order that finishes then
runs on real ranks, and its gradients are compared with one process's."""

from __future__ import annotations

import threading
from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from pipelab.exercises.core import Wrong, checker, first_line, name_of, on_ranks
from pipelab.exercises.pipeline import (BATCH, NUM_MICROBATCHES, compare_stage_grads, reference_grads,
                                        stage_module, two_stage_case)
from pipelab.worker import RankContext

WIDTH = 8  # the activation between the stages: (BATCH / NUM_MICROBATCHES, WIDTH)


class Stage:
    """What the student's loop drives on one rank: `forward(mb, x=None)` returns what to send on
    (stage 0: the activation; stage 1, given the activation: the micro-batch's loss),
    `backward(mb, grad=None)` returns what to send back (stage 1: the activation's gradient)."""

    def __init__(self, rank: int):
        model, x, y = two_stage_case()
        self.rank, self.module = rank, stage_module(model, rank)
        self.xs, self.ys = x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES)
        self.kept: dict[int, tuple] = {}

    def forward(self, mb: int, x: torch.Tensor | None = None) -> torch.Tensor:
        if self.rank == 0:
            out = self.module(self.xs[mb])
            self.kept[mb] = (out, None)
            return out.detach()
        x = x.detach().requires_grad_()
        loss = nn.functional.mse_loss(self.module(x), self.ys[mb]) / NUM_MICROBATCHES
        self.kept[mb] = (loss, x)
        return loss.detach()

    def backward(self, mb: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        if mb not in self.kept:
            raise Wrong(f"rank {self.rank} runs the backward of micro-batch {mb} before its forward")
        out, x = self.kept.pop(mb)
        out.backward(grad)
        return None if x is None else x.grad

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else p.grad.clone() for n, p in self.module.named_parameters()}


def _what(kind: str, mb: int) -> str:
    return f"{kind} {mb}"


class Deadlock(Exception):
    pass


class RendezvousPair:
    """Two ranks' sends and receives under NCCL's rule, played on threads in this process."""

    def __init__(self):
        self.cond = threading.Condition()
        self.sends = {0: deque(), 1: deque()}  # posted by rank r, not yet received: [kind, mb, tensor, done]
        self.recvs = {0: deque(), 1: deque()}  # posted by rank r, not yet matched: [kind, mb, slot]
        self.waiting: dict[int, str] = {}
        self.finished: set[int] = set()
        self.problem: str | None = None

    def _match(self) -> None:
        for r in (0, 1):
            while self.sends[r] and self.recvs[1 - r]:
                send, recv = self.sends[r].popleft(), self.recvs[1 - r].popleft()
                if send[:2] != recv[:2]:
                    self.problem = (f"rank {1 - r} posts its receive of {_what(*recv[:2])} where rank {r}'s next send is "
                                    f"{_what(*send[:2])}: messages between two ranks pair up in the order they are "
                                    "posted, so both must post them in the same order")
                recv[2].append(send[2])
                send[3].append(True)

    def _check_stuck(self) -> None:
        running = [r for r in (0, 1) if r not in self.finished]
        if self.problem or not running or not all(r in self.waiting and not self.waiting[r][1] for r in running):
            return
        waits = {r: what for r, (what, _) in self.waiting.items()}
        if len(running) == 2:
            self.problem = (f"ranks 0 and 1 wait on each other: rank 0 {waits[0]} while rank 1 {waits[1]} "
                            "(a send waits until its receive is posted, as with NCCL): one of them must receive first, "
                            "or post both with batch_isend_irecv")
        else:
            r = running[0]
            self.problem = f"rank {r} {waits[r]}, which rank {1 - r} never posts (it has finished)"

    def _block(self, rank: int, what: str, done: list) -> None:
        self.waiting[rank] = (what, done)
        self._match()
        self._check_stuck()
        self.cond.notify_all()
        while not done and not self.problem:
            if not self.cond.wait(timeout=30):
                self.problem = f"rank {rank} {what} for 30 s"
        self.waiting.pop(rank, None)
        if not done:
            raise Deadlock(self.problem)

    def send(self, rank: int, kind: str, mb: int, tensor: torch.Tensor) -> None:
        with self.cond:
            done: list = []
            self.sends[rank].append([kind, mb, tensor.detach().clone(), done])
            self._block(rank, f"waits to send {_what(kind, mb)}", done)

    def recv(self, rank: int, kind: str, mb: int) -> torch.Tensor:
        with self.cond:
            slot: list = []
            self.recvs[rank].append([kind, mb, slot])
            self._block(rank, f"waits to receive {_what(kind, mb)}", slot)
            return slot[0]

    def finish(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self._check_stuck()
            self.cond.notify_all()


def _play(fn) -> None:
    """Both ranks' loops on threads under the rendezvous rule; raise Wrong on a deadlock."""
    pair, errors = RendezvousPair(), {}

    def rank_thread(rank: int):
        stage = Stage(rank)
        try:
            fn(rank, NUM_MICROBATCHES, stage, lambda kind, mb, t: pair.send(rank, kind, mb, t),
               lambda kind, mb: pair.recv(rank, kind, mb))
        except Deadlock:
            pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[rank] = e
            with pair.cond:
                pair.problem = pair.problem or "stop"
                pair.cond.notify_all()
        finally:
            pair.finish(rank)

    threads = [threading.Thread(target=rank_thread, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        rank, e = min(errors.items())
        if isinstance(e, (Wrong, NotImplementedError)):
            raise e
        raise Wrong(f"rank {rank}: {name_of(fn)} raised {type(e).__name__}: {first_line(e)}")
    if pair.problem:
        raise Wrong(pair.problem)


def _real_rank(ctx: RankContext, fn) -> dict:
    stage, peer = Stage(ctx.rank), 1 - ctx.rank
    shape = (BATCH // NUM_MICROBATCHES, WIDTH)

    def send(kind, mb, tensor):
        dist.send(tensor.detach().contiguous(), dst=peer)

    def recv(kind, mb):
        buf = torch.empty(shape)
        dist.recv(buf, src=peer)
        return buf

    fn(ctx.rank, NUM_MICROBATCHES, stage, send, recv)
    return stage.grads()


@checker("07_send_recv_order")
def check_send_recv_order(my_pipeline_loop) -> str:
    """`my_pipeline_loop(rank, num_microbatches, stage, send, recv)`: rank 0 runs stage 0, rank 1
    stage 1, each micro-batch's activation goes right (`send("activation", mb, t)`) and its gradient
    comes back left (`send("gradient", mb, t)`); `recv(kind, mb)` returns the tensor. A send waits
    until the peer posts its receive, as with NCCL: the loop must not deadlock."""
    _play(my_pipeline_loop)
    model, x, y = two_stage_case()
    compare_stage_grads(on_ranks(_real_rank, 2, my_pipeline_loop), reference_grads(model, x, y), {},
                        "does every micro-batch go forward and backward once?")
    return (f"no deadlock under NCCL's rule, and on real ranks both stages' gradients equal one process's "
            f"({NUM_MICROBATCHES} micro-batches)")

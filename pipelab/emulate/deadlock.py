"""Deadlocks under NCCL's ordering rule (`pipelab.emulate.comm`), reported within seconds.

A *watchdog* thread on each rank publishes what the rank waits on in the rendezvous store; when
every rank that has not finished has waited `watchdog_seconds` without any progress, each raises a
`DeadlockError` naming every stuck rank and the operation it waits on. spawn reports it as a
`WorkerError`. (A single transfer that really takes longer than that would be misread as a
deadlock; the lessons' messages take milliseconds.) On a machine busier than its cores the wait is
stretched by its load (at most `MAX_STRETCH` times): a rank starved of CPU is slow, not stuck.
"""

from __future__ import annotations

import json
import os
import threading
import time

from pipelab.emulate.queues import Op

WATCHDOG_SECONDS = 5.0  # without progress on any rank for this long, the ranks are deadlocked
_TICK = 0.2  # how often the watchdog publishes this rank's state and looks at the others'
_FOUND = "deadlock"  # the store key of the first report, which every rank then raises
MAX_STRETCH = 6.0  # the most a busy machine stretches the wait


def patience(seconds: float) -> float:
    """`seconds` stretched by how much busier than its cores the machine is (1-minute load average)."""
    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no load average or affinity here (Windows, macOS)
        return seconds
    return seconds * min(MAX_STRETCH, max(1.0, load / max(1, cores)))


class DeadlockError(RuntimeError):
    """The ranks wait for each other under NCCL's ordering rule: on GPUs this program hangs."""


class Watchdog:
    """Publishes what this rank waits on (in the rendezvous store) and raises the alarm when every
    rank that has not finished has waited `seconds` without progress anywhere. `rule` is the rank's
    `comm.Rule` (its rank, world size, and the deadlock once found)."""

    def __init__(self, rule, store, seconds: float):
        self.rule, self.store, self.seconds = rule, store, seconds
        self.waiting_on: Op | None = None
        self.since = time.monotonic()
        self.progress = time.monotonic()
        self.finished = False
        self.published = None
        if store is not None:
            self.publish()
            threading.Thread(target=self.watch, name="nccl-rule watchdog", daemon=True).start()

    def wait_starts(self, op: Op) -> None:
        self.since, self.waiting_on = time.monotonic(), op

    def wait_ends(self) -> None:
        self.waiting_on = None

    def finish(self) -> None:
        """This rank's function returned: it waits for nobody any more."""
        self.finished = True
        if self.store is not None:
            self.publish()

    def found_elsewhere(self) -> DeadlockError | None:
        """The deadlock another rank reported, if one did. A rank that raised it may already have
        left, closing its connections: its peers' operations then fail, and this says why."""
        try:
            if self.store is not None and self.store.check([_FOUND]):
                return DeadlockError(self.store.get(_FOUND).decode())
        except Exception:  # noqa: BLE001 - the store is gone with the rank that hosted it
            pass
        return None

    def state(self) -> dict:
        if self.finished:
            return {"state": "finished"}
        op = self.waiting_on
        if op is None:
            return {"state": "running"}
        return {"state": "waiting", "what": self.describe(op), "since": max(self.since, self.progress)}

    def describe(self, op: Op) -> str:
        """"rank 0 waits for its send to rank 1 (op 2 on channel 0<->1), queued behind its ...\""""
        text = f"rank {self.rule.rank} waits for its {op.describe()}"
        head = op.queue.current if op.queue is not None else []
        if head and op not in head:
            text += ", queued behind its " + " and ".join(h.describe() for h in head)
        elif op.queue is not None and (behind := [o for o in list(op.queue.pending) if o not in head and o is not op]):
            text += f", before it can run its {behind[0].describe()}"
        return text

    def publish(self) -> None:
        state = self.state()
        if state != self.published:
            self.store.set(str(self.rule.rank), json.dumps(state))
            self.published = state

    def everyone(self) -> list[dict]:
        """Every rank's published state (a rank that has not published yet is still starting)."""
        return [json.loads(self.store.get(str(r))) if self.store.check([str(r)]) else {"state": "running"}
                for r in range(self.rule.world_size)]

    def stuck(self, states: list[dict]) -> bool:
        """Every rank finished or waiting, at least one waiting, none progressed for `seconds`."""
        now, wait = time.monotonic(), patience(self.seconds)
        waiting = [s for s in states if s["state"] == "waiting"]
        return (bool(waiting) and all(s["state"] in ("waiting", "finished") for s in states)
                and all(now - s["since"] > wait for s in waiting))

    def watch(self) -> None:
        while self.rule.deadlock is None:
            time.sleep(_TICK)
            try:
                self.publish()
                if self.waiting_on is None or time.monotonic() - self.state().get("since", 0) <= self.seconds:
                    continue
                if self.store.check([_FOUND]):  # another rank found it first: every rank says the same
                    self.rule.deadlock = DeadlockError(self.store.get(_FOUND).decode())
                    continue
                first = self.everyone()
                if not self.stuck(first):
                    continue
                time.sleep(2 * _TICK)  # confirm: a rank that just moved on has published it by now
                if self.everyone() == first and self.waiting_on is not None:
                    report = self.report(first)
                    self.store.set(_FOUND, report)
                    self.rule.deadlock = DeadlockError(report)
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending
                return

    def report(self, states: list[dict]) -> str:
        lines = [s["what"] if s["state"] == "waiting" else f"rank {r} has finished its function"
                 for r, s in enumerate(states)]
        return (f"deadlock under NCCL's ordering rule: no rank made progress for {patience(self.seconds):.3g} s.\n  "
                + ";\n  ".join(lines) + ".\nOn GPUs this program hangs: NCCL runs the operations between two "
                "ranks one after another in the order each rank issued them, and a send waits until its "
                "receiver has reached the matching receive. Issue each step's matched sends and receives "
                "together (dist.batch_isend_irecv), or post a receive only after the sends its peer is "
                "waiting for.")

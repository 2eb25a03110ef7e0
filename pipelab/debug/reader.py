"""Read the flight recorders' dumps of all ranks together: who waits for whom, and who fell behind.

One rank's dump says only what it waits on. Together they say why: a rank waiting on the receive
number n from rank P is waiting for P's send number n, and P's own records say whether P ever
issued it. Likewise a rank waiting on collective n of a group waits for every rank of the group
that has not issued its collective n. A rank that others wait for and that waits on nothing fell
behind outside communication (computing, loading data, stuck in its own code); ranks that wait for
each other are in a cycle: their operations are issued in orders that do not match.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Wait:
    """`rank` waits on its operation `what`, for `peer`, who issued `peer_count` of those so far."""

    rank: int
    peer: int
    what: str
    peer_count: int
    wanted: int  # how many of them the waiting operation needs the peer to have issued

    def sentence(self) -> str:
        return (f"rank {self.rank} waits for rank {self.peer}: its {self.what} is issued, and rank {self.peer} "
                f"issued {self.peer_count} of the matching operations where it needs {self.wanted}")


@dataclass(frozen=True)
class Diagnosis:
    """Who waits for whom (`waits`), the ranks others wait for that wait on nothing (`behind`),
    and ranks that wait for each other (`cycle`)."""

    waits: list[Wait]
    behind: list[int]
    cycle: list[int]
    last: dict[int, str]  # each rank's last record, in words

    def sentences(self) -> list[str]:
        lines = [w.sentence() for w in self.waits]
        for rank in self.behind:
            lines.append(f"rank {rank} fell behind: it waits on no operation; its last one, {self.last[rank]}, "
                         "completed, and it issued nothing after (it is stuck in its own work)")
        if self.cycle:
            lines.append(f"ranks {', '.join(map(str, self.cycle))} wait for each other: their operations are issued "
                         "in orders that do not match, and none can move")
        return lines or ["no rank waits on an operation"]

    def __str__(self) -> str:
        return "\n".join(self.sentences())


def load_dumps(dump_dir: str) -> dict[int, dict]:
    """Every rank's dump in `dump_dir` (rank-R.json), by rank."""
    dumps = {}
    for name in sorted(os.listdir(dump_dir)):
        if name.startswith("rank-") and name.endswith(".json"):
            with open(os.path.join(dump_dir, name)) as f:
                data = json.load(f)
            dumps[data["rank"]] = data
    return dumps


def issued(dump: dict, kind: str, channel: str) -> int:
    """How many operations of `kind` on `channel` the rank issued (its records' numbers count them,
    also when older records have left the ring buffer)."""
    numbers = [r["number"] for r in dump["records"] if r["kind"] == kind and r["channel"] == channel]
    return max(numbers) + 1 if numbers else 0


def members(channel: str, ranks: list[int]) -> list[int]:
    """The ranks of a collective's group: 'world' or 'ranks 0,2'."""
    return ranks if channel == "world" else [int(r) for r in channel.split(" ", 1)[1].split(",")]


def waits_of(rank: int, dumps: dict[int, dict]) -> list[Wait]:
    """What the rank's oldest waiting operation waits for, peer by peer."""
    pending = [r for r in dumps[rank]["records"] if r["state"] == "issued"]
    if not pending:
        return []
    op = pending[0]
    what = f"{op['kind']} {op['channel']} #{op['number']}" + (f" (shape {tuple(op['shape'])})" if op["shape"] else "")
    if op["kind"] in ("send", "recv"):
        peer = int(op["channel"].split()[1])
        if peer not in dumps:
            return [Wait(rank, peer, what, -1, op["number"] + 1)]
        match = ("recv", f"from {rank}") if op["kind"] == "send" else ("send", f"to {rank}")
        count = issued(dumps[peer], *match)
        return [Wait(rank, peer, what, count, op["number"] + 1)] if count <= op["number"] else []
    waits = []
    for peer in members(op["channel"], sorted(dumps)):
        if peer != rank and peer in dumps:
            count = issued(dumps[peer], op["kind"], op["channel"])
            if count <= op["number"]:
                waits.append(Wait(rank, peer, what, count, op["number"] + 1))
    return waits


def last_record(dump: dict) -> str:
    if not dump["records"]:
        return "none recorded"
    r = dump["records"][-1]
    return f"{r['kind']} {r['channel']} #{r['number']} ({r['state']})"


def diagnose(dumps: dict[int, dict]) -> Diagnosis:
    """Who waits for whom, who fell behind, and whether the waits form a cycle."""
    waits = [w for rank in sorted(dumps) for w in waits_of(rank, dumps)]
    waiting = {w.rank for w in waits}
    waited_for = sorted({w.peer for w in waits})
    behind = [r for r in waited_for if r not in waiting]
    cycle = [r for r in sorted(waiting) if _reaches(r, r, waits)]
    return Diagnosis(waits, behind, cycle, {rank: last_record(d) for rank, d in dumps.items()})


def _reaches(start: int, goal: int, waits: list[Wait]) -> bool:
    """Whether following "waits for" from `start` leads back to `goal`."""
    seen, todo = set(), [w.peer for w in waits if w.rank == start]
    while todo:
        r = todo.pop()
        if r == goal:
            return True
        if r not in seen:
            seen.add(r)
            todo += [w.peer for w in waits if w.rank == r]
    return False

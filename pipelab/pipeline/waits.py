"""Where a pipeline step's message time went, read off its timeline: what a receive waited for
(`recv_waits`), and what a sender did while its message was in flight (`send_waits`)."""

from __future__ import annotations

from pipelab.timeline import Timeline, complement, overlap, union


def send_waits(timeline: Timeline) -> dict[str, float]:
    """Split the time messages were in flight (the union of each rank's send boxes, seconds summed
    over ranks) by what the sender did meanwhile: "computing" (the send hidden behind work), "in
    recv" (waiting in a recv box for another message: its bubble), or nothing else, "blocked" (a send
    holding its sender up), of which "blocked at the end" came after the rank's last compute, where
    `P2P.finish` waits for the step's last messages to leave."""
    out = dict.fromkeys(("in flight", "computing", "in recv", "blocked", "blocked at the end"), 0.0)
    for rank in {s.rank for s in timeline.filter(kind="send", lane="comm")}:
        def spans(**where) -> list[tuple[float, float]]:
            return union((s.start, s.end) for s in timeline.filter(rank=rank, **where))

        sends, busy, waiting = spans(kind="send", lane="comm"), spans(lane="compute"), spans(kind="recv", lane="comm")
        idle = complement(busy, sends)  # message time while the rank computed nothing (hatched)
        blocked = complement(waiting, idle)
        last = max((b for _, b in busy), default=float("-inf"))
        for key, part in (("in flight", sends), ("computing", overlap(sends, busy)), ("in recv", overlap(idle, waiting)),
                          ("blocked", blocked), ("blocked at the end", overlap(blocked, [(last, float("inf"))]))):
            out[key] += sum(b - a for a, b in part)
    return out


def recv_waits(timeline: Timeline) -> tuple[float, float]:
    """Split the time ranks spent in `recv` boxes (seconds, summed over ranks) in two: waiting for
    the sender, whose matching send had not started yet (it was still computing: the pipeline's
    ordinary fill and drain), and waiting for the message, sent but not yet arrived (what moving it
    costs). The k-th send from one rank to another on micro-batch mb pairs with the k-th recv."""
    sent: dict[tuple, list[float]] = {}
    for s in sorted(timeline.filter(kind="send", lane="comm"), key=lambda s: s.start):
        sent.setdefault((s.rank, s.meta["to"], s.mb), []).append(s.start)
    for_sender = for_message = 0.0
    for r in sorted(timeline.filter(kind="recv", lane="comm"), key=lambda s: s.start):
        cut = min(max(sent[r.meta["frm"], r.rank, r.mb].pop(0), r.start), r.end)
        for_sender += cut - r.start
        for_message += r.end - cut
    return for_sender, for_message


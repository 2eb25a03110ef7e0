"""NCCL's ordering rule on gloo (pipelab.emulate.comm) and the emulated node's modelled time.

Under `spawn(..., nccl_rule=True)` a rank's operations toward one peer run in issue order and a
send waits for its receiver, as on NCCL: an exchange whose ranks both receive first deadlocks, and
the watchdog names both ranks within seconds. The same exchange in a matching order, a batch of
matched pairs and the collectives of one group pass.
"""

import time

import pytest
import torch
import torch.distributed as dist

from pipelab.emulate.comm import DeadlockError
from pipelab.emulate import deadlock
from pipelab.launch import WorkerError, spawn


def receive_first(ctx, catch: bool):
    """Both ranks post the receive their peer's send waits for ahead of their own send: fine on
    gloo, a deadlock on NCCL. With `catch`, return how long the rule took to say so, and what it said."""
    peer = 1 - ctx.rank
    incoming, outgoing = torch.empty(4), torch.full((4,), float(ctx.rank))
    recv = dist.irecv(incoming, peer)
    send = dist.isend(outgoing, peer)
    t0 = time.monotonic()
    try:
        recv.wait()
        send.wait()
    except DeadlockError as e:
        if not catch:
            raise
        return time.monotonic() - t0, str(e)
    return None


def matched(ctx):
    """The same exchange in an order NCCL runs: rank 0 sends first, rank 1 receives first; then the
    same pair as one batch; then collectives of the world and of a sub-group, in issue order."""
    peer = 1 - ctx.rank
    got = {}
    incoming, outgoing = torch.empty(4), torch.full((4,), float(ctx.rank))
    if ctx.rank == 0:
        dist.send(outgoing, peer)
        dist.recv(incoming, peer)
    else:
        dist.recv(incoming, peer)
        dist.send(outgoing, peer)
    got["ordered"] = incoming.tolist()
    incoming = torch.empty(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.irecv, incoming, peer), dist.P2POp(dist.isend, torch.arange(3) + 10 * ctx.rank, peer)]
    for work in dist.batch_isend_irecv(ops):  # the receive first in both: together, it runs
        work.wait()
    got["batch"] = incoming.tolist()
    pair = dist.new_group([0, 1])
    a, b = torch.tensor([1.0 + ctx.rank]), torch.tensor([10.0 * (1 + ctx.rank)])
    first = dist.all_reduce(a, async_op=True)
    second = dist.all_reduce(b, group=pair, async_op=True)
    third = torch.zeros(2)
    dist.all_gather_into_tensor(third, torch.tensor([float(ctx.rank)]))
    second.wait()
    first.wait()
    dist.barrier()
    got["collectives"] = [a.item(), b.item(), third.tolist()]
    return got


def send_first(ctx):
    """Both ranks send first, blocking: on NCCL each send waits for a receive its peer never reaches."""
    dist.send(torch.ones(2), 1 - ctx.rank)
    dist.recv(torch.empty(2), 1 - ctx.rank)


def test_receive_before_send_deadlocks_and_names_both_ranks():
    """Reported within the watchdog's wait (which a machine busier than its cores stretches)."""
    before = deadlock.patience(deadlock.WATCHDOG_SECONDS)
    results = spawn(receive_first, 2, True, nccl_rule=True, timeout=120)
    limit = max(before, deadlock.patience(deadlock.WATCHDOG_SECONDS)) + 5
    for rank, (seconds, message) in enumerate(results):
        assert seconds < limit, f"rank {rank} took {seconds:.1f} s to report the deadlock"
        assert "rank 0 waits for its receive from rank 1" in message, message
        assert "rank 1 waits for its receive from rank 0" in message, message
        assert "before it can run its send to rank" in message, message


def test_spawn_reports_the_deadlock_as_a_worker_error():
    with pytest.raises(WorkerError, match="deadlock under NCCL's ordering rule") as info:
        spawn(send_first, 2, nccl_rule=True, timeout=120)
    assert "rank 0 waits for its send to rank 1" in str(info.value)
    assert "rank 1 waits for its send to rank 0" in str(info.value)


def test_matching_order_batches_and_collectives_pass():
    results = spawn(matched, 2, nccl_rule=True, timeout=120)
    for rank, got in enumerate(results):
        assert got["ordered"] == [float(1 - rank)] * 4
        assert got["batch"] == [10 * (1 - rank) + i for i in range(3)]
        assert got["collectives"] == [3.0, 30.0, [0.0, 1.0]]


def test_without_the_rule_gloo_runs_the_receive_first_exchange():
    """The deadlock is the rule's, not gloo's: plain gloo posts both and finishes."""
    assert spawn(receive_first, 2, False, timeout=120) == [None, None]


def test_bad_node_name_is_refused_before_any_process():
    with pytest.raises(ValueError, match="known devices"):
        spawn(matched, 2, emulate="2xH900-nvlink")
    with pytest.raises(ValueError, match="do not fit"):
        spawn(matched, 4, emulate="2xH100-nvlink")


# ---- the emulated node: modelled time on a logical clock -------------------------------------

NODE = "2xH100-nvlink"


def timed_exchanges(ctx, numel: int):
    """A ping-pong, a blocking all-reduce, a compute span of a known cost, then an asynchronous
    all-reduce under a longer compute span: each rank's logical clock after each."""
    from pipelab.emulate.cost import Counts

    peer = 1 - ctx.rank
    t = torch.zeros(numel)
    times = [ctx.now()]
    if ctx.rank == 0:
        dist.send(t, peer)
        dist.recv(t, peer)
    else:
        dist.recv(t, peer)
        dist.send(t, peer)
    times.append(ctx.now())
    dist.all_reduce(t)
    times.append(ctx.now())
    with ctx.rec.span("F", cost=Counts(1e12, 0.0)):
        torch.ones(10).sum()  # real math, whatever it costs here
    times.append(ctx.now())
    work = dist.all_reduce(t, async_op=True)
    with ctx.rec.span("B", cost=0.5):  # much longer than the all-reduce: it hides under it
        pass
    work.wait()
    times.append(ctx.now())
    spans = [(s.kind, s.start, s.end) for s in ctx.timeline()]
    return times, spans, ctx.emulator.node.link.name


def test_ping_pong_all_reduce_and_compute_take_the_models_times_exactly():
    from pipelab.emulate.cost import Counts, collective_seconds, compute_seconds, message_seconds
    from pipelab.emulate.specs import parse_node

    node, numel = parse_node(NODE), 1 << 16
    nbytes = 4 * numel
    one_way = message_seconds(nbytes, node.link)
    after_pong = one_way + one_way
    after_all_reduce = after_pong + collective_seconds("all_reduce", nbytes, 2, node.link)
    after_f = after_all_reduce + compute_seconds(Counts(1e12, 0.0), node.device)
    want = [0.0, after_pong, after_all_reduce, after_f, after_f + 0.5]
    first = spawn(timed_exchanges, 2, numel, emulate=NODE)
    again = spawn(timed_exchanges, 2, numel, emulate=NODE)
    assert first == again  # deterministic, whatever the machine's load
    for times, spans, link in first:
        assert link == node.link.name
        assert times == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert spans == [("F", after_all_reduce, after_f), ("B", after_f, after_f + 0.5)]


def test_without_emulation_a_modelled_cost_is_ignored_and_time_is_the_machines():
    def clocks(ctx):
        with ctx.rec.span("F", cost=60.0):  # a minute, were it emulated
            pass
        (span,) = ctx.timeline().spans
        return ctx.emulator, span.duration < 1.0
    assert spawn(clocks, 2) == [(None, True), (None, True)]


def emulated_pipeline(ctx, names, model, x, y, m, costs):
    """One step of each schedule on this rank, its spans lasting `costs`; the step's time and spans."""
    from pipelab.emulate.table import stage_table
    from pipelab.pipeline.p2p import P2P, message_specs
    from pipelab.pipeline.partition import split_model
    from pipelab.pipeline.schedules import make_schedule
    from pipelab.pipeline.stage import StageRunner

    out = {}
    for name in names:
        schedule = make_schedule(name, ctx.world_size, m)
        stages = split_model(model, schedule.num_stages)
        modules = {s: stages[s] for s in range(schedule.num_stages) if schedule.rank_of(s) == ctx.rank}
        ctx.barrier()
        ctx.rec.clear()
        start = ctx.now()
        p2p = P2P(ctx, schedule, message_specs(stages, x, m))
        ctx.emulator.use(stage_table({s: costs for s in modules}))  # each span lasts `costs`
        runner = StageRunner(ctx, schedule, modules, torch.nn.MSELoss(), p2p, list(x.chunk(m)), list(y.chunk(m)))
        for action in schedule.actions[ctx.rank]:
            runner.run(action)
        p2p.finish()
        out[name] = (ctx.now() - start, ctx.timeline().filter(lane="compute"))
    return out


def test_an_emulated_pipeline_lasts_what_the_simulator_gives_for_the_same_costs():
    from pipelab import models
    from pipelab.emulate.cost import message_seconds
    from pipelab.emulate.specs import parse_node
    from pipelab.pipeline.schedules import make_schedule
    from pipelab.pipeline.simulate import Costs, simulate
    from pipelab.timeline import Timeline

    torch.manual_seed(0)
    model, m = models.mlp([8] * 5), 4
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    costs = {"F": 1e-3, "I": 1e-3, "W": 1e-3, "B": 2e-3}  # seconds, as the simulator's unit costs
    transfer = message_seconds(x.chunk(m)[0].nbytes, parse_node(NODE).link)
    results = spawn(emulated_pipeline, 2, ["gpipe", "1f1b"], model, x, y, m, costs, emulate=NODE)
    for name in ["gpipe", "1f1b"]:
        sim = simulate(make_schedule(name, 2, m), Costs(transfer=1e3 * transfer))
        step = max(rank[name][0] for rank in results)
        timeline = Timeline.merge(rank[name][1] for rank in results)
        assert step * 1e3 == pytest.approx(sim.makespan_ms, rel=0.01), name  # the runtime adds < 1 %
        assert timeline.bubble_fraction() == pytest.approx(sim.bubble_fraction, abs=0.01), name
        assert [s.duration for s in timeline.filter(kind="F")] == pytest.approx([1e-3] * 2 * m)


def scaled_ping_pong(ctx):
    """One float computed, a megabyte emulated: a ping-pong's time is the megabyte's."""
    ctx.emulator.scale_messages(1e6, 4)
    t = torch.zeros(1)
    if ctx.rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
        dist.send(t, 0)
    return ctx.now()


def test_messages_last_their_emulated_size():
    from pipelab.emulate.cost import message_seconds
    from pipelab.emulate.specs import parse_node

    one_way = message_seconds(1e6, parse_node(NODE).link)
    assert spawn(scaled_ping_pong, 2, emulate=NODE) == pytest.approx([2 * one_way] * 2, rel=1e-12)


def test_a_receive_broken_by_a_peer_that_left_after_reporting_the_deadlock_raises_that_report():
    """The peer that found the deadlock first raises it and exits, closing its connections: this rank's
    receive then fails with gloo's "Connection closed by peer" before its own watchdog has read the
    report. The rank must raise the report (the cause), not the transport error (its echo)."""
    from pipelab.emulate.comm import Rule
    from pipelab.emulate.queues import Op

    store = dist.HashStore()
    rule = Rule(0, 2, clock=None, store=store)
    op = Op("recv", torch.empty(4), 0.0, 1, "channel 0<->1", peer=1)
    op.error = RuntimeError("Connection closed by peer [127.0.0.1]:54940")
    op.done.set()
    with pytest.raises(RuntimeError, match="Connection closed by peer") as plain:
        rule.wait(op)  # no rank reported a deadlock: the transport error is the story
    assert not isinstance(plain.value, DeadlockError)
    store.set(deadlock._FOUND, "rank 0 waits for its receive from rank 1 (op 1 on channel 0<->1)")
    with pytest.raises(DeadlockError, match="rank 0 waits for its receive from rank 1"):
        rule.wait(op)
    rule.watchdog.finish()

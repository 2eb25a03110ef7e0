"""Lesson 17 from a notebook: hangs and silent gradient bugs, planted on real gloo ranks, each
beside the check that finds it and a one-process reference.

Every planted hang runs under a small process-group timeout (`Config.hang_seconds`, per operation):
the waiting rank raises when it expires, spawn stops every rank and leaves no process behind, so a
hang costs seconds. Times called "measured" are wall-clock seconds of the call on this machine,
start-up of the ranks included.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipelab import experiments
from pipelab.checks import positive_number, whole_number
from pipelab.debug import bugs, check_replicas, collective_check, diagnose, flight_recorder, load_dumps
from pipelab.debug.compare import Comparison, compare, rank_gradients, reference_gradients
from pipelab.launch import WorkerError, spawn

ISSUES = {"zero_bubble_w_pass": "pytorch#144530", "shard_group_of_one": "verl#7493",
          "expert_gradients": "pytorch#160285", "pipeline_accumulation": "NeMo PR #3530"}


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """Two ranks; a model of `width` features, a batch of `batch` rows; planted hangs stopped after
    `hang_seconds` (the process group's timeout, and the flight recorder's); the collective check
    waits `check_seconds` for a peer's call; the flight recorder keeps `capacity` operations."""

    width: int = 8
    batch: int = 16
    num_microbatches: int = 4
    steps: int = 2
    hang_seconds: float = 5.0
    check_seconds: float = 3.0
    capacity: int = 16

    def check(self) -> None:
        super().check()
        if self.world_size != 2:
            raise ValueError(f"lesson 17's planted bugs are written for two ranks, got world_size={self.world_size}; "
                             "use world_size=2")
        for name in ("width", "batch", "num_microbatches", "steps", "capacity"):
            whole_number(name, getattr(self, name))
        for name in ("hang_seconds", "check_seconds"):
            positive_number(name, getattr(self, name), unit="seconds")
        if self.batch % (2 * self.world_size) or self.batch % self.num_microbatches:
            raise ValueError(f"batch={self.batch} must split into {2 * self.world_size} expert blocks and "
                             f"{self.num_microbatches} micro-batches; use e.g. batch=16")

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        w = self.width
        return nn.Sequential(nn.Linear(w, 2 * w), nn.Tanh(), nn.Linear(2 * w, w), nn.Tanh())

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(self.batch, self.width, generator=g), torch.randn(self.batch, self.width, generator=g)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The lesson's loss: mean squared error of the model's output."""
    return F.mse_loss(model(x), y)


@dataclass(frozen=True)
class Outcome:
    """How one run ended: `ended` ('finished', 'raised', 'timed out'), after `seconds` measured, and
    the first line(s) of what it said."""

    name: str
    ended: str
    seconds: float
    message: str


def short_timeout(seconds: float) -> None:
    """Give this rank's process group a timeout of `seconds` for each operation (as
    `init_process_group(timeout=...)` does for a whole job): a planted hang then ends in seconds
    once the ranks run, however long they took to start."""
    import datetime

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def attempt(name: str, fn, cfg: Config, *args, env: dict[str, str] | None = None, **spawn_kwargs) -> Outcome:
    """Run `fn` on the ranks and say how it ended, after how many seconds. A planted hang ends at
    the process group's timeout (`short_timeout`); spawn's own `cfg.timeout` is the last resort."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    start = time.perf_counter()
    try:
        spawn(fn, cfg.world_size, *args, timeout=cfg.timeout, **spawn_kwargs)
        ended, message = "finished", ""
    except WorkerError as e:
        ended = ("timed out" if "did not finish within timeout" in e.args[0] or "code 3 " in e.args[0] or
                 "Timed out" in e.args[0] else "raised")
        message = _short(e)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return Outcome(name, ended, time.perf_counter() - start, message)


def _short(e: WorkerError) -> str:
    """The cause's first line, and its first consequence's."""
    lines = [e.args[0].splitlines()[0][:300]]
    lines += [c.args[0].splitlines()[0][:300] for c in e.consequences[:1]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 1. A collective mismatch
# ---------------------------------------------------------------------------------------------


def mismatched_collectives(ctx, hang_seconds: float, checked: bool = False, seconds: float = 2.0) -> None:
    """Rank 0 all-reduces its gradient; rank 1, on another branch, broadcasts it (DeepSpeed#7044's kind)."""
    short_timeout(hang_seconds)
    grad = torch.ones(4, 8)
    with collective_check(seconds) if checked else contextlib.nullcontext():
        if ctx.rank == 0:
            dist.all_reduce(grad)
        else:
            dist.broadcast(grad, src=0)


def collective_mismatch(cfg: Config) -> list[Outcome]:
    """The same mismatch three ways: plain gloo, torch's TORCH_DISTRIBUTED_DEBUG=DETAIL, our check."""
    h = cfg.hang_seconds
    return [attempt("gloo", mismatched_collectives, cfg, h),
            attempt("gloo, TORCH_DISTRIBUTED_DEBUG=DETAIL", mismatched_collectives, cfg, h,
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
            checked_mismatch(cfg)]


def checked_mismatch(cfg: Config) -> Outcome:
    """The mismatch under our collective check."""
    return attempt("pipelab.debug.collective_check", mismatched_collectives, cfg, cfg.hang_seconds, True,
                   cfg.check_seconds)


def names_both_calls(outcome: Outcome) -> bool:
    """Whether what the run said names both ranks' collectives."""
    text = outcome.message.lower().replace("allreduce", "all_reduce")
    return outcome.ended == "raised" and "all_reduce" in text and "broadcast" in text


def mismatch_verdict(outcomes: list[Outcome]) -> tuple[str, str, str, dict]:
    """Whether our check named both calls, and which of torch's runs did too."""
    ours, others = outcomes[-1], outcomes[:-1]
    if not names_both_calls(ours):
        return "debug.mismatch", "not named", f"The check did not name both calls: {ours.message[:100]}", {}
    named = [o.name for o in others if names_both_calls(o)]
    text = "Our check named both ranks' calls"
    if others:
        text += f"; {len(named)} of {len(others)} runs without it did" + (f" ({', '.join(named)})" if named else "")
    return "debug.mismatch", "named", text + ".", {"torch_named": len(named)}


# ---------------------------------------------------------------------------------------------
# 2. A point-to-point deadlock under NCCL's rule
# ---------------------------------------------------------------------------------------------


def receive_first(ctx, hang_seconds: float) -> None:
    """Both ranks post their receive before their send: gloo runs it, NCCL hangs."""
    short_timeout(hang_seconds)
    peer = 1 - ctx.rank
    recv = dist.irecv(torch.empty(4), peer)
    send = dist.isend(torch.ones(4), peer)
    recv.wait()
    send.wait()


def p2p_deadlock(cfg: Config) -> list[Outcome]:
    """The same program on gloo and under NCCL's ordering rule (`spawn(nccl_rule=True)`)."""
    return [attempt("gloo", receive_first, cfg, cfg.hang_seconds),
            attempt("NCCL's rule", receive_first, cfg, cfg.hang_seconds, nccl_rule=True)]


# ---------------------------------------------------------------------------------------------
# 3. A hang in a pipeline, read from the flight recorders' dumps
# ---------------------------------------------------------------------------------------------


def gpipe_step(ctx, cfg: Config, stage: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> None:
    """One GPipe step of two stages over `m` micro-batches: every forward, then every backward."""
    rows, peer = cfg.batch // cfg.num_microbatches, 1 - ctx.rank
    outs, ins = [], []
    for i in range(m):
        if ctx.rank == 0:
            out = stage(x[i * rows:(i + 1) * rows])
            dist.send(out.detach(), peer)
        else:
            a = torch.empty(rows, 2 * cfg.width)
            dist.recv(a, peer)
            a.requires_grad_()
            out = F.mse_loss(stage(a), y[i * rows:(i + 1) * rows]) / m
            ins.append(a)
        outs.append(out)
    for i, out in enumerate(outs):
        if ctx.rank == 0:
            g = torch.empty_like(out)
            dist.recv(g, peer)
            out.backward(g)
        else:
            out.backward()
            dist.send(ins[i].grad, peer)


def pipeline_with_planted_hang(ctx, cfg: Config, dump_dir: str, plant: str) -> None:
    """Two GPipe stages for `cfg.steps` recorded steps. `plant="microbatches"`: in the last step
    rank 0 cuts its batch into one micro-batch fewer than rank 1 expects (a short last batch);
    `plant="stall"`: in the last step rank 1 stops in its own work (a stuck data loader)."""
    short_timeout(cfg.hang_seconds)
    model, (x, y) = cfg.model(), cfg.data()
    stage = model[:2] if ctx.rank == 0 else model[2:]
    # A job's first step is slow (autograd starts its machinery, memory is allocated): on a busy
    # machine it could outlast the timeout, so it runs before the recorder watches.
    gpipe_step(ctx, cfg, stage, x, y, cfg.num_microbatches)
    with flight_recorder(dump_dir, cfg.capacity, cfg.hang_seconds):
        for step in range(cfg.steps):
            m, last = cfg.num_microbatches, step == cfg.steps - 1
            if last and plant == "microbatches" and ctx.rank == 0:
                m -= 1
            if last and plant == "stall" and ctx.rank == 1:
                time.sleep(10 * cfg.hang_seconds)  # stopped long before, when rank 0 times out
            gpipe_step(ctx, cfg, stage, x, y, m)


@dataclass
class HangRun:
    """A planted hang: how the run ended, every rank's dump, and what the reader says."""

    outcome: Outcome
    dumps: dict[int, dict]
    diagnosis: object = field(repr=False)


def planted_hang(cfg: Config, plant: str = "microbatches") -> HangRun:
    """Run the pipeline with its planted hang; read the dumps the ranks left."""
    if plant not in ("microbatches", "stall"):
        raise ValueError(f"plant must be 'microbatches' or 'stall', got {plant!r}")
    dump_dir = tempfile.mkdtemp(prefix="pipelab-flight-")
    try:
        outcome = attempt(f"pipeline, {plant}", pipeline_with_planted_hang, cfg, cfg, dump_dir, plant)
        dumps = load_dumps(dump_dir)
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    return HangRun(outcome, dumps, diagnose(dumps))


def recorder_verdict(run: HangRun) -> tuple[str, str, str, dict]:
    """Who waits for whom, from the dumps alone."""
    d = run.diagnosis
    if not d.waits:
        return "debug.recorder", "no wait found", "The dumps show no rank waiting on an operation.", {}
    w = d.waits[0]
    tail = (f"rank {d.behind[0]} fell behind outside communication" if d.behind else
            f"ranks {' and '.join(map(str, d.cycle))} wait for each other")
    text = (f"From {len(run.dumps)} dumps: rank {w.rank} waits for rank {w.peer}, which issued {w.peer_count} "
            f"of the {w.wanted} operations needed; {tail}.")
    return "debug.recorder", "behind" if d.behind else "cycle", text, {"issued": w.peer_count, "needed": w.wanted}


# ---------------------------------------------------------------------------------------------
# 4. Silent gradient bugs, beside one process
# ---------------------------------------------------------------------------------------------


def case_model(cfg: Config, name: str) -> nn.Module:
    """The model a case trains: the expert case has one expert per rank."""
    if name == "expert_gradients":
        return bugs.TinyMoE(cfg.width, cfg.world_size, cfg.batch // (2 * cfg.world_size))
    return cfg.model()


def replicated(model: nn.Module, name: str) -> nn.Module | None:
    """What should be equal on every rank after the step (a pipeline's stages are not replicas)."""
    return {"pipeline_accumulation": None, "expert_gradients": getattr(model, "dense", None)}.get(name, model)


def bugs_worker(ctx, cfg: Config) -> dict:
    """Every case with its bug and with its fix: the loss share, the gradients, the replica check."""
    x, y = cfg.data()
    out = {}
    for name in ISSUES:
        for fixed in (False, True):
            model = case_model(cfg, name)
            step = functools.partial(getattr(bugs, name), fixed=fixed)
            loss, grads = rank_gradients(ctx, step, model, mse, x, y)
            module = replicated(model, name)
            report = None if module is None else check_replicas(module)
            out[name, fixed] = (loss, grads, None if report is None else str(report), report is None or report.agree)
    return out


@dataclass
class BugRow:
    name: str
    issue: str
    fixed: bool
    loss_same: bool
    replicas: str  # "agree", "differ" or "n/a"
    comparison: Comparison


def silent_bugs(cfg: Config) -> list[BugRow]:
    """Run every case (bug, then fix) on real ranks; compare each with its one-process reference."""
    results = spawn(bugs_worker, cfg.world_size, cfg, timeout=cfg.timeout)
    x, y = cfg.data()
    rows = []
    for name, issue in ISSUES.items():
        reference = reference_gradients(case_model(cfg, name), mse, x, y)
        for fixed in (False, True):
            per_rank = [r[name, fixed] for r in results]
            c = compare([(loss, grads) for loss, grads, _, _ in per_rank], reference)
            loss_same = c.loss is not None and abs(c.loss - c.reference_loss) <= 1e-5 * max(1.0, abs(c.reference_loss))
            report, agree = per_rank[0][2], per_rank[0][3]
            replicas = "n/a" if report is None else "agree" if agree else "differ"
            rows.append(BugRow(name, issue, fixed, loss_same, replicas, c))
    return rows


def bug_table(rows: list[BugRow]) -> list[dict]:
    """One row per case and variant: the loss, the replica check, the comparison's first finding."""
    return [{"bug": r.name, "issue": r.issue, "variant": "fix" if r.fixed else "bug",
             "loss = one process": "yes" if r.loss_same else "no", "replicas": r.replicas,
             "one-process comparison": "same" if r.comparison.same else str(r.comparison).splitlines()[-1]}
            for r in rows]


def bugs_verdict(rows: list[BugRow]) -> tuple[str, str, str, dict]:
    """Did every bug keep the loss right, did a check catch each, does every fix match one process?"""
    buggy, fixed = [r for r in rows if not r.fixed], [r for r in rows if r.fixed]
    hidden = sum(r.loss_same for r in buggy)
    caught = sum((not r.comparison.same) or r.replicas == "differ" for r in buggy)
    fixes = sum(r.comparison.same for r in fixed)
    verdict = "caught" if caught == len(buggy) and fixes == len(fixed) else "missed"
    text = (f"{hidden} of {len(buggy)} bugs left the loss equal to one process's; the checks caught "
            f"{caught} of {len(buggy)}, and {fixes} of {len(fixed)} fixes match one process.")
    return "debug.bugs", verdict, text, {"hidden": hidden, "caught": caught}

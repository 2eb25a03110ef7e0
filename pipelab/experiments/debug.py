"""Lesson 17 from a notebook: hangs and silent gradient bugs planted on real gloo ranks, each beside
the check that finds it and a one-process reference. A planted hang ends after `Config.hang_seconds`
and leaves no process behind; "measured" times are the call's wall clock, rank start-up included."""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pipelab import experiments
from pipelab.checks import positive_number, whole_number
from pipelab.debug import bugs, check_replicas, diagnose, load_dumps
from pipelab.debug.compare import Comparison, compare, rank_gradients, reference_gradients
from pipelab.debug.hangs import mismatched_collectives, pipeline_with_planted_hang, receive_first
from pipelab.debug.runs import Outcome, attempt
from pipelab.launch import spawn

ISSUES = {"zero_bubble_w_pass": "pytorch#144530", "shard_group_of_one": "verl#7493",
          "expert_gradients": "pytorch#160285", "pipeline_accumulation": "NeMo PR #3530"}


@dataclass(frozen=True, kw_only=True)
class Config(experiments.Config):
    """Two ranks, a model of `width` features, `batch` rows; a planted hang stops after `hang_seconds`,
    the collective check waits `check_seconds` for a peer, the flight recorder keeps `capacity` operations."""

    width: int = 8
    batch: int = 16
    num_microbatches: int = 4
    steps: int = 2
    hang_seconds: float = 2.0
    check_seconds: float = 2.0
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
    return F.mse_loss(model(x), y)


def collective_mismatch(cfg: Config, torch_runs: bool = True) -> list[Outcome]:
    """The mismatch under our collective check, after (`torch_runs`) plain gloo and torch's
    TORCH_DISTRIBUTED_DEBUG=DETAIL on the same program."""
    h, n = cfg.hang_seconds, cfg.world_size
    runs = [attempt("gloo", mismatched_collectives, n, h),
            attempt("gloo, TORCH_DISTRIBUTED_DEBUG=DETAIL", mismatched_collectives, n, h,
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})] if torch_runs else []
    return runs + [attempt("pipelab.debug.collective_check", mismatched_collectives, n, h, True, cfg.check_seconds)]


def names_both_calls(outcome: Outcome) -> bool:
    """Whether what the run said names both ranks' collectives."""
    text = outcome.message.lower().replace("allreduce", "all_reduce")
    return outcome.ended == "raised" and "all_reduce" in text and "broadcast" in text


def mismatch_verdict(outcomes: list[Outcome]) -> tuple[str, str, str, dict]:
    ours, others = outcomes[-1], outcomes[:-1]
    if not names_both_calls(ours):
        return "debug.mismatch", "not named", f"The check did not name both calls: {ours.message[:100]}", {}
    named = [o.name for o in others if names_both_calls(o)]
    text = "Our check named both ranks' calls"
    if others:
        text += f"; {len(named)} of {len(others)} runs without it did" + (f" ({', '.join(named)})" if named else "")
    return "debug.mismatch", "named", text + ".", {"torch_named": len(named)}


def p2p_deadlock(cfg: Config) -> list[Outcome]:
    """The same program on gloo and under NCCL's ordering rule (`spawn(nccl_rule=True)`)."""
    return [attempt("gloo", receive_first, cfg.world_size, cfg.hang_seconds),
            attempt("NCCL's rule", receive_first, cfg.world_size, cfg.hang_seconds, nccl_rule=True)]


@dataclass
class HangRun:
    """A planted hang: how the run ended, every rank's dump, and what the reader says."""

    outcome: Outcome
    dumps: dict[int, dict]
    diagnosis: object = field(repr=False)


def planted_hang(cfg: Config, plant: str = "microbatches") -> HangRun:
    """The pipeline with its planted hang, and the dumps the ranks left, read."""
    if plant not in ("microbatches", "stall"):
        raise ValueError(f"plant must be 'microbatches' or 'stall', got {plant!r}")
    with tempfile.TemporaryDirectory(prefix="pipelab-flight-", ignore_cleanup_errors=True) as dump_dir:
        outcome = attempt(f"pipeline, {plant}", pipeline_with_planted_hang, cfg.world_size, cfg, dump_dir, plant,
                          timeout=cfg.timeout)
        dumps = load_dumps(dump_dir)
    return HangRun(outcome, dumps, diagnose(dumps))


def recorder_verdict(run: HangRun) -> tuple[str, str, str, dict]:
    d = run.diagnosis
    if not d.waits:
        return "debug.recorder", "no wait found", "The dumps show no rank waiting on an operation.", {}
    w = d.waits[0]
    tail = (f"rank {d.behind[0]} fell behind outside communication" if d.behind else
            f"ranks {' and '.join(map(str, d.cycle))} wait for each other")
    text = (f"From {len(run.dumps)} dumps: rank {w.rank} waits for rank {w.peer}, which issued {w.peer_count} "
            f"of the {w.wanted} operations needed; {tail}.")
    return "debug.recorder", "behind" if d.behind else "cycle", text, {"issued": w.peer_count, "needed": w.wanted}


def case_model(cfg: Config, name: str) -> nn.Module:
    """The model a case trains (the expert case: one expert per rank)."""
    if name == "expert_gradients":
        return bugs.TinyMoE(cfg.width, cfg.world_size, cfg.batch // (2 * cfg.world_size))
    return cfg.model()


def replicated(model: nn.Module, name: str) -> nn.Module | None:
    """What should be equal on every rank after the step (a pipeline's stages are not replicas)."""
    return {"pipeline_accumulation": None, "expert_gradients": getattr(model, "dense", None)}.get(name, model)


def bugs_worker(ctx, cfg: Config) -> dict:
    """Every case with its bug and its fix: the loss share, the gradients, the replica check."""
    x, y = cfg.data()
    out = {}
    for name in ISSUES:
        for fixed in (False, True):
            model = case_model(cfg, name)
            step = functools.partial(getattr(bugs, name), fixed=fixed)
            loss, grads = rank_gradients(ctx, step, model, mse, x, y)
            module = replicated(model, name)
            replicas = "n/a" if module is None else "agree" if check_replicas(module).agree else "differ"
            out[name, fixed] = loss, grads, replicas
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
    """Every case, bug then fix, on real ranks, each compared with its one-process reference."""
    results = spawn(bugs_worker, cfg.world_size, cfg, timeout=cfg.timeout)
    x, y = cfg.data()
    rows = []
    for name, issue in ISSUES.items():
        reference = reference_gradients(case_model(cfg, name), mse, x, y)
        for fixed in (False, True):
            per_rank = [r[name, fixed] for r in results]
            c = compare([(loss, grads) for loss, grads, _ in per_rank], reference)
            loss_same = c.loss is not None and abs(c.loss - c.reference_loss) <= 1e-5 * max(1.0, abs(c.reference_loss))
            rows.append(BugRow(name, issue, fixed, loss_same, per_rank[0][2], c))
    return rows


def bug_table(rows: list[BugRow]) -> list[dict]:
    """One row per case and variant: the loss, the replica check, the comparison's first finding."""
    return [{"bug": r.name, "issue": r.issue, "variant": "fix" if r.fixed else "bug",
             "loss = one process": "yes" if r.loss_same else "no", "replicas": r.replicas,
             "one-process comparison": "same" if r.comparison.same else str(r.comparison).splitlines()[-1]}
            for r in rows]


def bugs_verdict(rows: list[BugRow]) -> tuple[str, str, str, dict]:
    buggy, fixed = [r for r in rows if not r.fixed], [r for r in rows if r.fixed]
    hidden = sum(r.loss_same for r in buggy)
    caught = sum((not r.comparison.same) or r.replicas == "differ" for r in buggy)
    fixes = sum(r.comparison.same for r in fixed)
    verdict = "caught" if caught == len(buggy) and fixes == len(fixed) else "missed"
    text = (f"{hidden} of {len(buggy)} bugs left the loss equal to one process's; the checks caught "
            f"{caught} of {len(buggy)}, and {fixes} of {len(fixed)} fixes match one process.")
    return "debug.bugs", verdict, text, {"hidden": hidden, "caught": caught}

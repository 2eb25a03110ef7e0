"""Run a pipeline schedule for real: one process per rank, point-to-point sends between stages.

Each rank holds its stage module(s) and walks its action list:

* `F(s, mb)`: take micro-batch `mb`'s input (the batch slice on stage 0, else the activation
  received from stage s-1), run the stage, send the output on (or, on the last stage, compute the
  loss), and *stash* what the backward will need.
* `B(s, mb)`: take the gradient of the stage's output (from stage s+1, or the loss), backpropagate,
  send the input's gradient to stage s-1, and free the stash (unless a `W` still needs it).
* `W(s, mb)`: the weight gradients, from the output gradients `B` kept for each layer.

Communication is plain `isend`/`irecv` (gloo has a history of hangs with `batch_isend_irecv`).
Sends never block the sender. A receiver posts its receives in the order its peer sends (every
rank knows every action list), so messages match on NCCL, which pairs sends and receives between
two ranks in the order they are issued, as well as on gloo.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from pipelab.pipeline.schedules import Action, Schedule, validate
from pipelab.timeline import Timeline, now

# ---------------------------------------------------------------------------------------------
# Stages: cutting a model
# ---------------------------------------------------------------------------------------------

def split_model(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """Cut a Sequential into `num_stages` consecutive stages with (nearly) equal numbers of
    parameterised layers; a parameter-free layer (an activation) stays with the layer before it."""
    blocks: list[list[nn.Module]] = []
    for layer in model:
        if any(True for _ in layer.parameters()) or not blocks:
            blocks.append([layer])
        else:
            blocks[-1].append(layer)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a whole number >= 1, got {num_stages!r}")
    if num_stages > len(blocks):
        raise ValueError(f"cannot cut a model with {len(blocks)} layers into {num_stages} stages: "
                         f"use at most {len(blocks)} stages, or a deeper model "
                         f"(e.g. models.mlp with {num_stages + 1} widths or more)")
    base, extra = divmod(len(blocks), num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        stages.append(nn.Sequential(*[layer for block in blocks[start:start + n] for layer in block]))
        start += n
    return stages


def stage_output_shapes(stages: list[nn.Module], sample: torch.Tensor) -> list[tuple[int, ...]]:
    """The shape each stage outputs for one micro-batch `sample`: what its receiver allocates."""
    shapes, h = [], sample
    with torch.no_grad():
        for stage in stages:
            h = stage(h)
            shapes.append(tuple(h.shape))
    return shapes


# ---------------------------------------------------------------------------------------------
# Point-to-point messages
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Message:
    """An activation (`kind`="act", from stage `stage` to stage+1) or a gradient ("grad", from
    stage `stage` to stage-1) of micro-batch `mb`."""

    kind: str
    stage: int
    mb: int


def message_sent_by(action: Action, schedule: Schedule) -> Message | None:
    """The message an action sends when it finishes, if any (the last stage's F sends nothing)."""
    if action.kind == "F" and action.stage < schedule.num_stages - 1:
        return Message("act", action.stage, action.mb)
    if action.kind == "B" and action.stage > 0:
        return Message("grad", action.stage, action.mb)
    return None


def _destination(msg: Message, schedule: Schedule) -> int:
    return schedule.rank_of(msg.stage + 1 if msg.kind == "act" else msg.stage - 1)


class P2P:
    """This rank's sends and receives for one step of `schedule`."""

    def __init__(self, ctx, schedule: Schedule, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                 lookahead: int = 1):
        self.ctx, self.schedule, self.shapes, self.dtype = ctx, schedule, shapes, dtype
        # For each peer, the messages it sends us, in the order it sends them.
        self.expected: dict[int, list[Message]] = {}
        for src, actions in enumerate(schedule.actions):
            msgs = [m for a in actions if (m := message_sent_by(a, schedule))
                    and src != ctx.rank and _destination(m, schedule) == ctx.rank]
            if msgs:
                self.expected[src] = msgs
        self.posted: dict[Message, tuple] = {}  # message -> (buffer, work)
        self.lookahead = lookahead
        self.local: dict[Message, torch.Tensor] = {}  # messages between two stages on this rank
        self.sends: list = []
        for src in self.expected:
            self._post_ahead(src)
        self.bytes_sent = 0
        self.messages_sent = 0

    def _shape(self, msg: Message) -> tuple[int, ...]:
        # An activation has stage s's output shape; a gradient has stage s's input shape.
        return self.shapes[msg.stage] if msg.kind == "act" else self.shapes[msg.stage - 1]

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        dst = _destination(msg, self.schedule)
        tensor = tensor.detach()  # the receiver starts a graph of its own, as after a real transfer
        if dst == self.ctx.rank:
            self.local[msg] = tensor
            return
        import torch.distributed as dist

        tensor = tensor.contiguous()
        with self.ctx.rec.span("send", lane="comm", mb=msg.mb, to=dst, bytes=tensor.nbytes):
            self.sends.append((dist.isend(tensor, dst), tensor))  # keep the tensor alive until sent
        self.bytes_sent += tensor.nbytes
        self.messages_sent += 1

    def recv(self, msg: Message) -> torch.Tensor:
        if msg in self.local:
            return self.local.pop(msg)
        src = self.schedule.rank_of(msg.stage)
        with self.ctx.rec.span("recv", lane="comm", mb=msg.mb, frm=src):
            self._post_until(src, msg)
            buffer, work = self.posted.pop(msg)
            work.wait()
        self._post_ahead(src)
        return buffer

    def _post(self, src: int) -> None:
        import torch.distributed as dist

        nxt = self.expected[src].pop(0)
        buffer = torch.empty(self._shape(nxt), dtype=self.dtype, device=self.ctx.device)
        self.posted[nxt] = (buffer, dist.irecv(buffer, src))

    def _post_until(self, src: int, msg: Message) -> None:
        """Post receives for `src`'s messages, in its send order, up to and including `msg`."""
        while msg not in self.posted:
            self._post(src)

    def _post_ahead(self, src: int) -> None:
        """Keep `lookahead` receives from `src` posted, so its next message can land while this
        rank computes instead of when it asks (one buffer per posted receive)."""
        in_flight = sum(1 for m in self.posted if self.schedule.rank_of(m.stage) == src)
        for _ in range(min(self.lookahead - in_flight, len(self.expected.get(src, [])))):
            self._post(src)

    def finish(self) -> None:
        """Wait until every send of the step has left."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


# ---------------------------------------------------------------------------------------------
# One rank's step
# ---------------------------------------------------------------------------------------------

@dataclass
class Stash:
    """What the backward of one (stage, micro-batch) needs, kept from its F to its B (or W)."""

    inputs: torch.Tensor
    outputs: torch.Tensor  # the stage output, or the micro-batch loss on the last stage
    layers: list[tuple[torch.Tensor, list[nn.Parameter]]]  # (layer output, its parameters) for W
    nbytes: int
    output_grads: list[torch.Tensor] | None = None  # per layer, left by B for W


class StashMeter:
    """Counts live stashes and their bytes over the step, so memory is measured, not assumed."""

    def __init__(self):
        self.live = 0
        self.live_bytes = 0
        self.trace: list[tuple[float, int, int]] = [(now(), 0, 0)]  # (time, stashes, bytes)

    def change(self, count: int, nbytes: int) -> None:
        self.live += count
        self.live_bytes += nbytes
        self.trace.append((now(), self.live, self.live_bytes))

    @property
    def peak(self) -> int:
        return max(n for _, n, _ in self.trace)

    @property
    def peak_bytes(self) -> int:
        return max(b for _, _, b in self.trace)


class SavedBytes:
    """Adds up the bytes a forward keeps for its backward: every tensor autograd saves (seen
    through saved-tensors hooks) and any tensor kept by hand, each storage once, leaving out the
    `exclude` storages (the parameters and the batch, which live anyway)."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.seen, self.total = exclude, set(), 0

    def add(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.exclude and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += t.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.add, lambda t: t)


def _forward_by_layer(module: nn.Module, x: torch.Tensor):
    """Run `module`, keeping each parameterised layer's output: W needs the gradient there."""
    if not isinstance(module, nn.Sequential):
        out = module(x)
        return out, [(out, list(module.parameters()))]
    layers, h = [], x
    for layer in module:
        h = layer(h)
        params = list(layer.parameters())
        if params:
            layers.append((h, params))
    return h, layers


class StageRunner:
    """Runs F, B and W actions of the stages one rank holds."""

    def __init__(self, ctx, schedule: Schedule, modules: dict[int, nn.Module], loss_fn: Callable,
                 p2p: P2P, x_mbs: list[torch.Tensor], y_mbs: list[torch.Tensor]):
        self.ctx, self.schedule, self.modules, self.loss_fn = ctx, schedule, modules, loss_fn
        self.p2p, self.x_mbs, self.y_mbs = p2p, x_mbs, y_mbs
        self.last = schedule.num_stages - 1
        self.stash: dict[tuple[int, int], Stash] = {}
        self.meter = StashMeter()
        self.losses: list[torch.Tensor] = []
        # Saved tensors that are not stash: the weights, and the batch itself (it lives anyway).
        self.not_stash = {t.untyped_storage().data_ptr() for t in [*x_mbs, *y_mbs]}
        self.not_stash |= {p.untyped_storage().data_ptr() for m in modules.values() for p in m.parameters()}

    def run(self, action: Action) -> None:
        getattr(self, action.kind)(action.stage, action.mb)

    def F(self, stage: int, mb: int) -> None:
        x = self.x_mbs[mb] if stage == 0 else self.p2p.recv(Message("act", stage - 1, mb))
        if stage > 0:
            x.requires_grad_(True)
        saved = SavedBytes(self.not_stash)
        with self.ctx.rec.span("F", mb=mb, stage=stage), saved.hooks():
            if self.schedule.split_backward:
                out, layers = _forward_by_layer(self.modules[stage], x)
            else:
                out, layers = self.modules[stage](x), []
            if stage == self.last:  # the loss of a micro-batch, scaled so the m of them add up to the batch mean
                out = self.loss_fn(out, self.y_mbs[mb]) / self.schedule.num_microbatches
                self.losses.append(out.detach())
        for layer_out, _ in layers:  # kept for W
            saved.add(layer_out)
        self.stash[stage, mb] = Stash(x, out, layers, saved.total)
        self.meter.change(+1, saved.total)
        if stage < self.last:
            self.p2p.send(Message("act", stage, mb), out)

    def B(self, stage: int, mb: int) -> None:
        grad_out = None if stage == self.last else self.p2p.recv(Message("grad", stage + 1, mb))
        st = self.stash[stage, mb]
        with self.ctx.rec.span("B", mb=mb, stage=stage):
            if self.schedule.split_backward:
                grad_in = self._backward_input(st, stage, grad_out)
            else:
                torch.autograd.backward(st.outputs, grad_out)
                grad_in = st.inputs.grad if stage > 0 else None
        if not self.schedule.split_backward:
            self._free(stage, mb)
        if stage > 0:
            self.p2p.send(Message("grad", stage, mb), grad_in)

    def _backward_input(self, st: Stash, stage: int, grad_out) -> torch.Tensor | None:
        """Input gradient only, keeping every layer's output gradient for W."""
        wanted = ([st.inputs] if stage > 0 else []) + [out for out, _ in st.layers]
        grads = torch.autograd.grad(st.outputs, wanted, grad_out, retain_graph=True)
        st.output_grads = list(grads[1:] if stage > 0 else grads)
        return grads[0] if stage > 0 else None

    def W(self, stage: int, mb: int) -> None:
        st = self.stash[stage, mb]
        with self.ctx.rec.span("W", mb=mb, stage=stage):
            for (out, params), g in zip(st.layers, st.output_grads):
                # Each layer's weight gradient from its own output gradient: no walk back through
                # the earlier layers, which B already did.
                for p, dp in zip(params, torch.autograd.grad(out, params, g, retain_graph=True)):
                    p.grad = dp if p.grad is None else p.grad.add_(dp)
        self._free(stage, mb)

    def _free(self, stage: int, mb: int) -> None:
        st = self.stash.pop((stage, mb))
        self.meter.change(-1, -st.nbytes)


@dataclass
class RankResult:
    """What one rank brings back from `pipeline_worker`."""

    rank: int
    stages: list[int]
    loss: float | None  # on the rank holding the last stage
    grads: dict[int, dict[str, torch.Tensor]]  # stage -> parameter name -> gradient
    timelines: list[Timeline]  # one per measured step
    step_times: list[float]  # seconds, one per measured step
    stash_traces: list[list[tuple[float, int, int]]]  # one per measured step: (time, stashes, bytes)
    peak_stash: int
    peak_stash_bytes: int
    messages_sent: int
    bytes_sent: int


def run_step(ctx, schedule: Schedule, modules: dict[int, nn.Module], loss_fn: Callable,
             x: torch.Tensor, y: torch.Tensor, shapes: list[tuple[int, ...]]) -> StageRunner:
    """One training step (no optimizer): run this rank's actions of `schedule` in order."""
    m = schedule.num_microbatches
    p2p = P2P(ctx, schedule, shapes, x.dtype)
    runner = StageRunner(ctx, schedule, modules, loss_fn, p2p, list(x.chunk(m)), list(y.chunk(m)))
    for action in schedule.actions[ctx.rank]:
        runner.run(action)
    p2p.finish()
    return runner


def pipeline_worker(ctx, stages: list[nn.Module], schedules: list[Schedule],
                    batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                    shapes: list[list[tuple[int, ...]]], steps: int = 2) -> list[RankResult]:
    """Worker: run each schedule on its (inputs, targets) batch for `steps` steps; report the
    timelines and times of all but the first (a warm-up), and the last step's gradients."""
    results = []
    for schedule, (x, y), sched_shapes in zip(schedules, batches, shapes):
        x, y = x.to(ctx.device), y.to(ctx.device)
        modules = {s: copy.deepcopy(stages[s]).to(ctx.device) for s in schedule.stages_of(ctx.rank)}
        times, timelines, traces = [], [], []
        for step in range(steps):
            for mod in modules.values():
                mod.zero_grad(set_to_none=True)
            ctx.barrier()
            ctx.rec.clear()
            t0 = now()
            runner = run_step(ctx, schedule, modules, loss_fn, x, y, sched_shapes)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            times.append(now() - t0)
            timelines.append(ctx.rec.timeline())
            traces.append(runner.meter.trace)
        measured = slice(1, None) if steps > 1 else slice(None)  # the first step warms up
        loss = float(sum(runner.losses)) if runner.losses else None
        grads = {s: {n: p.grad.detach().cpu() for n, p in mod.named_parameters()} for s, mod in modules.items()}
        results.append(RankResult(ctx.rank, sorted(modules), loss, grads, timelines[measured], times[measured],
                                  traces[measured], runner.meter.peak, runner.meter.peak_bytes,
                                  runner.p2p.messages_sent, runner.p2p.bytes_sent))
    return results


# ---------------------------------------------------------------------------------------------
# The notebook side
# ---------------------------------------------------------------------------------------------

@dataclass
class PipelineRun:
    """One schedule's run, gathered from every rank: its loss and gradients, and a typical step's
    timeline (the measured step of median length)."""

    schedule: Schedule
    loss: float
    grads: list[dict[str, torch.Tensor]]  # per stage
    timeline: Timeline
    step_time: float  # seconds: median over measured steps of the slowest rank
    peak_stash: dict[int, int]
    peak_stash_bytes: dict[int, int]
    stash_traces: dict[int, list[tuple[float, int, int]]] = field(repr=False, default_factory=dict)
    messages_sent: int = 0
    bytes_sent: int = 0

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of the compute lane over the step, averaged over ranks."""
        return self.timeline.bubble_fraction("compute")

    def row(self) -> dict:
        """The figures as one table row."""
        return {"schedule": self.schedule.name, "p": self.schedule.num_ranks,
                "m": self.schedule.num_microbatches, "step_ms": round(self.step_time * 1e3, 2),
                "bubble": round(self.bubble_fraction, 3), "peak_stash": max(self.peak_stash.values()),
                "peak_stash_KiB": round(max(self.peak_stash_bytes.values()) / 1024, 1),
                "messages": self.messages_sent}


def check_pipeline(stages: list[nn.Module], schedule: Schedule, x: torch.Tensor, y: torch.Tensor,
                   loss_fn: Callable | None) -> None:
    """Refuse what cannot run, before any worker starts."""
    if not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a pipelab Schedule, got {schedule!r}; "
                         "build one with pipelab.pipeline.schedules.make_schedule")
    validate(schedule)
    if len(stages) != schedule.num_stages:
        raise ValueError(f"{schedule!r} runs {schedule.num_stages} stages "
                         f"({schedule.num_ranks} ranks x {schedule.stages_per_rank} per rank) but "
                         f"{len(stages)} were given; cut the model with "
                         f"split_model(model, {schedule.num_stages})")
    if loss_fn is None or not callable(loss_fn):
        raise ValueError(f"the last stage needs a loss function, got loss_fn={loss_fn!r}; "
                         "pass e.g. loss_fn=torch.nn.MSELoss() (it must average over the batch)")
    batch, m = x.shape[0], schedule.num_microbatches
    if batch % m:
        fits = [k for k in range(1, batch + 1) if batch % k == 0]
        raise ValueError(f"num_microbatches={m} does not divide the batch of {batch} samples; "
                         f"use one of {fits}, or a batch that is a multiple of {m}")
    if y.shape[0] != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {y.shape[0]}; pass one target per input")


def _prepare(stages: list[nn.Module], schedules: list[Schedule], x, y, loss_fn: Callable, steps: int):
    """Check everything; return the world size, a (inputs, targets) batch per schedule, and the
    stage output shapes per schedule."""
    if not schedules:
        raise ValueError("give at least one schedule")
    ranks = {s.num_ranks for s in schedules}
    if len(ranks) != 1:
        raise ValueError(f"schedules run in one set of processes must share num_ranks, got {sorted(ranks)}; "
                         "run them in one call per number of ranks")
    xs = list(x) if isinstance(x, (list, tuple)) else [x] * len(schedules)
    ys = list(y) if isinstance(y, (list, tuple)) else [y] * len(schedules)
    if len(xs) != len(schedules) or len(ys) != len(schedules):
        raise ValueError(f"give one batch for all schedules or one per schedule: got {len(xs)} inputs "
                         f"and {len(ys)} targets for {len(schedules)} schedules")
    for schedule, xi, yi in zip(schedules, xs, ys):
        check_pipeline(stages, schedule, xi, yi, loss_fn)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
    shapes = [stage_output_shapes(stages, xi[: xi.shape[0] // s.num_microbatches]) for s, xi in zip(schedules, xs)]
    return ranks.pop(), list(zip(xs, ys)), shapes


def run_pipelines(stages: list[nn.Module], schedules: list[Schedule], x, y, loss_fn: Callable,
                  steps: int = 2, backend: str = "auto", timeout: float = 120.0) -> list[PipelineRun]:
    """Run each schedule (all on the same number of ranks) for real, in one set of processes.

    `x` and `y` are one batch for every schedule, or lists with one batch per schedule."""
    from pipelab.launch import spawn

    world, batches, shapes = _prepare(stages, schedules, x, y, loss_fn, steps)
    per_rank = spawn(pipeline_worker, world, stages, schedules, batches, loss_fn, shapes, steps,
                     backend=backend, timeout=timeout)
    return [_gather(schedule, [r[i] for r in per_rank]) for i, schedule in enumerate(schedules)]


def run_pipeline(stages: list[nn.Module], schedule: Schedule, x: torch.Tensor, y: torch.Tensor,
                 loss_fn: Callable, steps: int = 2, backend: str = "auto",
                 timeout: float = 120.0) -> PipelineRun:
    """Run one step of `schedule` on `schedule.num_ranks` real processes (after `steps`-1 warm-ups)."""
    return run_pipelines(stages, [schedule], x, y, loss_fn, steps, backend, timeout)[0]


def _gather(schedule: Schedule, results: list[RankResult]) -> PipelineRun:
    grads: list[dict] = [{} for _ in range(schedule.num_stages)]
    for r in results:
        for s, g in r.grads.items():
            grads[s] = g
    loss = next(r.loss for r in results if r.loss is not None)
    slowest = [max(step) for step in zip(*(r.step_times for r in results))]
    # Of the measured steps, show the one with the median makespan: a typical step, not a lucky one.
    steps = [Timeline.merge(tls) for tls in zip(*(r.timelines for r in results))]
    typical = sorted(range(len(steps)), key=lambda i: steps[i].makespan)[(len(steps) - 1) // 2]
    return PipelineRun(
        schedule, loss, grads, steps[typical], statistics.median(slowest),
        {r.rank: r.peak_stash for r in results}, {r.rank: r.peak_stash_bytes for r in results},
        {r.rank: r.stash_traces[typical] for r in results}, sum(r.messages_sent for r in results),
        sum(r.bytes_sent for r in results))


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------

def reference_step(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
                   loss_fn: Callable) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """Loss and per-stage gradients of the whole model on the whole batch, in one process."""
    model = nn.Sequential(*[copy.deepcopy(s) for s in stages])
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = [{n: p.grad.detach().clone() for n, p in stage.named_parameters()} for stage in model]
    return loss.item(), grads


def assert_matches_reference(run, stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
                             loss_fn: Callable, atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """Assert a pipelined run's loss and every gradient equal the single-process ones; return the
    largest gradient difference."""
    ref_loss, ref_grads = reference_step(stages, x, y, loss_fn)
    torch.testing.assert_close(torch.tensor(run.loss), torch.tensor(ref_loss), atol=atol, rtol=rtol)
    worst = 0.0
    for s, (got, want) in enumerate(zip(run.grads, ref_grads)):
        if set(got) != set(want):
            raise AssertionError(f"stage {s}: gradients for {sorted(got)}, expected {sorted(want)}")
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=atol, rtol=rtol,
                                       msg=lambda m, s=s, name=name: f"stage {s} {name}: {m}")
            worst = max(worst, (got[name] - want[name]).abs().max().item())
    return worst


# ---------------------------------------------------------------------------------------------
# The same schedules through torch.distributed.pipelining, for comparison
# ---------------------------------------------------------------------------------------------

TORCH_SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved 1F1B": "ScheduleInterleaved1F1B",
    "ZB-H1": "ScheduleInterleavedZeroBubble",  # with one stage per rank, its order is ZB-H1's
}


def _record_torch_stage(stage, rec) -> None:
    """Time torch's per-micro-batch stage calls as F, B and W spans on our timeline."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    index = stage.stage_index

    def forward_one_chunk(mb, *args, **kwargs):
        with rec.span("F", mb=mb, stage=index):
            return fwd(mb, *args, **kwargs)

    def backward_one_chunk(mb, *args, **kwargs):
        with rec.span("B", mb=mb, stage=index):
            return bwd(mb, *args, **kwargs)

    def backward_weight_one_chunk(mb, *args, **kwargs):
        with rec.span("W", mb=mb, stage=index):
            return wgt(mb, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def torch_pipeline_worker(ctx, stages: list[nn.Module], schedules: list[Schedule],
                          batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                          steps: int = 2) -> list[RankResult]:
    """Worker: the same schedules, stages and data run by torch.distributed.pipelining."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    results = []
    for schedule, (x, y) in zip(schedules, batches):
        x, y = x.to(ctx.device), y.to(ctx.device)
        modules = {s: copy.deepcopy(stages[s]).to(ctx.device) for s in schedule.stages_of(ctx.rank)}
        pipe_stages = []
        for s, mod in modules.items():
            stage = PipelineStage(mod, s, schedule.num_stages, ctx.device)  # infers shapes itself
            _record_torch_stage(stage, ctx.rec)
            pipe_stages.append(stage)
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule.name])
        single = cls in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B)
        runner = cls(pipe_stages[0] if single else pipe_stages, schedule.num_microbatches, loss_fn=loss_fn)
        holds_first, holds_last = 0 in modules, schedule.num_stages - 1 in modules
        times, timelines = [], []
        for step in range(steps):
            for mod in modules.values():
                mod.zero_grad(set_to_none=True)
            losses: list = []
            ctx.barrier()
            ctx.rec.clear()
            t0 = now()
            runner.step(*([x] if holds_first else []), target=y if holds_last else None,
                        losses=losses if holds_last else None)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            times.append(now() - t0)
            timelines.append(ctx.rec.timeline())
        measured = slice(1, None) if steps > 1 else slice(None)
        loss = float(sum(l.detach() for l in losses) / len(losses)) if holds_last else None
        grads = {s: {n: p.grad.detach().cpu() for n, p in mod.named_parameters()} for s, mod in modules.items()}
        results.append(RankResult(ctx.rank, sorted(modules), loss, grads, timelines[measured], times[measured],
                                  [[] for _ in times[measured]], 0, 0, 0, 0))
    return results


def run_torch_pipelines(stages: list[nn.Module], schedules: list[Schedule], x, y, loss_fn: Callable,
                        steps: int = 2, backend: str = "auto", timeout: float = 120.0) -> list[PipelineRun]:
    """Run each schedule through torch.distributed.pipelining (same stages, data and loss).

    The runs carry losses, gradients, step times and F/B/W spans; torch's stash is not counted."""
    from pipelab.launch import spawn

    world, batches, _ = _prepare(stages, schedules, x, y, loss_fn, steps)
    for schedule in schedules:
        if schedule.name not in TORCH_SCHEDULES:
            raise ValueError(f"torch has no counterpart of {schedule!r}; use one of {sorted(TORCH_SCHEDULES)}")
        if schedule.name == "1F1B" and schedule.num_microbatches < schedule.num_ranks:
            raise ValueError(f"torch's Schedule1F1B needs num_microbatches >= num_ranks, got "
                             f"m={schedule.num_microbatches} < p={schedule.num_ranks}; use m >= {schedule.num_ranks}")
    per_rank = spawn(torch_pipeline_worker, world, stages, schedules, batches, loss_fn, steps,
                     backend=backend, timeout=timeout)
    return [_gather(schedule, [r[i] for r in per_rank]) for i, schedule in enumerate(schedules)]


def plot_stash(run: PipelineRun, ax=None, in_bytes: bool = False, title: str | None = None):
    """Live stashed activations of each rank over the step (a count, or KiB), as measured."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    origin = run.timeline.start
    for rank, trace in sorted(run.stash_traces.items()):
        t = [(when - origin) * 1e3 for when, _, _ in trace]
        v = [b / 1024 if in_bytes else n for _, n, b in trace]
        ax.step(t, v, where="post", label=f"rank {rank} (peak {max(v):.0f})")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("stashed activations (KiB)" if in_bytes else "stashed micro-batches")
    ax.set_title(title or f"{run.schedule.name}, p={run.schedule.num_ranks}, m={run.schedule.num_microbatches}: "
                          "activations kept for backward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax

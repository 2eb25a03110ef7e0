"""Lesson 16's exercise: the update rule of fp16's dynamic loss scaler, the part of
`torch.amp.GradScaler` every mixed-precision run relies on. The checker plays the situations a run
meets (an overflow, a good step, the step that completes a run of good steps) and then a whole
sequence, each against `pipelab.precision.DynamicLossScaler`, and names the first mistake."""

from __future__ import annotations

from pipelab.exercises.core import Wrong, call, checker
from pipelab.precision import DynamicLossScaler

INTERVAL = 4
# found_inf by step: overflows at the start (the scale is too large), then runs of good steps
SEQUENCE = [True, True, False, False, False, False, False, False, False, False, True, False, False, False, False,
            False, True, True, False, False, False, False, False]


def reference_update(scale: float, good_steps: int, found_inf: bool, growth_interval: int) -> tuple[float, int]:
    """The rule as `DynamicLossScaler.update` applies it."""
    scaler = DynamicLossScaler(scale, growth_interval=growth_interval)
    scaler.good_steps = good_steps
    scaler.update(found_inf)
    return scaler.scale, scaler.good_steps


def _answer(fn, *args) -> tuple[float, int]:
    got = call(fn, *args)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise Wrong(f"returned {got!r}: return the pair (new scale, new count of good steps)")
    return float(got[0]), int(got[1])


def _situations(fn) -> None:
    """The three cases of the rule, one at a time, each with the mistake it reveals."""
    scale, good = _answer(fn, 1024.0, 3, True, INTERVAL)
    if scale == 2048.0:
        raise Wrong("on an overflow (found_inf=True) you doubled the scale: an inf means the scaled gradients "
                    "were too large for fp16, so halve it (1024 -> 512)")
    if scale != 512.0:
        raise Wrong(f"on an overflow you turned scale 1024 into {scale:g}: halve it (1024 -> 512)")
    if good != 0:
        raise Wrong(f"after an overflow the count of good steps is {good}: it must start again at 0, "
                    f"the run of good steps was broken")
    scale, good = _answer(fn, 1024.0, 1, False, INTERVAL)
    if scale != 1024.0:
        raise Wrong(f"after only 2 good steps of growth_interval={INTERVAL} you changed the scale to {scale:g}: "
                    f"grow only when the run reaches growth_interval good steps")
    if good != 2:
        raise Wrong(f"a good step with 1 good step before it left the count at {good}: count it (2)")
    scale, good = _answer(fn, 1024.0, INTERVAL - 1, False, INTERVAL)
    if scale == 1024.0 and good == INTERVAL:
        raise Wrong(f"the {INTERVAL}th good step in a row did not double the scale (count {good}): you grow one "
                    f"step late; growth_interval={INTERVAL} good steps are enough")
    if scale != 2048.0:
        raise Wrong(f"the {INTERVAL}th good step in a row turned scale 1024 into {scale:g}: double it (2048)")
    if good != 0:
        raise Wrong(f"after doubling, the count of good steps is {good}: reset it to 0, or the scale doubles "
                    f"again at every later step")


@checker("16_loss_scale_update")
def check_loss_scale_update(my_update_scale) -> str:
    """`my_update_scale(scale, good_steps, found_inf, growth_interval)` -> (the new scale, the new count
    of good steps in a row): halve the scale on an overflow, double it when the run of good steps
    reaches growth_interval, as torch.amp.GradScaler does."""
    fn = my_update_scale
    _situations(fn)
    scale, good, want = 2.0 ** 16, 0, (2.0 ** 16, 0)
    for step, found_inf in enumerate(SEQUENCE):
        scale, good = _answer(fn, scale, good, found_inf, INTERVAL)
        want = reference_update(*want, found_inf, INTERVAL)
        if (scale, good) != want:
            raise Wrong(f"step {step} (found_inf={found_inf}) of a {len(SEQUENCE)}-step run: you have scale "
                        f"{scale:g} with {good} good steps, the rule gives {want[0]:g} with {want[1]}")
    return (f"the overflow, the good step and the growing step, then {len(SEQUENCE)} steps: scale 65536 -> "
            f"{scale:g}, as torch.amp.GradScaler's rule gives")

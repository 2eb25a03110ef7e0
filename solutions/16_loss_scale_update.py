"""Lesson 16: the dynamic loss scaler's update rule (torch.amp.GradScaler's): back off on an
overflow, grow after growth_interval good steps in a row, and count the run of good steps."""


def my_update_scale(scale, good_steps, found_inf, growth_interval):
    """The dynamic loss scale after one step: halve on an overflow, double after a run of good steps."""
    if found_inf:
        return scale * 0.5, 0  # too large: the gradients overflowed; the run of good steps starts again
    good_steps += 1
    if good_steps == growth_interval:
        return scale * 2.0, 0  # a run of good steps: try a larger scale
    return scale, good_steps

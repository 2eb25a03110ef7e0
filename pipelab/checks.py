"""Argument checks for the public entry points: a bad value fails at once, before any worker
starts, with a `ValueError` that names the value and says what to pass instead."""

from __future__ import annotations

import math


def whole_number(name: str, value, minimum: int = 1, example: str | None = None) -> int:
    """`value` if it is an int >= `minimum` (not a bool), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        hint = f"; pass e.g. {example}" if example else ""
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}{hint}")
    return value


def positive_number(name: str, value, example: str | None = None, unit: str | None = None) -> float:
    """`value` if it is a finite int or float > 0 (not a bool), else a ValueError naming it
    (and the `unit` it counts, e.g. "MiB")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        hint = f"; pass e.g. {example}" if example else ""
        of_unit = f" of {unit}" if unit else ""
        raise ValueError(f"{name} must be a number{of_unit} > 0, got {value!r}{hint}")
    return value


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The whole numbers that divide `n` (up to `limit`): what to suggest when a split is uneven."""
    top = n if limit is None else min(n, limit)
    return [k for k in range(1, top + 1) if n % k == 0]


def same_batch(x, y) -> int:
    """The batch size, if inputs `x` and targets `y` have one row each per sample."""
    batch, targets = x.shape[0], y.shape[0]
    if batch == 0:
        raise ValueError("the batch is empty (0 samples); pass at least one sample per rank")
    if targets != batch:
        raise ValueError(f"inputs have {batch} samples but targets have {targets}; pass one target per input")
    return batch


def divides(name: str, value: int, by_name: str, by: int) -> None:
    """Refuse `value` (e.g. a batch of 30 samples) that does not split evenly into `by` parts."""
    if value % by:
        raise ValueError(f"{name}={value} does not divide evenly by {by_name}={by}; use {by_name} in "
                         f"{divisors(value, 16)}, or a {name} that is a multiple of {by}")


def mean_loss(loss_fn) -> None:
    """Refuse a loss that is not a mean over the batch. Every parallel mode here averages: DDP
    divides the summed gradients by the world size and a pipeline divides each micro-batch's loss
    by their number, which matches one process only if the loss is a mean (with 'sum' every
    gradient comes out world_size or num_microbatches times too small, and the loss still looks fine)."""
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction != "mean":
        raise ValueError(f"loss_fn {loss_fn} has reduction={reduction!r}; the parallel modes average "
                         "gradients over ranks and micro-batches, which equals one process only for a mean "
                         "over the batch: use reduction='mean', e.g. nn.MSELoss()")


def trainable(model) -> list:
    """The parameters of `model` that require gradients; refuses a model with none."""
    from pipelab.models import trainable_parameters

    params = [p for _, p in trainable_parameters(model)]
    if not params:
        raise ValueError("the model has no parameters that require gradients: there is nothing to "
                         "train; pass the model you train (e.g. pipelab.models.mlp([8, 16, 4]))")
    return params


RANK_BASE_BYTES = 300 * 2**20  # a rank's interpreter, torch and its process group, before any tensor
RANKS_PER_CORE = 8  # beyond this, ranks on CPU spend their time waiting for a core


def ranks_fit(world_size: int, bytes_per_rank: float = 0) -> None:
    """Refuse a world size this machine cannot hold: more than RANKS_PER_CORE ranks per core, or
    more memory (RANK_BASE_BYTES plus `bytes_per_rank` for each rank) than it has available."""
    from pipelab import hardware

    whole_number("world_size", world_size, example="world_size=2")
    cores = hardware.cpu_cores()
    if hardware.gpu_count() < world_size and world_size > RANKS_PER_CORE * cores:
        raise ValueError(f"world_size={world_size} ranks on {cores} CPU core(s) is over {RANKS_PER_CORE} "
                         f"ranks per core: they would mostly wait for a core; use world_size <= "
                         f"{RANKS_PER_CORE * cores}")
    available = hardware.available_memory()
    need = world_size * (RANK_BASE_BYTES + bytes_per_rank)
    if available is not None and need > available:
        per = (RANK_BASE_BYTES + bytes_per_rank) / 2**30
        raise ValueError(f"world_size={world_size} ranks need about {need / 2**30:.1f} GiB "
                         f"({per:.2f} GiB each) but this machine has {available / 2**30:.1f} GiB available; "
                         f"use world_size <= {max(1, int(available // (RANK_BASE_BYTES + bytes_per_rank)))}")


def modelled_size(name: str, value, node, example: str) -> None:
    """Refuse a size for the modelled compute (e.g. `emulated_batch`) that is not a whole number,
    or that is given without a modelled node to use it."""
    if value is None:
        return
    whole_number(name, value, example=example)
    if node is None:
        raise ValueError(f"{name}={value} sizes the modelled compute of an emulated node; name one "
                         f"(emulate='4xH100-nvlink4') or leave {name}=None")

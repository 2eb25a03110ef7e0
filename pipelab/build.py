"""Each rank builds only its own stage: the model on the meta device, one stage made real per rank.

Sending every rank the whole model costs every rank the whole model's memory: it unpickles every
stage before it keeps its own. Built on the meta device a model has shapes and no storage (a
537 MB stack pickles to a few kB), so it travels for free, and each rank gives real storage to its
own stages only, on its device:

    model = on_meta(lambda: nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]), seed=0)
    stages = split_model(model, 4)              # still meta: cut, traced, costed for free
    mine = materialize(copy.deepcopy(stages[s]), ctx.device)   # on the rank: this stage only
    reference_run(model, x, y, loss_fn)         # the whole model, the same weights

The weights must be the same wherever they are made: a rank holding stage 3 and the
single-process reference holding all of them. Drawing them from one global random stream in
construction order cannot give that (a rank would have to draw stages 0-2 first), so every module
is initialised by its own generator, seeded from its qualified name in the whole model and the
seed, by its own `reset_parameters()`, children before parents (a parent's overrides its children's,
as a model's own initialisation does). `on_meta` writes that name on each module (`name_modules`),
so it survives cutting the model into stages; a module built on meta without it is named by its
place in what is materialised (give `name=` its place in the whole model). A module already real
is left as it is (and moved to `device`), so models built the ordinary way keep working unchanged.
A module holding meta tensors and no `reset_parameters()` cannot be made on a rank: every lesson's
`Config` refuses it before any rank starts (`check_config`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import torch
from torch import nn

INIT_KEY = "_pipelab_init_key"  # the attribute `on_meta` writes: "seed:qualified.name"


def on_meta(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """`build()` on the meta device (shapes, no storage), each module named for its initialisation
    by its place in this whole model and `seed`."""
    with torch.device("meta"):
        model = build()
    return name_modules(model, seed)


def name_modules(model: nn.Module, seed: int = 0) -> nn.Module:
    """Write on each module of the whole `model` not yet named its initialisation's key (`seed` and
    its qualified name), so that a stage cut from it is initialised as it is in the whole."""
    for name, module in model.named_modules():
        if not hasattr(module, INIT_KEY):
            setattr(module, INIT_KEY, f"{seed}:{name}")
    return model


def own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers `module` holds itself (not its children's)."""
    own = dict(module.named_parameters(recurse=False))
    own.update((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)
    return own


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device (has no storage)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def initializer(module: nn.Module) -> Callable[[], None] | None:
    """What fills `module`'s own tensors: its `reset_parameters` (torch's attention calls it
    `_reset_parameters`), or None."""
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def check_materializable(module: nn.Module, what: str = "the model", prefix: str = "") -> None:
    """Refuse a meta module that cannot be given weights: one holding meta tensors of its own and
    no `reset_parameters()` to fill them. `what` names `module` in the message; `prefix` is its
    place in the whole model."""
    for name, sub in module.named_modules(prefix=prefix):
        meta = [n for n, t in own_tensors(sub).items() if t.is_meta]
        if meta and initializer(sub) is None:
            where = f"{what}: module {name!r}" if name else what
            raise ValueError(
                f"{where} ({type(sub).__name__}) holds meta tensors {meta} and has no reset_parameters() to "
                f"initialise them on the rank; give {type(sub).__name__} a reset_parameters() that fills "
                f"{', '.join(meta)} (as nn.Linear's does), or build the model with real weights (not on the "
                f"meta device)")


def check_config(cfg) -> None:
    """`check_materializable` on every module a lesson's Config carries (a field holding a module
    or a list of them), so a bad one is refused before any rank starts."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name, None)
        if isinstance(value, nn.Module):
            check_materializable(value, f.name)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, nn.Module):
                    check_materializable(item, f"{f.name}[{i}]")


def seed_of(key: str) -> int:
    """A 63-bit seed from a module's key, the same in every process (Python's hash() is not)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def materialize(module: nn.Module, device: torch.device | str | None = None, name: str = "",
                seed: int = 0) -> nn.Module:
    """Give every meta tensor of `module` storage and its weights, in place; then move the whole to
    `device` (None: leave it where it is, the new weights on the CPU). Each module holding meta
    tensors, and each with a `reset_parameters()` above one, gets a CPU generator seeded from its
    key (`on_meta`'s, else `seed` and its qualified name, `name` being `module`'s own place in the
    whole model) and its `reset_parameters()`, children before parents (a parent's overrides its
    children's, as a model's own initialisation does): the same weights in every process, on every
    device."""
    check_materializable(module, "the model", name)
    meta = {id(sub) for _, sub in module.named_modules() if is_meta(sub)}
    for qualified, sub in reversed(list(module.named_modules(prefix=name))):  # every child before its parent
        if id(sub) not in meta or initializer(sub) is None:
            continue
        if any(t.is_meta for t in own_tensors(sub).values()):
            sub.to_empty(device="cpu", recurse=False)  # storage for its own; its children have theirs
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.default_generator.manual_seed(seed_of(getattr(sub, INIT_KEY, f"{seed}:{qualified}")))
            initializer(sub)()
    return module.to(device) if device is not None else module

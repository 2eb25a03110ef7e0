"""How each pipeline rank gets its own stages, and only them.

A rank runs a few stages of the model; it needs those and nothing else. Pickling a list of real
stages to every rank costs each rank every stage: it unpickles all of them before it keeps its
own. Eight Linear(4096) layers (512 MB) cut into two stages then cost each of two ranks over 1 GB,
twice its stage. Three kinds of stages avoid it, each built or read on the rank that runs it:

1. **Stages built on the meta device** (`pipelab.build.on_meta`): shapes only travel, and each rank
   gives weights to its own (`build.materialize`). The lessons build their models this way.
2. **A function**, `StageBuilder(build_stage, num_stages, seed)`: each rank calls
   `build_stage(s)` for its own stage indexes only. Each call runs under its own seed, made from
   `seed` and `s`, so stage 3 has the same weights on its rank as in one process that builds all
   of them (`list(builder)`, or `nn.Sequential(*builder)` for the reference).
3. **Real modules** already built: `StageFiles.save(stages)` writes each stage to its own file
   in a temporary folder. What travels is the folder's name; each rank loads its own files only,
   straight into its device. The folder is removed when the run is over (`remove()`), or at the
   latest when the `StageFiles` is garbage collected or Python exits.

`stage_for_rank(stages, s, rank, device)` gives a rank stage `s` from any of the three.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import weakref
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from pipelab.build import materialize, seed_of


class StageBuilder(Sequence):
    """Stages given as a function: stage `s` is `build_stage(s)`, built where it is asked for, under
    a seed of its own, so each stage's weights are the same in every process that builds it."""

    def __init__(self, build_stage: Callable[[int], nn.Module], num_stages: int, seed: int = 0):
        if not callable(build_stage):
            raise ValueError(f"build_stage must be a function of the stage index returning an nn.Module, "
                             f"got {build_stage!r}; e.g. StageBuilder(lambda s: nn.Linear(8, 8), num_stages=2)")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be a whole number >= 1, got {num_stages!r}; e.g. num_stages=2")
        self.build_stage, self.num_stages, self.seed = build_stage, num_stages, seed

    def __len__(self) -> int:
        return self.num_stages

    def __getitem__(self, s: int) -> nn.Module:
        """Stage `s` built now, with real weights: use it for one process's reference."""
        if not 0 <= s < self.num_stages:
            raise IndexError(f"stage {s} of {self.num_stages}")
        return self.build(s)

    def __iter__(self) -> Iterator[nn.Module]:
        return (self.build(s) for s in range(self.num_stages))

    def build(self, s: int, where: str = "in this process") -> nn.Module:
        """Call `build_stage(s)` under stage `s`'s own seed (the caller's random state is left as it
        was) and check that it gave a module; `where` names the process in the error."""
        with torch.random.fork_rng(devices=[]):
            # Seeded by (seed, s), not drawn on from one stream: a rank building stage 3 alone gets
            # the weights one process building stages 0, 1, 2, 3 in a row gives stage 3.
            torch.manual_seed(seed_of(f"{self.seed}:{s}"))
            try:
                module = self.build_stage(s)
            except Exception as e:
                raise ValueError(f"build_stage({s}) raised {type(e).__name__}: {e} ({where}); "
                                 "a stage builder must build stage s of the model for any s in "
                                 f"0..{self.num_stages - 1}") from e
        if not isinstance(module, nn.Module):
            raise ValueError(f"build_stage({s}) returned {type(module).__name__} {module!r:.80} ({where}), not an "
                             "nn.Module; return the stage as a module (e.g. nn.Sequential of its layers)")
        return module

    def on_meta(self) -> list[nn.Module]:
        """Every stage built on the meta device (shapes, no storage): what the parent traces and
        checks before any rank starts, at no memory cost."""
        if not hasattr(self, "_meta"):
            with torch.device("meta"):
                self._meta = [self.build(s, "building it on the meta device, to check it") for s in range(len(self))]
        return self._meta

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_meta"}  # the function only

    def __repr__(self) -> str:
        return f"StageBuilder({getattr(self.build_stage, '__name__', self.build_stage)!r}, num_stages={self.num_stages})"


class StageFiles(Sequence):
    """Real stages saved one file per stage (`save`); a rank loads only the files of its own."""

    def __init__(self, folder: str, num_stages: int):
        self.folder, self.num_stages = folder, num_stages

    @classmethod
    def save(cls, stages: Sequence[nn.Module]) -> "StageFiles":
        """Write each stage to its own file in a new temporary folder, removed by `remove()`."""
        _remove_orphans()
        files = cls(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"), len(stages))
        files._remove = weakref.finalize(files, shutil.rmtree, files.folder, True)  # only the saving process's copy
        for s, stage in enumerate(stages):
            # torch.save writes each tensor's storage as its own record, so loading one reads it
            # straight into new storage (no second copy); cloudpickle writes a class defined in a
            # notebook by value, so a rank that cannot import it can still load it.
            import cloudpickle

            torch.save(stage, files.path(s), pickle_module=cloudpickle)
        return files

    def path(self, s: int) -> str:
        return os.path.join(self.folder, f"stage{s}.pt")

    def __len__(self) -> int:
        return self.num_stages

    def __getitem__(self, s: int) -> nn.Module:
        """Stage `s` read from its file, on the CPU."""
        return self.load(s)

    def load(self, s: int, device: torch.device | str = "cpu") -> nn.Module:
        """Stage `s` read from its file, its tensors placed straight on `device`."""
        if not 0 <= s < self.num_stages:
            raise IndexError(f"stage {s} of {self.num_stages}")
        # weights_only=False: the file holds a whole module, written by this run's own parent.
        return torch.load(self.path(s), map_location=device, weights_only=False)

    def remove(self) -> None:
        """Delete the folder (in the process that saved it; a rank's copy has nothing to remove)."""
        remove = self.__dict__.get("_remove")
        if remove is not None:
            remove()

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "num_stages": self.num_stages}  # the names, not the cleanup

    def __repr__(self) -> str:
        return f"StageFiles({self.folder!r}, num_stages={self.num_stages})"


def holds_storage(stages: Sequence[nn.Module]) -> bool:
    """Whether any stage has a real tensor (not on meta): one that would travel with its bytes."""
    return any(not t.is_meta for stage in stages for t in (*stage.parameters(), *stage.buffers()))


def for_ranks(stages: Sequence[nn.Module]) -> Sequence[nn.Module]:
    """What to send the ranks in place of `stages`: real modules as `StageFiles` (each stage a file),
    a `StageBuilder` and stages on the meta device as they are (they pickle small)."""
    if isinstance(stages, (StageBuilder, StageFiles)) or not holds_storage(stages):
        return stages
    return StageFiles.save(stages)


def traceable(stages: Sequence[nn.Module]) -> Sequence[nn.Module]:
    """Stages the parent can run for shapes without building them for real: a builder's on meta."""
    return stages.on_meta() if isinstance(stages, StageBuilder) else stages


def stage_for_rank(stages: Sequence[nn.Module], s: int, rank: int, device: torch.device | str) -> nn.Module:
    """Stage `s` as rank `rank` holds it: its own module with real weights on `device`, built,
    loaded or copied from `stages` (any kind above) without touching the other stages."""
    if isinstance(stages, StageBuilder):
        module = stages.build(s, where=f"on rank {rank}")
    elif isinstance(stages, StageFiles):
        module = stages.load(s, device)
    else:
        # A list: on meta, copied for free (real stages reach a spawned rank as files; a list of
        # real ones is here only where the rank built them itself, as a torchrun script does).
        module = copy.deepcopy(stages[s])
    # A stage still on meta gets its weights here, named by its place in nn.Sequential(*stages).
    return materialize(module, device, name=str(s))


_PREFIX = "pipelab-stages-"  # then the saving process's pid


def _remove_orphans() -> None:
    """Delete stage folders whose saving process is gone: one killed by a signal could not."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(_PREFIX):].split("-", 1)[0] if name.startswith(_PREFIX) else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True

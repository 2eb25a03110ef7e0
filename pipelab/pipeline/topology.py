"""A process grid with named axes, rank order and method names as in DeepSpeed's topology.py.

Ranks are laid out with the LAST axis fastest: in a pipe x data grid, ranks 0 and 1 are the two
data-parallel replicas of pipeline stage 0.
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product

import torch.distributed as dist

from pipelab.checks import whole_number


class ProcessTopology:
    """Maps each rank to a coordinate on named axes (e.g. pipe, data) and back."""

    def __init__(self, axes: list[str], dims: list[int]):
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"axes {axes} and dims {dims} must have equal length and distinct names; "
                             "e.g. ProcessTopology(axes=['pipe', 'data'], dims=[2, 2])")
        for axis, d in zip(axes, dims):
            whole_number(f"the size of axis {axis!r}", d, example="dims=[2, 2]")
        self.axes, self.dims = axes, dims
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        # product() varies its last range fastest, which gives DeepSpeed's rank order.
        self.mapping = {self.ProcessCoord(*c): rank
                        for rank, c in enumerate(product(*(range(d) for d in self.dims)))}

    def world_size(self) -> int:
        return len(self.mapping)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Size of ``axis`` (0 if the grid has no such axis, as in DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord: int) -> int:
        """Rank at a full coordinate, e.g. ``get_rank(pipe=1, data=0)``."""
        if set(coord) != set(self.axes):
            raise ValueError(f"get_rank needs one value per axis {self.axes}, got {sorted(coord)}")
        for axis, value in coord.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.get_dim(axis):
                raise ValueError(f"get_rank({axis}={value!r}): axis {axis!r} has positions "
                                 f"0..{self.get_dim(axis) - 1} in this {self._grid_text()} grid")
        return self.mapping[self.ProcessCoord(**coord)]

    def _grid_text(self) -> str:
        """The grid's shape, e.g. "pipe=2 x data=2"."""
        return " x ".join(f"{a}={d}" for a, d in zip(self.axes, self.dims))

    def get_coord(self, rank: int):
        """Coordinate (a namedtuple with one field per axis) of ``rank``."""
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is not in a grid of {self.world_size()} ranks")

    def get_rank_repr(self, rank: int, omit_axes: tuple[str, ...] = ("data", "pipe"),
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}"
                              for a in self.axes if a not in omit_axes)

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """All ranks whose coordinate on ``axis`` equals ``idx``."""
        i = self.axes.index(axis)
        return sorted(r for c, r in self.mapping.items() if c[i] == idx)

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinates match every given axis value."""
        return sorted(r for c, r in self.mapping.items()
                      if all(getattr(c, a) == v for a, v in filter_kwargs.items()))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Groups of ranks that differ only along ``axis``: who talks to whom on that axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in product(*(range(self.get_dim(a)) for a in others)):
            where = dict(zip(others, fixed))
            lists.append([self.mapping[self.ProcessCoord(**where, **{axis: k})]
                          for k in range(self.get_dim(axis))])
        return lists

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages x data-parallel replicas."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline stages x data-parallel replicas x tensor (model) parallel shards."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def axis_groups(topo: ProcessTopology, axis: str, rank: int):
    """Create one process group per comm list on ``axis``; return the group holding ``rank``.

    Every rank must call this with the same arguments, because ``new_group`` is collective.
    """
    mine = None
    for ranks in topo.get_axis_comm_lists(axis):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine

"""A process grid with named axes, rank order and method names as in DeepSpeed's topology.py.

Ranks are laid out with the LAST axis fastest: in a pipe x data grid, ranks 0 and 1 are the two
data-parallel replicas of pipeline stage 0.
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product

import torch.distributed as dist


class ProcessTopology:
    """Maps each rank to a coordinate on named axes (e.g. pipe, data) and back."""

    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims) or any(d < 1 for d in dims):
            raise ValueError(f"axes {axes} and dims {dims} must have equal length and dims >= 1")
        self.axes, self.dims = list(axes), list(dims)
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
        return self.mapping[self.ProcessCoord(**coord)]

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


def draw_topology(topo: ProcessTopology, ax=None, title: str | None = None):
    """Draw a pipe x data grid: a box per rank (stage down, replica across), the pipe groups
    (activations and gradients flow down a column) and the data groups (gradients are averaged
    along a row)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if topo.get_axis_names()[:2] != ["pipe", "data"]:
        raise ValueError(f"draw_topology draws pipe x data grids, got axes {topo.get_axis_names()}")
    P, D = topo.get_dim("pipe"), topo.get_dim("data")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.8 * D + 2.5, 1.3 * P + 1.2))
    for ranks in topo.get_axis_comm_lists("data"):
        if len(ranks) > 1:  # one row: the replicas of one stage
            y = topo.get_coord(ranks[0]).pipe
            ax.plot([0, D - 1], [y, y], color="#DD8452", linewidth=6, alpha=0.5, zorder=1)
    for ranks in topo.get_axis_comm_lists("pipe"):
        if len(ranks) > 1:  # one column: the stages of one replica
            x = topo.get_coord(ranks[0]).data
            ax.annotate("", xy=(x, P - 1), xytext=(x, 0), zorder=1,
                        arrowprops=dict(arrowstyle="->", color="#4C72B0", linewidth=2))
    for rank in range(topo.world_size()):
        c = topo.get_coord(rank)
        ax.text(c.data, c.pipe, f"rank {rank}\npipe={c.pipe} data={c.data}", ha="center", va="center",
                fontsize=9, zorder=2, bbox=dict(boxstyle="round", facecolor="white", edgecolor="black"))
    ax.set_xticks(range(D), [f"replica {d}" for d in range(D)])
    ax.set_yticks(range(P), [f"stage {p}" for p in range(P)])
    ax.set_xlim(-0.6, D - 0.4)
    ax.set_ylim(P - 0.5, -0.5)  # stage 0 on top
    ax.set_xlabel("data-parallel axis (replica index)")
    ax.set_ylabel("pipe axis (stage index)")
    ax.set_title(title or f"Process grid: pipe={P} x data={D} ({topo.world_size()} ranks, last axis fastest)")
    ax.legend(handles=[Line2D([], [], color="#4C72B0", linewidth=2, label="pipe group: send/recv"),
                       Line2D([], [], color="#DD8452", linewidth=6, alpha=0.5, label="data group: all-reduce")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return ax

"""Rank order and per-axis groups of pipelab.pipeline.topology, checked against DeepSpeed's layout."""
import pytest

from pipelab.pipeline.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from pipelab.plots.pipeline import draw_topology


def test_pipe_data_grid_puts_data_axis_fastest():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert topo.world_size() == 4
    assert topo.get_rank(pipe=0, data=1) == 1
    assert topo.get_rank(pipe=1, data=0) == 2
    assert tuple(topo.get_coord(3)) == (1, 1)
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert topo.get_axis_comm_lists("model") == []


def test_three_axis_grid():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=0, model=1) == [1, 3]
    assert topo.get_dim("data") == 2 and topo.get_dim("tensor") == 0
    assert topo.get_rank_repr(5) == "model_01"


def test_bad_coordinates_raise():
    topo = ProcessTopology(["pipe", "data"], [2, 3])
    with pytest.raises(ValueError, match="one value per axis"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="not in a grid"):
        topo.get_coord(6)
    with pytest.raises(ValueError):
        ProcessTopology(["pipe"], [0])


def test_draw_topology_labels_every_rank():
    import matplotlib

    matplotlib.use("Agg")
    ax = draw_topology(PipeDataParallelTopology(2, 3))
    labels = [t.get_text() for t in ax.texts if t.get_text()]  # arrows are empty texts
    assert len(labels) == 6 and labels[4].startswith("rank 4\npipe=1 data=1")
    with pytest.raises(ValueError, match="pipe x data"):
        draw_topology(ProcessTopology(["data", "pipe"], [2, 2]))


def test_matches_deepspeed_topology():
    ds_topo = pytest.importorskip("deepspeed.runtime.pipe.topology")
    pairs = [(PipeDataParallelTopology(3, 2), ds_topo.PipeDataParallelTopology(3, 2)),
             (PipeModelDataParallelTopology(2, 2, 3), ds_topo.PipeModelDataParallelTopology(2, 2, 3))]
    for ours, theirs in pairs:
        for axis in ("pipe", "data", "model", "tensor"):
            assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)
            assert ours.get_dim(axis) == theirs.get_dim(axis)
        for rank in range(ours.world_size()):
            assert tuple(ours.get_coord(rank)) == tuple(theirs.get_coord(rank))
            assert ours.get_rank_repr(rank) == theirs.get_rank_repr(rank)
        assert ours.filter_match(pipe=1) == theirs.filter_match(pipe=1)
        assert ours.get_axis_list("pipe", 0) == theirs.get_axis_list("pipe", 0)

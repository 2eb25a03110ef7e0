"""Rank order and per-axis groups of pipelab.pipeline.topology, checked against DeepSpeed's layout."""
import pytest

from pipelab.pipeline.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                       ProcessTopology)


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


def test_matches_deepspeed_topology():
    ds_topo = pytest.importorskip("deepspeed.runtime.pipe.topology")
    ours, theirs = PipeDataParallelTopology(3, 2), ds_topo.PipeDataParallelTopology(3, 2)
    for axis in ("pipe", "data"):
        assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)

"""Lesson 05: the groups of a pipe x data grid numbered data-fastest (rank = stage * data + replica).
A pipeline holds one replica's ranks, one per stage; a data-parallel group holds one stage's
replicas, which all-reduce that stage's gradients."""


def my_grid_groups(pipe, data):
    pipelines = [[stage * data + replica for stage in range(pipe)] for replica in range(data)]
    replicas = [[stage * data + replica for replica in range(data)] for stage in range(pipe)]
    return {"pipe": pipelines, "data": replicas}

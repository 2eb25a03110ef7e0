"""Lesson 08: partition by parameters, the lesson's rule (`partition.partition_balanced`): of all
cuts into non-empty contiguous stages, one whose heaviest minus lightest stage is smallest. A
dynamic programme over prefixes: the best cut of the first i layers into j stages tries every
start k of its last stage, keeping the heaviest and lightest stage of the best cut of the first k."""


def my_partition(weights, num_stages):
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[i][j]: (spread, heaviest, lightest, start of the last stage) of the first i layers in j stages
    best = [[None] * (num_stages + 1) for _ in range(n + 1)]
    best[0][0] = (0, float("-inf"), float("inf"), 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_stages) + 1):
            for k in range(j - 1, i):  # the last stage holds layers k..i-1, at least one
                if best[k][j - 1] is None:
                    continue
                last = prefix[i] - prefix[k]
                heavy, light = max(best[k][j - 1][1], last), min(best[k][j - 1][2], last)
                if best[i][j] is None or heavy - light <= best[i][j][0]:
                    best[i][j] = (heavy - light, heavy, light, k)
    bounds = [n]
    for j in range(num_stages, 0, -1):
        bounds.append(best[bounds[-1]][j][3])
    return bounds[::-1]

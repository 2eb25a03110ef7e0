"""Lesson 08: partition by parameters. The smallest possible heaviest stage is found by bisection
on that cap: a greedy pass over the layers tells how many stages a cap needs; then cut greedily at
the smallest cap that needs no more than num_stages."""


def my_partition(weights, num_stages):
    def cuts(cap):
        bounds, total = [0], 0
        for i, w in enumerate(weights):
            if total + w > cap:
                bounds.append(i)
                total = 0
            total += w
        return bounds

    lo, hi = max(weights), sum(weights)
    while lo < hi:  # the smallest cap that fits in num_stages stages
        mid = (lo + hi) // 2
        if len(cuts(mid)) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    bounds = cuts(lo)
    # fewer stages than asked: split the last ones further (an empty-free cut exists while layers remain)
    while len(bounds) < num_stages:
        for i in range(len(weights) - 1, 0, -1):
            if i not in bounds:
                bounds = sorted(bounds + [i])
                break
    return bounds + [len(weights)]

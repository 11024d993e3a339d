"""Exact min-max partition for the padded cost (rank cost = count * g(longest length)).

Why contiguous runs suffice: sort samples by length descending. In any feasible partition the
bin holding the longest remaining sample can swap its shorter members for the next-longest
samples of other bins without raising any bin's cost (its own max is unchanged; the other bins
get shorter samples) and then take more of them while ``count * g(longest) <= C`` and the caps
allow. So a greedy that gives each bin as many of the longest remaining samples as fit is an
exact feasibility test for a target C, and the optimum is the smallest feasible C.

The optimum is a float64 product ``k * g`` and feasibility is monotone in C, so a binary
search over the float64 bit patterns between a lower and a feasible upper bound (at most 64
steps of an O(m) test) finds it exactly -- this searches every candidate value without
listing the O(n^2) candidates ``k * g_i``.
"""

from __future__ import annotations

import math

import numpy as np

from .caps import Caps, infeasible_error, largest_multiple


def _runs(g_desc: np.ndarray, l_desc: np.ndarray | None, num_ranks: int, caps: Caps,
          target: float) -> list[int] | None:
    """Run lengths of the longest-first greedy at ``target``, or None if > num_ranks needed."""
    n = g_desc.shape[0]
    runs: list[int] = []
    p = 0
    while p < n:
        if len(runs) == num_ranks:
            return None
        longest = float(g_desc[p]) if l_desc is None else float(l_desc[p])
        k_cap = caps.max_count(longest, n - p)
        k = largest_multiple(float(g_desc[p]), target, k_cap)
        if k == 0:
            return None
        runs.append(k)
        p += k
    return runs


def _bits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


def _from_bits(b: int) -> float:
    return float(np.int64(b).view(np.float64))


def padded_groups(unit: np.ndarray, num_ranks: int, caps: Caps = Caps(),
                  length: np.ndarray | None = None) -> list[list[int]]:
    """Groups minimising max over bins of ``count * max(unit)``.

    ``unit[i] = g(length[i])`` must be non-decreasing in ``length`` (checked by the caller);
    without ``length`` the units themselves order the samples.
    """
    key = unit if length is None else length
    order = np.argsort(-key, kind="stable")  # ties by (source_rank, position)
    g_desc = unit[order]
    l_desc = None if length is None else length[order]
    n = int(order.shape[0])
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    if n == 0:
        return groups
    loose = _runs(g_desc, l_desc, num_ranks, caps, math.inf)
    if loose is None:
        raise infeasible_error(caps, n, num_ranks)
    # Feasible upper bound: the actual cost of the caps-only greedy partition.
    starts = np.cumsum([0] + loose[:-1])
    hi = max(k * float(g_desc[s]) for k, s in zip(loose, starts))
    lo_b, hi_b = _bits(float(g_desc[0])), _bits(hi)  # OPT >= g of the longest sample
    while lo_b < hi_b:
        mid = (lo_b + hi_b) // 2
        if _runs(g_desc, l_desc, num_ranks, caps, _from_bits(mid)) is None:
            lo_b = mid + 1
        else:
            hi_b = mid
    runs = _runs(g_desc, l_desc, num_ranks, caps, _from_bits(hi_b))
    assert runs is not None
    p = 0
    for b, k in enumerate(runs):
        groups[b] = order[p:p + k].tolist()
        p += k
    return groups


def padded_cost(unit: np.ndarray) -> float:
    """Padded cost of one rank holding samples with these unit costs."""
    return float(unit.shape[0] * float(unit.max())) if unit.shape[0] else 0.0

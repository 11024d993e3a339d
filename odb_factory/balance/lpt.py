"""Longest Processing Time first for the padding-free cost (rank cost = sum of sample costs).

Graham (1969): LPT's makespan is at most (4/3 - 1/(3m)) times the optimum; like any list
schedule it is also at most sum/m + (1 - 1/m) * max cost. Both hold without caps only.
"""

from __future__ import annotations

import heapq

import numpy as np

from .caps import Caps, fits_on, infeasible_error


def lpt_groups(cost: np.ndarray, num_ranks: int, caps: Caps = Caps(),
               length: np.ndarray | None = None) -> list[list[int]]:
    """Partition sample ids into ``num_ranks`` groups (bins without a rank identity yet).

    Samples go in order of cost descending (stable, so ties by (source_rank, position)) onto
    the least-loaded bin (ties by bin id) whose caps accept them.
    """
    order = np.argsort(-cost, kind="stable")
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    counts = [0] * num_ranks
    max_len = [0.0] * num_ranks
    heap = [(0.0, b) for b in range(num_ranks)]  # (load, bin id): the tie-break is the id
    for i in order.tolist():
        c = float(cost[i])
        li = 0.0 if length is None else float(length[i])
        rejected = []
        while heap and not caps.accepts(counts[heap[0][1]], max_len[heap[0][1]], li):
            load_b = heapq.heappop(heap)
            if caps.max_samples is None or counts[load_b[1]] < caps.max_samples:
                rejected.append(load_b)  # full bins never come back
        if not heap:
            raise _failure(caps, cost, length, num_ranks, i)
        _, b = heapq.heappop(heap)
        groups[b].append(i)
        loads[b] += c
        counts[b] += 1
        max_len[b] = max(max_len[b], li)
        heapq.heappush(heap, (loads[b], b))
        for item in rejected:
            heapq.heappush(heap, item)
    return groups


def _failure(caps: Caps, cost: np.ndarray, length: np.ndarray | None, num_ranks: int,
             sample: int) -> ValueError:
    lengths_desc = None if length is None else np.sort(length)[::-1]
    if not fits_on(caps, lengths_desc, cost.shape[0], num_ranks):
        return infeasible_error(caps, cost.shape[0], num_ranks)
    # Bin packing is NP-hard: the cost-ordered greedy can fail where a placement exists.
    return ValueError(
        f"LPT could not place a sample of cost {cost[sample]:g}"
        + ("" if length is None else f" and length {length[sample]:g}")  # pragma: no mutate, without lengths LPT cannot fail
        + f" within {caps.describe()} although a "
        "feasible placement exists; use mode='padded' (exact under caps) or relax the caps"
    )
